"""Giving the C heap's free memory back to the system.

glibc keeps freed memory in its heap for reuse, and a freed chunk below the top of the heap is
not returned by `free` alone. Quantising a model one tensor at a time leaves the heap full of
such holes (each full-precision draw and bitsandbytes' temporaries), which the process then
holds while it serves rollouts; training reuses them. `malloc_trim` returns them: loading.py
trims once a model is loaded, and a random-init build also trims after each quantised tensor
(models/random_init.py), so the holes never pile up while it loads. `artrl bench memory
--model random:qwen3-8b --load-in-4bit` on a 2-core CPU (benchmarks/results/2026-12-02-cpu/memory.jsonl,
lines 4, 8 and 10 in that order): resident once registered 8.01 GB with no trim, 6.99 GB with the
trim after loading; the load's peak 8.21 GB with that trim alone, 7.08 GB with the trim after
each tensor too.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl): nothing to do
        return None


def release_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc's `malloc_trim(0)`); a no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
