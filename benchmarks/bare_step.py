"""A bare transformers + peft forward/backward, for comparison with `artrl bench train`'s MFU.

One causal row of random token ids through the peft-wrapped model with
transformers' own SDPA attention, loss = mean cross-entropy over every position,
backward; no packing, no masks, no engine. Prints one JSON line per row length:
seconds (best of --repeats after one warm-up), LoRA-aware model FLOPs (the same
formula as `artrl bench train`) and the MFU against the measured matmul peak.

    python benchmarks/bare_step.py --model artrl/bench-100m --lengths 768 3072
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from artrl.commands.bench.flops import ModelShape, hardware_peak
from artrl.models.loading import load_model, resolve_device, resolve_dtype
from artrl.config.model import InternalModelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artrl/bench-100m")
    p.add_argument("--lengths", type=int, nargs="+", default=[768, 3072])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = InternalModelConfig(attn_implementation="sdpa")
    model, tok = load_model(args.model, cfg)
    model.train()
    device = resolve_device(cfg)
    shape = ModelShape.of(model)
    peak = hardware_peak(device, resolve_dtype(cfg, device))
    for n in args.lengths:
        ids = torch.randint(10, len(tok), (1, n), device=device)
        best = float("inf")
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            torch.nn.functional.cross_entropy(logits, ids[0, 1:]).backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first pass warms up
                best = min(best, time.perf_counter() - t0)
        flops = shape.flops(n, n, n * (n + 1) // 2, lora_aware=True)
        print(json.dumps({"bench": "bare_step", "model": args.model, "tokens": n, "seconds": round(best, 3),
                          "tokens_per_s": round(n / best, 1), "model_flops": flops,
                          "mfu": round(flops / best / (peak["peak_tflops"] * 1e12), 4), "peak": peak}))


if __name__ == "__main__":
    main()
