"""The train hooks a backend gives `Model.train` / `train_sft`, in artrl's protocol or in ART's.

A backend trains through two hooks, `_train_model(model, groups, config,
dev_config, verbose)` and `_train_sft(model, trajectories, config, dev_config,
verbose)`. Two protocols are accepted, told apart by what the call returns:

* **artrl's**: an awaitable of a `TrainResult` (`LocalBackend`'s hooks). The model
  writes one train row at `result.step` with `result.metrics`, and none (with a
  warning) when the step did not advance.
* **ART's** (0.5.x): an async iterator, usually an async generator, of metric
  dicts, one per optimizer step. They are aggregated as ART aggregates them
  (`average_metric_samples`: the mean of each key over the steps that report it;
  `data/step_num_gradient_steps` must be the same in every dict and is kept as
  it is), plus `time/step_backend_train_s` (ART 0.5.23) and `time/step_trainer_s`
  (0.5.18), the seconds the iteration took (RL: unless the backend reports it; SFT:
  always, as in ART). The row is written at the
  step the backend reports after training (`_get_step`), as ART does; an SFT
  call whose iterator yields nothing writes no row and returns None.

Either way the row goes through `Model.log`, so ART's automatic train-row metrics
(`time/step_wall_s` and `costs/gpu`, from a backend that offers
`supports_automatic_train_step_metrics` / `automatic_gpu_cost_per_hour_usd`) are
added there, in both protocols.

`LocalBackend.train` also runs ART's protocol when its `_train_model` is replaced
(on the instance or in a subclass) by an async generator function, as ART's
`LocalBackend.train` iterates its own hook: `backend_train_result` builds the
`LocalTrainResult` as ART's does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from .metrics_taxonomy import average_metric_samples, build_training_summary_metrics, summarize_trajectory_groups
from .trajectories.data import TrajectoryGroup
from .types import TrainResult

if TYPE_CHECKING:
    from .model import TrainableModel

log = logging.getLogger(__name__)

TRAINER_SECONDS_KEY = "time/step_trainer_s"  # ART 0.5.18's name of the train call's seconds
BACKEND_TRAIN_SECONDS_KEY = "time/step_backend_train_s"  # ART 0.5.23's


def is_metric_stream(produced: Any) -> bool:
    """True when a hook returned ART's per-optimizer-step metric stream (an async iterator)."""
    return hasattr(produced, "__aiter__")


async def collect_step_metrics(stream: AsyncIterator[dict[str, float]], hook: str) -> tuple[list[dict], float]:
    """Every metric dict the stream yields, and the seconds it took; a non-dict item is a TypeError naming it."""
    started = time.monotonic()
    samples: list[dict[str, float]] = []
    async for item in stream:
        if not isinstance(item, dict):
            raise TypeError(f"{hook} yielded a {type(item).__name__} (item {len(samples)}); ART's hook protocol "
                            "yields one dict of metrics per optimizer step, e.g. {'loss/train': 0.5}")
        samples.append(item)
    return samples, time.monotonic() - started


def aggregate_step_metrics(samples: list[dict[str, float]], seconds: float, kind: str) -> dict[str, float]:
    """ART's train-row aggregation of per-step metrics (`kind` "rl" keeps a reported trainer time), the time under
    ART 0.5.23's key (`time/step_backend_train_s`) and 0.5.18's (`time/step_trainer_s`)."""
    metrics = average_metric_samples(samples)
    for key in (BACKEND_TRAIN_SECONDS_KEY, TRAINER_SECONDS_KEY):
        if kind == "rl":
            metrics.setdefault(key, seconds)
        else:
            metrics[key] = seconds
    return metrics


def _close(produced: Any) -> None:
    close = getattr(produced, "close", None)  # a coroutine never awaited: no "never awaited" warning
    if callable(close):
        close()


async def train_through_hook(model: "TrainableModel", kind: str, data: list[Any], config: Any,
                             dev_config: dict[str, Any], verbose: bool, log_row: bool = True) -> TrainResult | None:
    """Run the backend's RL (`kind="rl"`, data = groups) or SFT hook in whichever protocol it speaks, write
    the train row (unless `log_row` is False: ART's `train_sft(log_metrics=False)`), and return the result (see
    the module docstring)."""
    backend = model.backend()
    hook_name = "_train_model" if kind == "rl" else "_train_sft"
    produced = getattr(backend, hook_name)(model, data, config, dev_config, verbose)
    groups = data if kind == "rl" else None
    if not is_metric_stream(produced):
        try:  # a coroutine has not started yet: the step before it is read first
            before = await model.get_step()
        except BaseException:
            _close(produced)
            raise
        result = await produced
        if log_row:
            await model._log_train_row(groups, result, before, kind)
        return result
    samples, seconds = await collect_step_metrics(produced, f"{type(backend).__name__}.{hook_name}")
    if kind == "sft" and not samples:
        log.warning("%s: %s.%s yielded no metrics, so no train row is written (as in ART)", model.name,
                    type(backend).__name__, hook_name)
        return None
    metrics = aggregate_step_metrics(samples, seconds, kind)
    step = await model.get_step()
    if log_row:
        await model._log(groups, "train", metrics, step, extra={"kind": kind})
    return TrainResult(step=step, metrics=metrics)


async def backend_train_result(backend: Any, model: "TrainableModel", groups: list[TrajectoryGroup], config: Any,
                               dev_config: dict[str, Any], verbose: bool, checkpoint_dir: Any) -> Any:
    """ART's `LocalBackend.train` over an ART-protocol `_train_model`: the aggregated metrics with the groups'
    data counts, the step the backend reports, and `checkpoint_dir(step)` when that directory exists."""
    from .types import LocalTrainResult

    hook = f"{type(backend).__name__}._train_model"
    samples, seconds = await collect_step_metrics(backend._train_model(model, groups, config, dev_config, verbose),
                                                  hook)
    metrics = aggregate_step_metrics(samples, seconds, "rl")
    summary = build_training_summary_metrics(summarize_trajectory_groups(groups), include_trainable_groups=True)
    metrics.update({k: v for k, v in summary.items() if k not in metrics})
    step = await backend._get_step(model)
    path = checkpoint_dir(step) if checkpoint_dir is not None else None
    return LocalTrainResult(step=step, metrics=metrics,
                            checkpoint_path=str(path) if path is not None and path.exists() else None)
