"""artrl.runtime.heap.release_free_memory gives the C heap's free pages back to the system (glibc)."""

from __future__ import annotations

import pytest

from artrl.runtime import heap


def _resident_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(heap._libc() is None, reason="not glibc: release_free_memory is a no-op")
def test_holes_below_the_top_of_the_heap_go_back_to_the_system():
    blocks = [bytearray(4000) for _ in range(40_000)]  # 160 MB of heap chunks, each below glibc's mmap threshold
    keep = bytearray(4000)  # allocated last: the top of the heap stays in use, so free() alone cannot shrink it
    del blocks
    before = _resident_mb()
    heap.release_free_memory()
    after = _resident_mb()
    assert before - after > 100, (before, after)
    assert len(keep) == 4000
