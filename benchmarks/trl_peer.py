"""A peer for `train_sft`: TRL's SFTTrainer on the same synthetic trajectories, trainable tokens/s.

Both sides train the same base model (the same random-init or local weights), the same LoRA
(rank, alpha, dropout 0, the same target modules), on the same trajectories (a user turn
and an assistant reply of random words, drawn from `--seed`), with the same effective batch
(`--batch-size` trajectories per optimizer step, in the same order), the same learning rate, and the loss on the
assistant tokens only (TRL: prompt-completion data, completion-only loss). TRL runs
padding-free (the step's trajectories flattened into one row with position ids; transformers
masks across them) and with Liger's kernels where liger_kernel imports on CUDA. Each side runs
in its own subprocess (its own peak memory); the first optimizer step is a warm-up and is not
timed: the figure is the trainable (assistant) tokens of the later steps over their seconds.

    python benchmarks/trl_peer.py --model artrl/tiny --device cpu          # CPU check
    python benchmarks/trl_peer.py --model random:qwen3-0.6b --device cuda  # on a GPU

Prints one JSON line. Needs `pip install trl` (and its `datasets`, `accelerate`); without them it
says so and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORDS = ("river stone cloud lamp orange seven garden quiet market window silver paper engine forest "
         "yellow music winter bridge circle number planet simple travel doctor basket thunder").split()


def trajectories(n: int, prompt_words: int, completion_words: int, seed: int) -> list[tuple[str, str]]:
    """(user text, assistant text) pairs of random words, lengths varied by up to +-25%."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        k = max(1, int(k * rng.uniform(0.75, 1.25)))
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [(text(prompt_words), text(completion_words)) for _ in range(n)]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_mb(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _model_cfg(args: Any) -> Any:
    from artrl.config.model import InternalModelConfig

    return InternalModelConfig(device=args.device, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                               lora_dropout=0.0, seed=args.seed,
                               gradient_checkpointing=True if args.gradient_checkpointing else None)


def run_artrl(args: Any) -> dict[str, Any]:
    import artrl as art
    from artrl.train.call import run_call
    from artrl.models.loading import load_model
    from artrl.train.sft import prepare_sft
    from artrl.train.trainer import Trainer

    cfg = _model_cfg(args)
    model, tok = load_model(args.model, cfg)
    trainer = Trainer(model, tok, cfg)
    data = [art.Trajectory(messages_and_choices=[{"role": "user", "content": u},
                                                 {"role": "assistant", "content": a}], reward=0.0)
            for u, a in trajectories(args.trajectories, args.prompt_words, args.completion_words, args.seed)]
    sft = art.TrainSFTConfig(learning_rate=args.learning_rate, batch_size=args.batch_size, shuffle=False)
    # warm-up: the first optimizer step's trajectories, as its own call (not timed)
    run_call(trainer, prepare_sft(trainer.build_context(), data[:args.batch_size], sft), show_progress=False)
    call = prepare_sft(trainer.build_context(), data[args.batch_size:], sft)
    assert call.plan is not None
    if args.device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()
    _sync(args.device)
    t0 = time.perf_counter()
    steps, _ = run_call(trainer, call, show_progress=False)
    _sync(args.device)
    seconds = time.perf_counter() - t0
    tokens = int(sum(s.trainable_tokens for s in call.plan.steps))
    return {"side": "artrl", "optimizer_steps": len(steps), "trainable_tokens": tokens, "seconds": round(seconds, 3),
            "trainable_tokens_per_s": round(tokens / seconds, 1), "peak_memory_mb": _peak_mb(args.device),
            "micro_batches": call.plan.num_micro_batches, "attn_implementation": trainer.attn_implementation,
            "kernels": trainer.kernels}


class _Counting:
    """Wraps the trainer's collator: counts each batch's trainable tokens (labels != -100) on the host."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.counts: list[int] = []

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collate(examples)
        self.counts.append(int((batch["labels"] != -100).sum()))
        return batch


def run_trl(args: Any) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from artrl.train.kernels import liger_available
    from artrl.models.loading import default_target_modules, load_base_model

    cfg = _model_cfg(args)
    model, tok = load_base_model(args.model, cfg)
    cuda = args.device.startswith("cuda")
    if cuda and importlib.util.find_spec("flash_attn") is not None:
        model.set_attn_implementation("flash_attention_2")  # TRL's documented padding-free path
    elif model.config._attn_implementation not in ("sdpa", "flex_attention", "flash_attention_2"):
        model.set_attn_implementation("sdpa")  # transformers masks packed rows from the position ids
    lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM", target_modules=default_target_modules(model))
    rows = [{"prompt": [{"role": "user", "content": u}], "completion": [{"role": "assistant", "content": a}]}
            for u, a in trajectories(args.trajectories, args.prompt_words, args.completion_words, args.seed)]
    micro = args.trl_per_device or args.batch_size
    if args.batch_size % micro:
        raise SystemExit(f"--trl-per-device {micro} must divide --batch-size {args.batch_size}")
    steps = args.trajectories // args.batch_size
    liger = cuda and liger_available() and not args.no_liger
    out_dir = tempfile.mkdtemp(prefix="trl-peer-")
    config = SFTConfig(
        output_dir=out_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=args.batch_size // micro,
        max_steps=steps, learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        padding_free=True, packing=False, max_length=None, completion_only_loss=True,
        gradient_checkpointing=bool(args.gradient_checkpointing), use_liger_kernel=liger,
        bf16=cuda, use_cpu=not cuda, report_to="none", save_strategy="no", logging_steps=10**6,
        dataloader_num_workers=0, seed=args.seed, optim="adamw_torch_fused" if cuda else "adamw_torch",
        weight_decay=0.0, max_grad_norm=1.0,
        # in order, as artrl's side (shuffle=False): each timed step trains the same trajectories on both sides
        **({"train_sampling_strategy": "sequential"} if "train_sampling_strategy" in SFTConfig.__dataclass_fields__
           else {}),
    )
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            _sync(args.device)
            ends.append(time.perf_counter())

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if len(ends) == 1 and cuda:  # after the warm-up step
                torch.cuda.reset_peak_memory_stats()

    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         peft_config=lora, callbacks=[Clock()])
    counting = _Counting(trainer.data_collator)
    trainer.data_collator = counting
    trainer.train()
    if len(ends) < 2:
        raise SystemExit(f"TRL ran {len(ends)} optimizer steps; give at least 2 (--trajectories >= 2 x --batch-size)")
    per_step = args.batch_size // micro
    timed = counting.counts[per_step:per_step * len(ends)]  # the batches of steps 2.. (the loader may fetch ahead)
    seconds = ends[-1] - ends[0]
    tokens = sum(timed)
    return {"side": "trl", "optimizer_steps": len(ends) - 1, "trainable_tokens": tokens,
            "seconds": round(seconds, 3), "trainable_tokens_per_s": round(tokens / seconds, 1),
            "peak_memory_mb": _peak_mb(args.device), "micro_batches": (len(ends) - 1) * per_step,
            "attn_implementation": model.config._attn_implementation, "liger_kernel": liger,
            "trl_per_device_train_batch_size": micro}


def _side(side: str, argv: list[str]) -> dict[str, Any]:
    env = os.environ.copy()
    env["PYTHONPATH"] = str(HERE.parent / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, __file__, "--side", side, *argv], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"side": side, "error": f"exit {out.returncode}: " + " | ".join(out.stderr.strip().splitlines()[-6:])}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="artrl/tiny")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    p.add_argument("--trajectories", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8, help="trajectories per optimizer step (both sides)")
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--completion-words", type=int, default=60)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="both sides checkpoint activations (default: TRL off, artrl as memory requires)")
    p.add_argument("--trl-per-device", type=int, default=0,
                   help="TRL's trajectories per forward pass (default: the whole batch; a divisor of --batch-size)")
    p.add_argument("--no-liger", action="store_true", help="TRL without Liger's kernels")
    p.add_argument("--side", choices=["artrl", "trl"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.trajectories < 2 * args.batch_size:
        p.error("--trajectories must be at least 2 x --batch-size (the first step is a warm-up)")
    if args.side == "artrl":
        print(json.dumps(run_artrl(args)))
        return 0
    if args.side == "trl":
        print(json.dumps(run_trl(args)))
        return 0
    missing = [m for m in ("trl", "datasets", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"trl_peer: {', '.join(missing)} not installed (`pip install trl`; on an offline GPU machine carry "
              "the wheels: benchmarks/gpu_wheels.sh); nothing measured", file=sys.stderr)
        return 2
    forward = [a for a in (argv if argv is not None else sys.argv[1:])]
    forward += ["--device", args.device] if "--device" not in forward else []
    ours, peer = _side("artrl", forward), _side("trl", forward)
    result = {"bench": "trl_peer", "model": args.model, "device": args.device, "trajectories": args.trajectories,
              "batch_size": args.batch_size, "prompt_words": args.prompt_words,
              "completion_words": args.completion_words,
              "lora": {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": 0.0},
              "artrl": ours, "trl": peer}
    if "error" not in ours and "error" not in peer:
        result["ratio_tokens_per_s"] = round(ours["trainable_tokens_per_s"] / peer["trainable_tokens_per_s"], 3)
    print(json.dumps(result))
    return 0 if "ratio_tokens_per_s" in result else 1


if __name__ == "__main__":
    sys.exit(main())
