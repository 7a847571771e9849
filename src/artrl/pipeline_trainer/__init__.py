"""ART's `art.pipeline_trainer`: rollouts, training and eval overlapped with bounded staleness (docs/pipeline.md)."""

from .checkpoint_retention import (CHECKPOINT_CREATED_AT_METRIC, CHECKPOINT_EVAL_COMPLETED_METRIC,
                                   CHECKPOINT_SAVED_METRIC, CheckpointInfo, CheckpointRetentionContext,
                                   CheckpointRetentionStrategy, keep_recent_and_top)
from ..pipeline_tuner import PipelineAutotuneConfig, PipelineRuntimeConfig
from .status import StatusReporter
from .trainer import PipelineTrainer, make_group_rollout_fn
from .types import EvalFn, RolloutFn, ScenarioT, SingleRolloutFn

__all__ = [
    "CHECKPOINT_CREATED_AT_METRIC", "CHECKPOINT_EVAL_COMPLETED_METRIC", "CHECKPOINT_SAVED_METRIC", "CheckpointInfo",
    "CheckpointRetentionContext", "CheckpointRetentionStrategy", "PipelineTrainer", "PipelineAutotuneConfig",
    "PipelineRuntimeConfig", "make_group_rollout_fn",
    "keep_recent_and_top", "StatusReporter", "RolloutFn", "SingleRolloutFn", "EvalFn", "ScenarioT",
]
