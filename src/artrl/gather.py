"""Running rollouts concurrently: `gather_trajectory_groups` (ART's name and signature).

`TrajectoryGroup(rollout() for _ in range(8))` returns an awaitable (see
trajectories.py); this module awaits many of them at once, with an optional
concurrency limit, one tqdm bar over all rollouts (reward running mean and
exception count in its postfix), and exceptions collected per group. Nothing is
lost: each failed rollout's exception is kept in its group's `exceptions`, the
total is logged, and more than `max_exceptions` failures raise a `GatherError`
that lists them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from .errors import ArtrlError
from .trajectories import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


class GatherError(ArtrlError, RuntimeError):
    """Too many rollouts raised; the message lists them."""


@dataclass
class _GatherContext:
    pbar: tqdm | None = None
    semaphore: asyncio.Semaphore | None = None
    rewards: list[float] = field(default_factory=list)
    exceptions: int = 0

    def update(self, trajectory: Trajectory | None) -> None:
        if trajectory is not None:
            self.rewards.append(trajectory.reward)
        else:
            self.exceptions += 1
        if self.pbar is not None:
            self.pbar.update(1)
            postfix = {"reward": f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "-"}
            if self.exceptions:
                postfix["exceptions"] = self.exceptions
            self.pbar.set_postfix(postfix, refresh=False)


_CONTEXT: contextvars.ContextVar[_GatherContext | None] = contextvars.ContextVar("artrl_gather", default=None)


async def _run_one(item: Awaitable[Trajectory], ctx: _GatherContext | None) -> Trajectory:
    if ctx is not None and ctx.semaphore is not None:
        async with ctx.semaphore:
            return await item
    return await item


async def collect_group(items: list[Any], exceptions: list[Any]) -> TrajectoryGroup:
    """Await a group's rollouts; failures go to the group's `exceptions`."""
    ctx = _CONTEXT.get()
    results: list[Any] = []
    tasks = [asyncio.ensure_future(_run_one(i, ctx)) if isinstance(i, Awaitable) else i for i in items]
    for task in tasks:
        if not isinstance(task, asyncio.Future):
            results.append(task)
            continue
        try:
            t = await task
        except Exception as e:  # noqa: BLE001 - collected and reported, not swallowed
            log.debug("rollout failed", exc_info=True)
            results.append(e)
            if ctx is not None:
                ctx.update(None)
            continue
        if not isinstance(t, Trajectory):
            results.append(TypeError(f"rollout returned {type(t).__name__}, expected a Trajectory"))
            if ctx is not None:
                ctx.update(None)
            continue
        results.append(t)
        if ctx is not None:
            ctx.update(t)
    return TrajectoryGroup(results, exceptions=exceptions)


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
    after_each: Callable[[TrajectoryGroup], Awaitable[Any] | Any] | None = None,
) -> list[TrajectoryGroup]:
    """Await every group concurrently and return them in the order given.

    Args:
        groups: awaitables of `TrajectoryGroup` (e.g. `TrajectoryGroup(rollout() for _ in range(8))`).
        pbar_desc: description of the progress bar (None hides it).
        pbar_total_completion_tokens: accepted for ART compatibility; unused.
        max_exceptions: how many failed rollouts are tolerated: a count, or a
            fraction of all rollouts when below 1. Past it, `GatherError` is raised
            after all rollouts finished. Failures within the limit stay in each
            group's `exceptions` and are logged.
        max_concurrency: at most this many rollouts run at once (None: no limit).
        after_each: called with each finished group (may be async).
    """
    del pbar_total_completion_tokens
    awaitables = list(groups)
    ctx = _GatherContext(semaphore=asyncio.Semaphore(max_concurrency) if max_concurrency else None)
    token = _CONTEXT.set(ctx)
    try:
        # Rollout coroutines are created lazily by TrajectoryGroup's awaitable; count them as they start.
        ctx.pbar = tqdm(desc=pbar_desc, total=None, disable=pbar_desc is None, unit="rollout")
        tasks = [asyncio.ensure_future(_as_group(g)) for g in awaitables]
        done: list[TrajectoryGroup] = []
        for task in tasks:
            group = await task
            if after_each is not None:
                r = after_each(group)
                if isinstance(r, Awaitable):
                    await r
            done.append(group)
    finally:
        if ctx.pbar is not None:
            ctx.pbar.close()
        _CONTEXT.reset(token)
    n_rollouts = sum(len(g.trajectories) + len(g.exceptions) for g in done)
    failures = [(i, e) for i, g in enumerate(done) for e in g.exceptions]
    if failures:
        log.warning("%d of %d rollouts raised; first: group %d: %s", len(failures), n_rollouts, *failures[0])
        limit = max_exceptions * n_rollouts if 0 < max_exceptions < 1 else max_exceptions
        if len(failures) > limit:
            listing = "\n".join(f"  group {i}: {e}" for i, e in failures[:20])
            raise GatherError(
                f"{len(failures)} of {n_rollouts} rollouts raised (max_exceptions={max_exceptions}):\n{listing}\n"
                "Fix the rollout, or raise max_exceptions to train on the groups that succeeded."
            )
    return done


async def _as_group(g: Awaitable[TrajectoryGroup] | TrajectoryGroup) -> TrajectoryGroup:
    if isinstance(g, TrajectoryGroup):
        return g
    return await g
