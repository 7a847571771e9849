"""ART 0.5.23's pipeline configs: `PipelineRuntimeConfig` (workers and batch bounds of a `PipelineTrainer`) and
`PipelineAutotuneConfig` (its online tuner's knobs), with ART's fields, defaults and checks.

`PipelineTrainer(pipeline=PipelineRuntimeConfig(...))` honours every runtime field (docs/pipeline.md).
The tuner itself is not built here: `PipelineTrainer` takes `autotune=PipelineAutotuneConfig()` (mode "off",
the default) and refuses mode "online" or "profile" with a ConfigError naming the mode, so a run never looks
tuned when it is not. The autotune fields are still checked here as ART checks them, so a config written for
ART fails here where it fails there.
"""

from __future__ import annotations

from typing import Literal

import pydantic

AUTOTUNE_MODES = ("off", "online", "profile")
BUILT_AUTOTUNE_MODES = ("off",)


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
    """ART 0.5.23's online pipeline tuner settings (`art.pipeline_tuner.PipelineAutotuneConfig`).

    Only `mode="off"` (the default) runs here; `PipelineTrainer` refuses "online" and "profile" (module
    docstring). The other fields are ART's tuner knobs, checked as ART checks them."""

    mode: Literal["off", "online", "profile"] = pydantic.Field(
        "off", description="off: the runtime config as given. online / profile: ART's tuner (not built here; "
        "refused by PipelineTrainer).")
    profile: str | None = pydantic.Field(None, description="ART: a saved tuner profile to start from.")
    output_name: str = pydantic.Field("latest", description="ART: the name the tuner's profile is saved under.")
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
