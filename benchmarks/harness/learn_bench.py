"""`python benchmarks/bench.py learn`: how much a policy learns per rollout, artrl against a plain GRPO step.

For every task x learning rate x seed, two runs ("arms") start from the same
model (`--model`, default `artrl/tiny`; the colour quiz from its warmed-up copy,
see `learn_tasks`) with the same fresh LoRA adapter (`InternalModelConfig`
defaults, initialised from the seed), and take `--steps` RL steps. A step
samples `--samples` replies to each of `--prompts` prompts from the current
policy, grades them, and updates the policy on those groups:

* **artrl**: the public API, as a user writes it: a `TrainableModel` registered
  with a `LocalBackend` in a temporary directory, each reply a `Trajectory`,
  each prompt's replies a `TrajectoryGroup`, and
  `await model.train(groups, config=TrainConfig(learning_rate=lr, **extra))`.
  Everything but the learning rate is TrainConfig's default unless `--config
  k=v` says otherwise (so the benchmark measures what a user gets).
* **yardstick**: `grpo_step` below, the textbook on-policy GRPO update in a few
  lines, with the settings a TRL GRPOTrainer user gets by default:
  group-relative advantages `(r - mean) / (std + 1e-4)` (sample std), the
  policy gradient `-A * logp` of every sampled token averaged over all sampled
  tokens of the batch (zero-advantage groups included; TRL's token-level
  "bnpo"/"dapo" normalisation), gradient norm clipped at 1.0, then ONE AdamW
  step (transformers' defaults: betas 0.9/0.999, eps 1e-8, no weight decay).
  With one update per batch the importance ratio is 1, so PPO's clipping never
  acts and is left out. It shares with artrl only what must be equal: the model
  loading (`load_model`, hence the same weights, LoRA config and adapter init)
  and the sampling.

**Sampling, identical for both arms.** Each arm's policy is served by artrl's
OpenAI-compatible server (`serve/`) over a `TransformersEngine` built with the
same `InternalModelConfig`: the artrl arm by its `LocalBackend`, the yardstick
by a server started here on its own model. One function, `sample_step`, asks
either server through the `openai` client, one prompt at a time (`n` =
`--samples` replies per request, temperature 1, no top-p, `max_tokens` of the
task, a seed per (seed, step, prompt)). One request at a time keeps every
decode batch the same whatever the timing, so with equal weights both arms
sample exactly the same tokens (the test checks that step 0 agrees bit for
bit); on a CPU the tiny model answers a step's 48 requests in about a second,
so the concurrency given up costs little. Prompts per step are drawn from
`(task, seed)` alone, and both arms grade replies with the task's `grade`.

**Score.** A step's reward is the mean reward of the rollouts sampled at it
(before its update); a run's gain is the mean of its last `WINDOW` step rewards
minus that of its first (`learn_results`). The update after the last step's
rollouts would change no measured reward, so it is not run. Runs are written
to `--out` as each finishes; rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from artrl.errors import ConfigError
from artrl.runtime.progress import progress_bar
from .learn_results import (ARMS, GAIN_FLOOR, PAIRED_MARGIN, ResultsFile, compare_to_baseline, format_table,
                            run_key, run_scores, window)
from .learn_tasks import TASKS, LearnTask, Prompt, WarmUp, get_task, prompt_schedule, warm_up_colours

log = logging.getLogger(__name__)

TEMPERATURE: Final = 1.0
YARDSTICK_BETAS: Final = (0.9, 0.999)
YARDSTICK_EPS: Final = 1e-8
YARDSTICK_WEIGHT_DECAY: Final = 0.0
YARDSTICK_MAX_GRAD_NORM: Final = 1.0
YARDSTICK_STD_EPS: Final = 1e-4
"""The yardstick's optimizer, clipping and advantage settings (TRL GRPOTrainer / transformers defaults)."""

_NOISY_LOGGERS: Final = ("httpx", "httpcore", "openai", "uvicorn", "uvicorn.access", "uvicorn.error",
                         "artrl.local.backend", "artrl.train.call", "artrl.models.loading", "artrl.serve.http.background",
                         "artrl.serve.http.served_models")


@dataclass
class Sample:
    """One sampled reply: its prompt, the server's choice, the prompt's and the reply's token ids, its reward."""

    prompt: Prompt
    choice: Any
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float


