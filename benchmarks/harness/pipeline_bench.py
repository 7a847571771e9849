"""`python benchmarks/bench.py pipeline`: the synchronous RL loop against ART's `PipelineTrainer`, same model, same work.

Both arms run from this process on one `LocalBackend`, each on a fresh LoRA adapter of the same
base model (models `bench-sync` and `bench-pipeline`), over the same `steps x groups_per_step`
scenarios of the agent workload (agent_workload.py: turns whose tools take
`tool_latency_s`), with the same train call:

* **sync**: the loop of ART's examples: gather one step's groups, `backend.train`, log, repeat.
* **pipeline**: `artrl.pipeline_trainer.PipelineTrainer` with `min_batch_size = max_batch_size =
  groups_per_step`, `max_steps = steps` and `max_steps_off_policy`: rollouts of the next steps run
  while the trainer trains. With `--autotune online` the pipeline's tuner (docs/pipeline.md, "The online
  tuner") sets its workers, batch floor and schedule instead, starting from the same shape (ART's
  `initial_*` knobs: `groups_per_step` groups a step, the bench's workers); the report then says which
  schedule it chose (`tuner_schedule`: overlap, or in turn) and what each measured.

The train call is `backend.train(model, groups, learning_rate, loss_fn, loss_fn_config=None,
normalize_advantages, adam_params=None, save_checkpoint=False)`, the keywords the pipeline's
training stage passes (it saves checkpoints only at eval steps, and this bench has no eval).

What is measured, the same way in both arms (each arm's clock starts after its model is
registered and one warm-up request is answered, and stops when its last train call returns;
before either arm, one untimed synchronous step on a throwaway model warms the process up):

* `wall_s`; `train_s`: time inside train calls; `rollout_s`: time during which at least one
  rollout group was in flight (overlaps counted once); `request_s`: time during which at least one
  model request was in flight, and `request_during_train_s` the part of it that overlapped a train
  call (requests the engine may hold back while the trainer has the model).
* `trainer_idle_fraction` = 1 - train_s / wall_s; `actor_idle_fraction` = 1 - rollout_s / wall_s:
  the share of the run in which the trainer, or every actor, had nothing to do.
* `mean_staleness` / `max_staleness` over trained groups: the step the trainer trained from minus
  the policy version the group's rollouts started on (0 for the synchronous loop; at most
  `max_steps_off_policy` for the pipeline; ART's logged `steps_off_policy` is this plus one).
* `groups_trained`, `groups_discarded` (scenarios not trained: stale, no reward spread, or failed).

Where training runs (`--trainer`): on a CPU, by default, each arm's model trains in a worker process
of its own (`InternalModelConfig.train_in_worker`, docs/pipeline.md), with the cores the engine's
decode thread (`inference_cpu_threads`, 1) does not use; in this process (`--trainer here`) the
trainer (torch's intra-op threads, set here with `torch.set_num_threads`) and the decode thread
share the cores and the interpreter lock. Both arms train the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artrl.errors import ConfigError
from .agent_workload import AgentRollouts, AgentWorkload, Intervals

log = logging.getLogger(__name__)

PROJECT = "artrl-bench-pipeline"
LOSS_FNS = ("cispo", "ppo")
AUTOTUNE = ("off", "online")
TUNER_STARTS = ("art", "bench")
UPDATE_MODES = ("step_lora", "in_flight_lora")


@dataclass(frozen=True)
class PipelineBenchConfig:
    """Every knob of the bench; the CLI flags map one to one (`command()` writes them back)."""

    turns: int = 2
    """Policy turns per rollout, each followed by one tool call."""
    tool_latency_s: float = 0.5
    """Seconds each tool call takes (an asyncio sleep: waiting, not computing)."""
    groups_per_step: int = 4
    """Groups (scenarios) per train call."""
    rollouts_per_group: int = 4
    """Rollouts per group (the group of group-relative advantages)."""
    steps: int = 16
    """Train calls per arm. The pipeline's first step has nothing to overlap its rollouts with, and its last
    train call nothing to overlap it with: over 8 steps where rollouts and training take as long, that alone caps
    the ratio at 1.78; over 16, at 1.88 (docs/performance.md, "Pipelined RL")."""
    max_steps_off_policy: int = 1
    """The pipeline's staleness bound (ART's PipelineTrainer argument)."""
    rollout_workers: int | None = None
    """The pipeline's num_rollout_workers (each runs one group at a time); None: groups_per_step x
    (max_steps_off_policy + 1), enough to fill every step the bound lets run ahead."""
    max_tokens: int = 8
    """Completion budget of each turn."""
    final_tokens: int = 0
    """Completion budget of a final answer after the last tool result, with no tool after it (0: none)."""
    prompt_words: int = 50
    """Words of the agent's system prompt (its tool manual): the trainer's share of the work grows with it."""
    result_words: int = 200
    """Words of each tool result (the context every later turn carries): the trainer processes them for every
    rollout, the engine only prefills them, so they set how training-heavy a step is (at 200, on the tiny
    model on a CPU, a train call takes about 1.5x the decoding of its rollouts)."""
    model: str = "artrl/tiny"
    """Base model (a Hugging Face name, a path, artrl/tiny or random:<shape>)."""
    device: str | None = None
    """cpu / cuda; None: cuda when available."""
    train_threads: int | None = None
    """torch intra-op threads of the trainer on a CPU when it trains in this process; None: the cores minus the
    engine's decode thread."""
    train_in_worker: bool | None = None
    """Each arm's model trains in a worker process of its own (`InternalModelConfig.train_in_worker`); None: on a
    CPU only, where in one process the trainer and the decode thread take turns on the interpreter lock."""
    learning_rate: float = 1e-4
    loss_fn: str = "cispo"
    """ART 0.5.18's loss_fn of backend.train and PipelineTrainer: cispo or ppo."""
    seed: int = 0
    arms: tuple[str, ...] = ("sync", "pipeline")
    """Which arms to run (both by default; one alone for a quick look)."""
    autotune: str = "off"
    """The pipeline arm's `PipelineAutotuneConfig.mode`: off (the fixed shape above) or online (the tuner)."""
    tuner_start: str = "art"
    """With autotune online, where the tuner starts: "art", `PipelineAutotuneConfig(mode="online")` with nothing
    else set (ART's defaults: what a user who turns the tuner on gets); "bench", the bench's shape
    (`initial_*` knobs at groups_per_step groups and the bench's workers, `queue_running_reserve_fraction=0`),
    how the figures before 2026-12-05 were taken."""
    update_mode: str = "step_lora"
    """The pipeline arm's `rollout_weight_update_mode`: step_lora (a rollout samples from the version it started
    on) or in_flight_lora (running sequences move to each new version, docs/pipeline.md)."""

    def check(self) -> None:
        if self.prompt_words < 0 or self.result_words < 0:
            raise ConfigError(f"bench pipeline: prompt_words={self.prompt_words} and result_words="
                              f"{self.result_words} must be >= 0")
        for name in ("turns", "groups_per_step", "rollouts_per_group", "steps", "max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench pipeline: {name}={getattr(self, name)}; it must be >= 1")
        if self.rollouts_per_group < 2:
            raise ConfigError(f"bench pipeline: rollouts_per_group={self.rollouts_per_group}; a group needs >= 2 "
                              "rollouts to have reward spread (ART's pipeline sets single-rollout groups aside)")
        if self.final_tokens < 0:
            raise ConfigError(f"bench pipeline: final_tokens={self.final_tokens}; it must be >= 0 (0: no final "
                              "answer)")
        if self.tool_latency_s < 0 or self.max_steps_off_policy < 0:
            raise ConfigError(f"bench pipeline: tool_latency_s={self.tool_latency_s} and max_steps_off_policy="
                              f"{self.max_steps_off_policy} must be >= 0")
        if self.rollout_workers is not None and self.rollout_workers < 1:
            raise ConfigError(f"bench pipeline: rollout_workers={self.rollout_workers}; it must be >= 1 or None")
        if self.loss_fn not in LOSS_FNS:
            raise ConfigError(f"bench pipeline: loss_fn={self.loss_fn!r}; choose one of {LOSS_FNS}")
        if self.update_mode not in UPDATE_MODES:
            raise ConfigError(f"bench pipeline: update_mode={self.update_mode!r}; choose one of {UPDATE_MODES}")
        if self.autotune not in AUTOTUNE:
            raise ConfigError(f"bench pipeline: autotune={self.autotune!r}; choose one of {AUTOTUNE}")
        if self.tuner_start not in TUNER_STARTS:
            raise ConfigError(f"bench pipeline: tuner_start={self.tuner_start!r}; choose one of {TUNER_STARTS}")
        unknown = sorted(set(self.arms) - {"sync", "pipeline"})
        if unknown or not self.arms:
            raise ConfigError(f"bench pipeline: arms={self.arms}; choose among 'sync' and 'pipeline'")

    @property
    def workers(self) -> int:
        return self.rollout_workers or self.groups_per_step * (self.max_steps_off_policy + 1)

    @property
    def workload(self) -> AgentWorkload:
        return AgentWorkload(turns=self.turns, tool_latency_s=self.tool_latency_s, max_tokens=self.max_tokens,
                             rollouts_per_group=self.rollouts_per_group, prompt_words=self.prompt_words,
                             result_words=self.result_words, seed=self.seed, final_tokens=self.final_tokens)

    def train_kwargs(self) -> dict[str, Any]:
        """The keywords of every train call, as PipelineTrainer's training stage passes them."""
        return {"learning_rate": self.learning_rate, "loss_fn": self.loss_fn, "loss_fn_config": None,
                "normalize_advantages": True, "adam_params": None, "save_checkpoint": False}

    def command(self) -> str:
        """The command line that reproduces this run."""
        parts = ["python", "benchmarks/bench.py", "pipeline", "--turns", self.turns, "--tool-latency", self.tool_latency_s,
                 "--groups-per-step", self.groups_per_step, "--rollouts-per-group", self.rollouts_per_group,
                 "--steps", self.steps, "--max-steps-off-policy", self.max_steps_off_policy,
                 "--max-tokens", self.max_tokens, "--prompt-words", self.prompt_words,
                 "--result-words", self.result_words, "--model", self.model, "--learning-rate", self.learning_rate,
                 "--loss-fn", self.loss_fn, "--seed", self.seed]
        if self.rollout_workers is not None:
            parts += ["--rollout-workers", self.rollout_workers]
        if self.final_tokens:
            parts += ["--final-tokens", self.final_tokens]
        if self.device is not None:
            parts += ["--device", self.device]
        if self.train_threads is not None:
            parts += ["--train-threads", self.train_threads]
        if self.train_in_worker is not None:
            parts += ["--trainer", "worker" if self.train_in_worker else "here"]
        if tuple(self.arms) != ("sync", "pipeline"):
            parts += ["--arms", ",".join(self.arms)]
        if self.autotune != "off":
            parts += ["--autotune", self.autotune]
        if self.tuner_start != "art":
            parts += ["--tuner-start", self.tuner_start]
        if self.update_mode != "step_lora":
            parts += ["--rollout-weight-update-mode", self.update_mode]
        return shlex.join(str(p) for p in parts)


