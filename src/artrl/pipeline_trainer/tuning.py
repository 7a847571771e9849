"""`PipelineTrainer(autotune=PipelineAutotuneConfig(mode=...))`: the glue between the trainer and the tuner
(pipeline_tuner/autotune.py), as ART's `PipelineAutotunerAttachment`.

* At `train()` start: the settings to run with. Mode "online" with no `profile`: ART's initial settings
  (`build_initial_settings`: one packed sequence per `grad_accumulation_sequences` row, default 1; one inference
  device per run); with `profile`, that profile's settings. Mode "profile": the saved profile's settings and
  schedule (`profile`, default "latest"), kept for the whole run.
* After every train step (online): the step's measurement goes to the tuner; its decisions are applied
  (`trainer.apply_pipeline_settings`, the schedule), logged one line each, shown on the status line, counted in
  the train row (`pipeline_tuner/...`), and the profile is saved (`<run dir>/pipeline_tuner/<output_name>.json`).

Inference pressure: the built-in engine's requests queued and not yet in a batch, over its batch size
(`engine_pressure`); an engine that does not report its queue leaves the tuner's inference state "unmeasured".
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ..pipeline_tuner.autotune import PipelineAutotuner, Schedule, StepMeasurement, build_initial_settings, \
    worker_limit
from ..pipeline_tuner.config import PipelineAutotuneConfig, PipelineAutotunerProfile, PipelineTuneSettings, \
    TunerDecision
from ..pipeline_tuner.store import PipelineTunerProfileStore

log = logging.getLogger("artrl.pipeline_trainer")


def engine_pressure(backend: Any, model: Any) -> float | None:
    """Requests the model's built-in engine holds queued (not yet in a batch) over its batch size; None when the
    backend serves the model some other way (replicas, vLLM, a fake)."""
    runs = getattr(backend, "_runs", None)
    session = runs.get(getattr(model, "name", None)) if isinstance(runs, dict) else None
    engine = getattr(session, "engine", None)
    pending = getattr(engine, "pending_requests", None)
    size = getattr(engine, "max_batch_size", None)
    if isinstance(pending, int) and isinstance(size, int) and size > 0:
        return pending / size
    return None


def policy_age_limit_steps(trainer: Any) -> float:
    """ART's: the mean limit, else the hard bound, else 1."""
    if trainer.limit_mean_steps_off_policy is not None:
        return float(trainer.limit_mean_steps_off_policy)
    if trainer.max_steps_off_policy is not None:
        return float(trainer.max_steps_off_policy)
    return 1.0