def request_seed(seed: int, step: int, prompt_index: int) -> int:
    """The sampling seed of one request, from the run's seed and the request's place in it."""
    h = hashlib.sha256(f"{seed}:{step}:{prompt_index}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


async def sample_step(client: Any, model_name: str, task: LearnTask, prompts: list[Prompt], *, samples: int,
                      seed: int, step: int) -> list[list[Sample]]:
    """Sample `samples` replies to each prompt (one request per prompt, one at a time) and grade them."""
    from artrl.utils import choice_from_completion

    groups = []
    for i, prompt in enumerate(prompts):
        completion = await client.chat.completions.create(
            model=model_name, messages=list(prompt.messages), n=samples, max_tokens=task.max_tokens,
            temperature=TEMPERATURE, logprobs=True, seed=request_seed(seed, step, i))
        prompt_ids = (completion.model_extra or {}).get("prompt_token_ids")
        group = []
        for k in range(samples):
            choice = choice_from_completion(completion, k)
            ids = (choice.model_extra or {}).get("token_ids")
            if prompt_ids is None or ids is None:
                raise ConfigError("the inference server returned no prompt_token_ids/token_ids; `python benchmarks/bench.py learn` "
                                  "samples from artrl's own server, which always does")
            group.append(Sample(prompt, choice, list(prompt_ids), list(ids),
                                float(task.grade(choice.message.content or "", prompt))))
        groups.append(group)
    return groups


def grpo_step(model: Any, optimizer: torch.optim.Optimizer, groups: list[list[Sample]], *, pad_id: int,
              max_grad_norm: float = YARDSTICK_MAX_GRAD_NORM) -> dict[str, float]:
    """The yardstick: one on-policy GRPO update on one batch of groups (see the module docstring)."""
    device = next(model.parameters()).device
    advantages, rows = [], []
    for group in groups:
        r = torch.tensor([s.reward for s in group], dtype=torch.float32)  # [G]
        advantages.append((r - r.mean()) / (r.std() + YARDSTICK_STD_EPS))  # [G]
        rows += [(s.prompt_ids, s.completion_ids) for s in group]
    adv = torch.cat(advantages).to(device)  # [B]
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T], right-padded
    attention = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]
    sampled = torch.zeros(len(rows), width, dtype=torch.bool)  # [B, T], True on sampled tokens
    for b, (p, c) in enumerate(rows):
        input_ids[b, :len(p) + len(c)] = torch.tensor(p + c)
        attention[b, :len(p) + len(c)] = 1
        sampled[b, len(p):len(p) + len(c)] = True
    input_ids, attention, sampled = input_ids.to(device), attention.to(device), sampled.to(device)
    model.train()
    logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits.float()  # [B, T, V]
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    mask = sampled[:, 1:].float()  # [B, T-1]: position t predicts token t + 1
    loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        raise FloatingPointError(f"the yardstick's loss ({float(loss.detach())}) or gradient norm ({float(grad_norm)}) is "
                                 "not finite; the step was not taken")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "tokens": float(mask.sum())}


# ---------------------------------------------------------------- the two arms

_ARTRL_METRICS: Final = {"optimizer_steps": "data/step_num_gradient_steps", "loss": "loss/train",
                         "grad_norm": "loss/grad_norm", "mean_ratio": "train/mean_ratio",
                         "clip_fraction": "train/clip_fraction", "tokens": "data/step_trainer_tokens",
                         "groups_skipped": "data/groups_skipped_zero_advantage"}


class ArtrlArm:
    """artrl through its public API: TrainableModel + LocalBackend in `workdir`, `model.train` per step."""

    name = "artrl"

    def __init__(self, base_model: str, seed: int, lr: float, extra: dict[str, Any], workdir: Path) -> None:
        from artrl.config.model import InternalModelConfig
        from artrl.types import TrainConfig

        self.config = TrainConfig(**{**extra, "learning_rate": lr})
        self.internal = InternalModelConfig(seed=seed)
        self.base_model, self.workdir = base_model, workdir
        self.model: Any = None
        self.backend: Any = None

    async def start(self) -> tuple[Any, str]:
        from artrl.local import LocalBackend
        from artrl.model import TrainableModel

        self.model = TrainableModel(name="learn", project="bench-learn", base_model=self.base_model,
                                    _internal_config=self.internal)
        self.backend = LocalBackend(path=str(self.workdir), show_progress=False)
        await self.model.register(self.backend)
        return self.model.openai_client(), self.model.get_inference_name()

    async def update(self, groups: list[list[Sample]]) -> dict[str, float]:
        from artrl.trajectories.data import Trajectory, TrajectoryGroup

        batch = [TrajectoryGroup([Trajectory(messages_and_choices=[*s.prompt.messages, s.choice], reward=s.reward)
                                  for s in group]) for group in groups]
        result = await self.model.train(batch, config=self.config)
        return {k: result.metrics[m] for k, m in _ARTRL_METRICS.items() if m in result.metrics}

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


