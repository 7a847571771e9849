"""How a checkpointed RL call's peak grows with the number of decoder layers, with glibc's mmap threshold dynamic
(its default) or as a CPU trainer sets it for the call (src/artrl/runtime/host_allocator.py).

One RL call through the public API on random:qwen3-0.6b cut to `--layers` decoder layers (float32, this CPU), on one
trajectory pair sharing a `--context`-token prompt; prints one JSON line: the resident memory after `register`, the
train call's high-water mark above it (VmHWM, reset before the call), and the setting. With the threshold fixed the
peak grows by one checkpointed hidden state per layer (context x hidden x 4 bytes: 17 MB at 4,224 tokens); left
dynamic, by ~200 MB a layer (docs/performance.md, "Long trajectories"). `--dynamic` leaves glibc's default: the
trainer's calls to mallopt are skipped (host_allocator reads as having none), in this process only.

    python benchmarks/experiments/heap_growth.py --layers 4 [--dynamic] [--no-checkpointing]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

import artrl as art
from artrl.runtime import host_allocator
from artrl.commands.bench.memory import reset_high_water_mark, status_kb, context_pair
from artrl.models import shapes

MODEL = "random:qwen3-0.6b"


async def main(args: argparse.Namespace) -> dict:
    shapes.RANDOM_SHAPES[MODEL][1]["num_hidden_layers"] = args.layers  # this process's copy of the shape only
    if args.dynamic:
        host_allocator._mallopt = False  # as if the C library had no mallopt: glibc keeps its dynamic threshold
    cfg = art.InternalModelConfig(gradient_checkpointing=args.checkpointing, check_memory=False)
    group = context_pair(MODEL, cfg, args.context, "prompt")
    model = art.TrainableModel(name="heap", project="bench", base_model=MODEL, _internal_config=cfg)
    with tempfile.TemporaryDirectory() as root:
        backend = art.LocalBackend(path=root, show_progress=False)
        try:
            await model.register(backend)
            registered = status_kb("VmRSS") / 1e6
            reset_high_water_mark()
            t0 = time.perf_counter()
            result = await model.train([group], config=art.TrainConfig(learning_rate=1e-5,
                                                                       allow_training_without_logprobs=True))
            seconds = time.perf_counter() - t0
            peak = status_kb("VmHWM") / 1e6
        finally:
            backend.close()
    return {"bench": "heap_growth", "model": MODEL, "layers": args.layers, "context": args.context,
            "row_tokens": int(result.metrics.get("data/row_length", 0)), "checkpointing": args.checkpointing,
            "mmap_threshold": "dynamic" if args.dynamic else "fixed", "registered_gb": round(registered, 3),
            "train_above_registered_gb": round(peak - registered, 3), "train_seconds": round(seconds, 1),
            "command": " ".join(["python", "benchmarks/experiments/heap_growth.py", *sys.argv[1:]])}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--dynamic", action="store_true", help="leave glibc's mmap threshold dynamic (its default)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    print(json.dumps(asyncio.run(main(p.parse_args()))))
