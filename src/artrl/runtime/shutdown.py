"""Stop artrl's background threads, in order, before the interpreter shuts down.

The inference engine decodes in a daemon thread that spends its time inside
torch's C++ code, and the server runs uvicorn in another daemon thread. When a
program ends (or raises) while generation is in flight, CPython finalises with
those threads still running; a daemon thread that comes back from C++ into
Python after finalisation began is ended with `pthread_exit`, whose forced
unwinding through torch's C++ frames calls `std::terminate`: the process dies
with SIGABRT ("terminate called without an active exception", exit 134)
instead of the program's own exit status.

`atexit` hooks run before finalisation, while every thread is still alive, so
one hook stops the threads properly:

1. engines (`ENGINES`): generation in flight fails with an error at its next
   decode step, queued requests are refused, and the decode thread is joined;
2. servers (`SERVERS`): uvicorn, with nothing left to wait for, exits and its
   thread is joined.

Objects register themselves when they start a thread (`track`) and leave when
closed (`untrack`). Only weak references are kept.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any

log = logging.getLogger(__name__)

ENGINES = "engines"
SERVERS = "servers"
STAGES = (ENGINES, SERVERS)  # the order in which they are stopped

_live: dict[str, weakref.WeakSet[Any]] = {stage: weakref.WeakSet() for stage in STAGES}


def track(obj: Any, stage: str) -> None:
    """Stop `obj` (its `shutdown_at_exit()` method) at interpreter exit, in `stage`'s turn."""
    _live[stage].add(obj)


def untrack(obj: Any, stage: str) -> None:
    _live[stage].discard(obj)


def stop_all() -> None:
    """Stop every tracked object, stage by stage (what the atexit hook runs)."""
    for stage in STAGES:
        for obj in list(_live[stage]):
            try:
                obj.shutdown_at_exit()
            except Exception:  # one failing component must not keep the others running
                log.exception("stopping %r at exit failed", obj)


atexit.register(stop_all)