class YardstickArm:
    """`grpo_step` on the same model, served by artrl's server for sampling (see the module docstring)."""

    name = "yardstick"

    def __init__(self, base_model: str, seed: int, lr: float, extra: dict[str, Any], workdir: Path) -> None:
        from artrl.config.model import InternalModelConfig

        del extra, workdir  # TrainConfig fields are artrl's; the yardstick is fixed
        self.base_model, self.lr = base_model, lr
        self.internal = InternalModelConfig(seed=seed)
        self.server: Any = None
        self.engine: Any = None

    async def start(self) -> tuple[Any, str]:
        from openai import AsyncOpenAI

        from artrl.chat.format import end_of_turn_ids
        from artrl.serve import ServedModels, create_app, start_server
        from artrl.serve.engines.factory import open_engine
        from artrl.models.loading import load_model

        cfg = self.internal
        self.model, tok = await asyncio.to_thread(load_model, self.base_model, cfg)
        # opened as LocalBackend opens its built-in engine (sharing the stepped model), so both arms sample alike
        self.engine = open_engine("builtin", tokenizer=tok, end_ids=end_of_turn_ids(tok, self.model), cfg=cfg,
                                  model=self.model, shares_trainer_weights=True, model_lock=threading.RLock())
        self.server = start_server(create_app(ServedModels("yardstick", self.engine)))
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.lr,
                                           betas=YARDSTICK_BETAS, eps=YARDSTICK_EPS,
                                           weight_decay=YARDSTICK_WEIGHT_DECAY)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        return AsyncOpenAI(base_url=self.server.base_url, api_key="artrl", timeout=600.0), "yardstick"

    async def update(self, groups: list[list[Sample]]) -> dict[str, float]:
        def step() -> dict[str, float]:
            with self.engine.training():  # the engine never decodes while the weights change
                return grpo_step(self.model, self.optimizer, groups, pad_id=self.pad_id)

        return await asyncio.to_thread(step)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.engine is not None:
            self.engine.close()


ARM_CLASSES: Final = {"artrl": ArtrlArm, "yardstick": YardstickArm}


def _digest(groups: list[list[Sample]]) -> str:
    ids = [s.completion_ids for g in groups for s in g]
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


async def run_arm(arm_name: str, task: LearnTask, base_model: str, lr: float, seed: int,
                  schedule: list[list[Prompt]], *, samples: int, extra: dict[str, Any],
                  show_progress: bool = True) -> dict[str, Any]:
    """One run: len(schedule) steps of one arm; returns its record (per-step rewards, scores).

    A non-finite update (artrl's NonFiniteError, the yardstick's FloatingPointError) ends
    the run; it is recorded with `failed` set and no scores, and counted, not averaged.
    """
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="artrl-bench-learn-"))
    arm = ARM_CLASSES[arm_name](base_model, seed, lr, extra, workdir)
    steps: list[dict[str, Any]] = []
    failed: str | None = None
    desc = f"{task.name} lr={lr:g} seed={seed} {arm_name}"
    try:
        client, model_name = await arm.start()
        with progress_bar(total=len(schedule), desc=desc, unit="step", leave=False, disable=not show_progress) as bar:
            for i, prompts in enumerate(schedule):
                groups = await sample_step(client, model_name, task, prompts, samples=samples, seed=seed, step=i)
                rewards = [s.reward for g in groups for s in g]
                record: dict[str, Any] = {"prompts": [p.key for p in prompts], "rewards": rewards,
                                          "reward": sum(rewards) / len(rewards), "digest": _digest(groups)}
                steps.append(record)
                bar.set_postfix(reward=f"{record['reward']:.3f}", refresh=False)
                bar.update(1)
                if i + 1 == len(schedule):
                    break
                try:
                    record["update"] = await arm.update(groups)
                except FloatingPointError as e:  # NonFiniteError is one
                    failed = f"{type(e).__name__} in the update after step {i}: {e}"
                    log.error("%s: %s; the run stops and is counted as failed", desc, failed)
                    break
    finally:
        arm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    scores: dict[str, Any] = {"first": None, "last": None, "gain": None}
    if failed is None:
        scores = run_scores([s["reward"] for s in steps])
        log.info("%s: reward %.3f -> %.3f (gain %+.3f)", desc, scores["first"], scores["last"], scores["gain"])
    return {"task": task.name, "lr": lr, "seed": seed, "arm": arm_name, "base_model": base_model,
            "reward_shape": task.reward_shape, "max_tokens": task.max_tokens, "steps": steps,
            **scores, "failed": failed, "seconds": time.perf_counter() - started}


