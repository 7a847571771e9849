"""Supervised fine-tuning from data: ART's `art.utils.sft` helpers, same signatures and numbers.

* `create_lr_schedule(total_steps, peak_lr, method, warmup_steps, min_lr)`: one learning
  rate per optimizer step: a linear warm-up from `min_lr` (its first step already above
  it), then constant, linear or cosine decay that reaches `min_lr` on the last step.
* `iterate_file(path, epochs, ...)`: trajectories streamed from a JSONL file (one
  `{"messages": [...], "tools": [...]}` object a line) with a bounded shuffle buffer.
* `create_sft_dataset_iterator(trajectories, ...)`: cuts a dataset into chunks of
  `chunk_size` batches, each with its slice of the whole run's schedule, so each
  `model.train_sft(chunk.trajectories, chunk.config)` call reports its own metrics
  while warm-up and decay span the run.
* `train_sft_from_file(model, path, ...)`: all of the above in one call.

A line that is not a JSON object with a `messages` list is refused with its line
number (ART would fail later or train on an empty conversation).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ..errors import TrajectoryError
from ..runtime.progress import progress_bar
from ..trajectories.data import Trajectory
from ..types import TrainSFTConfig

if TYPE_CHECKING:
    from ..model import TrainableModel

log = logging.getLogger(__name__)

Schedule = Literal["cosine", "linear", "constant"]
JSONL_SUFFIX = ".jsonl"


class SFTChunk(NamedTuple):
    """One `train_sft` call's worth of data: its trajectories, config (with its learning rates) and position."""

    trajectories: list[Trajectory]
    config: TrainSFTConfig
    step: int
    epoch: int
    epoch_step: int


def _check_jsonl(file_path: str) -> None:
    if not file_path.endswith(JSONL_SUFFIX):
        raise ValueError(f"Only JSONL files are supported. Got: {file_path}")


def _parse_line(line: str, file_path: str, line_number: int) -> Trajectory:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise TrajectoryError(f"{file_path}:{line_number} is not valid JSON ({e.msg}); each line must be one "
                              'object like {"messages": [...], "tools": [...]}.') from e
    if not isinstance(data, dict) or not isinstance(data.get("messages", []), list):
        raise TrajectoryError(f"{file_path}:{line_number} must be a JSON object with a 'messages' list, "
                              f"got {line.strip()[:120]!r}.")
    return Trajectory(messages_and_choices=data.get("messages", []), tools=data.get("tools"))


def get_file_row_count(file_path: str) -> int:
    """The number of non-empty lines of a JSONL file."""
    _check_jsonl(file_path)
    with open(file_path) as f:
        return sum(1 for line in f if line.strip())


def create_lr_schedule(
    total_steps: int,
    peak_lr: float,
    method: Schedule = "linear",
    warmup_steps: int = 0,
    min_lr: float = 0.0,
) -> list[float]:
    """One learning rate per step: warm up over `warmup_steps`, then decay by `method` to `min_lr`."""
    if method not in ("cosine", "linear", "constant"):
        raise ValueError(f"Unknown method: {method}. Choose from: cosine, linear, constant")
    if total_steps <= 0:
        return []
    decay_steps = total_steps - warmup_steps
    rates = []
    for step in range(total_steps):
        if step < warmup_steps:
            rates.append(min_lr + (peak_lr - min_lr) * (step + 1) / warmup_steps)
            continue
        progress = (step - warmup_steps) / (decay_steps - 1) if decay_steps > 1 else 0.0  # 0 -> 1
        if method == "cosine":
            rates.append(min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))
        elif method == "linear":
            rates.append(peak_lr - (peak_lr - min_lr) * progress)
        else:
            rates.append(peak_lr)
    return rates