@dataclass
class ArmRecord:
    """What one arm measured (see the module docstring for each figure)."""

    wall_s: float = 0.0
    rollouts: Intervals = dataclasses.field(default_factory=Intervals)
    requests: Intervals = dataclasses.field(default_factory=Intervals)
    trains: Intervals = dataclasses.field(default_factory=Intervals)
    staleness: list[int] = dataclasses.field(default_factory=list)
    token_lag: dict[int, int] = dataclasses.field(default_factory=dict)  # steps behind -> sampled tokens trained
    train_calls: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def report(self, scenarios: int, start: float, end: float) -> dict[str, Any]:
        wall = end - start
        train_s, rollout_s = self.trains.busy(start, end), self.rollouts.busy(start, end)
        trained = len(self.staleness)
        return {"wall_s": round(wall, 3), "train_s": round(train_s, 3), "rollout_s": round(rollout_s, 3),
                "request_s": round(self.requests.busy(start, end), 3),
                "request_during_train_s": round(self.requests.overlap(self.trains, start, end), 3),
                "trainer_idle_fraction": round(1 - train_s / wall, 4) if wall > 0 else None,
                "actor_idle_fraction": round(1 - rollout_s / wall, 4) if wall > 0 else None,
                "steps": self.train_calls, "groups_trained": trained, "groups_discarded": scenarios - trained,
                "mean_staleness": round(sum(self.staleness) / trained, 3) if trained else None,
                "max_staleness": max(self.staleness) if trained else None,
                # per sampled token: the step trained from minus the version that sampled that token
                "token_policy_lag_mean": round(sum(lag * n for lag, n in self.token_lag.items())
                                               / sum(self.token_lag.values()), 4) if self.token_lag else None,
                "tokens_by_policy_lag": dict(sorted(self.token_lag.items())), **self.extra}


