"""Which checkpoints a pipelined run keeps (ART 0.5.18's retention names and rule).

Every `checkpoint_retention_interval` steps the trainer lists the run's checkpoints,
takes out the protected ones (the current step, every step a rollout or an eval holds
a lease on, every step whose eval is scheduled), and asks the strategy which of the
remaining, *eligible* ones to keep; the others are deleted. A strategy therefore can
never delete a protected step, whatever it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, Field

from ..run import storage

CHECKPOINT_CREATED_AT_METRIC = "checkpoint/created_at_unix"
CHECKPOINT_EVAL_COMPLETED_METRIC = "checkpoint/eval_completed"
CHECKPOINT_SAVED_METRIC = "checkpoint/saved"


class CheckpointInfo(BaseModel):
    """One checkpoint eligible for deletion, with the metrics logged at its step (averaged per key)."""

    step: int
    path: str
    created_at: datetime
    is_eval_step: bool = False
    metrics: dict[str, float] = Field(default_factory=dict)


class CheckpointRetentionContext(BaseModel):
    """What a strategy sees: the current step and the eligible checkpoints only."""

    current_step: int
    checkpoints: list[CheckpointInfo] = Field(default_factory=list)


CheckpointRetentionStrategy = Callable[[CheckpointRetentionContext], Iterable[int]]
"""Returns the eligible steps to keep; every other eligible step is deleted."""


def keep_recent_and_top(*, recent: int = 5, top: int = 2, metric: str = "val/reward") -> CheckpointRetentionStrategy:
    """Keep the `recent` newest eligible checkpoints and the `top` best by `metric` (ties: the later step)."""
    if recent < 0:
        raise ValueError(f"keep_recent_and_top(recent={recent}): recent must be >= 0")
    if top < 0:
        raise ValueError(f"keep_recent_and_top(top={top}): top must be >= 0")

    def strategy(context: CheckpointRetentionContext) -> set[int]:
        by_step = sorted(context.checkpoints, key=lambda c: c.step)
        keep = {c.step for c in by_step[len(by_step) - recent:]} if recent else set()
        scored = sorted((c for c in by_step if metric in c.metrics), key=lambda c: (c.metrics[metric], c.step),
                        reverse=True)
        keep.update(c.step for c in scored[:top])
        return keep

    return strategy


def steps_to_delete(context: CheckpointRetentionContext, strategy: CheckpointRetentionStrategy) -> set[int]:
    """The eligible steps the strategy does not keep (what it returns outside the eligible set is ignored)."""
    eligible = {c.step for c in context.checkpoints}
    return eligible - (set(strategy(context)) & eligible)


def metrics_by_step(history: Path) -> dict[int, dict[str, float]]:
    """Each step's numeric history values, averaged per key (what strategies rank checkpoints by)."""
    values: dict[int, dict[str, list[float]]] = {}
    for row in storage.read_jsonl(history) if history.exists() else []:
        step = row.get("step")
        if not isinstance(step, int):
            continue
        for key, value in row.items():
            if key not in ("step", "recorded_at") and isinstance(value, (int, float)) and not isinstance(value, bool):
                values.setdefault(step, {}).setdefault(key, []).append(float(value))
    return {step: {k: sum(v) / len(v) for k, v in d.items()} for step, d in values.items()}


def checkpoint_infos(run: Path, completed_eval_steps: set[int]) -> list[CheckpointInfo]:
    """Every complete checkpoint of the run directory with its step's logged metrics, oldest first."""
    metrics = metrics_by_step(run / storage.HISTORY_FILE)
    infos = []
    for step in storage.list_checkpoints(run):
        path = storage.checkpoint_dir(run, step)
        m = metrics.get(step, {})
        created = m.get(CHECKPOINT_CREATED_AT_METRIC, path.stat().st_ctime)
        is_eval = (step in completed_eval_steps or m.get(CHECKPOINT_EVAL_COMPLETED_METRIC, 0) > 0
                   or any(k.startswith(("val/", "test/")) for k in m))
        infos.append(CheckpointInfo(step=step, path=str(path), created_at=datetime.fromtimestamp(created, timezone.utc),
                                    is_eval_step=is_eval, metrics=m))
    return infos
