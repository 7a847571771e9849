"""A model's history: `history.jsonl` rows, Parquet trajectory logs, and the trackers that mirror them.

`Model.log` (and `model.train`, which logs once per step) write here; no
backend is needed, so a prompted model or a model not yet registered logs the
same way. Everything lands in the run directory (`storage.py` has the layout):

    <base_path>/<project>/models/<run_name>/   (`name` for a model without a run_name)
        history.jsonl                       one row per log call
        trajectories/<split>/NNNN.parquet   the logged groups of that split and step
        state.json                          running totals of the metrics builder

A row is ART's (0.5.x): `step`, `training_step`, `recorded_at`,
`time/wall_clock_sec`, then the split's averages (`val/reward`,
`val/exception_rate`, `val/reward_std_dev` = mean within-group std,
`val/<trajectory metric>`, `val/group_<group metric>`), ART's `data/step_*`
counts with their `data/cum/*` totals, and any metrics passed in (a key in
one of ART's sections, e.g. `loss/train`, keeps its name; others get the split
prefix). Ours, beside ART's: `split` (the split's name), `kind` ("rl"/"sft"
on the row a train call writes) and `<split>/exceptions` (the count).

Simplifications against ART: rows are appended with one fsynced write (a torn
last line is skipped on read, `storage.read_jsonl`); logging the same split
twice at one step adds the second call's groups to that step's Parquet file
instead of replacing it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..metrics import MetricsBuilder, is_builder_managed_metric
from ..metrics_taxonomy import build_data_metrics_from_summary, summarize_trajectory_groups
from ..trajectories.data import Trajectory, TrajectoryGroup, revalidate
from . import storage

log = logging.getLogger(__name__)

# ART 0.5.23's sections (art/model.py), and "reward"
METRIC_SECTIONS = frozenset({"reward", "loss", "objective", "offpolicy", "pipeline", "pipeline_settings", "queue",
                             "sample_efficiency", "throughput", "costs", "discarded", "time", "data", "vllm"})
METRIC_SPLITS = frozenset({"train", "val", "test"})
BUILDER_STATE_KEY = "_metrics_builder_state"
ROW_KEYS = ("step", "split", "kind", "training_step", "recorded_at", "time/wall_clock_sec")
"""Keys of a history row that are not metrics."""


# --------------------------------------------------------------------------- what is logged


def normalize_trajectory_groups(trajectories: Iterable[Any] | None) -> list[TrajectoryGroup]:
    """Groups as given, or loose trajectories (and exceptions, counted) as one group.

    Any iterable is read once, so a generator logs what it yields.
    """
    if trajectories is None:
        return []
    if isinstance(trajectories, (TrajectoryGroup, Trajectory)):
        trajectories = [trajectories]
    items = list(trajectories)
    if not items:
        return []
    if all(isinstance(i, TrajectoryGroup) for i in items):
        return items
    if all(isinstance(i, (Trajectory, BaseException)) for i in items):
        return [TrajectoryGroup(items)]
    bad = next((i for i, x in enumerate(items) if not isinstance(x, (Trajectory, BaseException, TrajectoryGroup))),
               None)
    if bad is not None:
        raise TypeError(f"model.log: item {bad} is a {type(items[bad]).__name__}; pass TrajectoryGroup objects, or "
                        "Trajectory objects (exceptions allowed among them)")
    raise TypeError("model.log got a mix of TrajectoryGroup and Trajectory objects; pass groups, or trajectories "
                    "(which are logged as one group), not both")


def check_loggable(groups: list[TrajectoryGroup], metrics: dict[str, Any]) -> None:
    """Refuse what cannot be logged before anything is written (names the group and trajectory)."""
    for gi, g in enumerate(groups):
        for ti, t in enumerate(g.trajectories):
            revalidate(t, f"group {gi}, trajectory {ti}")
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"model.log metrics[{k!r}] is {v!r:.80}; logged metrics must be numbers.")


def mean_group_std(groups: list[TrajectoryGroup]) -> float:
    """ART's `reward_std_dev`: the population std of rewards within each group, averaged over groups of 2+."""
    stds = []
    for g in groups:
        rewards = [t.reward for t in g.trajectories]
        if len(rewards) > 1:
            mean = sum(rewards) / len(rewards)
            stds.append(math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)))
    return sum(stds) / len(stds) if stds else 0.0


