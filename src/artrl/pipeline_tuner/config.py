"""ART 0.5.23's pipeline configs: `PipelineRuntimeConfig` (workers and batch bounds of a `PipelineTrainer`) and
`PipelineAutotuneConfig` (its tuner's knobs), with ART's fields, defaults and checks; and the tuner's records
(`PipelineTuneSettings`, `TunerWindowStats`, `TunerDecision`, `PipelineAutotunerProfile`), ART's schema, so a
profile file written here loads in ART and one of ART's loads here.

`PipelineTrainer(pipeline=PipelineRuntimeConfig(...))` honours every runtime field, and
`autotune=PipelineAutotuneConfig(mode=...)` runs modes "off", "online" and "profile" (the tuner: autotune.py;
docs/pipeline.md says which of ART's rules it applies and which knobs it reads). A config written for ART fails
here where it fails there.
"""

from __future__ import annotations

from typing import Literal

import pydantic

AUTOTUNE_MODES = ("off", "online", "profile")
BUILT_AUTOTUNE_MODES = AUTOTUNE_MODES
SCHEDULES = ("overlap", "in_turn")
UNREAD_AUTOTUNE_KNOBS = {
    "ART's packing-spill target adaptation (Megatron's fixed packed sequences; the target batch stays where it "
    "starts here)": ("target_spill_probability", "packing_trials", "packing_reservoir_multiplier",
                     "packing_reservoir_min_groups", "packing_history_steps", "packing_spill_prior_alpha",
                     "packing_spill_prior_beta", "packing_spill_confidence", "target_group_change_windows",
                     "target_group_increase_fraction", "target_group_max_increase",
                     "target_group_min_relative_change", "target_group_immediate_decrease_fraction"),
    "ART's vLLM metrics polling (the built-in engine's queue is read at each rollout and step end)": (
        "vllm_metric_interval_s", "vllm_metric_timeout_window_frac"),
    "ART's hardware recommendations": ("recommendation_min_windows", "recommendation_consecutive_holds",
                                       "trainer_load_severe_under_score", "unused_and_dummy_high_frac"),
}
"""Tuner knobs that only parts of ART's tuner not built here read: with mode "online" or "profile" a value other
than the default is refused by name (a knob that changes nothing must not look honoured)."""


def refuse_unread_knobs(config: "PipelineAutotuneConfig") -> None:
    from ..errors import ConfigError

    if config.mode == "off":
        return
    defaults = PipelineAutotuneConfig()
    for what, names in UNREAD_AUTOTUNE_KNOBS.items():
        for name in names:
            if getattr(config, name) != getattr(defaults, name):
                raise ConfigError(f"PipelineAutotuneConfig({name}={getattr(config, name)!r}) with mode="
                                  f"{config.mode!r} is not supported: only {what} reads it, and that is not built "
                                  f"in artrl. Leave it at its default ({getattr(defaults, name)!r}).")


