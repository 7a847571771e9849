"""`iterate_dataset`: a list of scenarios as training steps, epoch after epoch (ART's, same order).

Each epoch visits every item once in an order shuffled by the epoch number (the same
order ART gives: `random.Random(epoch)`, without touching the global `random` state),
cut into batches of `groups_per_step` items (the last one may be smaller). Each batch
is a `DatasetBatch(items, step, epoch, epoch_step)`; `step` counts batches over all
epochs, so a loop resumed at `initial_step=model.get_step()` skips the steps done.

    for batch in iterate_dataset(scenarios, groups_per_step=4, num_epochs=2, initial_step=await model.get_step()):
        groups = await art.gather_trajectory_groups(... for scenario in batch.items)
        await model.train(groups)
"""

from __future__ import annotations

import math
import random
from collections.abc import Generator
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..runtime.progress import progress_bar


T = TypeVar("T")


@dataclass
class DatasetBatch(Generic[T]):
    """One training step's items and where it lies: global `step`, `epoch`, `epoch_step` (0-based)."""

    items: list[T]
    step: int
    epoch: int
    epoch_step: int


def iterate_dataset(
    dataset: list[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
) -> Generator[DatasetBatch[T], None, None]:
    """Yield the batches of `num_epochs` epochs over `dataset`, from `initial_step` on (a tqdm bar counts them)."""
    if groups_per_step < 1:
        raise ValueError(f"iterate_dataset(groups_per_step={groups_per_step}): a step needs at least one item.")
    size = len(dataset)
    if size == 0:
        return
    steps_per_epoch = math.ceil(size / groups_per_step)
    bar = progress_bar(initial=initial_step, total=steps_per_epoch * num_epochs, desc="Iterating dataset",
               unit="batch") if use_tqdm else None
    try:
        for epoch in range(num_epochs):
            order = list(range(size))
            random.Random(epoch).shuffle(order)
            for epoch_step, start in enumerate(range(0, size, groups_per_step)):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                yield DatasetBatch(items=[dataset[i] for i in order[start:start + groups_per_step]], step=step,
                                   epoch=epoch, epoch_step=epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