def create_sft_dataset_iterator(
    trajectories: list[Trajectory],
    chunk_size: int = 10,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 2e-4,
    schedule_type: Schedule = "linear",
    warmup_ratio: float = 0.1,
    shuffle: bool = True,
    seed: int = 42,
    initial_step: int = 0,
    show_progress: bool = True,
) -> Generator[SFTChunk, None, None]:
    """Yield `SFTChunk`s of `chunk_size` batches of `batch_size` trajectories, epoch after epoch.

    Epoch `e` is shuffled with `random.Random(seed + e)`. `initial_step` (in batches)
    skips the chunks already trained. The learning rates of all chunks, concatenated,
    are `create_lr_schedule` over the whole run.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    size = len(trajectories)
    if size == 0:
        return
    batches_per_epoch = math.ceil(size / batch_size)
    total_batches = batches_per_epoch * epochs
    schedule = create_lr_schedule(total_batches, peak_lr, schedule_type, int(total_batches * warmup_ratio))
    per_chunk = batch_size * chunk_size
    chunks_per_epoch = math.ceil(size / per_chunk)
    first_chunk = initial_step // chunk_size
    bar = progress_bar(initial=initial_step, total=total_batches, desc="SFT Training",
                       unit="step") if show_progress else None
    try:
        for epoch in range(epochs):
            order = list(trajectories)
            if shuffle:
                random.Random(seed + epoch).shuffle(order)
            for k in range(chunks_per_epoch):
                if epoch * chunks_per_epoch + k < first_chunk:
                    continue
                start = k * per_chunk
                chunk = order[start:start + per_chunk]
                n_batches = math.ceil(len(chunk) / batch_size)
                epoch_step = start // batch_size
                step = epoch * batches_per_epoch + epoch_step
                config = TrainSFTConfig(learning_rate=schedule[step:step + n_batches], batch_size=batch_size)
                yield SFTChunk(trajectories=chunk, config=config, step=step, epoch=epoch, epoch_step=epoch_step)
                if bar is not None:
                    bar.update(n_batches)
    finally:
        if bar is not None:
            bar.close()


def iterate_file(
    file_path: str,
    epochs: int = 1,
    shuffle_buffer_size: int = 10000,
    seed: int = 42,
    initial_skip: int = 0,
) -> Generator[Trajectory, None, None]:
    """Stream the file's trajectories `epochs` times, shuffled through a buffer of `shuffle_buffer_size`.

    Epoch `e` draws with `random.Random(seed + e)`: once the buffer is full, a random
    buffered trajectory is yielded for each line read; the rest are shuffled and
    yielded at the end of the file. The first `initial_skip` trajectories are skipped.
    """
    _check_jsonl(file_path)
    if shuffle_buffer_size < 1:
        raise ValueError(f"shuffle_buffer_size must be >= 1, got {shuffle_buffer_size}")
    skipped = 0

    def emit(items: Iterable[Trajectory]) -> Generator[Trajectory, None, None]:
        nonlocal skipped
        for t in items:
            if skipped < initial_skip:
                skipped += 1
            else:
                yield t

    for epoch in range(epochs):
        rng = random.Random(seed + epoch)
        buffer: list[Trajectory] = []
        with open(file_path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                buffer.append(_parse_line(line, file_path, number))
                if len(buffer) >= shuffle_buffer_size:
                    yield from emit([buffer.pop(rng.randint(0, len(buffer) - 1))])
        rng.shuffle(buffer)
        yield from emit(buffer)


async def train_sft_from_file(
    model: "TrainableModel",
    file_path: str,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 2e-4,
    schedule_type: Schedule = "linear",
    warmup_ratio: float = 0.1,
    initial_step: int = 0,
    final_step: int | None = None,
    _config: Any = None,
    verbose: bool = False,
    shuffle_buffer_size: int = 10000,
    log_metrics: bool = True,
    assistant_turns: Literal["all", "last"] = "all",
) -> None:
    """Fine-tune `model` on a JSONL file in one `model.train_sft` call, streaming the file.

    Batches `initial_step` to `final_step` (exclusive; None: to the end) of the whole
    run's schedule are trained; the file is read lazily, never all at once.
    `log_metrics` and `assistant_turns` (ART 0.5.23) go to `model.train_sft` and its TrainSFTConfig.
    """
    rows = get_file_row_count(file_path)
    say = log.info if verbose else log.debug
    say("%s has %d rows", file_path, rows)
    if rows == 0:
        log.warning("%s has no trajectories; nothing to train", file_path)
        return
    total = rows * epochs
    skip = initial_step * batch_size
    if skip >= total:
        log.warning("initial_step=%d skips all %d trajectories of %s; nothing to train", initial_step, total,
                    file_path)
        return
    total_batches = math.ceil(total / batch_size)
    if final_step is not None and final_step > total_batches:
        final_step = total_batches
    schedule = create_lr_schedule(total_batches, peak_lr, schedule_type, int(total_batches * warmup_ratio))
    rates = schedule[initial_step:final_step]
    say("training %d trajectories: %d batches of %d, %s schedule, peak_lr %g", len(rates) * batch_size,
        len(rates), batch_size, schedule_type, peak_lr)
    trajectories = itertools.islice(
        iterate_file(file_path, epochs=epochs, shuffle_buffer_size=shuffle_buffer_size, initial_skip=skip),
        len(rates) * batch_size)
    config = TrainSFTConfig(learning_rate=rates, batch_size=batch_size, assistant_turns=assistant_turns)
    await model.train_sft(trajectories, config, _config=_config, verbose=verbose, log_metrics=log_metrics)
