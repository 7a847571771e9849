"""The host's memory allocator for training on a CPU: glibc's thresholds, chosen for each train call.

torch takes a CPU tensor's memory from the C library's malloc. glibc serves a block above its mmap threshold
with a mapping of its own, which `free` unmaps at once, and which the next block of that size faults in again
page by page; below it, from the heap, which keeps what is freed and hands it out again without a fault. The
threshold starts at 128 KiB and is *dynamic*: each freed mapping raises it to that block's size (up to
32 MiB). Setting it (`mallopt(M_MMAP_THRESHOLD, ...)`) fixes it and turns the dynamic rule off.

Two costs pull against each other, both measured on this 2-core CPU (docs/performance.md, "The allocator rule",
`benchmarks/results/2026-12-05-cpu/allocator-grid.jsonl`):

* **A low threshold is slow.** Every activation above it is a fresh mapping, faulted in page by page. On the
  seed-like train bench (artrl/tiny, rows of 3,072 tokens) a 1 MiB threshold takes 6.2-6.7 s a call where
  16 MiB takes 3.4 s; on random:qwen3-0.6b cut to 8 layers at 1,152 tokens, 9.0-10.8 s against 6.5 s.
* **A threshold above the kept hidden state grows the heap.** Blocks that live through the backward pass (a
  layer's hidden state, `tokens x hidden x element bytes`) taken from the heap between short-lived ones pin it:
  freed holes cannot go back, and the heap grows by about 20-27 hidden states a layer (the 0.6B cut to 8 layers
  at 1,152 tokens: 0.21 GB above the model at 1-4 MiB, 0.65 at 8 MiB, 0.91-0.96 at 16 MiB; at 4,224 tokens, a
  17 MB hidden state: 0.72 GB at 1-4 MiB, 0.76-0.80 at 8-16 MiB, 2.35-2.48 GB at 32 MiB).

So each call gets (`thresholds_for`):

* **roomy**, 16 MiB (trim 128 MiB), when what the heap could grow by at 16 MiB (`GROWTH_PER_KEPT` hidden states
  a layer) is at most `ROOMY_GROWTH_BYTES`: small calls, which most training is, run at the speed the heap gives;
  the memory plan counts that growth (`heap_allowance`, models/memory_plan.py);
* otherwise **below the hidden state**: the largest power of two at most half of it, between 1 MiB and 16 MiB,
  so every kept hidden state is a mapping of its own (returned when freed) and the blocks under it still come
  from the heap. Long calls keep the fixed-heap peaks; 1 MiB stays the floor because torch's bf16 flash-attention
  backward allocates scratch blocks of a few hundred KiB per block of queries, which a lower threshold turned
  into 30 million page faults in one 2-layer call at 32k tokens.

The trim threshold (free memory the heap's top may keep before it is given back) is 64 MiB below the roomy
setting. Where the C library is not glibc nothing changes; `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_`
in the environment (glibc reads them at start) stand, and the rule leaves that one alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MiB = 1024 * 1024
ENV = "MALLOC_MMAP_THRESHOLD_"
TRIM_ENV = "MALLOC_TRIM_THRESHOLD_"

FLOOR_BYTES = 1 * MiB
"""The lowest mmap threshold: above the bf16 flash-attention backward's scratch blocks."""
ROOMY_BYTES = 16 * MiB
"""The mmap threshold of a small call (and the ceiling of every call's)."""
GROWTH_PER_KEPT = 32
"""What the heap may grow by, in kept hidden states a decoder layer, when they come from it (measured 20-27)."""
ROOMY_GROWTH_BYTES = 256 * MiB
"""The most heap growth a call may take for the roomy threshold's speed."""


@dataclass(frozen=True)
class Thresholds:
    """glibc's two thresholds for one call, and why."""

    mmap_bytes: int
    trim_bytes: int
    why: str


LOADING = Thresholds(FLOOR_BYTES, 64 * MiB, "loading: a heap fragmented by loading would stay")


def kept_hidden_bytes(tokens: int, hidden_size: int, element_bytes: int) -> int:
    """One decoder layer's hidden state for a micro-batch of `tokens` tokens: what lives through its backward."""
    return max(0, int(tokens)) * max(0, int(hidden_size)) * max(1, int(element_bytes))


def heap_allowance(tokens: int, hidden_size: int, element_bytes: int, layers: int) -> int:
    """What the heap may grow by in a call that `thresholds_for` gives the roomy threshold (0 when it does not):
    the part of the memory plan that pays for its speed."""
    growth = GROWTH_PER_KEPT * kept_hidden_bytes(tokens, hidden_size, element_bytes) * max(1, int(layers))
    return growth if growth <= ROOMY_GROWTH_BYTES else 0


def thresholds_for(tokens: int, hidden_size: int, element_bytes: int, layers: int) -> Thresholds:
    """The thresholds for a train call whose largest micro-batch has `tokens` tokens (module docstring)."""
    kept = kept_hidden_bytes(tokens, hidden_size, element_bytes)
    if heap_allowance(tokens, hidden_size, element_bytes, layers) or kept == 0:
        return Thresholds(ROOMY_BYTES, 128 * MiB, f"roomy: a {kept / MiB:.1f} MiB hidden state a layer lets the "
                                                  "heap grow little")
    below = FLOOR_BYTES
    while below * 2 <= min(kept // 2, ROOMY_BYTES):
        below *= 2
    return Thresholds(below, 64 * MiB, f"below the hidden state: {kept / MiB:.1f} MiB a layer, kept out of the "
                                       "heap")


_lock = threading.Lock()
_mallopt = None  # glibc's mallopt, once found; False where there is none
_current: tuple[int | None, int | None] | None = None


def _find_mallopt():
    global _mallopt
    if _mallopt is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
            fn = libc.mallopt
            fn.argtypes = [ctypes.c_int, ctypes.c_int]
            fn.restype = ctypes.c_int
            _mallopt = fn
        except (OSError, AttributeError):
            log.debug("no mallopt in this C library: the host allocator keeps its defaults")
            _mallopt = False
    return _mallopt


def use_thresholds(t: Thresholds) -> bool:
    """Set glibc's thresholds to `t` for what this process allocates from now on (a threshold the environment
    sets stands); whether the mmap threshold is fixed now (by this call, an earlier one, or the environment).
    False where the C library has no `mallopt` (not glibc)."""
    global _current
    with _lock:
        from_env, trim_from_env = bool(os.environ.get(ENV)), bool(os.environ.get(TRIM_ENV))
        wanted = (None if from_env else t.mmap_bytes, None if trim_from_env else t.trim_bytes)
        if _current == wanted:
            return True
        mallopt = _find_mallopt()
        if not mallopt:
            return from_env
        fixed = from_env or bool(mallopt(M_MMAP_THRESHOLD, t.mmap_bytes))
        if fixed and not trim_from_env:
            mallopt(M_TRIM_THRESHOLD, t.trim_bytes)  # after the mmap threshold, which turns the dynamic rule off
        if fixed:
            _current = wanted
        log.debug("glibc mmap threshold %s, trim threshold %s (%s)", os.environ.get(ENV) or t.mmap_bytes,
                  os.environ.get(TRIM_ENV) or t.trim_bytes, t.why)
        return fixed


def current_thresholds() -> tuple[int | None, int | None] | None:
    """The (mmap, trim) bytes this module last set (None for one the environment holds); None before any."""
    return _current


def fix_mmap_threshold() -> bool:
    """The loading thresholds (`LOADING`): a model about to load on a CPU; see `use_thresholds`."""
    return use_thresholds(LOADING)