class PipelineTuning:
    def __init__(self, config: PipelineAutotuneConfig) -> None:
        self.config = config
        self.tuner: PipelineAutotuner | None = None
        self.store: PipelineTunerProfileStore | None = None
        self.schedule: Schedule = "overlap"
        self.settings_changes = 0
        self.last: TunerDecision | None = None
        self.profile_path: str | None = None

    # ------------------------------------------------------------------ start
    def start(self, trainer: Any, start_step: int) -> PipelineTuneSettings:
        c = self.config
        self.store = PipelineTunerProfileStore.for_model(trainer.model)
        age = policy_age_limit_steps(trainer)
        target_packed = trainer.grad_accumulation_sequences or 1
        loaded: PipelineAutotunerProfile | None = None
        if c.mode == "profile" or c.profile:
            loaded = self._load(age)
            settings = self._with_current_limits(loaded.settings, age)
            self.schedule = loaded.schedule or "overlap"
        else:
            settings = build_initial_settings(config=c, inference_gpu_count=1, target_packed_sequences=target_packed,
                                              policy_age_limit_steps=age)
        if c.mode == "online":
            self.tuner = PipelineAutotuner(
                config=c, settings=settings, policy_age_limit_steps=age, starting_step=start_step,
                model_name=getattr(trainer.model, "name", None), backend_name=type(trainer.backend).__name__,
                target_packed_sequences=target_packed, packed_sequence_length=trainer.packed_sequence_length,
                schedule=None if loaded is None else loaded.schedule)
            self.schedule = self.tuner.schedule
            self._save()
        source = "profile " + str(self.store.resolve(c.profile)) if loaded is not None else "ART's initial settings"
        log.info("pipeline tuner (%s): starting from %s: %d workers, batch %d-%d, queue %d, %s", c.mode, source,
                 settings.num_rollout_workers, settings.min_batch_size, settings.max_batch_size,
                 settings.queue_maxsize, self._schedule_text())
        trainer._status.note_tuner(self.status_text(settings))
        return settings

    def _load(self, age: float) -> PipelineAutotunerProfile:
        assert self.store is not None
        profile = self.store.load(self.config.profile)
        if profile.settings.num_rollout_workers > self.config.max_rollout_workers:
            raise ValueError(f"Autotuner profile requests num_rollout_workers={profile.settings.num_rollout_workers}, "
                             f"which exceeds the active max_rollout_workers={self.config.max_rollout_workers}.")
        if profile.policy_age_limit_steps is not None and profile.policy_age_limit_steps != age:
            log.warning("pipeline tuner: the profile was made with policy_age_limit_steps=%s, this run has %s; the "
                        "worker limit is recomputed for this run", profile.policy_age_limit_steps, age)
        return profile

    def _with_current_limits(self, settings: PipelineTuneSettings, age: float) -> PipelineTuneSettings:
        """ART's `_settings_with_current_queue`: the min-batch floor, this run's freshness worker limit, a
        one-batch queue."""
        c = self.config
        limit = worker_limit(target_groups_per_step=settings.target_groups_per_step, limit_steps_off_policy=age,
                             running_reserve_fraction=c.queue_running_reserve_fraction, worker_step=c.worker_step)
        workers = settings.num_rollout_workers if limit is None else min(settings.num_rollout_workers, limit)
        return settings.model_copy(update={
            "min_batch_size": max(settings.min_batch_size, math.ceil(settings.target_groups_per_step *
                                                                     c.freshness_min_batch_floor_fraction)),
            "num_rollout_workers": workers, "queue_maxsize": max(1, settings.target_groups_per_step)})

    # ------------------------------------------------------------------ each step
    def on_step(self, trainer: Any, measured: StepMeasurement) -> dict[str, float]:
        """Feed one step to the tuner, apply what it decides; the train row's `pipeline_tuner/...` figures."""
        metrics = {"pipeline_tuner/schedule_in_turn": 1.0 if measured.schedule == "in_turn" else 0.0}
        if self.tuner is None:
            return metrics
        decisions = self.tuner.observe(measured)
        for d in decisions:
            self.last = d
            if d.updated != d.previous:
                self.settings_changes += 1
                trainer.apply_pipeline_settings(d.updated)
            log.info("pipeline tuner step %d: %s (%s; state %s): %d workers, batch %d-%d, %s", d.step, d.action,
                     d.reason, d.state, d.updated.num_rollout_workers, d.updated.min_batch_size,
                     d.updated.max_batch_size, self._schedule_text(self.tuner.schedule))
            if d.stats is not None:
                metrics["pipeline_tuner/trainer_underfeed_score"] = d.stats.trainer_underfeed_score
                metrics["pipeline_tuner/queue_put_wait_frac"] = d.stats.queue_put_wait_frac
                metrics["pipeline_tuner/actual_stale_frac"] = d.stats.actual_stale_frac
        self.schedule = self.tuner.schedule
        if decisions:
            self._save()
        metrics["pipeline_tuner/decisions"] = float(len(self.tuner.decisions))
        metrics["pipeline_tuner/settings_changes"] = float(self.settings_changes)
        if measured.inference_pressure is not None:
            metrics["pipeline_tuner/inference_pressure"] = measured.inference_pressure
        for key, value in self.tuner.judge.evidence.items():
            metrics[f"pipeline_tuner/{key}"] = value
        trainer._status.note_tuner(self.status_text(self.tuner.settings))
        return metrics

    # ------------------------------------------------------------------ what is shown and saved
    def _schedule_text(self, schedule: Schedule | None = None) -> str:
        schedule = schedule or self.schedule
        if self.tuner is not None and not self.tuner.judge.decided:
            return f"probing ({'in turn' if schedule == 'in_turn' else 'overlapped'})"
        return "in turn" if schedule == "in_turn" else "overlapped"

    def status_text(self, settings: PipelineTuneSettings) -> str:
        parts = [f"tuner {self.config.mode}: {self._schedule_text()}"]
        if self.tuner is not None and "overlap_speedup" in self.tuner.judge.evidence:
            parts[0] += f" (overlap {self.tuner.judge.evidence['overlap_speedup']:.2f}x)"
        parts.append(f"workers {settings.num_rollout_workers}, batch {settings.min_batch_size}-"
                     f"{settings.max_batch_size}")
        if self.last is not None:
            parts.append(f"step {self.last.step} {self.last.action}: {self.last.reason}")
        return " | ".join(parts)

    def _save(self) -> None:
        if self.tuner is None or self.store is None:
            return
        self.profile_path = str(self.store.save(self.config.output_name, self.tuner.profile()))
