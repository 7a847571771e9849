"""`artrl bench train --workers N`: one train call on N data-parallel workers against one worker.

* one worker: the default path, one process (`artrl bench train`'s "ours" run),
  with every CPU core, or one GPU;
* N workers: `torch.distributed.run --standalone --nproc-per-node N` runs this
  module on every rank: the FSDP2-sharded trainer (distributed/sharding.py) on
  the same synthetic call (the RL build path, the same workload, scale and
  batching flags), gloo and cores / N threads each on a CPU, NCCL and one GPU
  each on GPUs.

Reported (one JSON line): trainable tokens per second of both, the speedup,
the scaling efficiency (speedup / N), each rank's computed tokens (how evenly
balance.py split the steps), their imbalance (max / mean - 1) and padding
passes, and each run's peak memory (the largest rank's). Both runs time the
whole call after one untimed warm-up pass; nothing else is measured here, and
figures from a shared machine mean little.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch


def run_rank(args: Any) -> dict[str, Any] | None:
    """One rank of the N-worker run (under torchrun); rank 0 returns the figures."""
    import torch.distributed as dist

    from ...distributed.sharding import ShardedTrainer
    from ...preprocess.plan import OptimizerStep
    from ...models.loading import load_model, resolve_device, resolve_name
    from ...train.rl import build_rl, rl_loss_fn
    from .train import bench_configs, peak_memory_mb
    from .workload import load_workload, workload_groups

    cfg, mcfg = bench_configs(args)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(mcfg)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    mcfg = mcfg.model_copy(update={"device": str(device)})
    resolve_name(args.model)  # build the tiny model (if needed) before the process group exists
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10),
                            device_id=device if device.type == "cuda" else None)
    try:
        torch.manual_seed(0)
        model, tok = load_model(args.model, mcfg)
        trainer = ShardedTrainer(model, tok, mcfg)
        groups = workload_groups(load_workload(args.workload), scale=args.scale, vocab_size=len(tok))
        built = build_rl(groups, cfg, trainer.build_context())
        assert built.packed is not None and built.plan is not None
        packed, plan = built.packed, built.plan
        loss_fn = rl_loss_fn(cfg)
        # warm-up: one pass (every rank takes part: one real, the others padding), not timed, gradients dropped
        first = plan.steps[0]
        warm = OptimizerStep(first.micro_batches[:1], first.trainable_tokens, first.sequences)
        trainer._plan = plan
        trainer.accumulate(packed, warm, loss_fn)
        trainer._plan = None
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.reset_balance()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        t0 = time.perf_counter()
        steps = list(trainer.run(packed, plan, loss_fn, [cfg.learning_rate] * len(plan.steps), optimizer=cfg,
                                 show_progress=False))
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        seconds = time.perf_counter() - t0
        peak = torch.tensor([peak_memory_mb(device)], dtype=torch.float64,
                            device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if dist.get_rank() != 0:
            return None
        trainable = sum(s.trainable_tokens for s in plan.steps)
        tokens = trainer.rank_tokens
        mean = sum(tokens) / len(tokens)
        return {
            "workers": dist.get_world_size(),
            "device": str(device.type),
            "rows": packed.num_rows,
            "optimizer_steps": len(plan.steps),
            "trainable_tokens": trainable,
            "computed_tokens": int(sum(m["computed_tokens"] for m in steps)),
            "rank_computed_tokens": tokens,
            "computed_tokens_imbalance": round(max(tokens) / mean - 1, 4) if mean else 0.0,
            "rank_padding_passes": trainer.rank_padding,
            "seconds": round(seconds, 3),
            "trainable_tokens_per_s": round(trainable / seconds, 1),
            "peak_memory_mb": round(float(peak), 1),
            "skipped_nonfinite_steps": int(sum(m["skipped_nonfinite_steps"] for m in steps)),
        }
    finally:
        dist.destroy_process_group()


def _forwarded(args: Any) -> list[str]:
    out = ["--workload", args.workload, "--scale", str(args.scale), "--model", args.model]
    for flag, value in (("--groups-per-optimizer-step", args.groups_per_optimizer_step),
                        ("--grad-accumulation-sequences", args.grad_accumulation_sequences),
                        ("--per-device-train-batch-size", args.per_device_train_batch_size),
                        ("--max-tokens-per-microbatch", args.max_tokens_per_microbatch),
                        ("--device", args.device), ("--attn-implementation", args.attn_implementation)):
        if value:
            out += [flag, str(value)]
    if args.gradient_checkpointing:
        out.append("--gradient-checkpointing")
    return out


def run_workers(args: Any) -> dict[str, Any]:
    """The N-worker run, launched with torchrun; its rank 0's figures."""
    env = os.environ.copy()
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if not cuda:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.workers))
    elif torch.cuda.device_count() < args.workers:
        raise SystemExit(f"artrl bench train: --workers {args.workers} needs that many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.workers),
           "-m", "artrl.commands.bench.workers", *_forwarded(args)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"artrl bench train: the {args.workers}-worker run failed (exit {out.returncode}); its "
                         "last output:\n" + "\n".join(out.stderr.strip().splitlines()[-30:]))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args: Any) -> int:
    from .train import run_in_subprocess

    if args.workers < 2:
        raise SystemExit("artrl bench train: --workers N compares N >= 2 workers with one; without it the "
                         "bench compares our layout with the reference")
    one = run_in_subprocess("ours", args)
    many = run_workers(args)
    speedup = many["trainable_tokens_per_s"] / one["trainable_tokens_per_s"]
    print(json.dumps({
        "bench": "train-workers", "workload": args.workload, "scale": args.scale, "model": args.model,
        "workers": args.workers,
        "trainable_tokens_per_s": {"one_worker": one["trainable_tokens_per_s"],
                                   "workers": many["trainable_tokens_per_s"]},
        "speedup": round(speedup, 3), "scaling_efficiency": round(speedup / args.workers, 3),
        "rank_computed_tokens": many["rank_computed_tokens"],
        "computed_tokens_imbalance": many["computed_tokens_imbalance"],
        "one_worker": one, "distributed": many,
    }))
    return 0


if __name__ == "__main__":
    import argparse

    from ...errors import ArtrlError
    from .train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    try:
        figures = run_rank(parser.parse_args())
    except ArtrlError as e:  # a clear message, not a traceback, reaches the parent's report
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    if figures is not None:
        print(json.dumps(figures))