def prefix_metrics(metrics: dict[str, float], split: str) -> dict[str, float]:
    """ART's routing: keys in a known section or split keep their name; the rest get `<split>/`."""
    out = {}
    for key, value in metrics.items():
        head = key.split("/", 1)[0]
        keep = split in METRIC_SPLITS and "/" in key and (head in METRIC_SECTIONS or head in METRIC_SPLITS)
        out[key if keep else f"{split}/{key}"] = value
    return out


def finite_values(d: dict[str, Any]) -> dict[str, float]:
    """`d`'s finite numbers (a history row keeps no NaN, inf or non-number among its metrics)."""
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and math.isfinite(v)}


# --------------------------------------------------------------------------- the writer


class RunHistory:
    """Writes one model's history rows and trajectory logs, and feeds its trackers.

    One per model and run directory (Model keeps it); it holds the metrics builder
    (running totals survive restarts through state.json) and the wall clock of the run.
    """

    def __init__(self, run: Path, *, trackers: Any = None) -> None:
        self.run = Path(run)
        self.started = time.time()
        self.builder = MetricsBuilder(cost_context="train")
        self.trackers = trackers
        self._state_loaded = False
        self._last_train_step: int | None = None
        self._last_train_log = time.monotonic()
        self._write_lock = threading.Lock()  # one writer at a time: a step's Parquet file is read, then rewritten

    # builder views and state ------------------------------------------------
    def builder_for(self, split: str) -> MetricsBuilder:
        self.load_state()
        context = "train" if split == "train" else "eval" if split in ("val", "test") else split
        return self.builder.for_cost_context(context, buffer_scope=context)

    def load_state(self) -> None:
        if self._state_loaded:
            return
        self._state_loaded = True
        state = storage.read_state(self.run) or {}
        if isinstance(state.get(BUILDER_STATE_KEY), dict):
            self.builder.load_state_dict(state[BUILDER_STATE_KEY])

    def _save_state(self) -> None:
        storage.merge_state(self.run, {BUILDER_STATE_KEY: self.builder.state_dict()})

    def _route(self, metrics: dict[str, float], split: str) -> dict[str, float]:
        """Send builder-managed metrics (costs, data/step_*, time/step_*) to the builder; return the rest."""
        builder = self.builder_for(split)
        rest: dict[str, float] = {}
        for key, value in metrics.items():
            if key.startswith("costs/"):
                builder.add_cost(key[len("costs/"):], float(value))
            elif key.startswith("costs_"):
                raise ConfigError(f"metric {key!r}: legacy cost keys are not supported; log explicit cost keys "
                                  "like 'costs/train/prefill' or 'costs/eval/judge/ruler'")
            elif is_builder_managed_metric(key):
                builder.add_metric(key, float(value))
            else:
                rest[key] = float(value)
        return rest

    def _automatic(self, backend: Any, model: Any, split: str, step: int, given: set[str]) -> dict[str, float]:
        """ART's automatic train-row metrics (`time/step_wall_s`, `costs/gpu`) where the backend offers them."""
        supports = getattr(backend, "supports_automatic_train_step_metrics", None)
        if split != "train" or not callable(supports) or not supports() or self._last_train_step == step:
            return {}
        now = time.monotonic()
        wall, self._last_train_log, self._last_train_step = max(0.0, now - self._last_train_log), now, step
        out = {} if "time/step_wall_s" in given else {"time/step_wall_s": wall}
        price = getattr(backend, "automatic_gpu_cost_per_hour_usd", None)
        rate = price(model) if callable(price) and model is not None and "costs/gpu" not in given else None
        if rate is not None:
            out["costs/gpu"] = wall * float(rate) / 3600.0
        return out

    # logging ------------------------------------------------------------------
    async def log(self, groups: list[TrajectoryGroup] | None, split: str, metrics: dict[str, float] | None,
                  step: int, *, extra: dict[str, Any] | None = None, backend: Any = None,
                  model: Any = None, validated: bool = False) -> dict[str, Any]:
        """Write the step's trajectory log (if any groups) and one history row; returns the row.

        `validated`: the groups' trajectories were checked already in this call (a train call's tokenizer
        checks each one before training), so they are not checked again."""
        metrics = dict(metrics or {})
        check_loggable([] if validated else groups or [], metrics)
        automatic = self._automatic(backend, model, split, step, set(metrics))
        if automatic:
            self._route(automatic, split)
        averages: dict[str, float] = {}
        if groups is not None:
            averages = self._group_averages(groups, split, set(metrics))
            # file writes run in a worker thread, so rollouts sharing the event loop are not held up
            await asyncio.to_thread(self.write_trajectories, groups, split, step)
        averages.update(self._route(metrics, split))
        flushed = await self.builder_for(split).flush()
        merged = {**averages, **flushed}
        if not merged and groups is None:
            return {}
        row = await asyncio.to_thread(self._write_row_and_state, merged, split, step, extra)
        if self.trackers is not None:  # fed on the caller's thread, one row after another, in order
            self.trackers.log(row, step)
        return row

    def _write_row_and_state(self, metrics: dict[str, float], split: str, step: int,
                             extra: dict[str, Any] | None) -> dict[str, Any]:
        row = self.write_row(metrics, split, step, extra)
        with self._write_lock:
            self._save_state()
        return row

    def _group_averages(self, groups: list[TrajectoryGroup], split: str, given: set[str]) -> dict[str, float]:
        if split in METRIC_SPLITS:
            summary = summarize_trajectory_groups(groups)
            builder = self.builder_for(split)
            for key, value in build_data_metrics_from_summary(
                    summary, include_trainable_groups=split == "train").items():
                if key not in given:
                    builder.add_metric(key, value)
            if summary.scenario_ids:
                builder.add_data(scenario_ids=summary.scenario_ids)
        values: dict[str, list[float]] = {"reward": [], "exception_rate": []}
        group_values: dict[str, list[float]] = {}
        for g in groups:
            group_metrics = self._route(dict(getattr(g, "metrics", None) or {}), split)
            if g.trajectories:
                for k, v in group_metrics.items():
                    group_values.setdefault(k, []).append(v)
            values["exception_rate"] += [0.0] * len(g.trajectories) + [1.0] * len(g.exceptions)
            for t in g.trajectories:
                values["reward"].append(float(t.reward))
                for k, v in self._route({k: float(v) for k, v in t.metrics.items()}, split).items():
                    values.setdefault(k, []).append(v)
        out = {k: sum(v) / len(v) for k, v in values.items() if v}
        out.update({f"group_{k}": sum(v) / len(v) for k, v in group_values.items() if v})
        out["reward_std_dev"] = mean_group_std(groups)
        out["exceptions"] = float(sum(len(g.exceptions) for g in groups))
        return out

    def write_trajectories(self, groups: list[TrajectoryGroup], split: str, step: int) -> Path | None:
        """Add the groups to `trajectories/<split>/NNNN.parquet` (atomically rewritten)."""
        from .trajectory_logs import append_trajectory_groups_parquet

        path = storage.trajectory_log_path(self.run, split, step)
        with self._write_lock:
            append_trajectory_groups_parquet(groups, path)
        return path

    def write_row(self, metrics: dict[str, float], split: str, step: int,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Append one history row (ART's keys, then ours)."""
        row: dict[str, Any] = prefix_metrics(metrics, split)
        row["training_step"] = step
        row["time/wall_clock_sec"] = time.time() - self.started
        row = finite_values(row)
        row.update({"step": step, "split": split, "recorded_at": datetime.datetime.now().isoformat()})
        row.update(extra or {})
        storage.append_jsonl(self.run / storage.HISTORY_FILE, storage.json_safe(row))
        return row


def restore_train_row(run: Path, record: dict[str, Any] | None) -> bool:
    """Re-append a checkpoint's own train row when history.jsonl lacks a train row for its step.

    A train row is appended after its checkpoint is written; a crash in between would lose
    it, so the checkpoint carries the trainer's part of the row. Returns whether it appended.
    """
    if not record:
        return False
    path = run / storage.HISTORY_FILE
    have = any(r.get("step") == record.get("step") and r.get("split") == "train" and "kind" in r
               for r in storage.read_jsonl(path))
    if have:
        return False
    storage.append_jsonl(path, record)
    log.warning("history.jsonl lacked the train row of step %s (a crash after the checkpoint was written); "
                "restored the trainer's metrics from the checkpoint", record.get("step"))
    return True


def best_logged_step(run: Path, metric: str, steps: Iterable[int] | None = None) -> int | None:
    """The step whose history rows have the highest mean of `metric` (ART's rule), among `steps` if given.

    Ties go to the later step; None when no row has a finite value of the metric.
    """
    allowed = set(steps) if steps is not None else None
    logged: dict[int, list[float]] = {}
    for rec in storage.read_jsonl(run / storage.HISTORY_FILE):
        value, step = rec.get(metric), rec.get("step")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and isinstance(step, int) and (allowed is None or step in allowed):
            logged.setdefault(step, []).append(float(value))
    if not logged:
        return None
    means = {s: sum(vs) / len(vs) for s, vs in logged.items()}
    return max(means, key=lambda s: (means[s], s))
