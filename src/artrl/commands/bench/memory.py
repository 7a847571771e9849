"""`artrl bench memory`: the memory plan of a model beside the measured peak of one LoRA RL train call.

What it runs is what a user's loop runs, through the public API: register the model with a
LocalBackend (the memory plan is checked there, before anything loads), sample `--groups` x
`--rollouts` short answers through the local server (`--max-tokens` each), and train one RL
call on them. One JSON line:

* `plan_register`: the plan the check before loading used (micro-batches and cache of
  `PLAN_TOKENS` tokens each: the least a run needs), and whether it refused;
* `plan_workload`: the same plan for this call's own sizes (its largest micro-batch, the
  tokens the engine held), the figure to compare with the measured peak;
* `measured`: on a CPU the process's resident memory (GB): `baseline` before the model loads
  (the interpreter, torch, transformers, the server), `registered` after it loaded,
  `load_peak`, `train_peak` (each phase's high-water mark: /proc/self/status VmHWM, reset
  between phases through /proc/self/clear_refs) and `peak`, the largest of them; on a GPU
  torch's `max_memory_allocated` per phase;
* `plan_error`: plan_workload's peak / the measured peak - 1;
* `train`: the train call's trained tokens, optimizer steps, seconds, peak and torch threads side by side
  (`trained_tokens` 0, with a note, when the rewards tied and nothing was trained: such a call is fast
  because it trains nothing, and must not pass for a fast one);
* the train call's tokens/s, the token record's `sampled_logprob_delta_max`, the wall time of
  each phase.

`--context N` trains one trajectory pair of about N tokens each instead of sampled rollouts (nothing is
sampled; the turns are text, trained as on-policy): sharing an N-token prompt (`--layout prompt`) or
answering a short prompt at length (`--layout completion`, every token trained). The line then has
`context`: the call's row tokens, trained tokens, whether it checkpointed, its peak above the registered
model, in total and per token, the plan's activations, and `fit_tokens`, the most tokens the trainer's budget
(train/memory.py) let that setting hold when the call began. A call whose longest micro-batch fits no
setting is refused before it trains: `{"call_refused": true, "tokens": ..., "fit": ..., "message": ...}`.

`--gpu-memory-gb G` caps the process at G GB of its GPU (`torch.cuda.set_per_process_memory_fraction`), which
the plan and the trainer's budgets count as the device's size: a call planned, trained or refused as on a card
of G GB.

A model whose plan does not fit (and `--check-memory`, the default) prints
`{"refused": true, "message": ..., "seconds": ...}`: how long the refusal took.
Each invocation is one process, so peaks are its own; compare settings by running it twice.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from typing import Any

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="artrl/tiny", help="base model (e.g. random:qwen3-14b; default artrl/tiny)")
    p.add_argument("--load-in-4bit", action=argparse.BooleanOptionalAction, default=None,
                   help="4-bit NF4 base weights (default: the model config's rule, models/quantization.py)")
    p.add_argument("--load-in-8bit", action="store_true", help="8-bit LLM.int8 base weights")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--optim", default=None, help="ART's trainer_args.optim (default adamw_torch)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--offload-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="on CUDA, keep the checkpointed layer inputs in host memory (InternalModelConfig."
                        "offload_activations; default: when the call's longest micro-batch needs it)")
    p.add_argument("--device", default=None, help="cpu, cuda (default: cuda when available)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=2, help="trajectories per group")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each rollout samples")
    p.add_argument("--check-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="refuse a model whose plan does not fit (InternalModelConfig.check_memory)")
    p.add_argument("--path", default=None, help="run directory root (default: a temporary directory)")
    p.add_argument("--context", type=int, default=None,
                   help="train one trajectory pair of this many tokens each instead of sampled rollouts (no sampling)")
    p.add_argument("--layout", default="prompt", choices=["prompt", "completion"],
                   help="with --context: the pair shares a long prompt and answers briefly (prompt), or a short "
                        "prompt and two long answers (completion)")
    p.add_argument("--logprob-chunk-size", type=int, default=None, help="InternalModelConfig.logprob_chunk_size")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="on CUDA, cap this process at this many GB of the GPU (torch.cuda."
                        "set_per_process_memory_fraction): plan, train and refuse as on a card of that size")


def status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class _Phases:
    """Per-phase peaks: host RSS high-water marks on a CPU, torch's max_memory_allocated on a GPU."""

    def __init__(self, device_type: str) -> None:
        self.cuda = device_type == "cuda"
        self.figures: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}  # the process's CPU time (all its threads): cores busy = cpu / wall
        self._t = time.perf_counter()
        self._cpu = time.process_time()

    def now_gb(self) -> float:
        if self.cuda:
            import torch

            return torch.cuda.memory_allocated() / GB
        return status_kb("VmRSS") * 1024 / GB

    def start(self) -> None:
        self._t = time.perf_counter()
        self._cpu = time.process_time()
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        else:
            reset_high_water_mark()

    def end(self, name: str) -> None:
        self.seconds[name] = round(time.perf_counter() - self._t, 2)
        self.cpu_seconds[name] = round(time.process_time() - self._cpu, 2)
        if self.cuda:
            import torch

            self.figures[f"{name}_peak"] = torch.cuda.max_memory_allocated() / GB
        else:
            self.figures[f"{name}_peak"] = status_kb("VmHWM") * 1024 / GB


