"""`artrl demo`: SFT warm-up then RL on the tiny model, on a CPU, in a few minutes.

The whole ART loop on the colour quiz (`artrl.tasks.colours`): register a fresh
`TrainableModel("demo", project "artrl-demo")` with a `LocalBackend`, measure the
validation reward (held-out phrasings), warm up with `train_sft`, then run RL
steps (8 rollouts per question through the local OpenAI-compatible server,
`delete_checkpoints`, `train`), and plot train and validation reward per step.

Steps: 0 is the untrained model, 1 the model after the SFT call, 2.. one per RL
call. Train reward at step s is the mean reward of the rollouts that trained
step s (sampled with the weights of step s-1: ART logs a train call's groups at
the step it produces); validation reward at step s is measured with the weights
of step s. The plot is `artrl runs show`'s (runs.py).

Choices, and what they simplify:

1. **Validation samples, like training.** Each validation question is answered
   `val_samples` times at temperature 1 (seeded), so the number is the expected
   reward of the policy RL optimises, not a greedy accuracy.
2. **Seeded, end to end.** Adapter initialisation, the SFT order, the questions
   of each RL step and every sampling request derive from `seed`, so the
   untrained and after-SFT numbers repeat exactly. RL steps may not: the server
   batches concurrent requests as they arrive, batch composition changes float
   rounding, and a sample that flips changes every later step.
3. **Fresh run each time.** The demo's run directory is deleted before it starts
   (the demo never resumes), so its history and plot describe one run.
4. **Advantages are not scaled by the group's std** (`scale_rewards=False`,
   as Dr. GRPO). Once most questions are solved, a group of seven right answers
   and one runaway ("greenyellow...") gives the runaway an advantage of -2.6
   when scaled; such groups dominate the late steps, and with scaling one run
   in our tries lost its end-of-answer token and fell from 0.96 to 0.72
   validation reward before recovering. Unscaled, the same group gives -0.9.
5. **What RL learns here.** The warm-up data mixes bare and hedged answers; the
   grader wants one word. RL makes the bare answer the rule on held-out
   phrasings and sharpens the facts. It does not teach facts absent from the
   warm-up: on this random-init 1M-parameter model, group-relative RL learns
   behaviour shared by all prompts quickly but not new prompt-dependent facts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import runs
from ..train import schedules
from ..errors import ConfigError
from ..gather import gather_trajectory_groups
from ..local import LocalBackend
from ..run import storage
from ..model import TrainableModel
from ..tasks import colours
from ..trajectories.data import Trajectory, TrajectoryGroup
from ..config.model import InternalModelConfig
from ..types import TrainConfig, TrainSFTConfig

log = logging.getLogger(__name__)

PROJECT = "artrl-demo"
MODEL_NAME = "demo"
BASE_MODEL = "artrl/tiny"
PLOT_FILE = "rewards.png"
GROUP_SIZE = 8
"""Rollouts per question in an RL step (the group of group-relative advantages)."""

_NOISY_LOGGERS = ("httpx", "httpx2", "httpcore", "uvicorn", "uvicorn.access", "uvicorn.error", "openai",
                  "matplotlib", "artrl.local.backend", "artrl.serve.http.background", "artrl.models.loading")


@dataclass(frozen=True)
class DemoConfig:
    """Every knob of the demo; `quick()` is the setting the tests use."""

    rl_steps: int = 40
    """RL steps (train calls) after the warm-up; validation reward plateaus after about 10-15."""
    groups_per_step: int = 32
    """Questions per RL step, drawn from the 96 train questions; each gets a group of GROUP_SIZE rollouts."""
    sft_epochs: int = 20
    """Passes over the 96 warm-up examples in the one SFT call (about 50 s of the run at the default)."""
    sft_learning_rate: float = 1e-2
    """Peak of the SFT cosine schedule. LoRA on the random-init tiny model needs a large rate."""
    sft_batch_size: int = 8
    """Warm-up examples per SFT optimizer step."""
    rl_learning_rate: float = 3e-3
    """Learning rate of the first RL step; it decays by a cosine over the RL steps."""
    rl_min_learning_rate: float = 3e-4
    """Learning rate the RL cosine ends at (late steps then cannot undo what the early ones learnt)."""
    scale_rewards: bool = False
    """Divide group-relative advantages by the group's reward std (TrainConfig.scale_rewards). Off: see
    the module docstring, point 4."""
    val_every: int = 5
    """Measure validation reward after every this many RL steps (and after the last)."""
    val_samples: int = 2
    """Sampled answers per validation question (48 questions)."""
    seed: int = 0
    """Seeds the adapter initialisation, the data order, the RL questions and every sampling request."""

    @classmethod
    def quick(cls) -> "DemoConfig":
        """A tiny setting for tests: two SFT epochs, two RL steps on four questions."""
        return cls(rl_steps=2, groups_per_step=4, sft_epochs=2, val_every=1, val_samples=1)

    def check(self) -> None:
        for name in ("rl_steps", "groups_per_step", "sft_epochs", "sft_batch_size", "val_every", "val_samples"):
            value = getattr(self, name)
            if value < (0 if name == "rl_steps" else 1):
                raise ConfigError(f"DemoConfig.{name}={value}; it must be >= {0 if name == 'rl_steps' else 1}")
        n_train = len(colours.scenarios("train"))
        if self.groups_per_step > n_train:
            raise ConfigError(f"DemoConfig.groups_per_step={self.groups_per_step} exceeds the {n_train} train "
                              "questions; lower it")


@dataclass
class DemoResult:
    """What a demo run measured; rewards are (step, mean reward) pairs read back from history.jsonl."""

    run_dir: Path
    plot_path: Path
    val_before: float
    val_after_sft: float
    val_after_rl: float
    seconds: float
    train_rewards: list[tuple[int, float]] = field(default_factory=list)
    val_rewards: list[tuple[int, float]] = field(default_factory=list)
    base_model: str = BASE_MODEL
    device: str = "cpu"
    rollout_seconds: float = 0.0
    """Wall time spent sampling (validation and RL rollouts through the server)."""
    train_seconds: float = 0.0
    """Wall time spent in train_sft / train calls (and deleting old checkpoints)."""
    rollout_completion_tokens: int = 0
    """Completion tokens sampled in those rollouts."""

    @property
    def rollout_tokens_per_s(self) -> float:
        """Completion tokens per second of rollout wall time (the server's decode throughput as the loop sees it)."""
        return self.rollout_completion_tokens / self.rollout_seconds if self.rollout_seconds > 0 else 0.0


def _fresh_run_dir(path: Path) -> Path:
    run = storage.run_dir(path, PROJECT, MODEL_NAME)
    if run.exists():
        if not (run / storage.MODEL_FILE).exists() and any(run.iterdir()):
            raise ConfigError(f"{run} exists but holds no {storage.MODEL_FILE}, so it is not an artrl run "
                              "directory; the demo will not delete it. Pass another --path.")
        log.info("removing the previous demo run at %s (the demo always starts from a fresh model)", run)
        shutil.rmtree(run)
    return run


def _request_seed(seed: int, *parts: int) -> int:
    """A reproducible per-request sampling seed from the demo seed and the request's coordinates."""
    h = seed
    for p in parts:
        h = (h * 1_000_003 + p + 1) % (2**31 - 1)
    return h


async def _validate(model: TrainableModel, client: Any, cfg: DemoConfig, clock: _Clock) -> list[Trajectory]:
    """Answer every validation question `val_samples` times (the same seeds at every step) and log 'val'."""
    questions = colours.scenarios("val")
    trajectories = await clock.rollouts(asyncio.gather(*(
        colours.rollout(model, s, client=client, seed=_request_seed(cfg.seed, 0, i, k))
        for i, s in enumerate(questions) for k in range(cfg.val_samples))))
    await model.log(list(trajectories), split="val")
    return list(trajectories)


def _completion_tokens(trajectories: list[Trajectory]) -> int:
    """Sampled tokens of the trajectories' choices (one logprob entry each)."""
    total = 0
    for t in trajectories:
        for item in t.messages_and_choices:
            logprobs = getattr(item, "logprobs", None)
            total += len(getattr(logprobs, "content", None) or [])
    return total


class _Clock:
    """Wall time and sampled tokens of the demo's phases."""

    def __init__(self) -> None:
        self.rollout_seconds = self.train_seconds = 0.0
        self.tokens = 0

    async def rollouts(self, work: Any) -> Any:
        t0 = time.perf_counter()
        result = await work
        self.rollout_seconds += time.perf_counter() - t0
        groups = result if isinstance(result, list) else [result]
        self.tokens += _completion_tokens([t for g in groups for t in
                                           (g.trajectories if isinstance(g, TrajectoryGroup) else [g])])
        return result

    async def training(self, work: Any) -> Any:
        t0 = time.perf_counter()
        result = await work
        self.train_seconds += time.perf_counter() - t0
        return result


def _mean(trajectories: list[Trajectory], key: str | None = None) -> float:
    values = [t.reward if key is None else float(t.metrics[key]) for t in trajectories]
    return sum(values) / len(values)


def _describe(trajectories: list[Trajectory]) -> str:
    return (f"reward {_mean(trajectories):.3f} (right colour {_mean(trajectories, 'right_colour'):.0%}, "
            f"one-word answers {_mean(trajectories, 'one_word'):.0%})")


def _sft_data(cfg: DemoConfig, rng: random.Random) -> list[Trajectory]:
    examples = colours.sft_trajectories()
    data: list[Trajectory] = []
    for _ in range(cfg.sft_epochs):
        epoch = list(examples)
        rng.shuffle(epoch)
        data += epoch
    return data


def _read_rewards(run: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    table = runs.step_table(runs.load_history(run))
    return ([(r.step, r.train_reward) for r in table if r.train_reward is not None],
            [(r.step, r.val_reward) for r in table if r.val_reward is not None])


async def run_demo(path: str | Path = "./.art", *, rl_steps: int | None = None, seed: int | None = None,
                   quick: bool = False, config: DemoConfig | None = None, show_progress: bool = True,
                   base_model: str = BASE_MODEL, device: str | None = None) -> DemoResult:
    """Run the demo into `<path>/artrl-demo/models/demo` (deleted first) and return what it measured.

    `config` replaces the defaults (`DemoConfig()`, or `DemoConfig.quick()` when
    `quick`); `rl_steps` and `seed`, when given, override its fields. `base_model` (default the tiny
    model; e.g. "random:qwen3-0.6b" to time the loop at a real shape) and `device` ("cpu", "cuda";
    None: cuda when available) choose what is trained where.
    """
    cfg = config or (DemoConfig.quick() if quick else DemoConfig())
    if rl_steps is not None:
        cfg = dataclasses.replace(cfg, rl_steps=rl_steps)
    if seed is not None:
        cfg = dataclasses.replace(cfg, seed=seed)
    cfg.check()
    started = time.perf_counter()
    run = _fresh_run_dir(Path(path))
    rng = random.Random(cfg.seed)

    clock = _Clock()
    internal = InternalModelConfig(seed=cfg.seed, device=device)
    from ..models.loading import resolve_device  # torch: loaded when the demo runs, not for `--help`

    device_name = str(resolve_device(internal))  # checks a CUDA device is there before anything starts
    model = TrainableModel(name=MODEL_NAME, project=PROJECT, base_model=base_model, _internal_config=internal)
    backend = LocalBackend(path=str(path), show_progress=show_progress)
    try:
        await model.register(backend)
        client = model.openai_client()
        log.info("run directory %s; %d SFT examples x %d epochs, then %d RL steps of %d questions x %d samples",
                 run, len(colours.sft_trajectories()), cfg.sft_epochs, cfg.rl_steps, cfg.groups_per_step,
                 GROUP_SIZE)

        val = await _validate(model, client, cfg, clock)
        log.info("step 0 (untrained): validation %s", _describe(val))

        sft = _sft_data(cfg, rng)
        n_sft_steps = -(-len(sft) // cfg.sft_batch_size)
        await clock.training(model.train_sft(sft, config=TrainSFTConfig(
            learning_rate=schedules.cosine(cfg.sft_learning_rate, n_sft_steps), batch_size=cfg.sft_batch_size)))
        val = await _validate(model, client, cfg, clock)
        log.info("step %d (after SFT, %d optimizer steps): validation %s", await model.get_step(), n_sft_steps,
                 _describe(val))

        train_questions = colours.scenarios("train")
        rl_rates = schedules.cosine(cfg.rl_learning_rate, cfg.rl_steps, min_lr=cfg.rl_min_learning_rate) \
            if cfg.rl_steps else []
        for i in range(cfg.rl_steps):
            step = await model.get_step()
            questions = rng.sample(train_questions, cfg.groups_per_step)
            groups = await clock.rollouts(gather_trajectory_groups(
                (TrajectoryGroup(colours.rollout(model, q, client=client, seed=_request_seed(cfg.seed, step, g, k))
                                 for k in range(GROUP_SIZE))
                 for g, q in enumerate(questions)),
                pbar_desc=f"rollouts for step {step + 1}" if show_progress else None))
            await clock.training(model.delete_checkpoints())
            result = await clock.training(model.train(groups, config=TrainConfig(
                learning_rate=rl_rates[i], scale_rewards=cfg.scale_rewards)))
            rollouts = [t for g in groups for t in g.trajectories]
            # named by the step it made, as the trainer's bar ("rl step N") and the rollouts' bar are
            line = f"step {result.step} (RL {i + 1}/{cfg.rl_steps}): train {_describe(rollouts)}"
            if (i + 1) % cfg.val_every == 0 or i + 1 == cfg.rl_steps:
                val = await _validate(model, client, cfg, clock)
                line += f"; validation reward {_mean(val):.3f}"
            log.info(line)
        await model.delete_checkpoints()
    finally:
        backend.close()

    train_rewards, val_rewards = _read_rewards(run)
    plot_path = runs.plot_run(runs.step_table(runs.load_history(run)), run / PLOT_FILE,
                              f"artrl demo: colour quiz, {'tiny model' if base_model == BASE_MODEL else base_model}, "
                              f"seed {cfg.seed}")
    by_step = dict(val_rewards)
    return DemoResult(run_dir=run, plot_path=plot_path, val_before=by_step[0], val_after_sft=by_step[1],
                      val_after_rl=val_rewards[-1][1], seconds=time.perf_counter() - started,
                      train_rewards=train_rewards, val_rewards=val_rewards, base_model=base_model,
                      device=device_name, rollout_seconds=clock.rollout_seconds, train_seconds=clock.train_seconds,
                      rollout_completion_tokens=clock.tokens)


def summary(result: DemoResult) -> str:
    """The report printed at the end of `artrl demo`."""
    return "\n".join([
        "",
        "artrl demo: done",
        f"  validation reward, untrained    : {result.val_before:.3f}",
        f"  validation reward, after SFT    : {result.val_after_sft:.3f}   (before RL)",
        f"  validation reward, after RL     : {result.val_after_rl:.3f}   "
        f"({result.val_after_rl - result.val_after_sft:+.3f} from RL)",
        f"  time                            : {result.seconds / 60:.1f} min ({result.seconds:.0f} s)",
        f"  plot                            : {result.plot_path}",
        f"  history                         : {result.run_dir / storage.HISTORY_FILE}",
    ])


def summary_json(result: DemoResult) -> str:
    """`artrl demo --json`: one line with what a benchmark compares across devices and commits."""
    return json.dumps({
        "bench": "demo", "model": result.base_model, "device": result.device,
        "wall_s": round(result.seconds, 2), "rollout_s": round(result.rollout_seconds, 2),
        "train_s": round(result.train_seconds, 2),
        "other_s": round(result.seconds - result.rollout_seconds - result.train_seconds, 2),
        "rollout_completion_tokens": result.rollout_completion_tokens,
        "rollout_completion_tokens_per_s": round(result.rollout_tokens_per_s, 1),
        "val_reward_before": result.val_before, "val_reward_after_sft": result.val_after_sft,
        "val_reward_after_rl": result.val_after_rl})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default="./.art", help="LocalBackend directory (default ./.art); the demo's run "
                   f"directory <path>/{PROJECT}/{storage.MODELS_DIR}/{MODEL_NAME} is replaced")
    p.add_argument("--rl-steps", type=int, default=None,
                   help=f"RL steps (default {DemoConfig.rl_steps}; {DemoConfig.quick().rl_steps} with --quick)")
    p.add_argument("--seed", type=int, default=0, help="seed of the adapter, the data order and sampling")
    p.add_argument("--quick", action="store_true", help="a much smaller run (well under a minute), for tests")
    p.add_argument("--model", default=BASE_MODEL, help=f"base model (default {BASE_MODEL}); e.g. random:qwen3-0.6b "
                   "times the same loop at a real model's shape (random weights: the rewards mean nothing)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available, else cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON line of timings and rewards on standard "
                   "output at the end (the readable summary goes to standard error)")
    p.add_argument("--pipeline", action="store_true", help="instead: one SFT warm-up, then the RL stage three "
                   "ways, the synchronous loop and PipelineTrainer at each --bounds value; validation reward "
                   "against wall time, and a plot (src/artrl/commands/demo_pipeline.py)")
    p.add_argument("--bounds", default="1,4", help="with --pipeline: the max_steps_off_policy of each pipelined "
                   "arm (default 1,4)")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="with --pipeline: the constant RL learning "
                   "rate of every arm (default 1e-3)")
    p.add_argument("--trainer", choices=("auto", "worker", "here"), default="auto", help="with --pipeline: where "
                   "every arm trains: 'worker', a process of its own (InternalModelConfig.train_in_worker); "
                   "'here', this process; 'auto' (default): a worker on a CPU, here on a GPU (docs/pipeline.md)")


def quiet_logs(args: argparse.Namespace) -> None:
    """What the demo's output leaves out unless --verbose: the HTTP loggers, a transformers notice, load bars."""
    if not getattr(args, "verbose", False):
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" of the 1M-parameter model


def main(args: argparse.Namespace) -> int:
    """`artrl demo`: run the demo and print its summary (`--pipeline`: cli.py runs demo_pipeline.main)."""
    quiet_logs(args)
    result = asyncio.run(run_demo(args.path, rl_steps=args.rl_steps, seed=args.seed, quick=args.quick,
                                  base_model=args.model, device=args.device))
    if args.json:
        print(summary(result), file=sys.stderr, flush=True)
        print(summary_json(result), flush=True)
    else:
        print(summary(result), flush=True)
    return 0