# ---------------------------------------------------------------- the sweep


@dataclass(frozen=True)
class LearnSettings:
    """What a sweep measures; every field but tasks, lrs, seeds and arms must match to resume a results file."""

    tasks: tuple[str, ...] = ("vowels", "nodigit", "colours")
    lrs: tuple[float, ...] = (2e-3, 1e-2, 3e-2)
    seeds: int = 12
    steps: int = 20
    prompts: int = 6
    samples: int = 8
    config: tuple[tuple[str, Any], ...] = ()
    model: str = "artrl/tiny"
    arms: tuple[str, ...] = ARMS
    warm_up: WarmUp = WarmUp()

    def check(self) -> None:
        from artrl.types import TrainConfig

        if not self.tasks:
            raise ConfigError(f"--tasks is empty; choose from {sorted(TASKS)}")
        for t in self.tasks:
            if self.prompts > len(get_task(t).prompts):
                raise ConfigError(f"--prompts {self.prompts} exceeds the {len(get_task(t).prompts)} prompts of task "
                                  f"{t!r}; lower it")
        for name, least in (("seeds", 1), ("steps", 2), ("prompts", 1), ("samples", 2)):
            if getattr(self, name) < least:
                raise ConfigError(f"--{name} {getattr(self, name)}; it must be >= {least}"
                                  + (" (a group needs two replies to compare)" if name == "samples" else ""))
        if not self.lrs or any(not lr > 0 for lr in self.lrs):
            raise ConfigError(f"--lrs {list(self.lrs)}; give one or more learning rates > 0")
        unknown = [a for a in self.arms if a not in ARM_CLASSES]
        if unknown or not self.arms:
            raise ConfigError(f"--arms {list(self.arms)}; choose from {list(ARM_CLASSES)}")
        extra = dict(self.config)
        if "learning_rate" in extra:
            raise ConfigError("--config learning_rate=...: the learning rates come from --lrs")
        TrainConfig(**extra, learning_rate=self.lrs[0]).check()  # an unknown or bad field fails here, not mid-sweep

    def shared(self) -> dict[str, Any]:
        """The settings every run of a results file shares."""
        return {"steps": self.steps, "prompts": self.prompts, "samples": self.samples, "model": self.model,
                "config": dict(self.config), "window": window(self.steps), "temperature": TEMPERATURE,
                "warm_up": self.warm_up.__dict__,
                "yardstick": {"betas": list(YARDSTICK_BETAS), "eps": YARDSTICK_EPS,
                              "weight_decay": YARDSTICK_WEIGHT_DECAY, "max_grad_norm": YARDSTICK_MAX_GRAD_NORM,
                              "std_eps": YARDSTICK_STD_EPS}}