def _timed_backend_class() -> type:
    """LocalBackend whose `train` records its calls in `self.record` (subclassed here: the pipeline checks
    `isinstance(backend, LocalBackend)` and calls `backend.train` itself)."""
    from artrl.local import LocalBackend

    class TimedLocalBackend(LocalBackend):
        record: ArmRecord | None = None

        async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> Any:
            groups = list(trajectory_groups)
            record = self.record
            from_step = await model.get_step()
            start = time.perf_counter()
            try:
                return await super().train(model, groups, **kwargs)
            finally:
                if record is not None:
                    record.trains.add(start, time.perf_counter())
                    record.train_calls += 1
                    for g in groups:  # ART's rule: a group's version is its trajectories' oldest
                        versions = [t.initial_policy_version for t in g.trajectories
                                    if t.initial_policy_version is not None]
                        record.staleness.append(from_step - min(versions) if versions else 0)
                        for t in g.trajectories:
                            _count_token_lag(record.token_lag, t, from_step)

    return TimedLocalBackend


def _count_token_lag(lags: dict[int, int], trajectory: Any, from_step: int) -> None:
    """Add `trajectory`'s sampled tokens to `lags` by how many steps behind `from_step` the version that sampled
    each one is. Each turn counts on its own: by its `policy_token_spans` (in-flight updates: every token at its
    own version), else all its sampled ids at the `policy_version` the server recorded on it (with step updates a
    later turn may run on a newer version than the first), else at the trajectory's initial version."""
    from artrl.trajectories.token_record import POLICY_TOKEN_SPANS_FIELD
    from artrl.trajectories.data import choice_policy_version

    histories = [trajectory.messages_and_choices,
                 *(h.messages_and_choices for h in getattr(trajectory, "additional_histories", []))]
    for item in (item for items in histories for item in items):
        extra = getattr(item, "model_extra", None)
        if extra is None:  # a message: nothing sampled
            continue
        spans = extra.get(POLICY_TOKEN_SPANS_FIELD)
        if isinstance(spans, list) and spans:
            counts = {span["policy_version"]: int(span["end_token"]) - int(span["start_token"]) for span in spans}
        else:
            version = choice_policy_version(item)
            version = trajectory.initial_policy_version if version is None else version
            if version is None:
                continue
            counts = {version: len(extra.get("token_ids") or ())}
        for version, n in counts.items():
            lags[from_step - version] = lags.get(from_step - version, 0) + n