async def _run(args: argparse.Namespace, root: str) -> dict[str, Any]:
    import artrl as art
    import artrl.local.backend  # noqa: F401 -- imported before the baseline is read
    from ...errors import ConfigError
    from ...models.loading import resolve_device
    from ...models.memory_plan import plan_for, plan_memory
    from ...models.source import check_model_source

    fields: dict[str, Any] = {"dtype": args.dtype, "lora_rank": args.lora_rank, "check_memory": args.check_memory,
                              "load_in_8bit": args.load_in_8bit}
    if args.logprob_chunk_size:
        fields["logprob_chunk_size"] = args.logprob_chunk_size
    for name in ("load_in_4bit", "optim", "gradient_checkpointing", "offload_activations", "device"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    cfg = art.InternalModelConfig(**fields)
    device = resolve_device(cfg)
    phases = _Phases(device.type)
    out: dict[str, Any] = {"bench": "memory", "model": args.model, "device": device.type,
                           "settings": {k: v for k, v in fields.items() if k != "check_memory"}}
    if args.gpu_memory_gb is not None:
        out["gpu_memory_gb"] = cap_gpu_memory(device, args.gpu_memory_gb)
    check_model_source(args.model)  # in seconds, never the network for artrl's names (models/source.py)
    registered = plan_for(args.model, cfg, device)  # what register checks
    out["plan_register"] = registered.as_json()
    phases.figures["baseline"] = phases.now_gb()

    model = art.TrainableModel(name="memory", project="bench", base_model=args.model, _internal_config=cfg)
    backend = art.LocalBackend(path=root, show_progress=False)
    t0 = time.perf_counter()
    phases.start()
    try:
        await model.register(backend)
    except ConfigError as e:
        backend.close()
        return {**out, "refused": True, "seconds": round(time.perf_counter() - t0, 2), "message": str(e)}
    phases.end("load")
    phases.figures["registered"] = phases.now_gb()
    try:
        client = model.openai_client()

        async def rollout(g: int, k: int) -> art.Trajectory:
            messages = [{"role": "user", "content": f"Name a colour ({g})."}]
            reply = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                         max_tokens=args.max_tokens, temperature=1.0,
                                                         seed=100 * g + k)
            return art.Trajectory(messages_and_choices=[*messages, reply.choices[0]], reward=float(k))

        phases.start()
        if args.context:
            groups = [context_pair(args.model, cfg, args.context, args.layout)]
        else:
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(g, k) for k in range(args.rollouts)) for g in range(args.groups)),
                pbar_desc=None)
        phases.end("rollouts")
        from ...train.memory import free_bytes

        # the call's trainer (None where workers elsewhere train) and its budgets as the call begins: the free memory
        # its choices of checkpointing and offloading see
        run_trainer = getattr(getattr(backend, "_runs", {}).get(model.name), "trainer", None)
        budget = run_trainer.memory_budget(host=True) if run_trainer is not None else None
        train_free = budget.free_bytes if budget is not None else free_bytes(device)
        phases.start()
        t_call = time.perf_counter()
        try:
            # a context pair's turns are text (nothing was sampled): trained as on-policy, ART's option for such turns
            result = await model.train(groups, config=art.TrainConfig(
                learning_rate=1e-5, allow_training_without_logprobs=bool(args.context)))
        except art.TrainTooLongError as e:  # refused before it trained: how fast, and what it said
            return {**out, "refused": False, "call_refused": True, "tokens": e.tokens, "fit": e.fit,
                    "seconds_to_refuse": round(time.perf_counter() - t_call, 2), "message": str(e),
                    "measured_gb": {k: round(v, 3) for k, v in phases.figures.items()}}
        phases.end("train")
        # what the call's last micro-batch moved to host memory (train/offload.py); None where the trainer is elsewhere
        offload = getattr(run_trainer, "offload", None)
        offloaded_gb = round(offload.bytes / GB, 3) if offload is not None else None
    finally:
        backend.close()
    metrics = result.metrics
    if args.context:
        prompt, rows = 0, 0  # nothing sampled: the engine held no sequence
    else:
        prompt = max(len(c.model_extra["prompt_token_ids"]) + len(c.model_extra["token_ids"])
                     for g in groups for t in g for c in t.messages_and_choices if not isinstance(c, dict))
        rows = args.groups * args.rollouts
    rows_per_pass = -(-metrics.get("data/rows", 1.0) // max(metrics.get("data/micro_batches", 1.0), 1.0))
    # checkpointing as the call ran it: a call with gradient_checkpointing=None turns it on only when its micro-batch
    # would not fit without it (train/memory.py: the same per-token figure, against the memory free then)
    tokens = int(metrics.get("data/row_length", prompt) * rows_per_pass)
    trained = int(metrics.get("data/step_trainable_assistant_tokens", tokens))
    workload = dataclasses.replace(registered.settings, gradient_checkpointing=False, micro_batch_tokens=tokens,
                                   head_tokens=trained, serving_tokens=rows * prompt)
    from ...train.memory import MEMORY_FRACTION

    def does_not_fit(settings: Any) -> bool:  # the planned activations against the memory free when the call began
        return plan_memory(registered.shape, settings).parts["activations"] > train_free * MEMORY_FRACTION

    checkpointing = cfg.gradient_checkpointing
    if checkpointing is None:
        checkpointing = does_not_fit(workload)
    # offloading as the call ran it (train/trainer.py Trainer.call_memory: CUDA only; None: when checkpointing alone
    # does not fit the call's longest micro-batch)
    offloaded = device.type == "cuda" and bool(cfg.offload_activations)
    if device.type == "cuda" and cfg.offload_activations is None and checkpointing is not False:
        offloaded = does_not_fit(dataclasses.replace(workload, gradient_checkpointing=True))
    if offloaded_gb is not None and device.type == "cuda":
        # what the trainer did, where it says: its own budget (train/memory.py) decides, and near the boundary it
        # may decide otherwise than the plan's figures above
        offloaded = offloaded_gb > 0
    if cfg.gradient_checkpointing is not False:
        checkpointing = checkpointing or offloaded  # offloading is of the checkpointed inputs
    workload = dataclasses.replace(workload, gradient_checkpointing=bool(checkpointing),
                                   offload_activations=offloaded)
    plan = plan_memory(registered.shape, workload)
    # the largest phase peak (ru_maxrss is no help: resetting VmHWM between phases resets it too)
    peak = max(v for k, v in phases.figures.items() if k.endswith("_peak"))
    measured = {k: round(v, 3) for k, v in {**phases.figures, "peak": peak}.items()}
    context = {}
    if args.context:
        above = measured["train_peak"] - measured["registered"]
        fit = None  # the most tokens the call's setting fits, by the trainer's budget when the call began
        if budget is not None:
            fit = (budget.tokens_offloaded if offloaded else budget.tokens_checkpointed if checkpointing
                   else budget.tokens)
        context = {"context": {"tokens": args.context, "layout": args.layout, "row_tokens": tokens, "fit_tokens": fit,
                               "trained_tokens": trained, "checkpointing": bool(checkpointing),
                               "offloaded": offloaded, "offloaded_gb": offloaded_gb or 0.0,
                               "train_above_registered_gb": round(above, 3),
                               "mb_per_token_above_registered": round(above * 1e3 / max(tokens, 1), 4),
                               "plan_activations_gb": round(plan.parts["activations"] / GB, 3)}}
    if device.type == "cuda":  # the host side of offloading: pinned copies of the layers' inputs
        import resource

        measured["host_max_resident"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, 3)
    return {**out, "refused": False, **context, "plan_workload": plan.as_json(), "measured_gb": measured,
            "plan_error": round(plan.peak / GB / peak - 1, 3),
            "train": train_figures(metrics, phases.seconds["train"], measured["train_peak"],
                                   phases.cpu_seconds["train"]),
            "train_tokens_per_second": round(metrics.get("train/tokens_per_second", 0.0), 2),
            "computed_tokens": metrics.get("train/computed_tokens"),
            "sampled_logprob_delta_max": metrics.get("train/sampled_logprob_delta_max"),
            "seconds": phases.seconds}


def cap_gpu_memory(device: Any, gb: float) -> float:
    """Cap this process at `gb` GB of its CUDA device (torch's allocator refuses more), so that the plan, the call's
    budgets and its refusals are those of a card of that size; the cap as set, in GB."""
    import torch

    if device.type != "cuda":
        raise SystemExit(f"--gpu-memory-gb caps a CUDA device; this run is on {device.type}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if not 0 < gb * GB <= total:
        raise SystemExit(f"--gpu-memory-gb {gb}: this GPU holds {total / GB:.1f} GB")
    torch.cuda.set_per_process_memory_fraction(gb * GB / total, index)
    return round(gb, 3)


def filler_text(tokenizer: Any, tokens: int, seed: int) -> str:
    """Text of about `tokens` tokens of `tokenizer`: words of the tiny model's corpus in a seeded order."""
    import random
    from importlib.resources import files

    # plain words only: the corpus also holds chat markup (<|im_start|>, <tool_call>), which would end a turn early
    words = [w for w in files("artrl.data").joinpath("tiny_corpus.txt").read_text().split() if w.isalpha()]
    rng = random.Random(seed)
    out: list[str] = []
    have = 0
    while have < tokens:
        piece = " ".join(rng.choice(words) for _ in range(256))
        out.append(piece)
        have += len(tokenizer(piece, add_special_tokens=False)["input_ids"])
    ids = tokenizer(" ".join(out), add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def context_pair(base_model: str, cfg: Any, tokens: int, layout: str) -> Any:
    """One group of two trajectories of about `tokens` tokens each (rewards 0 and 1, so both train): sharing a long
    prompt and answering in a few words (`layout` "prompt"), or a short prompt answered at length ("completion")."""
    import artrl as art

    from ...models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(base_model, cfg)
    if layout == "prompt":
        prompt = filler_text(tokenizer, tokens - 16, seed=0)
        answers = ["The first answer.", "The second answer."]
    else:
        prompt = "Write at length."
        answers = [filler_text(tokenizer, tokens - 16, seed=1 + k) for k in range(2)]
    messages = [{"role": "user", "content": prompt}]
    return art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*messages, {"role": "assistant", "content": a}],
                                               reward=float(k)) for k, a in enumerate(answers)])


