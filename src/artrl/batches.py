"""`trajectory_group_batches`: rollouts keep running while finished groups are handed out in batches.

ART's async generator, same signature: at most `batch_size * max_concurrent_batches`
groups run at once; as soon as `batch_size` groups have finished they are yielded
(in the order they finished) while the others keep going, so a training step
can start on the first batch without waiting for the slowest rollout. The last,
possibly smaller, batch is yielded at the end; `skip_batches` leaves out the
first `batch_size * skip_batches` groups (resuming).

Each batch has its own progress bar and its own exception budget
(`max_batch_exceptions`, counted as in `gather_trajectory_groups`). ART 0.5.17
resets that budget to 0 after the first batch; we keep it for every batch.
Stopping the iteration early cancels the groups still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable

from .gather import warn_deprecated_completion_tokens, wrap_group_awaitable
from .trajectories.gather_context import GatherContext, cancel_and_wait, context_with
from .runtime.progress import progress_bar
from .trajectories.data import TrajectoryGroup


async def trajectory_group_batches(
    groups: Iterable[Awaitable[TrajectoryGroup]],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
    pbar_desc: str | None = "batches",
    pbar_total_completion_tokens: bool = False,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """Yield lists of `batch_size` finished groups while later groups keep running."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; a batch needs at least one group.")
    if max_concurrent_batches < 1:
        raise ValueError(f"max_concurrent_batches={max_concurrent_batches}; it must be at least 1.")
    warn_deprecated_completion_tokens(pbar_total_completion_tokens)
    unstarted = list(groups)
    for skipped in unstarted[:batch_size * skip_batches]:
        close = getattr(skipped, "close", None)  # never awaited: close its coroutines (no "never awaited" warning)
        if callable(close):
            close()
    unstarted = unstarted[batch_size * skip_batches:]
    unstarted.reverse()  # pop() from the end takes them in the order given
    pending: set[asyncio.Future[TrajectoryGroup | None]] = set()
    batch: list[TrajectoryGroup] = []
    context = GatherContext(max_exceptions=max_batch_exceptions, increment_pbar=False, total=batch_size)
    # The groups run as tasks in a context where this gather is open; the consumer's own
    # context is left alone between batches (it may run other rollouts, e.g. an evaluation).
    task_context = context_with(context)
    try:
        while unstarted or pending:
            if context.pbar is None:
                context.pbar = progress_bar(desc=pbar_desc, total=batch_size, disable=pbar_desc is None)
            while unstarted and len(pending) < batch_size * max_concurrent_batches:
                pending.add(asyncio.create_task(wrap_group_awaitable(unstarted.pop()), context=task_context))
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            context.pbar.update(len(done))
            failed = [task for task in done if task.exception() is not None]  # retrieves every failure
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
            batch.extend(group for task in done if (group := task.result()) is not None)
            if len(batch) >= batch_size:
                context.pbar.close()
                context.reset()
                yield batch[:batch_size]
                batch = batch[batch_size:]
        if batch:
            yield batch
    finally:
        await cancel_and_wait(pending)
        if context.pbar is not None:
            context.pbar.close()