async def _warm_up(model: Any, cfg: PipelineBenchConfig) -> None:
    """One request, untimed: the first decode's allocations stay out of the arm's clock."""
    await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "warm up"}], max_tokens=2,
        temperature=1.0, seed=cfg.seed)


async def run_sync(backend: Any, model: Any, cfg: PipelineBenchConfig, record: ArmRecord) -> None:
    """The synchronous loop: gather a step's groups, train on them, log them, repeat."""
    rollouts = AgentRollouts(cfg.workload)
    record.rollouts, record.requests = rollouts.intervals, rollouts.requests
    scenarios = cfg.workload.scenarios(cfg.steps * cfg.groups_per_step)
    for s in range(cfg.steps):
        version = await model.get_step()
        batch = scenarios[s * cfg.groups_per_step:(s + 1) * cfg.groups_per_step]
        groups = await asyncio.gather(*(rollouts.rollout_group(model, sc) for sc in batch))
        for g in groups:
            for t in g.trajectories:  # what the pipeline records, so both arms' staleness is measured alike
                t.initial_policy_version = t.final_policy_version = version
        result = await backend.train(model, groups, **cfg.train_kwargs())
        await model.log(groups, split="train", step=result.step)


async def run_pipeline(backend: Any, model: Any, cfg: PipelineBenchConfig, record: ArmRecord) -> None:
    """ART's PipelineTrainer over the same scenarios, one batch of groups_per_step groups per train call."""
    try:
        from artrl.pipeline_trainer import PipelineTrainer
    except ImportError as e:
        raise ConfigError(f"bench pipeline: artrl.pipeline_trainer is not importable ({e}); run with "
                          "--arms sync, or on a tree that has it") from e
    rollouts = AgentRollouts(cfg.workload)
    record.rollouts, record.requests = rollouts.intervals, rollouts.requests
    kwargs = cfg.train_kwargs()
    shape: dict[str, int] = {"num_rollout_workers": cfg.workers, "min_batch_size": cfg.groups_per_step,
                             "max_batch_size": cfg.groups_per_step}
    try:  # ART 0.5.23's form; a tree from before it takes the direct keywords
        from artrl.pipeline_trainer import PipelineAutotuneConfig, PipelineRuntimeConfig
        runtime: dict[str, Any] = {"pipeline": PipelineRuntimeConfig(**shape)}
    except ImportError:
        runtime = dict(shape)
    if cfg.autotune != "off" and cfg.tuner_start == "art":
        # what a user who turns the tuner on gets: ART's defaults, the tuner owns the shape (ART's rule)
        runtime = {"autotune": PipelineAutotuneConfig(mode=cfg.autotune)}
    elif cfg.autotune != "off":
        # the tuner starts from the bench's shape, with no freshness worker limit
        runtime = {"autotune": PipelineAutotuneConfig(
            mode=cfg.autotune, initial_min_groups_per_packed_sequence=cfg.groups_per_step,
            initial_max_groups_per_packed_sequence=cfg.groups_per_step,
            initial_model_calls_per_inference_gpu=cfg.workers, queue_running_reserve_fraction=0.0)}
    trainer = PipelineTrainer(
        model, backend, rollouts.rollout_group, cfg.workload.scenarios(cfg.steps * cfg.groups_per_step), cfg,
        **runtime, max_steps_off_policy=cfg.max_steps_off_policy, learning_rate=kwargs["learning_rate"],
        loss_fn=kwargs["loss_fn"], loss_fn_config=kwargs["loss_fn_config"],
        normalize_advantages=kwargs["normalize_advantages"], adam_params=kwargs["adam_params"],
        max_steps=cfg.steps, eval_at_start=False, save_checkpoint=kwargs["save_checkpoint"], resume=False,
        log_interval_seconds=3600.0, total_scenarios=cfg.steps * cfg.groups_per_step)
    await trainer.train(handle_signals=False)
    record.extra["discarded_stale_groups"] = int(trainer.state.discarded_stale_groups)
    tuning = getattr(trainer, "_tuning", None)
    if tuning is not None and tuning.tuner is not None:
        judge = tuning.tuner.judge
        record.extra["tuner_schedule"] = judge.schedule if judge.decided else f"undecided ({judge.schedule})"
        record.extra["tuner_evidence"] = {k: round(v, 4) for k, v in judge.evidence.items()}
        record.extra["tuner_decisions"] = [f"{d.step}:{d.action}" for d in tuning.tuner.decisions]
        record.extra["tuner_settings"] = tuning.tuner.settings.model_dump()