def train_figures(metrics: dict[str, float], seconds: float, peak_gb: float,
                  cpu_seconds: float | None = None) -> dict[str, Any]:
    """The train call beside its peak: the tokens it trained (0 when every group's rewards tied: nothing was
    trained, however fast the call), the optimizer steps it took, its seconds, the torch threads every train
    call of this process sets (artrl/runtime/threads.py), and the process's CPU seconds over the call with the cores they
    kept busy on average (CPU seconds / wall seconds: 1.0 is one core working, the other idle)."""
    from ...metrics_taxonomy import TRAIN_GRADIENT_STEPS_KEY
    from ...runtime.threads import training_threads

    trained = int(metrics.get("data/step_trainer_tokens", 0.0))
    return {"trained_tokens": trained, "optimizer_steps": int(metrics.get(TRAIN_GRADIENT_STEPS_KEY, 0.0)),
            "seconds": seconds, "peak_gb": peak_gb, "torch_threads": training_threads(),
            "trained_tokens_per_second": round(trained / seconds, 3) if seconds else None,
            **({} if cpu_seconds is None else {"cpu_seconds": cpu_seconds,
                                               "cores_busy": round(cpu_seconds / seconds, 2) if seconds else None}),
            **({} if trained else {"note": "nothing was trained (tied rewards, or every group dropped): the "
                                           "seconds say nothing about training speed"})}


def main(args: argparse.Namespace) -> int:
    if args.path is not None:
        result = asyncio.run(_run(args, args.path))
    else:
        with tempfile.TemporaryDirectory(prefix="artrl-bench-memory-") as root:
            result = asyncio.run(_run(args, root))
    result["command"] = " ".join(["artrl", *sys.argv[1:]])
    print(json.dumps(result))
    return 0