async def run_learn_bench(settings: LearnSettings, out: Path, *, show_progress: bool = True) -> ResultsFile:
    """Run every (task, lr, seed, arm) not yet in `out`, saving `out` after each; returns the results."""
    settings.check()
    shared = settings.shared()
    results = ResultsFile(out, shared)
    done = results.done()
    # seeds outermost, so a sweep stopped early has every task and learning rate at the same seeds
    todo = [(t, lr, seed, arm) for seed in range(settings.seeds) for t in settings.tasks for lr in settings.lrs
            for arm in settings.arms if run_key(t, lr, seed, arm) not in done]
    if len(todo) < len(settings.tasks) * len(settings.lrs) * settings.seeds * len(settings.arms):
        log.info("%s: resuming, %d runs already done, %d to go", out, len(results.runs), len(todo))
    base_models: dict[str, str] = {}
    bar = progress_bar(total=len(todo), desc="bench learn", unit="run", disable=not show_progress)
    for task_name, lr, seed, arm in todo:
        task = get_task(task_name)
        if task_name not in base_models and task.warm_up:
            models_dir = out.resolve().parent / f"{out.stem}.models"  # absolute: a relative path reads as a hub id
            warmed = await warm_up_colours(settings.model, models_dir, settings.warm_up)
            base_models[task_name] = str(warmed)
        schedule = prompt_schedule(task, seed, settings.steps, settings.prompts)
        base = base_models.get(task_name, settings.model)
        results.add(await run_arm(arm, task, base, lr, seed, schedule, samples=settings.samples,
                                  extra=dict(settings.config), show_progress=show_progress))
        bar.update(1)
    bar.close()
    if not todo:
        results.save()  # aggregates of an already complete file, written again with this code's table
    return results


def parse_config(items: list[str]) -> tuple[tuple[str, Any], ...]:
    """`--config k=v` pairs; v is read as JSON (numbers, true/false, null) or else kept as a string."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--config {item!r}: expected FIELD=VALUE, e.g. --config scale_rewards=false")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        out.append((key.strip(), parsed))
    return tuple(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LearnSettings()
    p.add_argument("--tasks", nargs="+", default=list(d.tasks), choices=sorted(TASKS), help="tasks to run")
    p.add_argument("--lrs", nargs="+", type=float, default=list(d.lrs), help="learning rates")
    p.add_argument("--seeds", type=int, default=d.seeds, help="seeds 0..N-1 per (task, lr)")
    p.add_argument("--steps", type=int, default=d.steps, help="RL steps per run")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts (groups) per step")
    p.add_argument("--samples", type=int, default=d.samples, help="replies per prompt (group size)")
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                   help="a TrainConfig field for the artrl arm (repeatable), e.g. --config scale_rewards=false")
    p.add_argument("--arms", nargs="+", default=list(d.arms), choices=list(ARM_CLASSES), help="arms to run")
    p.add_argument("--model", default=d.model, help="base model (default artrl/tiny)")
    p.add_argument("--out", default="bench-learn.json",
                   help="results JSON, written after every run; rerunning with the same file resumes")
    p.add_argument("--baseline", default=None, metavar="FILE",
                   help="a results JSON of the same command to hold these results to: exit 1 when artrl's mean "
                        f"gain falls below {GAIN_FLOOR * 100:.0f}%% of the baseline's, or its gain minus the yardstick's "
                        f"more than {PAIRED_MARGIN} below the baseline's (benchmarks/results/learning-baseline.json "
                        "is the one CI holds the project to)")


def main(args: argparse.Namespace) -> int:
    if not getattr(args, "verbose", False):
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    settings = LearnSettings(tasks=tuple(args.tasks), lrs=tuple(args.lrs), seeds=args.seeds, steps=args.steps,
                             prompts=args.prompts, samples=args.samples, config=parse_config(args.config),
                             model=args.model, arms=tuple(args.arms))
    baseline = read_baseline(Path(args.baseline)) if args.baseline else None  # a bad file is refused before running
    results = asyncio.run(run_learn_bench(settings, Path(args.out)))
    doc = results.document()
    print(format_table(doc["table"], doc["paired"]), flush=True)
    print(f"\nresults: {args.out}", flush=True)
    if baseline is None:
        return 0
    problems = compare_to_baseline(doc, baseline)
    for line in problems:
        print(f"REGRESSION: {line}", flush=True)
    if not problems:
        print(f"learns as the baseline {args.baseline} did", flush=True)
    return 1 if problems else 0


def read_baseline(path: Path) -> dict[str, Any]:
    """A results file to compare against (`--baseline`), or a ConfigError naming what is wrong with it."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--baseline {path}: not a readable results file ({e})") from e
    if not isinstance(doc, dict) or doc.get("bench") != "learn" or not isinstance(doc.get("table"), list):
        raise ConfigError(f"--baseline {path}: not a `bench.py learn` results file")
    return doc