class PipelineRuntimeConfig(pydantic.BaseModel):
    """How a pipelined run is shaped (ART 0.5.23's `art.pipeline_tuner.PipelineRuntimeConfig`)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    num_rollout_workers: int = pydantic.Field(
        16, ge=1, description="Rollout workers: scenarios rolled out at once (each one group at a time).")
    min_batch_size: int = pydantic.Field(
        4, ge=1, description="Groups a train call waits for before it starts.")
    max_batch_size: int | None = pydantic.Field(
        None, ge=1, description="Most groups one train call takes (what is queued beyond min_batch_size, up to "
        "this). None: 10 * min_batch_size, as in ART.")
    queue_maxsize: int | None = pydantic.Field(
        None, ge=1, description="Finished groups waiting for the trainer before rollout workers block. None: "
        "the staleness window (max_steps_off_policy, or ceil(limit_mean_steps_off_policy), or 1) times "
        "max_batch_size, as in ART.")
    score_reference_groups_per_step: float | None = pydantic.Field(
        8.0, gt=0.0, description="Reference groups per step of the `sample_efficiency/batch_factor` figure "
        "(ART's score of a step); None turns the factor off (1.0).")
    score_reference_rollouts_per_group: float | None = pydantic.Field(
        None, gt=0.0, description="Reference rollouts per group of that figure; None: the batch's own mean.")

    @pydantic.model_validator(mode="after")
    def _batch_bounds(self) -> "PipelineRuntimeConfig":
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be >= min_batch_size="
                             f"{self.min_batch_size}")
        return self


class PipelineAutotuneConfig(pydantic.BaseModel):
    """ART 0.5.23's pipeline tuner settings (`art.pipeline_tuner.PipelineAutotuneConfig`), checked as ART checks
    them. Which knobs the tuner reads here, and which belong to ART's Megatron packing and vLLM polling (checked,
    unread): docs/pipeline.md, "The online tuner"."""

    mode: Literal["off", "online", "profile"] = pydantic.Field(
        "off", description="off: the runtime config as given. online: the tuner sets workers, batch bounds and "
        "the schedule (overlapped or in turn) from each step's measurements and saves its profile after each "
        "decision. profile: start from a saved profile's settings and keep them (no online changes).")
    profile: str | None = pydantic.Field(None, description="A saved tuner profile to start from: a name under "
                                         "<run dir>/pipeline_tuner/, or a path ending in .json. Mode profile: "
                                         "None reads 'latest'.")
    output_name: str = pydantic.Field("latest", description="The name the online tuner's profile is saved under "
                                      "(<run dir>/pipeline_tuner/<output_name>.json).")
    window_steps: int = pydantic.Field(4, ge=1)
    warmup_ignore_steps: int = pydantic.Field(3, ge=0)
    target_spill_probability: float = pydantic.Field(0.03, ge=0.0, le=1.0)
    worker_step: int = pydantic.Field(2, ge=1)
    worker_move_fraction: float = pydantic.Field(0.10, gt=0.0, le=1.0)
    worker_load_change_windows: int = pydantic.Field(2, ge=1)
    max_worker_move: int = pydantic.Field(16, ge=4)
    max_rollout_workers: int = pydantic.Field(1024, ge=1)
    initial_model_calls_per_inference_gpu: int = pydantic.Field(8, ge=1)
    initial_min_groups_per_packed_sequence: int = pydantic.Field(8, ge=1)
    initial_max_groups_per_packed_sequence: int = pydantic.Field(8, ge=1)
    packing_trials: int = pydantic.Field(48, ge=16)
    packing_reservoir_multiplier: int = pydantic.Field(2, ge=2)
    packing_reservoir_min_groups: int = pydantic.Field(32, ge=16)
    packing_history_steps: int = pydantic.Field(64, ge=1)
    packing_spill_prior_alpha: float = pydantic.Field(1.0, gt=0.0)
    packing_spill_prior_beta: float = pydantic.Field(8.0, gt=0.0)
    packing_spill_confidence: float = pydantic.Field(0.8, gt=0.0, lt=1.0)
    queue_running_reserve_fraction: float = pydantic.Field(0.75, ge=0.0, le=1.0)
    trainer_load_under_score: float = pydantic.Field(0.08, ge=0.0)
    trainer_load_severe_under_score: float = pydantic.Field(0.50, ge=0.0)
    trainer_load_over_score: float = pydantic.Field(0.04, ge=0.0)
    vllm_pressure_over_ratio: float = pydantic.Field(0.80, ge=0.0)
    vllm_pressure_under_ratio: float = pydantic.Field(0.50, ge=0.0)
    queue_put_severe_frac: float = pydantic.Field(1.0 / 3.0, ge=0.0, le=1.0)
    stale_high_frac: float = pydantic.Field(0.20, ge=0.0, le=1.0)
    stale_clear_frac: float = pydantic.Field(0.10, ge=0.0, le=1.0)
    unused_and_dummy_high_frac: float = pydantic.Field(0.25, ge=0.0, le=1.0)
    trainer_min_batch_lower_score: float = pydantic.Field(0.15, ge=0.0)
    trainer_min_batch_raise_score: float = pydantic.Field(0.10, ge=0.0)
    min_batch_collect_improvement_ratio: float = pydantic.Field(0.85, gt=0.0, le=1.0)
    min_batch_trial_windows: int = pydantic.Field(2, ge=1)
    recommendation_min_windows: int = pydantic.Field(5, ge=1)
    recommendation_consecutive_holds: int = pydantic.Field(2, ge=1)
    freshness_min_batch_floor_fraction: float = pydantic.Field(0.85, gt=0.0, le=1.0)
    target_group_change_windows: int = pydantic.Field(1, ge=1)
    target_group_increase_fraction: float = pydantic.Field(0.20, gt=0.0, le=1.0)
    target_group_max_increase: int = pydantic.Field(64, ge=1)
    target_group_min_relative_change: float = pydantic.Field(0.10, ge=0.0, le=1.0)
    target_group_immediate_decrease_fraction: float = pydantic.Field(0.25, ge=0.0, le=1.0)
    vllm_metric_interval_s: float = pydantic.Field(1.0, gt=0.0)
    vllm_metric_timeout_window_frac: float = pydantic.Field(0.35, ge=0.0, le=1.0)

    @pydantic.model_validator(mode="after")
    def _hysteresis(self) -> "PipelineAutotuneConfig":
        if self.stale_clear_frac > self.stale_high_frac:
            raise ValueError(f"stale_clear_frac={self.stale_clear_frac} must be <= stale_high_frac="
                             f"{self.stale_high_frac}")
        if self.trainer_min_batch_raise_score > self.trainer_min_batch_lower_score:
            raise ValueError(f"trainer_min_batch_raise_score={self.trainer_min_batch_raise_score} must be <= "
                             f"trainer_min_batch_lower_score={self.trainer_min_batch_lower_score}")
        return self


class PipelineTuneSettings(pydantic.BaseModel):
    """What the tuner sets (ART's `PipelineTuneSettings`)."""

    num_rollout_workers: int = pydantic.Field(ge=1)
    min_batch_size: int = pydantic.Field(ge=1)
    max_batch_size: int = pydantic.Field(ge=1)
    queue_maxsize: int = pydantic.Field(ge=1)
    target_groups_per_step: int = pydantic.Field(ge=1)


class TunerWindowStats(pydantic.BaseModel):
    """One decision window's figures (ART's `TunerWindowStats`; the vLLM poll fields stay 0 here, and
    `vllm_pressure` is the built-in engine's queue pressure when it is measured, autotune.py)."""

    start_step: int
    end_step: int
    window_start_s: float = 0.0
    window_end_s: float = 0.0
    collect_batch_s: float = 0.0
    trainer_underfeed_score: float = 0.0
    vllm_pressure: float = 0.0
    vllm_waiting_capacity_request_s: float = pydantic.Field(default=0.0, ge=0.0)
    vllm_running_request_s: float = pydantic.Field(default=0.0, ge=0.0)
    queue_put_wait_frac: float = 0.0
    predicted_stale_frac: float = 0.0
    actual_stale_frac: float = 0.0
    unused_and_dummy_ratio_mean: float = 0.0
    vllm_poll_samples: int = 0
    vllm_poll_successes: int = 0
    vllm_poll_timeouts: int = 0
    vllm_poll_errors: int = 0
    vllm_poll_skipped: int = 0
    vllm_poll_coverage: float = 0.0
    vllm_poll_schedule_lag_p99_s: float = 0.0
    vllm_poll_request_latency_p99_s: float = 0.0


class TunerDecision(pydantic.BaseModel):
    """One decision (ART's `TunerDecision`): the state it read, what it did and why, settings before and after."""

    step: int
    state: str
    action: str
    reason: str
    previous: PipelineTuneSettings
    updated: PipelineTuneSettings
    stats: TunerWindowStats | None = None
    recommendations: list[str] = pydantic.Field(default_factory=list)


class PipelineAutotunerProfile(pydantic.BaseModel):
    """A saved tuner profile (ART's `PipelineAutotunerProfile`, schema 1). artrl adds `schedule` (whether
    rollouts and training overlap, or run in turn; None: not decided) and `schedule_evidence` (the seconds per
    group each schedule measured); ART ignores both when it reads the file."""

    schema_version: int = 1
    model_name: str | None = None
    backend: str | None = None
    packed_sequence_length: int | None = None
    target_packed_sequences: int | None = None
    inference_gpu_count: int | None = None
    rollout_worker_capacity: int | None = pydantic.Field(default=None, ge=1)
    policy_age_limit_steps: float | None = None
    settings: PipelineTuneSettings
    config: PipelineAutotuneConfig
    decisions: list[TunerDecision] = pydantic.Field(default_factory=list)
    notes: list[str] = pydantic.Field(default_factory=list)
    schedule: Literal["overlap", "in_turn"] | None = None
    schedule_evidence: dict[str, float] = pydantic.Field(default_factory=dict)
