"""ART 0.5.23's `PipelineTrainer` options that are more than a stored value: the runtime config and its
deprecated keyword aliases, what is refused because it is not built, the staleness bound admission uses, and
the score figures of a step (`sample_efficiency/...`, `offpolicy/...`, `objective/score`).

The score, as ART computes it: each trajectory is `s - v` steps off policy (`s` the step a train call starts
from, `v` its `initial_policy_version`), weighted by its `completion_tokens` metric (1 where it has none);
with in-flight updates, each token is `s - v` off policy, `v` the version its turn's `policy_token_spans` name (ART's);
freshness is 1 / mean(exp(age / 8)); the batch factor compares the step's groups with a reference,
`(ref_groups + 300 / ref_rollouts) / (groups + 300 / rollouts)` (300: the rollouts a step needs before more
stop helping, ART's constant); the score is trained tokens per second * freshness * batch factor.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from ..runtime.notices import notice_once
from ..pipeline_tuner.config import (BUILT_AUTOTUNE_MODES, PipelineAutotuneConfig, PipelineRuntimeConfig,
                                     refuse_unread_knobs)
from ..trajectories.data import Trajectory, TrajectoryGroup, policy_token_counts

DEPRECATED_PIPELINE_KEYWORDS = ("num_rollout_workers", "min_batch_size", "max_batch_size", "queue_maxsize")
FRESHNESS_TAU_STEPS = 8.0
CRITICAL_ROLLOUT_BATCH_SIZE = 300.0


def resolve_pipeline_config(pipeline: PipelineRuntimeConfig | None, autotune: PipelineAutotuneConfig | None,
                            **aliases: int | None) -> tuple[PipelineRuntimeConfig, PipelineAutotuneConfig]:
    """The run's runtime and autotune configs from `pipeline=`, `autotune=` and the deprecated direct keywords
    (ART 0.5.18's; one notice per keyword per process). Refuses what ART refuses."""
    if autotune is None:
        autotune = PipelineAutotuneConfig()
    if not isinstance(autotune, PipelineAutotuneConfig):
        raise ConfigError(f"PipelineTrainer(autotune={autotune!r:.80}): pass a PipelineAutotuneConfig.")
    if autotune.mode not in BUILT_AUTOTUNE_MODES:
        raise ConfigError(f"PipelineTrainer(autotune=PipelineAutotuneConfig(mode={autotune.mode!r})) is not "
                          f"supported; choose one of {BUILT_AUTOTUNE_MODES}.")
    refuse_unread_knobs(autotune)
    if pipeline is not None and not isinstance(pipeline, PipelineRuntimeConfig):
        raise ConfigError(f"PipelineTrainer(pipeline={pipeline!r:.80}): pass a PipelineRuntimeConfig.")
    given = {k: v for k, v in aliases.items() if v is not None}
    if autotune.mode != "off" and (pipeline is not None or given):
        raise ValueError(f"PipelineTrainer(autotune=PipelineAutotuneConfig(mode={autotune.mode!r})): pipeline runtime "
                         f"config cannot be provided when pipeline autotuning is enabled (given: "
                         f"{'pipeline' if pipeline is not None else sorted(given)}). The tuner owns the initial and "
                         "online settings (ART's rule); its initial_* knobs set where it starts.")
    if pipeline is not None and given:
        raise ValueError(f"PipelineTrainer: use either pipeline=PipelineRuntimeConfig(...) or the deprecated direct "
                         f"pipeline settings {sorted(given)}, not both.")
    for key, value in given.items():
        notice_once(f"pipeline_trainer.deprecated.{key}",
                    f"PipelineTrainer({key}={value}) is deprecated (ART 0.5.23); it still works. Pass "
                    f"pipeline=PipelineRuntimeConfig({key}={value}) instead.")
    return pipeline if pipeline is not None else PipelineRuntimeConfig(**given), autotune


def refuse_unbuilt(*, rollout_executor: object | None) -> None:
    """ConfigError for the 0.5.23 keywords whose ART behaviour is not built here (docs/pipeline.md)."""
    if rollout_executor is not None:
        raise ConfigError(
            f"PipelineTrainer(rollout_executor={type(rollout_executor).__name__}) is not supported: ART's "
            "distributed rollout executors are not built in artrl; rollouts run as asyncio tasks of this process "
            "(pipeline=PipelineRuntimeConfig(num_rollout_workers=...)). Leave rollout_executor=None.")


def admission_bound(max_steps_off_policy: int | None, limit_mean_steps_off_policy: float | None) -> int | None:
    """The hard bound admission and the stale check use. A group that samples from one version `v` has mean
    age `s - v`, so `limit_mean_steps_off_policy=L` keeps it exactly when `v >= s - floor(L)`."""
    bounds = [b for b in (max_steps_off_policy,
                          None if limit_mean_steps_off_policy is None else math.floor(limit_mean_steps_off_policy))
              if b is not None]
    return min(bounds) if bounds else None


def staleness_window(max_steps_off_policy: int | None, limit_mean_steps_off_policy: float | None) -> int:
    """ART's freshness window: steps of groups the queue holds (its default size is this * max_batch_size)."""
    if max_steps_off_policy is not None:
        return max_steps_off_policy
    if limit_mean_steps_off_policy is not None:
        return math.ceil(limit_mean_steps_off_policy)
    return 1


def _weight(trajectory: Trajectory) -> float:
    value = trajectory.metrics.get("completion_tokens")
    if not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0:
        return float(value)
    return 1.0


def _ages(step: int, group: TrajectoryGroup) -> list[tuple[float, float]]:
    """(steps off policy, weight) of each trajectory with a recorded initial policy version; of each version's
    tokens (weight: their count) for one whose turns record `policy_token_spans` (in-flight updates, as ART)."""
    points = []
    for t in group.trajectories:
        if (counts := policy_token_counts(t)) is not None:
            points += [(float(step - version), float(n)) for version, n in sorted(counts.items()) if n > 0]
        elif t.initial_policy_version is not None:
            points.append((float(step - t.initial_policy_version), _weight(t)))
    return points


def group_mean_steps_off_policy(step: int, group: TrajectoryGroup) -> float | None:
    """The group's weighted mean steps off policy when trained from `step` (None: no version recorded)."""
    ages = _ages(step, group)
    total = sum(w for _, w in ages)
    return sum(a * w for a, w in ages) / total if total > 0 else None


def _weighted_p95(points: list[tuple[float, float]]) -> float:
    ordered = sorted(points)
    target, running = 0.95 * sum(w for _, w in ordered), 0.0
    for value, weight in ordered:
        running += weight
        if running >= target:
            return value
    return ordered[-1][0]


def score_metrics(step: int, groups: list[TrajectoryGroup], *, step_seconds: float, result_metrics: dict[str, Any],
                  reference_groups: float | None, reference_rollouts: float | None) -> dict[str, float]:
    """ART's per-step score figures (module docstring)."""
    out: dict[str, float] = {"sample_efficiency/accepted_groups_per_step": float(len(groups))}
    sizes = [len(g.trajectories) for g in groups]
    rollouts = sum(sizes) / len(sizes) if sizes else None
    factor = 1.0
    if reference_groups is not None and groups and rollouts:
        ref_rollouts = reference_rollouts if reference_rollouts is not None else rollouts
        factor = (reference_groups + CRITICAL_ROLLOUT_BATCH_SIZE / ref_rollouts) / \
            (len(groups) + CRITICAL_ROLLOUT_BATCH_SIZE / rollouts)
    out["sample_efficiency/batch_factor"] = factor
    points = [p for g in groups for p in _ages(step, g)]
    total = sum(w for _, w in points)
    if total <= 0:
        return out
    out["offpolicy/token_weighted_policy_age_steps"] = sum(a * w for a, w in points) / total
    out["offpolicy/token_weighted_policy_age_p95_steps"] = _weighted_p95(points)
    moment = sum(math.exp(min(max(a, 0.0) / FRESHNESS_TAU_STEPS, 700.0)) * w for a, w in points) / total
    freshness = 1.0 / max(moment, 1e-12)
    out["sample_efficiency/freshness_discount"] = freshness
    tokens = result_metrics.get("data/step_trainable_assistant_tokens", result_metrics.get("data/step_trainer_tokens"))
    if isinstance(tokens, (int, float)) and step_seconds > 0:
        out["throughput/accepted_train_tok_per_s"] = float(tokens) / step_seconds
        out["objective/score"] = out["throughput/accepted_train_tok_per_s"] * freshness * factor
    return out