ARMS = {"sync": run_sync, "pipeline": run_pipeline}


def _engine_threads(cfg: Any, device_type: str) -> int | None:
    return cfg.inference_cpu_threads if device_type == "cpu" else None


async def _run(cfg: PipelineBenchConfig, path: Path) -> dict[str, Any]:
    import torch

    from artrl.distributed.group import cpu_worker_threads
    from artrl.model import TrainableModel
    from artrl.models.loading import resolve_device
    from artrl.config.model import InternalModelConfig

    concurrency = cfg.groups_per_step * cfg.rollouts_per_group * (cfg.max_steps_off_policy + 1)
    internal = InternalModelConfig(seed=cfg.seed, device=cfg.device,
                                   inference_max_batch_size=max(32, min(concurrency, 256)))
    device = resolve_device(internal)
    in_worker = device.type == "cpu" if cfg.train_in_worker is None else cfg.train_in_worker
    internal = internal.model_copy(update={"train_in_worker": in_worker})
    engine_threads = _engine_threads(internal, device.type)
    if device.type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(cfg.train_threads or max(1, cores - (engine_threads or 0)))
    backend = _timed_backend_class()(path=str(path), show_progress=False)
    arms: dict[str, Any] = {}
    scenarios = cfg.steps * cfg.groups_per_step
    try:
        # process-wide warm-up, untimed: one synchronous step on a throwaway model (the first train calls and
        # decodes of a process pay one-off costs that made whichever arm ran first about twice as slow)
        warm = TrainableModel(name="bench-warmup", project=PROJECT, base_model=cfg.model, _internal_config=internal)
        await warm.register(backend)
        await run_sync(backend, warm, dataclasses.replace(cfg, steps=1), ArmRecord())
        for arm in cfg.arms:
            arm_internal = internal if arm != "pipeline" or cfg.update_mode == "step_lora" else \
                internal.model_copy(update={"rollout_weight_update_mode": cfg.update_mode})
            model = TrainableModel(name=f"bench-{arm}", project=PROJECT, base_model=cfg.model,
                                   _internal_config=arm_internal)
            await model.register(backend)
            record = ArmRecord()
            await _warm_up(model, cfg)
            backend.record = record
            start = time.perf_counter()
            await ARMS[arm](backend, model, cfg, record)
            end = time.perf_counter()
            backend.record = None
            arms[arm] = record.report(scenarios, start, end)
            log.info("bench pipeline: %s arm %s", arm, arms[arm])
    finally:
        await backend.close()
    from artrl.serve.engines.factory import resolve_engine_kind
    from artrl.models.loading import RANDOM_SHAPES

    engine = resolve_engine_kind(internal.inference_engine, device.type,
                                 weights_on_disk=cfg.model not in RANDOM_SHAPES)
    out: dict[str, Any] = {
        "bench": "pipeline", "model": cfg.model, "device": str(device), "engine": engine,
        "train_in_worker": in_worker,
        "threads": {"train": (cpu_worker_threads(internal) if in_worker else torch.get_num_threads())
                    if device.type == "cpu" else None, "engine": engine_threads},
        "turns": cfg.turns, "tool_latency_s": cfg.tool_latency_s, "groups_per_step": cfg.groups_per_step,
        "rollouts_per_group": cfg.rollouts_per_group, "steps": cfg.steps,
        "max_steps_off_policy": cfg.max_steps_off_policy, "rollout_workers": cfg.workers,
        "max_tokens": cfg.max_tokens, "final_tokens": cfg.final_tokens, "prompt_words": cfg.prompt_words,
        "result_words": cfg.result_words, "loss_fn": cfg.loss_fn, "learning_rate": cfg.learning_rate,
        "autotune": cfg.autotune, "tuner_start": cfg.tuner_start if cfg.autotune != "off" else None,
        "rollout_weight_update_mode": cfg.update_mode, **arms}
    if "sync" in arms and "pipeline" in arms and arms["pipeline"]["wall_s"] > 0:
        out["ratio_sync_over_pipeline"] = round(arms["sync"]["wall_s"] / arms["pipeline"]["wall_s"], 3)
        # the tuner may take more groups a step than the loop (ART's initial shape), so the fair figure is
        # seconds per trained group: the loop's over the pipeline's (> 1: the pipeline is faster)
        sync_g, pipe_g = arms["sync"]["groups_trained"], arms["pipeline"]["groups_trained"]
        if sync_g and pipe_g:
            out["ratio_per_trained_group"] = round((arms["sync"]["wall_s"] / sync_g)
                                                   / (arms["pipeline"]["wall_s"] / pipe_g), 3)
    if "sync" in arms and arms["sync"]["train_s"] > 0:  # where the workload sits: >1 rollouts dominate
        out["sync_rollout_over_train"] = round(arms["sync"]["rollout_s"] / arms["sync"]["train_s"], 3)
    out["command"] = cfg.command()
    return out


