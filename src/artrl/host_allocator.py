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

`fix_mmap_threshold()` sets it once per process, when a trainer is made on a CPU, to 1 MiB
(`mallopt(M_MMAP_THRESHOLD, 1 MiB)`), and the heap's trim threshold to 64 MiB (`M_TRIM_THRESHOLD`;
with the dynamic rule off it stays at glibc's 128 KiB, and the heap's free top goes back to the system
at nearly every free). Both are what a backward pass needs: torch's CPU flash attention backward in
bf16 allocates and frees scratch blocks of a few hundred KiB per block of queries; at a 128 KiB
threshold each was a fresh mapping, faulted in page by page (about 30 million more page faults in one
2-layer bf16 call at 32k tokens, which takes 26% less time without them). Blocks up to 1 MiB from the heap
cannot grow it as the 32 MiB ones did: the measured peaks are the same (docs/performance.md, "Long
trajectories").
It changes nothing where the C library is not glibc; when the environment sets
`MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_`, that setting stands (glibc read it at start).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1024 * 1024  # above it, a block is mapped and unmapped when freed
TRIM_BYTES = 64 * 1024 * 1024  # free memory the heap's top may keep
ENV = "MALLOC_MMAP_THRESHOLD_"
TRIM_ENV = "MALLOC_TRIM_THRESHOLD_"

_lock = threading.Lock()
_done: bool | None = None


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at `THRESHOLD_BYTES` and its trim threshold at `TRIM_BYTES` for this process
    (once); whether the mmap threshold is fixed now (by this call, an earlier one, or the environment). False where
    the C library has no `mallopt` (not glibc). A threshold the environment sets is left as it is."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        from_env = bool(os.environ.get(ENV))
        if from_env and os.environ.get(TRIM_ENV):
            _done = True
            return _done
        _done = False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            log.debug("no mallopt in this C library: the host allocator keeps its defaults")
            _done = from_env
            return _done
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _done = from_env or bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
        if _done and not os.environ.get(TRIM_ENV):
            mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)  # after the mmap threshold: setting that one resets the trim rule
        log.debug("glibc mmap threshold %s, trim threshold %s", os.environ.get(ENV) or THRESHOLD_BYTES,
                  os.environ.get(TRIM_ENV) or TRIM_BYTES)
        return _done
