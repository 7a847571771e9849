"""What the driver and its training workers say to each other, written down once.

The channel is torch.distributed's own c10d `TCPStore`, hosted by the driver
(the process that serves the model) at the rendezvous endpoint: the same store
carries torchrun's c10d rendezvous (every torchrun joins it with
`--rdzv-conf is_host=false`) and, under the `artrl/<generation>/` prefix, these
keys. A generation is one start of the worker group; after a failure the
driver starts a new one, so keys of a dead group are never read again.

    key                        written by   value (JSON)
    generation                 driver       the current generation number
    ready/<rank>               each rank    {rank, world_size, pid, host, device, step}
    call/<n>                   driver       {payload: file with the call's data, kind}
    trained/<n>                rank 0       {steps, summary, line}: the call ran, nothing written yet
    commit/<n>                 driver       {write: bool, step, record}: write checkpoint `step` or not
    done/<n>                   rank 0       {path}: the checkpoint is complete on disk
    error/<n>/<rank>           a rank       {type, message}: the call was refused (bad input, before any
                                            collective); the group lives on
    stop                       driver       the workers leave their loop and exit

Call payloads (pickled; both ends are this program) and the launcher's failure
report are files in the run directory's `workers/` folder; on several machines
the run directory is on a filesystem all of them mount at the same path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

WORKERS_DIR = "workers"  # under the run directory
FAILURE_FILE = "failure-{generation}.json"  # the launcher's report of its failed ranks
LAUNCH_LOG = "launcher-{generation}.log"
PAYLOAD_FILE = "call-{generation}-{n}.pkl"

PREFIX = "artrl"
GENERATION = "generation"
READY = "ready/{rank}"
CALL = "call/{n}"
TRAINED = "trained/{n}"
COMMIT = "commit/{n}"
DONE = "done/{n}"
ERROR = "error/{n}/{rank}"
STOP = "stop"

POLL_S = 0.05
STORE_TIMEOUT = timedelta(seconds=60)  # one store operation (a get of a key that exists, a set)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def generation_store(root: dist.Store, generation: int) -> dist.PrefixStore:
    return dist.PrefixStore(f"{PREFIX}/{generation}/", root)


def put(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def get(store: dist.Store, key: str) -> Any:
    return json.loads(store.get(key).decode())


def wait_any(store: dist.Store, keys: Sequence[str], *, alive: Callable[[], None] | None = None,
             timeout_s: float | None = None) -> str:
    """Poll until one of `keys` exists; returns it. `alive()` runs between polls and raises to give up."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        for k in keys:
            if store.check([k]):
                return k
        if alive is not None:
            alive()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"none of {list(keys)} appeared within {timeout_s:.0f} s")
        time.sleep(POLL_S)
