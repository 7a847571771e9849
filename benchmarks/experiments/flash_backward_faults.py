"""What glibc's malloc thresholds cost torch's CPU flash-attention backward in bf16.

One causal self-attention of `--tokens` tokens (16 query heads, 8 key/value heads, head size 128: Qwen3-0.6B's
attention), forward and backward, `--repeats` times; prints one JSON line per repeat with the seconds of each, the
process's system seconds and minor page faults over it, and the thresholds the process runs with. glibc reads its
thresholds from the environment at start, so each setting is a process of its own:

    python benchmarks/experiments/flash_backward_faults.py                   # glibc's defaults (dynamic threshold)
    python benchmarks/experiments/flash_backward_faults.py --trainer         # what a CPU trainer sets (src/artrl/runtime/host_allocator.py)
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/experiments/flash_backward_faults.py   # the 128 KiB threshold it set before

docs/performance.md ("The threshold's price in bf16") has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--trainer", action="store_true", help="fix the thresholds as a CPU trainer does")
    args = parser.parse_args()
    if args.trainer:
        from artrl.runtime.host_allocator import fix_mmap_threshold

        if not fix_mmap_threshold():
            raise SystemExit("this C library has no mallopt: nothing to measure")
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, dim, n = 16, 8, 128, args.tokens
    q = torch.randn(1, heads, n, dim, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, n, dim, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv_heads, n, dim, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, heads, n, dim, dtype=dtype)
    for repeat in range(args.repeats):
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        middle = time.perf_counter()
        out.backward(grad)
        end = time.perf_counter()
        after = resource.getrusage(resource.RUSAGE_SELF)
        q.grad = k.grad = v.grad = None
        print(json.dumps({
            "bench": "flash_backward_faults", "tokens": n, "dtype": args.dtype, "repeat": repeat,
            "setting": "trainer" if args.trainer else "environment",
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            "forward_s": round(middle - start, 3), "backward_s": round(end - middle, 3),
            "system_s": round(after.ru_stime - before.ru_stime, 2),
            "minor_page_faults": after.ru_minflt - before.ru_minflt,
            "torch_threads": torch.get_num_threads(),
        }), flush=True)


if __name__ == "__main__":
    main()