def run_pipeline_bench(cfg: PipelineBenchConfig, path: str | Path | None = None) -> dict[str, Any]:
    """The bench's JSON object (module docstring). `path`: the run directories' root (a temporary one,
    deleted afterwards, when None)."""
    cfg.check()
    if path is not None:
        return asyncio.run(_run(cfg, Path(path)))
    with tempfile.TemporaryDirectory(prefix="artrl-bench-pipeline-") as tmp:
        return asyncio.run(_run(cfg, Path(tmp)))


def add_arguments(p: Any) -> None:
    d = PipelineBenchConfig()
    p.add_argument("--turns", type=int, default=d.turns, help=f"policy turns per rollout (default {d.turns})")
    p.add_argument("--tool-latency", type=float, default=d.tool_latency_s,
                   help=f"seconds each tool call takes (default {d.tool_latency_s})")
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step,
                   help=f"groups per train call (default {d.groups_per_step})")
    p.add_argument("--rollouts-per-group", type=int, default=d.rollouts_per_group,
                   help=f"rollouts per group (default {d.rollouts_per_group})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"train calls per arm (default {d.steps})")
    p.add_argument("--max-steps-off-policy", type=int, default=d.max_steps_off_policy,
                   help=f"the pipeline's staleness bound (default {d.max_steps_off_policy})")
    p.add_argument("--rollout-workers", type=int, default=None, help="the pipeline's rollout workers (default: "
                   "groups-per-step x (max-steps-off-policy + 1))")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"tokens per turn (default {d.max_tokens})")
    p.add_argument("--final-tokens", type=int, default=d.final_tokens,
                   help="tokens of a final answer after the last tool result, with no tool after it (default 0: "
                        "none; the rollout ends with its last tool call)")
    p.add_argument("--prompt-words", type=int, default=d.prompt_words,
                   help=f"words of the agent's system prompt (default {d.prompt_words})")
    p.add_argument("--result-words", type=int, default=d.result_words,
                   help=f"words of each tool result (default {d.result_words})")
    p.add_argument("--model", default=d.model, help=f"base model (default {d.model})")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--train-threads", type=int, default=None, help="trainer threads on a CPU (default: the cores "
                   "minus the engine's decode thread, at least 1)")
    p.add_argument("--trainer", choices=("auto", "worker", "here"), default="auto", help="where each arm trains: "
                   "'worker', a process of its own; 'here', this process; 'auto' (default): a worker on a CPU")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate, help=f"default {d.learning_rate}")
    p.add_argument("--loss-fn", choices=LOSS_FNS, default=d.loss_fn, help=f"default {d.loss_fn}")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--arms", default="sync,pipeline", help="comma-separated arms to run (default: sync,pipeline)")
    p.add_argument("--path", default=None, help="root of the run directories (default: a temporary directory)")
    p.add_argument("--rollout-weight-update-mode", choices=UPDATE_MODES, default=d.update_mode,
                   help="the pipeline arm's InternalModelConfig.rollout_weight_update_mode (default step_lora; "
                   "in_flight_lora: running sequences move to each new version)")
    p.add_argument("--autotune", choices=AUTOTUNE, default=d.autotune, help="the pipeline arm's tuner: off (the "
                   "fixed shape, default) or online (workers, batch floor and overlap-or-in-turn set from what it "
                   "measures)")
    p.add_argument("--tuner-start", choices=TUNER_STARTS, default=d.tuner_start, help="with --autotune online: "
                   "'art' (default), PipelineAutotuneConfig(mode='online') with nothing else set, ART's defaults; "
                   "'bench', the tuner starts from the bench's shape with no freshness worker limit")


def config_from_args(args: Any) -> PipelineBenchConfig:
    return PipelineBenchConfig(
        turns=args.turns, tool_latency_s=args.tool_latency, groups_per_step=args.groups_per_step,
        rollouts_per_group=args.rollouts_per_group, steps=args.steps, max_steps_off_policy=args.max_steps_off_policy,
        rollout_workers=args.rollout_workers, max_tokens=args.max_tokens, final_tokens=args.final_tokens,
        prompt_words=args.prompt_words,
        result_words=args.result_words, model=args.model, device=args.device,
        train_threads=args.train_threads, train_in_worker={"worker": True, "here": False}.get(args.trainer),
        learning_rate=args.learning_rate, loss_fn=args.loss_fn, seed=args.seed,
        arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()), autotune=args.autotune,
        tuner_start=args.tuner_start,
        update_mode=args.rollout_weight_update_mode)


def main(args: Any) -> int:
    cfg = config_from_args(args)
    # the JSON line is this command's only standard output: the pipeline's status lines go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        report = run_pipeline_bench(cfg, args.path)
    print(json.dumps(report), flush=True)
    return 0
