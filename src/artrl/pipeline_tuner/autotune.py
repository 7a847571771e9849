"""The online pipeline tuner: from each train step's measurements it sets how many rollout workers run, the batch
bounds, and whether rollouts and training overlap at all. Pure and synchronous (no clock, no I/O): the trainer
feeds it one `StepMeasurement` per train call and applies the settings it returns (pipeline_trainer/tuning.py).

Two parts:

1. **The schedule** (`ScheduleJudge`). Overlapping rollouts with training pays only where the two do not fight
   for one device: on a CPU where the built-in engine and the trainer share the cores (and, in one process, the
   interpreter lock), overlap adds contention and a pipelined step can take longer than rolling out and then
   training. So the judge measures both: after `warmup_ignore_steps`, `window_steps` steps overlapped, then one
   settling step and `window_steps` steps *in turn* (no rollout runs while a train call does, the trainer waits
   for rollouts in flight before it trains: the synchronous loop's use of the machine), and compares seconds
   per trained group. Overlap stays only if it beats in-turn by `OVERLAP_MIN_GAIN`; otherwise the run goes on in
   turn. Kept overlapped, each later window is checked against the in-turn figure, and a window that no longer
   beats it switches the run to in turn. So the tuner never leaves a run slower than the synchronous loop by
   more than what the probe windows cost.

       warmup (overlap) | probe: overlap x window | settle | in turn x window | decided: faster one
                                                                              (overlap: re-checked each window)

2. **Workers and batch bounds**, ART 0.5.23's rules (`art/pipeline_tuner/autotune.py`, `_decide`), once the
   schedule is decided, every `window_steps` steps, on the window's figures (`TunerWindowStats`):

   * trainer underfeed score = collect seconds / wall seconds (ART's, with no padding term: artrl's rows are not
     a fixed packed capacity); > `trainer_load_under_score`: underfed, <= `trainer_load_over_score`: loaded;
   * inference pressure: the built-in engine's queued requests over its batch size, sampled at every step end
     (ART reads vLLM's waiting / running requests); > `vllm_pressure_over_ratio`: over, <=
     `vllm_pressure_under_ratio`: under; not measured (an engine that does not say): read as balanced;
   * stale backlog (hysteresis `stale_high_frac` / `stale_clear_frac` on stale / all groups of the window):
     raise `min_batch_size` by 15% (at least 1) while below `max_batch_size`, else remove workers;
   * queue put wait >= `queue_put_severe_frac` of rollout time with both sides loaded: remove workers
     (after `worker_load_change_windows` windows in a row); with only the backpressure: hold;
   * trainer underfed and inference not over: add workers (after `worker_load_change_windows` windows);
   * min-batch trial: trainer underfed beyond `trainer_min_batch_lower_score` and no worker increase: lower
     `min_batch_size` by 15% (not below `freshness_min_batch_floor_fraction` of the target), keep it only if
     collect time falls below `min_batch_collect_improvement_ratio` of before within `min_batch_trial_windows`;
     trainer idle at most `trainer_min_batch_raise_score`: raise it again;
   * a worker move is `worker_move_fraction` of the workers rounded to `worker_step` (at least one step, at most
     `max_worker_move`), within [`worker_step`, `max_rollout_workers`] and ART's freshness limit
     (`freshness_worker_limit`: one queued batch inside the policy-age budget), which here never goes below one
     step's groups (`worker_limit`: the loop's concurrency; admission keeps the bound).

   In turn the trainer's idle time is the rollout phase by construction, so only the stale-backlog rule runs
   there. Not built: ART's packing-spill target adaptation (`target_groups_per_step` stays where it started; its
   knobs are Megatron's fixed packed sequences) and its stable-hardware recommendations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .config import PipelineAutotuneConfig, PipelineAutotunerProfile, PipelineTuneSettings, TunerDecision, \
    TunerWindowStats

Schedule = Literal["overlap", "in_turn"]
OVERLAP_MIN_GAIN = 0.05
"""Overlap is kept only when its seconds per group are at least this much below in-turn's: a tie goes to in turn,
which never contends."""
SETTLE_STEPS = 1
"""Steps ignored after a schedule switch: the first carries the other schedule's work (groups rolled out ahead)."""


