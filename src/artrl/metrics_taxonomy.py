"""Metric names: ART's taxonomy, and how a train call's figures map onto it.

ART 0.5.x names a train step's metrics by section. Where ART has a name for
what our trainer measures, the history row and `TrainResult.metrics` use
ART's name; what ART does not measure keeps our name (`train/...` for the
optimizer, `data/...` for the layout). The table is `TRAINER_TO_ART` below and
docs/observability.md lists every key.

| our trainer's figure            | history / TrainResult key          |
|---------------------------------|------------------------------------|
| loss (the optimised objective)  | loss/train                         |
| grad_norm                       | loss/grad_norm                     |
| learning_rate                   | loss/learning_rate                 |
| entropy                         | loss/entropy                       |
| kl_policy_ref (mean new - ref)  | loss/kl_policy_ref                 |
| trainable_tokens                | data/step_trainer_tokens           |
| step_seconds (summed)           | time/step_trainer_s                |
| optimizer steps                 | data/step_num_gradient_steps       |
| offpolicy/... (RL, first step)  | the same key (ART's `offpolicy` section) |
| groups, trainable groups (RL)   | data/step_num_groups_submitted / _trainable |
| trajectories + exceptions (RL)  | data/step_num_trajectories         |
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

TRAIN_GRADIENT_STEPS_KEY = "data/step_num_gradient_steps"
_INVARIANT_KEYS = frozenset({TRAIN_GRADIENT_STEPS_KEY})

TRAINER_TO_ART = {
    "loss": "loss/train",
    "grad_norm": "loss/grad_norm",
    "learning_rate": "loss/learning_rate",
    "entropy": "loss/entropy",
    "kl_policy_ref": "loss/kl_policy_ref",  # ART: mean (new - reference) logprob; our beta term stays train/kl
    # ART 0.5.23's off-policy figures (train/loss.py)
    "importance_ratio_mean": "loss/importance_ratio_mean",
    "importance_ratio_p95": "loss/importance_ratio_p95",
    "importance_ratio_p99": "loss/importance_ratio_p99",
    "clipped_token_fraction": "loss/clipped_token_fraction",
    "trainable_tokens": "data/step_trainer_tokens",
    "step_seconds": "time/step_trainer_s",
    "data/optimizer_steps": TRAIN_GRADIENT_STEPS_KEY,
}
"""Our trainer's per-call figures (train/call.py `run_call`) -> ART's metric names."""
_DUPLICATES = frozenset({"data/trainable_tokens"})  # the same number as data/step_trainer_tokens


def average_metric_samples(metric_samples: Iterable[dict[str, float]]) -> dict[str, float]:
    """Mean of each key over the samples; invariant keys (gradient steps) must agree and are kept as is."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    invariant: dict[str, float] = {}
    for sample in metric_samples:
        for key, value in sample.items():
            value = float(value)
            if key in _INVARIANT_KEYS:
                if key in invariant and invariant[key] != value:
                    # ART's wording ("must be invariant across samples"), so code matching it keeps working
                    raise ValueError(f"Metric {key!r} must be invariant across samples (the same in every sample), "
                                     f"got {invariant[key]} and {value}.")
                invariant[key] = value
            totals[key] = totals.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {k: invariant[k] if k in _INVARIANT_KEYS else totals[k] / counts[k] for k in totals}


TRAINER_SECONDS_KEY = "time/step_trainer_s"  # ART 0.5.18's name of the train call's seconds


BACKEND_TRAIN_SECONDS_KEY = "time/step_backend_train_s"  # ART 0.5.23's


