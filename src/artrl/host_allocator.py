"""The host's memory allocator for training on a CPU: large blocks go back to the system when freed.

torch takes a CPU tensor's memory from the C library's malloc. glibc serves a block above its mmap
threshold with a mapping of its own, which `free` unmaps at once; below it, from the heap, which keeps
what is freed. The threshold starts at 128 KiB and is *dynamic*: each time a mapped block is freed,
glibc raises the threshold to that block's size (up to 32 MiB), so after the first freed activation
every activation tensor up to 32 MiB comes from the heap. A backward pass frees and allocates tensors of
many sizes in turn, and the heap only grows: measured on random:qwen3-0.6b (float32, this CPU, one RL
call on a 4,096-token shared prompt, activation checkpointing on), the call's peak rose by ~200 MB per
decoder layer where the checkpointed hidden state is 17 MB, and 6.8 GB above the loaded model in all.
With the threshold fixed (which also turns the dynamic rule off) the same call peaks ~17 MB a layer
above a fixed part: what the memory plan counts (docs/performance.md, "Long trajectories").

`fix_mmap_threshold()` sets it (`mallopt(M_MMAP_THRESHOLD, 128 KiB)`) once per process, when a
trainer is made on a CPU. It changes nothing where the C library is not glibc, and nothing when the
environment already sets `MALLOC_MMAP_THRESHOLD_` (glibc read that at start: the user's choice stands).
Mapping each large tensor costs page faults on first touch; the train calls measured ran as fast
(docs/performance.md has the A/B).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, kept fixed
ENV = "MALLOC_MMAP_THRESHOLD_"

_lock = threading.Lock()
_done: bool | None = None


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at `THRESHOLD_BYTES` for this process (once); whether it is fixed now (by this
    call, an earlier one, or the environment). False where the C library has no `mallopt` (not glibc)."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        if os.environ.get(ENV):
            _done = True
            return _done
        _done = False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            log.debug("no mallopt in this C library: the host allocator keeps its defaults")
            return _done
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _done = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
        log.debug("glibc mmap threshold fixed at %d bytes: %s", THRESHOLD_BYTES, _done)
        return _done