@dataclass(frozen=True)
class StepMeasurement:
    """One train step as the tuner sees it (seconds from the trainer's clock)."""

    step: int
    t_s: float
    wall_s: float
    collect_s: float
    train_s: float
    rollout_s: float
    groups: int
    stale_groups: int = 0
    zero_variance_groups: int = 0
    put_wait_s: float = 0.0
    inference_pressure: float | None = None
    schedule: Schedule = "overlap"


def _ceil_to_multiple(value: float, multiple: int, *, minimum: int = 1) -> int:
    return max(minimum, int(math.ceil(value / multiple)) * multiple)


def _round_to_multiple(value: float, multiple: int, *, minimum: int = 1) -> int:
    return max(minimum, int(math.floor(value / multiple + 0.5)) * multiple)


def freshness_worker_limit(*, target_groups_per_step: int, limit_steps_off_policy: float,
                           running_reserve_fraction: float, worker_step: int) -> int | None:
    """ART's: the most workers that leave one queued batch inside the completed-work freshness budget."""
    if running_reserve_fraction <= 0.0:
        return None
    target = max(1, int(target_groups_per_step))
    max_completed = int(math.floor(target * max(1.0, limit_steps_off_policy)))
    raw_limit = int(math.floor((max_completed - target) / running_reserve_fraction))
    return max(1, (raw_limit // max(1, worker_step)) * max(1, worker_step))


def worker_limit(*, target_groups_per_step: int, limit_steps_off_policy: float, running_reserve_fraction: float,
                 worker_step: int) -> int | None:
    """The most rollout workers the tuner runs: ART's freshness limit (`freshness_worker_limit`), never below one
    step's groups (rounded up to `worker_step`), the synchronous loop's own concurrency.

    ART's limit keeps the rollouts *running* (`queue_running_reserve_fraction` of the workers) plus one queued
    batch inside the policy-age budget: at a bound of one step (`max_steps_off_policy=1`) that budget is one
    batch, and the limit is one worker, so a pipeline with ART's defaults rolls out one group at a time where
    the loop it replaces rolls out a whole step's groups at once (2.7x slower per rollout on a 1 s tool workload,
    docs/pipeline.md, "The online tuner"). Here a rollout is admitted only when the version it would start on is
    inside the bound (pipeline_trainer/staleness.py), so workers beyond ART's limit wait at admission instead of
    producing stale groups: the floor costs no freshness."""
    limit = freshness_worker_limit(target_groups_per_step=target_groups_per_step,
                                   limit_steps_off_policy=limit_steps_off_policy,
                                   running_reserve_fraction=running_reserve_fraction, worker_step=worker_step)
    if limit is None:
        return None
    return max(limit, _ceil_to_multiple(max(1, int(target_groups_per_step)), max(1, worker_step)))


def build_initial_settings(*, config: PipelineAutotuneConfig, inference_gpu_count: int,
                           target_packed_sequences: int, policy_age_limit_steps: float,
                           rollout_worker_capacity: int | None = None) -> PipelineTuneSettings:
    """ART's starting point: `initial_max_groups_per_packed_sequence` groups per packed sequence per step (the
    minimum at least the freshness floor), `initial_model_calls_per_inference_gpu` workers per inference device,
    capped by the worker limit (`worker_limit`: ART's freshness limit, never below one step's groups); the queue
    holds one batch."""
    target_slots = max(1, int(target_packed_sequences))
    max_batch = int(config.initial_max_groups_per_packed_sequence) * target_slots
    min_batch = min(int(config.initial_min_groups_per_packed_sequence) * target_slots, max_batch)
    workers = min(config.max_rollout_workers,
                  _ceil_to_multiple(config.initial_model_calls_per_inference_gpu * inference_gpu_count,
                                    config.worker_step, minimum=config.worker_step))
    limit = worker_limit(target_groups_per_step=max_batch, limit_steps_off_policy=policy_age_limit_steps,
                         running_reserve_fraction=config.queue_running_reserve_fraction, worker_step=config.worker_step)
    if limit is not None:
        workers = min(workers, limit)
    if rollout_worker_capacity is not None:
        workers = min(workers, rollout_worker_capacity)
    min_batch = max(min_batch, math.ceil(max_batch * config.freshness_min_batch_floor_fraction))
    return PipelineTuneSettings(num_rollout_workers=workers, min_batch_size=min_batch, max_batch_size=max_batch,
                                queue_maxsize=max(1, max_batch), target_groups_per_step=max_batch)


def _seconds_per_group(window: list[StepMeasurement]) -> float:
    return sum(m.wall_s for m in window) / max(1, sum(m.groups for m in window))


class ScheduleJudge:
    """Overlapped or in turn; see the module docstring (part 1). `observe` returns a decision when the schedule
    changes or is decided."""

    def __init__(self, *, window_steps: int, warmup_ignore_steps: int, starting_step: int,
                 initial: Schedule | None = None, min_gain: float = OVERLAP_MIN_GAIN) -> None:
        self.window_steps = window_steps
        self.min_gain = min_gain
        self._warmup_end = starting_step + warmup_ignore_steps
        self.schedule: Schedule = initial or "overlap"
        self.phase = "decided" if initial is not None else "probe_overlap"
        self.evidence: dict[str, float] = {}
        self._window: list[StepMeasurement] = []
        self._settle = 0

    @property
    def decided(self) -> bool:
        return self.phase == "decided"

    def _switch(self, to: Schedule) -> None:
        self.schedule = to
        self._window = []
        self._settle = SETTLE_STEPS

    def observe(self, m: StepMeasurement) -> tuple[str, str] | None:
        """(action, reason) when the schedule changes or is decided; None otherwise."""
        if m.step <= self._warmup_end or m.groups <= 0:
            return None
        if m.schedule != self.schedule:
            return None  # a step that started before the switch
        if self._settle:
            self._settle -= 1
            return None
        if self.phase == "decided" and self.schedule == "in_turn":
            return None
        self._window.append(m)
        if len(self._window) < self.window_steps:
            return None
        spg = _seconds_per_group(self._window)
        steps = f"{self._window[0].step}-{m.step}"
        if self.phase == "probe_overlap":
            self.evidence["overlap_s_per_group"] = spg
            self.phase = "probe_in_turn"
            self._switch("in_turn")
            return "probe_in_turn", f"measuring in turn after {spg:.3g} s/group overlapped over steps {steps}"
        if self.phase == "probe_in_turn":
            self.evidence["in_turn_s_per_group"] = spg
            self.phase = "decided"
            overlap = self.evidence["overlap_s_per_group"]
            self.evidence["overlap_speedup"] = spg / overlap if overlap > 0 else 0.0
            if overlap < spg * (1.0 - self.min_gain):
                self._switch("overlap")
                return "run_overlapped", (f"overlap {overlap:.3g} s/group beats in turn {spg:.3g} s/group "
                                          f"({self.evidence['overlap_speedup']:.2f}x)")
            self._window = []
            return "run_in_turn", (f"giving up overlap: {overlap:.3g} s/group overlapped does not beat {spg:.3g} "
                                   f"s/group in turn (the synchronous loop's schedule) by {self.min_gain:.0%} "
                                   f"({self.evidence['overlap_speedup']:.2f}x): rollouts and training contend, so "
                                   "they run in turn")
        # decided, overlapped: each window must still beat the in-turn figure
        baseline = self.evidence["in_turn_s_per_group"]
        self.evidence["overlap_s_per_group"] = spg
        self.evidence["overlap_speedup"] = baseline / spg if spg > 0 else 0.0
        self._window = []
        if spg >= baseline:
            self.schedule = "in_turn"
            return "run_in_turn", (f"giving up overlap: overlapped steps fell to {spg:.3g} s/group, no faster "
                                   f"than in turn, the synchronous loop's schedule ({baseline:.3g} s/group)")
        return None


class PipelineAutotuner:
    """The online tuner (module docstring): `observe` one step, get the decisions it made (applied to
    `settings` already); `profile()` is what is saved."""

    def __init__(self, *, config: PipelineAutotuneConfig, settings: PipelineTuneSettings,
                 policy_age_limit_steps: float, starting_step: int = 0, model_name: str | None = None,
                 backend_name: str | None = None, target_packed_sequences: int = 1, inference_gpu_count: int = 1,
                 packed_sequence_length: int | None = None, schedule: Schedule | None = None) -> None:
        self.config = config
        self.settings = settings
        self.policy_age_limit_steps = policy_age_limit_steps
        self.model_name, self.backend_name = model_name, backend_name
        self.target_packed_sequences, self.inference_gpu_count = target_packed_sequences, inference_gpu_count
        self.packed_sequence_length = packed_sequence_length
        self.judge = ScheduleJudge(window_steps=config.window_steps, warmup_ignore_steps=config.warmup_ignore_steps,
                                   starting_step=starting_step, initial=schedule)
        self.decisions: list[TunerDecision] = []
        self._history: list[StepMeasurement] = []
        self._last_decision_step: int | None = None
        self._worker_candidate_direction: int | None = None
        self._worker_candidate_count = 0
        self._stale_backlog_active = False
        self._trial_baseline_collect_s: float | None = None
        self._trial_batch_size: int | None = None
        self._trial_failed_windows = 0

    @property
    def schedule(self) -> Schedule:
        return self.judge.schedule

    # ------------------------------------------------------------------ one step
    def observe(self, m: StepMeasurement) -> list[TunerDecision]:
        out: list[TunerDecision] = []
        self._history.append(m)
        self._history = self._history[-4 * self.config.window_steps:]
        change = self.judge.observe(m)
        if change is not None:
            action, reason = change
            self._last_decision_step = m.step
            out.append(self._record(TunerDecision(step=m.step, state=f"schedule_{self.judge.schedule}", action=action,
                                                  reason=reason, previous=self.settings, updated=self.settings)))
            return out
        if not self.judge.decided:
            return out
        if self._last_decision_step is not None and m.step - self._last_decision_step < self.config.window_steps:
            return out
        window = [h for h in self._history if h.schedule == m.schedule and
                  (self._last_decision_step is None or h.step > self._last_decision_step)]
        window = window[-self.config.window_steps:]
        if len(window) < self.config.window_steps:
            return out
        decision = self.decide(self.window_stats(window), in_turn=m.schedule == "in_turn",
                               pressure_measured=all(h.inference_pressure is not None for h in window))
        self._last_decision_step = m.step
        self.settings = decision.updated
        out.append(self._record(decision))
        return out

    def _record(self, decision: TunerDecision) -> TunerDecision:
        self.decisions.append(decision)
        return decision

    @staticmethod
    def window_stats(window: list[StepMeasurement]) -> TunerWindowStats:
        wall = sum(m.wall_s for m in window)
        collect = sum(m.collect_s for m in window)
        put_wait = sum(m.put_wait_s for m in window)
        rollout = sum(m.rollout_s for m in window)
        pressures = [m.inference_pressure for m in window if m.inference_pressure is not None]
        seen = sum(m.groups + m.stale_groups + m.zero_variance_groups for m in window)
        return TunerWindowStats(
            start_step=window[0].step, end_step=window[-1].step, window_start_s=window[0].t_s - window[0].wall_s,
            window_end_s=window[-1].t_s, collect_batch_s=collect / len(window),
            trainer_underfeed_score=collect / wall if wall > 0 else 0.0,
            vllm_pressure=sum(pressures) / len(pressures) if pressures else 0.0,
            queue_put_wait_frac=put_wait / max(put_wait + rollout, 1e-9),
            actual_stale_frac=sum(m.stale_groups for m in window) / max(seen, 1))

    # ------------------------------------------------------------------ ART's rules
    def decide(self, stats: TunerWindowStats, *, in_turn: bool = False, pressure_measured: bool = True
               ) -> TunerDecision:
        """ART's `_decide` on one window (module docstring, part 2); does not change `self.settings`."""
        c = self.config
        inference_over = pressure_measured and stats.vllm_pressure > c.vllm_pressure_over_ratio
        inference_under = pressure_measured and not inference_over and \
            stats.vllm_pressure <= c.vllm_pressure_under_ratio
        inference_state = ("inference_over" if inference_over else "inference_under" if inference_under
                           else "inference_balanced" if pressure_measured else "inference_unmeasured")
        trainer_under = stats.trainer_underfeed_score > c.trainer_load_under_score
        trainer_over = stats.trainer_underfeed_score <= c.trainer_load_over_score
        trainer_state = "train_under" if trainer_under else "train_over" if trainer_over else "train_balanced"
        state = f"{inference_state}_{trainer_state}" + ("_in_turn" if in_turn else "")
        previous = self.settings
        updated = self._recomputed(previous)
        stale = self._update_stale_backlog(stats)
        action, pending, reason = "hold", "hold", "inside hysteresis band or already balanced"
        if stale and updated.min_batch_size < updated.max_batch_size:
            self._clear_worker_candidate()
            updated = updated.model_copy(update={"min_batch_size": self._raised_min(updated)})
            action, reason = "raise_min_batch_size", "stale backlog requires dense batches before reducing workers"
        elif stale:
            self._clear_worker_candidate()
            updated = updated.model_copy(update={"num_rollout_workers": self.move_workers(
                updated.num_rollout_workers, -1)})
            action, reason = "decrease_workers", "actual stale backlog exceeds the freshness target"
        elif in_turn:
            self._clear_worker_candidate()
            reason = "in turn: the trainer waits for the rollout phase by construction; worker and batch rules hold"
        elif inference_over and trainer_over and stats.queue_put_wait_frac >= c.queue_put_severe_frac:
            pending = "decrease_workers"
            if self._worker_change_ready(-1):
                updated = updated.model_copy(update={"num_rollout_workers": self.move_workers(
                    updated.num_rollout_workers, -1)})
                action, reason = pending, "sustained inference pressure plus queue backpressure indicates excess " \
                    "workers"
            else:
                reason = self._pending_reason("decrease")
        elif stats.queue_put_wait_frac >= c.queue_put_severe_frac:
            self._clear_worker_candidate()
            reason = "completed-group queue backpressure is active"
        elif trainer_under and not inference_over:
            pending = "increase_workers"
            if self._worker_change_ready(+1):
                updated = updated.model_copy(update={"num_rollout_workers": self.move_workers(
                    updated.num_rollout_workers, +1)})
                action, reason = pending, "inference pressure is not high and the trainer is underfed"
            else:
                reason = self._pending_reason("increase")
        elif inference_over and trainer_over:
            self._clear_worker_candidate()
            reason = "both sides are loaded; no throughput-safe online change"
        else:
            self._clear_worker_candidate()
        if not stale and not in_turn:
            min_update = self._min_batch_adjustment(updated, stats, pending if pending == "increase_workers"
                                                    else action, inference_over=inference_over)
            if min_update is not None:
                self._clear_worker_candidate()
                updated, action, reason = min_update
        updated = self._recomputed(updated)
        limit = self._worker_limit(updated.target_groups_per_step)
        if limit is not None and previous.num_rollout_workers > limit >= updated.num_rollout_workers:
            self._clear_worker_candidate()
            action, reason = "decrease_workers", "running rollout reserve exceeded the policy-age budget"
        elif action == "hold" and updated != previous:
            action, reason = "resize_batch_queue", "recomputed batch floor, worker limit and one-batch queue"
        return TunerDecision(step=stats.end_step, state=state, action=action if updated != previous else "hold",
                             reason=reason, previous=previous, updated=updated, stats=stats)

    def _worker_limit(self, target: int) -> int | None:
        return worker_limit(target_groups_per_step=target,
                                      limit_steps_off_policy=self.policy_age_limit_steps,
                                      running_reserve_fraction=self.config.queue_running_reserve_fraction,
                                      worker_step=self.config.worker_step)

    def _recomputed(self, settings: PipelineTuneSettings) -> PipelineTuneSettings:
        """ART's `_settings_with_recomputed_queue` with a fixed target: the min-batch floor, the freshness worker
        limit, a one-batch queue."""
        target = settings.target_groups_per_step
        floor = math.ceil(target * self.config.freshness_min_batch_floor_fraction)
        limit = self._worker_limit(target)
        workers = settings.num_rollout_workers if limit is None else min(settings.num_rollout_workers, limit)
        return settings.model_copy(update={"num_rollout_workers": workers, "max_batch_size": target,
                                           "min_batch_size": max(floor, min(settings.min_batch_size, target)),
                                           "queue_maxsize": max(1, target)})

    def move_workers(self, current: int, direction: int) -> int:
        """ART's worker move: `worker_move_fraction` of the workers, rounded to `worker_step`, at least one
        `worker_step`, at most `max_worker_move`; never below `worker_step` or above `max_rollout_workers`."""
        c = self.config
        raw = max(c.worker_step, _round_to_multiple(current * c.worker_move_fraction, c.worker_step))
        cap = _ceil_to_multiple(c.max_worker_move, c.worker_step)
        return min(max(c.worker_step, current + direction * min(cap, raw)), c.max_rollout_workers)

    def _raised_min(self, settings: PipelineTuneSettings) -> int:
        return min(settings.max_batch_size, max(settings.min_batch_size + 1, round(settings.min_batch_size * 1.15)))

    def _worker_change_ready(self, direction: int) -> bool:
        if self._worker_candidate_direction == direction:
            self._worker_candidate_count += 1
        else:
            self._worker_candidate_direction, self._worker_candidate_count = direction, 1
        if self._worker_candidate_count < self.config.worker_load_change_windows:
            return False
        self._clear_worker_candidate()
        return True

    def _pending_reason(self, direction: str) -> str:
        return (f"worker {direction} awaits sustained evidence ({self._worker_candidate_count}/"
                f"{self.config.worker_load_change_windows})")

    def _clear_worker_candidate(self) -> None:
        self._worker_candidate_direction, self._worker_candidate_count = None, 0

    def _update_stale_backlog(self, stats: TunerWindowStats) -> bool:
        fractions = (stats.predicted_stale_frac, stats.actual_stale_frac)
        if self._stale_backlog_active:
            self._stale_backlog_active = any(f > self.config.stale_clear_frac for f in fractions)
        else:
            self._stale_backlog_active = any(f >= self.config.stale_high_frac for f in fractions)
        return self._stale_backlog_active

    def _min_batch_adjustment(self, settings: PipelineTuneSettings, stats: TunerWindowStats, action: str, *,
                              inference_over: bool) -> tuple[PipelineTuneSettings, str, str] | None:
        c = self.config
        if self._trial_baseline_collect_s is not None:
            if settings.min_batch_size != self._trial_batch_size:
                self._clear_trial()
            elif not inference_over and stats.trainer_underfeed_score <= c.trainer_min_batch_raise_score:
                self._clear_trial()
                return self._raise_min(settings, "trainer collection idle fell below the min-batch threshold")
            elif stats.collect_batch_s >= self._trial_baseline_collect_s * c.min_batch_collect_improvement_ratio:
                if inference_over:
                    return None
                self._trial_failed_windows += 1
                if self._trial_failed_windows >= c.min_batch_trial_windows:
                    self._clear_trial()
                    return self._raise_min(settings, "smaller batches did not reduce collection time enough")
                return None
            else:
                self._clear_trial()
        if action != "increase_workers" and stats.trainer_underfeed_score > c.trainer_min_batch_lower_score:
            floor = max(1, math.ceil(settings.target_groups_per_step * c.freshness_min_batch_floor_fraction))
            new_min = max(floor, round(settings.min_batch_size * 0.85))
            if new_min < settings.min_batch_size:
                self._trial_baseline_collect_s = stats.collect_batch_s
                self._trial_batch_size = new_min
                self._trial_failed_windows = 0
                return (settings.model_copy(update={"min_batch_size": min(new_min, settings.max_batch_size)}),
                        "lower_min_batch_size", "trainer is severely underfed and rollout workers are not being "
                        "increased")
        if not inference_over and stats.trainer_underfeed_score <= c.trainer_min_batch_raise_score:
            return self._raise_min(settings, "trainer collection idle is low enough to use denser batches")
        return None

    def _raise_min(self, settings: PipelineTuneSettings, reason: str
                   ) -> tuple[PipelineTuneSettings, str, str] | None:
        if settings.min_batch_size >= settings.max_batch_size:
            return None
        return settings.model_copy(update={"min_batch_size": self._raised_min(settings)}), "raise_min_batch_size", \
            reason

    def _clear_trial(self) -> None:
        self._trial_baseline_collect_s = self._trial_batch_size = None
        self._trial_failed_windows = 0

    # ------------------------------------------------------------------ the saved profile
    def profile(self) -> PipelineAutotunerProfile:
        return PipelineAutotunerProfile(
            model_name=self.model_name, backend=self.backend_name, packed_sequence_length=self.packed_sequence_length,
            target_packed_sequences=self.target_packed_sequences, inference_gpu_count=self.inference_gpu_count,
            policy_age_limit_steps=self.policy_age_limit_steps, settings=self.settings, config=self.config,
            decisions=self.decisions, schedule=self.judge.schedule if self.judge.decided else None,
            schedule_evidence=dict(self.judge.evidence),
            notes=["The first warmup_ignore_steps are excluded from decisions.",
                   "schedule: 'in_turn' runs no rollout during a train call (rollouts and training contended on "
                   "this machine); 'overlap' overlaps them (ART's pipeline)."])