def aggregate_step_metrics(samples: list[dict[str, float]], seconds: float, kind: str) -> dict[str, float]:
    """ART's train-row aggregation of per-step metrics (`kind` "rl" keeps a reported trainer time), the time under
    ART 0.5.23's key (`time/step_backend_train_s`) and 0.5.18's (`time/step_trainer_s`).

    What a backend on ART's hook protocol yields (one metric dict per optimizer step) becomes one train row so:
    the mean of each key over the steps that report it (`average_metric_samples`; `data/step_num_gradient_steps`
    must be the same in every dict and is kept as it is), plus the seconds the iteration took (RL: unless the
    backend reports them; SFT: always, as in ART)."""
    metrics = average_metric_samples(samples)
    for key in (BACKEND_TRAIN_SECONDS_KEY, TRAINER_SECONDS_KEY):
        if kind == "rl":
            metrics.setdefault(key, seconds)
        else:
            metrics[key] = seconds
    return metrics


@dataclass(frozen=True)
class TrajectoryBatchSummary:
    num_scenarios: int
    num_trajectories: int
    num_groups_submitted: int
    num_groups_trainable: int
    scenario_ids: list[str]


def _group_is_trainable(group: Any) -> bool:
    rewards = [t.reward for t in group.trajectories]
    return len(rewards) > 1 and len(set(rewards)) > 1


def _scenario_id(group: Any) -> str | None:
    for metadata in (getattr(group, "metadata", None) or {}, *(t.metadata for t in group.trajectories)):
        value = metadata.get("scenario_id") if isinstance(metadata, dict) else None
        if value is not None:
            return str(value)
    return None


def summarize_trajectory_groups(trajectory_groups: Iterable[Any]) -> TrajectoryBatchSummary:
    """Counts ART puts in every row: scenarios (= groups), trajectories (+ exceptions), trainable groups."""
    groups = list(trajectory_groups)
    ids: list[str] = []
    for g in groups:
        sid = _scenario_id(g)
        if sid is not None and sid not in ids:
            ids.append(sid)
    return TrajectoryBatchSummary(
        num_scenarios=len(groups),
        num_trajectories=sum(len(g.trajectories) + len(g.exceptions) for g in groups),
        num_groups_submitted=len(groups),
        num_groups_trainable=sum(1 for g in groups if _group_is_trainable(g)),
        scenario_ids=ids)


def build_data_metrics_from_summary(summary: TrajectoryBatchSummary, *,
                                    include_trainable_groups: bool) -> dict[str, float]:
    out = {"data/step_num_scenarios": float(summary.num_scenarios),
           "data/step_num_trajectories": float(summary.num_trajectories),
           "data/step_num_groups_submitted": float(summary.num_groups_submitted)}
    if include_trainable_groups:
        out["data/step_num_groups_trainable"] = float(summary.num_groups_trainable)
    return out


build_training_summary_metrics = build_data_metrics_from_summary


def trainer_metrics(summary: dict[str, float], kind: str) -> dict[str, float]:
    """A train call's `run_call` figures under the history's names (ART's where ART has one).

    `kind` is "rl" or "sft"; an RL call also reports ART's group counts from its tokenize figures.
    """
    out: dict[str, float] = {}
    for key, value in summary.items():
        if key in _DUPLICATES:
            continue
        if key in TRAINER_TO_ART:
            out[TRAINER_TO_ART[key]] = value
        else:
            # data/... (layout) and offpolicy/... (ART's section; train/offpolicy.py's mismatch) keep their names
            out[key if key.startswith(("data/", "offpolicy/")) else f"train/{key}"] = value
    out.setdefault(TRAIN_GRADIENT_STEPS_KEY, 0.0)
    out.setdefault("data/step_trainer_tokens", 0.0)
    out["data/step_trainable_assistant_tokens"] = out["data/step_trainer_tokens"]  # ART 0.5.23's name of the count
    if kind == "rl" and "data/groups" in summary:
        groups = summary["data/groups"]
        skipped = summary.get("data/groups_skipped_zero_advantage", 0.0) + summary.get("data/groups_skipped_empty",
                                                                                       0.0)
        out["data/step_num_scenarios"] = groups
        out["data/step_num_groups_submitted"] = groups
        out["data/step_num_groups_trainable"] = groups - skipped
        out["data/step_num_trajectories"] = summary.get("data/trajectories", 0.0) + summary.get(
            "data/rollout_exceptions", 0.0)
    return out
