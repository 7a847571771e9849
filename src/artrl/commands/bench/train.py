"""`artrl bench train`: one train call on a workload, reference mode vs ours.

* reference: the ART layout (row length = ceil(longest / G) * G with G = 2048
  scaled like the lengths, sequences in group order), one full-length row per
  forward pass, one optimizer step per row.
* ours: the RL build path of a train call (preprocess/build.py through
  train/rl.py's `build_rl`): optimizer steps of `groups_per_optimizer_step` groups (all
  of them by default), each packed with the prefix-sharing packer at the
  automatic row length, micro-batches of `per_device_train_batch_size` rows (or
  a token budget), rows trimmed to their used length.

Both run the same trainer and loss on the same synthetic data (workload lengths
scaled by `--scale`, random token ids), each in a fresh subprocess so its peak
memory (max RSS on CPU, max allocated on GPU) is its own. One warm-up
micro-batch runs before timing. Prints one JSON line.

With `--workers N` it compares N data-parallel workers with one instead
(commands/bench/workers.py). For a mixture-of-experts model, `--vs-dense-experts` also
times ours with every expert on every token (models/moe.py's dense reference), and MFU
counts active parameters (commands/bench/flops.py); `--layers N` cuts a random shape such as
random:qwen3-30b-a3b to its first N layers so it fits a small machine.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ...preprocess.pack import pack_reference
from ...preprocess.plan import reference_plan
from ...config.model import InternalModelConfig
from ...types import TrainConfig
from .pack import REFERENCE_MULTIPLE
from .flops import ModelShape, hardware_peak, packed_counts
from .workload import load_workload, scaled, workload_groups

log = logging.getLogger("artrl.commands.bench.train")  # also when run as __main__ (its subprocesses)

if TYPE_CHECKING:
    import torch  # loaded by the benchmark's run, not by `artrl --help`


def peak_memory_mb(device: torch.device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_mode(mode: str, workload: str, scale: float, model_name: str, cfg: TrainConfig,
             model_cfg: InternalModelConfig, max_steps: int | None = None,
             profile_micro_batches: int | None = None, layers: int | None = None,
             dense_experts: bool = False) -> dict[str, Any]:
    import torch

    from ...models.loading import load_model
    from ...models.moe import is_moe, use_dense_reference
    from ...models.quantization import quantization_of
    from ...train.rl import build_rl, rl_loss_fn
    from ...train.trainer import Trainer

    torch.manual_seed(0)
    t_load = time.perf_counter()
    model, tok = load_model(model_name, model_cfg,
                            shape_overrides={"num_hidden_layers": layers} if layers else None)
    log.info("%s: %s loaded in %.1f s", mode, model_name, time.perf_counter() - t_load)
    moe = is_moe(model.get_base_model().config)
    if dense_experts:
        if not moe:
            raise SystemExit(f"--dense-experts: {model_name} is not a mixture-of-experts model")
        use_dense_reference(model)  # every expert on every token: the reference the routed computation beats
    trainer = Trainer(model, tok, model_cfg)
    groups = workload_groups(load_workload(workload), scale=scale, vocab_size=len(tok))
    if mode == "reference":
        packed = pack_reference(groups, multiple=scaled(REFERENCE_MULTIPLE, scale), pad_id=trainer.pad_id)
        plan = reference_plan(packed)
    else:
        built = build_rl(groups, cfg, trainer.build_context())
        assert built.packed is not None and built.plan is not None
        packed, plan = built.packed, built.plan
    if max_steps is not None:
        plan.steps = plan.steps[:max_steps]
    loss_fn = rl_loss_fn(cfg)
    # warm-up: one micro-batch forward/backward, not timed, gradients dropped
    t_warm = time.perf_counter()
    warm = plan.steps[0]
    trainer.accumulate(packed, type(warm)(warm.micro_batches[:1], warm.trainable_tokens, warm.sequences), loss_fn)
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    log.info("%s: warm-up micro-batch in %.1f s (compiles, if any); timing %d optimizer steps, %d micro-batches",
             mode, time.perf_counter() - t_warm, len(plan.steps), plan.num_micro_batches)
    t0 = time.perf_counter()
    steps = list(trainer.run(packed, plan, loss_fn, [cfg.learning_rate] * len(plan.steps), optimizer=cfg,
                             show_progress=False))
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    log.info("%s: timed call in %.1f s", mode, seconds)
    peak_mb = round(peak_memory_mb(trainer.device), 1)
    profiled = None
    if profile_micro_batches is not None:
        t_profile = time.perf_counter()
        profiled = _profile(trainer, packed, plan, loss_fn, cfg, profile_micro_batches)
        log.info("%s: profiled call in %.1f s", mode, time.perf_counter() - t_profile)
    trainable = sum(s.trainable_tokens for s in plan.steps)
    real, trainable_check, keys = packed_counts(packed, [r for st in plan.steps for r in st.rows])
    assert trainable_check == trainable
    shape = ModelShape.of(trainer.model)
    return {
        "mode": mode,
        "rows": packed.num_rows,
        "row_length": packed.row_length,
        "padding_fraction": round(packed.stats.padding_fraction, 4),
        "computed_tokens": int(sum(m["computed_tokens"] for m in steps)),
        "trainable_tokens": trainable,
        "per_device_train_batch_size": max(len(mb.rows) for st in plan.steps for mb in st.micro_batches),
        "forward_passes": plan.num_micro_batches,
        "optimizer_steps": len(plan.steps),
        "seconds": round(seconds, 3),
        "trainable_tokens_per_s": round(trainable / seconds, 1),
        "computed_tokens_per_s": round(sum(m["computed_tokens"] for m in steps) / seconds, 1),
        "peak_memory_mb": peak_mb,
        "device": str(trainer.device),
        "quantization": quantization_of(trainer.model),  # what the loader chose: "4bit", "8bit" or None
        "skipped_nonfinite_steps": int(sum(m["skipped_nonfinite_steps"] for m in steps)),
        "real_tokens": real,
        "model_flops": shape.flops(real, trainable, keys, lora_aware=True),
        "model_flops_dense": shape.flops(real, trainable, keys, lora_aware=False),
        "non_embedding_params": shape.non_embedding_params,
        "lora_params": shape.lora_params,
        "dtype": str(trainer.dtype).replace("torch.", ""),
        "attn_implementation": trainer.attn_implementation,
        "kernels": trainer.kernels,
        "gradient_checkpointing": model_cfg.gradient_checkpointing,  # None: as the free memory requires
        "max_micro_batch_tokens": max(mb.tokens for st in plan.steps for mb in st.micro_batches),
        "layers": int(model.get_base_model().config.num_hidden_layers),
        **({"experts": "dense reference" if dense_experts else "routed"} if moe else {}),
        **({"profile": profiled} if profiled is not None else {}),
    }


def _profile(trainer: Any, packed: Any, plan: Any, loss_fn: Any, cfg: TrainConfig, micro_batches: int) -> dict:
    """A further call under torch.profiler: the first optimizer step cut to `micro_batches` micro-batches
    (0: the whole call), after the timed one, so profiling does not slow the figures above."""
    import copy

    from .train_profile import profile_call

    cut = copy.copy(plan)
    if micro_batches:
        first = plan.steps[0]
        mbs = first.micro_batches[:micro_batches]
        cut.steps = [type(first)(mbs, first.trainable_tokens, first.sequences)]
    table = profile_call(lambda: list(trainer.run(packed, cut, loss_fn, [cfg.learning_rate] * len(cut.steps),
                                                  optimizer=cfg, show_progress=False)),
                         trainer.model, trainer.device)
    table["micro_batches"] = cut.num_micro_batches
    return table


def run_in_subprocess(mode: str, args: Any) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "artrl.commands.bench.train", "--mode", mode, "--workload", args.workload,
           "--scale", str(args.scale), "--model", args.model]
    if args.groups_per_optimizer_step:
        cmd += ["--groups-per-optimizer-step", str(args.groups_per_optimizer_step)]
    if args.grad_accumulation_sequences:
        cmd += ["--grad-accumulation-sequences", str(args.grad_accumulation_sequences)]
    if args.per_device_train_batch_size:
        cmd += ["--per-device-train-batch-size", str(args.per_device_train_batch_size)]
    if args.max_tokens_per_microbatch:
        cmd += ["--max-tokens-per-microbatch", str(args.max_tokens_per_microbatch)]
    if args.device:
        cmd += ["--device", args.device]
    for flag in ("gradient_checkpointing", "liger_kernel", "compile_layers", "fused_optimizer"):
        value = getattr(args, flag, None)
        if value is not None:
            cmd += [f"--{'' if value else 'no-'}{flag.replace('_', '-')}"]
    if args.attn_implementation:
        cmd += ["--attn-implementation", args.attn_implementation]
    if args.logprob_chunk_size:
        cmd += ["--logprob-chunk-size", str(args.logprob_chunk_size)]
    if args.reference_steps and mode == "reference":
        cmd += ["--reference-steps", str(args.reference_steps)]
    if args.profile and mode == "ours":
        cmd += ["--profile", "--profile-micro-batches", str(args.profile_micro_batches)]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if getattr(args, "load_in_4bit", None) is not None:
        cmd += [f"--{'' if args.load_in_4bit else 'no-'}load-in-4bit"]
    if mode == "dense":  # ours, with every expert on every token
        cmd[cmd.index("--mode") + 1] = "ours"
        cmd += ["--dense-experts"]
    # the run's log passes through as it comes (a run stopped from outside, by a time limit, still shows where it
    # was), and its last lines stay for the error below
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    last: collections.deque[str] = collections.deque(maxlen=25)

    def forward() -> None:
        for line in proc.stderr:
            last.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    relay = threading.Thread(target=forward, daemon=True)
    relay.start()
    stdout = proc.stdout.read()
    code = proc.wait()
    relay.join()
    if code != 0:
        raise SystemExit(f"artrl bench train: the {mode} run failed (exit {code}); its last output:\n"
                         + "\n".join(last))
    return json.loads(stdout.strip().splitlines()[-1])


def bench_configs(args: Any) -> tuple[TrainConfig, InternalModelConfig]:
    cfg = TrainConfig(learning_rate=1e-5, per_device_train_batch_size=args.per_device_train_batch_size,
                      max_tokens_per_microbatch=args.max_tokens_per_microbatch or None,
                      groups_per_optimizer_step=args.groups_per_optimizer_step or None,
                      grad_accumulation_sequences=args.grad_accumulation_sequences or None)
    extra = {"logprob_chunk_size": args.logprob_chunk_size} if args.logprob_chunk_size else {}
    if getattr(args, "dtype", None):
        extra["dtype"] = args.dtype
    if getattr(args, "load_in_4bit", None) is not None:
        extra["load_in_4bit"] = args.load_in_4bit
    return cfg, InternalModelConfig(device=args.device, gradient_checkpointing=args.gradient_checkpointing,
                                    attn_implementation=args.attn_implementation or None,
                                    liger_kernel=args.liger_kernel, compile_layers=args.compile_layers,
                                    fused_optimizer=args.fused_optimizer, **extra)


def main(args: Any) -> int:
    """Our layout against the reference (`--workers N`: commands/bench/workers.py's main, which the CLI runs)."""
    if getattr(args, "mode", None):
        cfg, mcfg = bench_configs(args)
        steps = args.reference_steps if args.mode == "reference" and args.reference_steps else None
        print(json.dumps(run_mode(args.mode, args.workload, args.scale, args.model, cfg, mcfg, max_steps=steps,
                                  profile_micro_batches=args.profile_micro_batches if args.profile else None,
                                  layers=args.layers, dense_experts=args.dense_experts)))
        return 0
    from ...models.loading import resolve_device, resolve_dtype

    _, mcfg = bench_configs(args)
    device = resolve_device(mcfg)
    dtype = resolve_dtype(mcfg, device)  # the dtype both runs train in
    before = hardware_peak(device, dtype)
    ref = run_in_subprocess("reference", args) if args.only != "ours" else None
    ours = run_in_subprocess("ours", args) if args.only != "reference" else None
    dense = run_in_subprocess("dense", args) if args.vs_dense_experts else None
    # measured before and after the runs, the higher one kept: a shared CPU's matmul speed drifts
    peak = max(before, hardware_peak(device, dtype), key=lambda p: p["measured_matmul_tflops"])
    for r in (x for x in (ours, ref, dense) if x is not None):
        r["mfu"] = round(r["model_flops"] / r["seconds"] / (peak["peak_tflops"] * 1e12), 4)
        r["mfu_dense_flops"] = round(r["model_flops_dense"] / r["seconds"] / (peak["peak_tflops"] * 1e12), 4)
        r["achieved_tflops"] = round(r["model_flops"] / r["seconds"] / 1e12, 4)
    out: dict[str, Any] = {"bench": "train", "workload": args.workload, "scale": args.scale, "model": args.model}
    if ours is not None and ref is not None:
        out["ratio_tokens_per_s"] = round(ours["trainable_tokens_per_s"] / ref["trainable_tokens_per_s"], 3)
        # the ratio ours would reach at the reference's speed per computed token (layout alone); with
        # --reference-steps the reference ran only its first rows, so its tokens per row stand for the rest
        ref_computed = ref["computed_tokens"] * ref["rows"] / max(ref["optimizer_steps"], 1)
        out["computed_tokens_ratio"] = round(ref_computed / ours["computed_tokens"], 3)
    if dense is not None and ours is not None:  # the same call with every expert on every token
        out["routed_over_dense_experts_tokens_per_s"] = round(
            ours["trainable_tokens_per_s"] / dense["trainable_tokens_per_s"], 3)
        out["dense_experts"] = dense
    out.update({"mfu": ours["mfu"] if ours is not None else None, "peak": peak, "ours": ours, "reference": ref})
    print(json.dumps(out))
    return 0


def add_arguments(p: Any) -> None:
    p.add_argument("--workload", required=True,
                   help="workload JSON (benchmarks/workloads/README.md), e.g. benchmarks/workloads/seed-like.json")
    p.add_argument("--scale", type=float, default=0.125, help="multiply every length by this (default 1/8)")
    p.add_argument("--model", default="artrl/tiny", help="base model name or path")
    p.add_argument("--per-device-train-batch-size", type=int, default=None,
                   help="rows per forward pass (default: TrainConfig's, 2 on a GPU, 1 on a CPU)")
    p.add_argument("--max-tokens-per-microbatch", type=int, default=0, help="token budget (0: use rows)")
    p.add_argument("--groups-per-optimizer-step", type=int, default=None,
                   help="groups per optimizer step (default: TrainConfig's, all groups of the call in one step)")
    p.add_argument("--grad-accumulation-sequences", type=int, default=None,
                   help="packed rows per optimizer step instead (packing-dependent; default: unset)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    bool_flag = argparse_bool()
    p.add_argument("--gradient-checkpointing", action=bool_flag, default=None,
                   help="recompute activations in backward (default: on a GPU only when a micro-batch would not fit "
                   "without it; off on a CPU)")
    p.add_argument("--liger-kernel", action=bool_flag, default=None,
                   help="Liger's fused RMSNorm/SwiGLU/RoPE (default: on a GPU when liger_kernel imports)")
    p.add_argument("--compile-layers", action=bool_flag, default=None,
                   help="torch.compile each decoder layer (default: off)")
    p.add_argument("--fused-optimizer", action=bool_flag, default=None, help="fused AdamW (default: on a GPU)")
    p.add_argument("--logprob-chunk-size", type=int, default=0, help="tokens per LM-head chunk (0: the default)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed call, profile one more call of ours (torch.profiler) and add the table")
    p.add_argument("--profile-micro-batches", type=int, default=4,
                   help="micro-batches of the profiled call (0: the whole call; default 4)")
    p.add_argument("--attn-implementation", default=None,
                   help="artrl_tree / sdpa / eager / flex_attention (default: flex_attention on GPU, artrl_tree on CPU)")
    p.add_argument("--only", choices=["ours", "reference"], default=None, help="run one mode only (no ratio)")
    p.add_argument("--reference-steps", type=int, default=0,
                   help="the reference mode runs only its first N rows (one optimizer step each; 0: all); its "
                   "tokens/s stand for the whole call, which costs the same per row")
    p.add_argument("--workers", type=int, default=1,
                   help="N >= 2: train the call on N data-parallel workers (torch.distributed, FSDP2) and report "
                   "tokens/s against one worker, the scaling efficiency and each rank's computed tokens")
    p.add_argument("--layers", type=int, default=None,
                   help="a random shape cut to its first N decoder layers, every other dimension kept (a big shape "
                   "on a small machine)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype (default: float32 on a CPU, bfloat16 on a GPU)")
    p.add_argument("--load-in-4bit", action=argparse_bool(), default=None,
                   help="the base weights in 4-bit NF4 (bitsandbytes) or not (default: the loader's rule, "
                   "docs/models.md)")
    p.add_argument("--vs-dense-experts", action="store_true",
                   help="a mixture-of-experts model: also time ours with every expert on every token (the dense "
                   "reference the routed computation replaces) and report the ratio")
    p.add_argument("--mode", choices=["reference", "ours"], default=None, help=argparse_hidden())
    p.add_argument("--dense-experts", action="store_true", help=argparse_hidden())


def argparse_bool() -> Any:
    import argparse

    return argparse.BooleanOptionalAction


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    import argparse
    import logging

    from ...errors import ArtrlError

    # a mode's progress on stderr (the parent passes it through): a run stopped by a time limit shows where it was
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    try:
        sys.exit(main(parser.parse_args()))
    except ArtrlError as e:  # a clear message, not a traceback, reaches the parent's report
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
