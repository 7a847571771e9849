"""torch's CPU thread count for training: the process's own, in whichever thread a train call runs.

torch keeps the intra-op thread count per thread (OpenMP's), but a thread takes its count, at its first
parallel op, from the last `torch.set_num_threads` of *any* thread. The built-in engine's decode worker sets
its own count (`inference_cpu_threads`, 1 by default) from its own thread; every thread started after that
then computes on that one core, the worker thread that `asyncio.to_thread` starts for a train call included,
while the thread that loaded the model keeps the process's count. Which thread a call lands on is the
executor's choice, so the same call could run on all cores or on one.

So the process's count is read once, before any decode worker sets its own (`training_threads`: the first
caller reads it; a session reads it when it opens, the decode worker before it sets its count), and every
train call sets it in the thread it runs on (`use_training_threads`). That count is torch's default
(OMP_NUM_THREADS, else the machine's cores) or what the program set before artrl first read it.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_process_threads: int | None = None


def training_threads() -> int:
    """The process's torch thread count, read on the first call (before any decode worker sets its own)."""
    global _process_threads
    with _lock:
        if _process_threads is None:
            import torch

            _process_threads = torch.get_num_threads()
        return _process_threads


def use_training_threads() -> int:
    """Set `training_threads()` as the calling thread's torch thread count; returns it."""
    import torch

    wanted = training_threads()
    current = torch.get_num_threads()
    if current != wanted:
        log.debug("train thread %s computed on %d torch threads; set to the process's %d",
                  threading.current_thread().name, current, wanted)
        torch.set_num_threads(wanted)
    return wanted
