"""Giving the C heap's free memory back to the system.

glibc keeps freed memory in its heap for reuse, and a freed chunk below the top of the heap is
not returned by `free` alone. Quantising a model one tensor at a time leaves the heap full of
such holes (each full-precision draw and bitsandbytes' temporaries), which the process then
holds while it serves rollouts; training reuses them. `malloc_trim` returns them: on
random:qwen3-0.6b in 4-bit, `artrl bench memory` measured 1.12 GB resident once registered
with it, 1.41-1.75 GB without (loading.py trims once a model is loaded). The train call's peak
stays where it was (1.88-1.90 GB against 1.90-1.97). A random-init build also trims after each
quantised tensor (models/random_init.py), so the holes never pile up while it loads: building an
8-layer cut of random:qwen3-8b in 4-bit peaked at 3723 MiB against 4167 without (medians of 3
alternated whole-process runs; the wall time moved by a ratio of 0.97, within the noise), and the
whole 8B shape's load in `artrl bench memory` at 7.08 GB against 8.21.
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
