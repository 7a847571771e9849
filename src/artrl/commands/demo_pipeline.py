"""`artrl demo --pipeline`: the demo's RL stage run synchronously and pipelined, reward against wall time.

One SFT warm-up (the demo's, `artrl.demo`), then the same RL stage from that adapter in three arms,
one after the other on one `LocalBackend`:

* `sync`: gather a step's groups, `backend.train`, repeat (ART's loop);
* `pipeline-1`, `pipeline-4`: `artrl.pipeline_trainer.PipelineTrainer` with `max_steps_off_policy`
  1 and 4 (`--bounds`), `groups_per_step` groups per train call.

Every arm makes `rl_steps` train calls with the same keywords (ART 0.5.18's `backend.train`:
`learning_rate` constant, `loss_fn="cispo"`, `normalize_advantages=False` as the demo's
`scale_rewards=False`), on questions drawn from one seeded stream of train questions (the
synchronous loop takes the first `rl_steps x groups_per_step`; the pipeline draws on where it
sets groups without reward spread aside, as ART's does), each rollout seeded by its place in
that stream.

Choices, and what they simplify:

1. **Validation after the run, from the checkpoints.** Every step is a checkpoint (local/session.py),
   so each arm's validation reward at steps `val_every, 2 val_every, ..` and at its last step is
   measured once all arms are done, through `backend.adapter_lease(model, step)` with the demo's
   seeded validation requests. No arm's clock pays for validation, and every arm is measured alike.
2. **Wall time is the time to produce a step**: seconds from the arm's start (after its model is
   registered) to the end of the train call that produced the step; the SFT adapter is step 1 at
   0 s for every arm. An arm's `wall_s` is that of its last step.
3. **One warm-up for all arms**: the SFT checkpoint (and the history up to it) is copied into each
   arm's fresh run directory, which resumes from it (a run resumes from its latest complete
   checkpoint), so the arms start from the same weights and optimizer state.
4. **A constant learning rate** (`learning_rate`, default 1e-3, between the demo's cosine ends):
   PipelineTrainer takes one rate, and the synchronous arm uses the same.
5. **Rollout workers**: two steps' groups for any bound above 0 (`rollout_workers`): the bound then
   limits how old a trained group may be, not how many are decoded at once.
6. **On a CPU every model trains in a worker process** (`train_in_worker`; `--trainer here` for
   this process): in one process the trainer and the engine's decode thread take turns on the
   interpreter lock, and the pipelined arms were slower than the synchronous one (docs/pipeline.md).
   Every arm trains the same way, so each pays the same checkpoint round trip per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import demo
from ..train import schedules
from ..errors import ConfigError
from ..local import LocalBackend
from ..model import TrainableModel
from ..run import storage
from ..tasks import colours
from ..trajectories.data import TrajectoryGroup
from ..config.model import InternalModelConfig
from ..types import TrainSFTConfig

log = logging.getLogger(__name__)

PROJECT = "artrl-demo-pipeline"
WARMUP_NAME = "warmup"
PLOT_FILE = "pipeline-rewards.png"
LEARNING_RATE = 1e-3
LOSS_FN = "cispo"
DEFAULT_BOUNDS = (1, 4)


@dataclass
class ArmResult:
    """One arm: (seconds, step) when each step was produced, validation reward per measured step."""

    name: str
    max_steps_off_policy: int | None
    step_times: list[tuple[int, float]] = field(default_factory=list)
    val_rewards: list[tuple[int, float]] = field(default_factory=list)
    groups_trained: int = 0
    rollouts_sampled: int = 0
    staleness: list[int] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.step_times[-1][1] if self.step_times else 0.0

    def curve(self) -> list[tuple[float, float]]:
        """(seconds, validation reward) at each measured step, step 1 (the warm-up) at 0 s."""
        at = dict(self.step_times)
        at[1] = 0.0
        return [(at[s], r) for s, r in self.val_rewards if s in at]

    def report(self) -> dict[str, Any]:
        return {"max_steps_off_policy": self.max_steps_off_policy, "wall_s": round(self.wall_s, 2),
                "steps": len(self.step_times), "groups_trained": self.groups_trained,
                "rollouts_sampled": self.rollouts_sampled,
                "mean_staleness": round(sum(self.staleness) / len(self.staleness), 3) if self.staleness else None,
                "val_reward_final": self.val_rewards[-1][1] if self.val_rewards else None,
                "val_rewards": [[s, round(r, 4)] for s, r in self.val_rewards],
                "step_seconds": [[s, round(t, 2)] for s, t in self.step_times]}


@dataclass
class PipelineDemoResult:
    root: Path
    plot_path: Path
    val_after_sft: float
    arms: list[ArmResult]
    seconds: float
    device: str = "cpu"
    base_model: str = demo.BASE_MODEL
    seed: int = 0
    train_in_worker: bool = False


class _ClockedBackend(LocalBackend):
    """LocalBackend that notes, per model, when each train call returned and how stale its groups were."""

    arm: ArmResult | None = None
    started: float = 0.0

    async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> Any:
        groups = list(trajectory_groups)
        from_step = await model.get_step()
        result = await super().train(model, groups, **kwargs)
        arm = self.arm
        if arm is not None:
            arm.step_times.append((result.step, time.perf_counter() - self.started))
            arm.groups_trained += len(groups)
            for g in groups:
                versions = [t.initial_policy_version for t in g.trajectories if t.initial_policy_version is not None]
                arm.staleness.append(from_step - min(versions) if versions else 0)
        return result


def _question_stream(cfg: demo.DemoConfig, rng: random.Random) -> Iterator[dict[str, Any]]:
    """Train questions, `groups_per_step` distinct ones at a time (as the demo draws a step's), for ever."""
    questions = colours.scenarios("train")
    i = 0
    while True:
        for q in rng.sample(questions, cfg.groups_per_step):
            yield {"index": i, "question": q, "metadata": {"scenario_id": i}}
            i += 1


def _rollout_fn(cfg: demo.DemoConfig, arm: ArmResult) -> Any:
    """ART's RolloutFn: a group of GROUP_SIZE answers, each seeded by the scenario's place in the stream."""

    async def group(model: Any, scenario: dict[str, Any], config: Any = None) -> TrajectoryGroup:
        trajectories = await asyncio.gather(*(
            colours.rollout(model, scenario["question"], seed=demo._request_seed(cfg.seed, 7, scenario["index"], k))
            for k in range(demo.GROUP_SIZE)))
        arm.rollouts_sampled += len(trajectories)
        return TrajectoryGroup(trajectories)

    return group


def _train_kwargs(cfg: demo.DemoConfig, learning_rate: float) -> dict[str, Any]:
    """What PipelineTrainer's training stage passes (it saves checkpoints only at eval steps, and these arms have
    no eval; every step is a checkpoint all the same, choice 1)."""
    return {"learning_rate": learning_rate, "loss_fn": LOSS_FN, "normalize_advantages": cfg.scale_rewards,
            "save_checkpoint": False}


async def _run_sync(backend: Any, model: Any, cfg: demo.DemoConfig, lr: float, arm: ArmResult) -> None:
    stream = _question_stream(cfg, random.Random(cfg.seed + 1))
    group = _rollout_fn(cfg, arm)
    for _ in range(cfg.rl_steps):
        version = await model.get_step()
        groups = await asyncio.gather(*(group(model, next(stream)) for _ in range(cfg.groups_per_step)))
        for g in groups:
            for t in g.trajectories:
                t.initial_policy_version = t.final_policy_version = version
        result = await backend.train(model, groups, **_train_kwargs(cfg, lr))
        await model.log(groups, split="train", step=result.step)


async def _run_pipeline(backend: Any, model: Any, cfg: demo.DemoConfig, lr: float, arm: ArmResult) -> None:
    from ..pipeline_trainer import PipelineRuntimeConfig, PipelineTrainer

    kw = _train_kwargs(cfg, lr)
    bound = arm.max_steps_off_policy or 0
    pipeline = PipelineRuntimeConfig(num_rollout_workers=rollout_workers(cfg.groups_per_step, bound),
                                     min_batch_size=cfg.groups_per_step, max_batch_size=cfg.groups_per_step)
    trainer = PipelineTrainer(
        model, backend, _rollout_fn(cfg, arm), _question_stream(cfg, random.Random(cfg.seed + 1)), None,
        pipeline=pipeline, max_steps_off_policy=bound, learning_rate=lr, loss_fn=LOSS_FN,
        normalize_advantages=kw["normalize_advantages"], max_steps=cfg.rl_steps, eval_at_start=False,
        save_checkpoint=True, resume=False, log_interval_seconds=30.0)
    await trainer.train(handle_signals=False)


async def _validate_at(backend: Any, model: Any, step: int, cfg: demo.DemoConfig) -> float:
    """The demo's validation requests (same seeds at every step), answered by checkpoint `step`."""
    questions = colours.scenarios("val")
    async with backend.adapter_lease(model, step):
        trajectories = await asyncio.gather(*(
            colours.rollout(model, s, seed=demo._request_seed(cfg.seed, 0, i, k))
            for i, s in enumerate(questions) for k in range(cfg.val_samples)))
    await model.log(list(trajectories), split="val", step=step)
    return sum(t.reward for t in trajectories) / len(trajectories)


def _fresh(path: Path, name: str) -> Path:
    run = storage.run_dir(path, PROJECT, name)
    if run.exists():
        if not (run / storage.MODEL_FILE).exists() and any(run.iterdir()):
            raise ConfigError(f"{run} exists but holds no {storage.MODEL_FILE}, so it is not an artrl run "
                              "directory; the demo will not delete it. Pass another --path.")
        shutil.rmtree(run)
    return run


def plot_curves(arms: list[ArmResult], path: Path, title: str) -> Path:
    """Validation reward against wall seconds, one line per arm (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        for arm in arms:
            points = arm.curve()
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{arm.name} ({arm.wall_s:.0f} s)")
        ax.set_xlabel("wall seconds since the RL stage started")
        ax.set_ylabel("validation reward")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


async def run_pipeline_demo(path: str | Path = "./.art", *, config: demo.DemoConfig | None = None,
                            bounds: tuple[int, ...] = DEFAULT_BOUNDS, learning_rate: float = LEARNING_RATE,
                            base_model: str = demo.BASE_MODEL, device: str | None = None,
                            train_in_worker: bool | None = None, show_progress: bool = False) -> PipelineDemoResult:
    """Run the warm-up and the arms under `<path>/artrl-demo-pipeline/` (replaced) and measure them.

    `train_in_worker`: every model trains in a worker process of its own (None: on a CPU only; in one process the
    trainer and the decode thread take turns on the interpreter lock, docs/pipeline.md)."""
    cfg = config or demo.DemoConfig()
    cfg.check()
    if any(b < 0 for b in bounds) or len(set(bounds)) != len(bounds):
        raise ConfigError(f"demo --pipeline: bounds={bounds}; give distinct max_steps_off_policy values >= 0")
    started = time.perf_counter()
    root = Path(path)
    names = [WARMUP_NAME, "sync"] + [f"pipeline-{b}" for b in bounds]
    runs = {n: _fresh(root, n) for n in names}
    internal = InternalModelConfig(seed=cfg.seed, device=device)
    from ..models.loading import resolve_device  # torch: loaded when the demo runs, not for `--help`

    device_name = str(resolve_device(internal))
    if train_in_worker is None:
        train_in_worker = device_name == "cpu"
    internal = internal.model_copy(update={"train_in_worker": train_in_worker})
    backend = _ClockedBackend(path=str(root), show_progress=show_progress)
    arms = [ArmResult("sync", None)] + [ArmResult(f"pipeline-{b}", b) for b in bounds]
    models: dict[str, TrainableModel] = {}
    try:
        warm = TrainableModel(name=WARMUP_NAME, project=PROJECT, base_model=base_model, _internal_config=internal)
        await warm.register(backend)
        sft = demo._sft_data(cfg, random.Random(cfg.seed))
        n_sft = -(-len(sft) // cfg.sft_batch_size)
        await warm.train_sft(sft, config=TrainSFTConfig(
            learning_rate=schedules.cosine(cfg.sft_learning_rate, n_sft), batch_size=cfg.sft_batch_size))
        sft_step = await warm.get_step()
        val_after_sft = await _validate_at(backend, warm, sft_step, cfg)
        log.info("after SFT (step %d): validation reward %.3f", sft_step, val_after_sft)
        for arm in arms:
            run = runs[arm.name]
            (run / storage.CHECKPOINTS_DIR).mkdir(parents=True)
            shutil.copytree(storage.checkpoint_dir(runs[WARMUP_NAME], sft_step),
                            storage.checkpoint_dir(run, sft_step))
            # the warm-up's history too (its SFT row, its validation at step 1): the arm's run reads as one run
            shutil.copy2(runs[WARMUP_NAME] / storage.HISTORY_FILE, run / storage.HISTORY_FILE)
            model = TrainableModel(name=arm.name, project=PROJECT, base_model=base_model, _internal_config=internal)
            await model.register(backend)  # resumes from the warm-up's checkpoint
            models[arm.name] = model
            backend.arm, backend.started = arm, time.perf_counter()
            await (_run_sync if arm.max_steps_off_policy is None else _run_pipeline)(
                backend, model, cfg, learning_rate, arm)
            backend.arm = None
            log.info("%s: %d steps in %.1f s", arm.name, len(arm.step_times), arm.wall_s)
        for arm in arms:  # choice 1: validation after every arm has run
            steps = [s for s, _ in arm.step_times]
            measured = sorted({s for s in steps if (s - sft_step) % cfg.val_every == 0} | set(steps[-1:]))
            arm.val_rewards = [(sft_step, val_after_sft)]
            for s in measured:
                arm.val_rewards.append((s, await _validate_at(backend, models[arm.name], s, cfg)))
            log.info("%s: validation reward %s", arm.name, [f"{s}:{r:.3f}" for s, r in arm.val_rewards])
    finally:
        await backend.close()
    plot = plot_curves(arms, root / PROJECT / PLOT_FILE,
                       f"colour quiz, {'tiny model' if base_model == demo.BASE_MODEL else base_model}, seed "
                       f"{cfg.seed}: synchronous vs pipelined RL")
    return PipelineDemoResult(root=root / PROJECT, plot_path=plot, val_after_sft=val_after_sft, arms=arms,
                              seconds=time.perf_counter() - started, device=device_name, base_model=base_model,
                              seed=cfg.seed, train_in_worker=train_in_worker)


def summary(result: PipelineDemoResult) -> str:
    lines = ["", "artrl demo --pipeline: done",
             f"  validation reward after SFT : {result.val_after_sft:.3f}   (every arm starts here, at 0 s)",
             f"  trainer     : {'a worker process of each model' if result.train_in_worker else 'this process'}"]
    sync = next((a for a in result.arms if a.name == "sync"), None)
    for arm in result.arms:
        final = arm.val_rewards[-1][1] if arm.val_rewards else float("nan")
        speed = f", {sync.wall_s / arm.wall_s:.2f}x the synchronous loop's speed" \
            if sync is not None and arm is not sync and arm.wall_s > 0 else ""
        lines.append(f"  {arm.name:<12}: validation reward {final:.3f} after {len(arm.step_times)} steps in "
                     f"{arm.wall_s:.0f} s{speed}")
    lines += [f"  plot        : {result.plot_path}", f"  runs        : {result.root / storage.MODELS_DIR}"]
    return "\n".join(lines)


def summary_json(result: PipelineDemoResult, command: str) -> str:
    return json.dumps({"bench": "demo-pipeline", "model": result.base_model, "device": result.device,
                       "seed": result.seed, "train_in_worker": result.train_in_worker,
                       "val_reward_after_sft": result.val_after_sft,
                       "wall_s": round(result.seconds, 2), "arms": {a.name: a.report() for a in result.arms},
                       "command": command})


def rollout_workers(groups_per_step: int, bound: int) -> int:
    """PipelineTrainer's rollout workers for an arm: one step's groups, plus one step's more when the bound lets
    rollouts run ahead, whatever the bound. A demo rollout is all decoding: more groups in flight make each
    slower and older, not the decoding faster (bound 4 with five steps' groups in flight ran 0.90-1.02x the
    synchronous loop's speed, its first train call waiting for all of them)."""
    return groups_per_step * (min(bound, 1) + 1)


def parse_bounds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise ConfigError(f"--bounds {text!r}: give comma-separated integers, e.g. 1,4") from e


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (every option that changes what runs)."""
    parts = ["artrl", "demo", "--pipeline", "--bounds", args.bounds, "--learning-rate", str(args.learning_rate),
             "--seed", str(args.seed), "--model", args.model]
    parts += ["--quick"] if args.quick else []
    parts += ["--rl-steps", str(args.rl_steps)] if args.rl_steps is not None else []
    parts += ["--device", args.device] if args.device else []
    parts += ["--trainer", args.trainer] if getattr(args, "trainer", "auto") != "auto" else []
    parts += ["--json"] if args.json else []
    return " ".join(parts)


def main(args: argparse.Namespace) -> int:
    """`artrl demo --pipeline` (cli.py runs it instead of demo.main)."""
    demo.quiet_logs(args)
    cfg = demo.DemoConfig.quick() if args.quick else demo.DemoConfig()
    if args.rl_steps is not None:
        cfg = demo.dataclasses.replace(cfg, rl_steps=args.rl_steps)
    cfg = demo.dataclasses.replace(cfg, seed=args.seed)
    bounds = parse_bounds(args.bounds)
    result = asyncio.run(run_pipeline_demo(args.path, config=cfg, bounds=bounds, learning_rate=args.learning_rate,
                                           base_model=args.model, device=args.device,
                                           train_in_worker={"worker": True, "here": False}.get(args.trainer)))
    command = command_line(args)
    if args.json:
        print(summary(result), file=sys.stderr, flush=True)
        print(summary_json(result, command), flush=True)
    else:
        print(summary(result), flush=True)
    return 0
