"""Running rollouts concurrently: `gather_trajectory_groups`, `gather_trajectories` (ART's names and signatures).

`TrajectoryGroup(rollout() for _ in range(8))` returns an awaitable (trajectories/data.py);
`gather_trajectory_groups` awaits many of them at once under one `GatherContext`
(trajectories/gather_context.py): one tqdm bar over all rollouts with running means of the
reward and metrics, and an exception budget. As in ART:

* a failed rollout is kept in its group's `exceptions`; once more than
  `max_exceptions` rollouts failed (a count, or a fraction of all rollouts when
  below 1), the failing rollout's own exception is raised (with a note saying how
  many failed and what to change). We also cancel the rollouts still running.
* an awaitable that is not a `TrajectoryGroup(...)` of rollouts (e.g. your own
  `async def` building a group) that raises counts as one failure; within the
  budget its group is left out (logged);
* `after_each(group)` may return the group, another group, a list of groups (all
  kept) or None (the group is dropped).

What we add: `max_concurrency` (at most that many rollouts run at once), groups
that are already built may be passed as they are, `after_each` may be a plain
function, and an `after_each` result of another type is an error, not dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from .errors import ArtrlError
from .trajectories.gather_context import (GatherContext, cancel_and_wait, get_gather_context, record_metrics,
                             set_gather_context)
from .runtime.progress import progress_bar
from .trajectories.data import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)

# after_each(group) -> the group, a replacement, a list of groups, or None (or an awaitable of one of those)
AfterEach = Callable[[TrajectoryGroup], Any]


class GatherError(ArtrlError, TypeError):
    """`after_each` returned something that is not a group, a list of groups, or None."""


_warned: set[str] = set()


def warn_deprecated_completion_tokens(flag: bool) -> None:
    if flag and "pbar_total_completion_tokens" not in _warned:
        _warned.add("pbar_total_completion_tokens")
        log.warning("pbar_total_completion_tokens is deprecated in ART and has no effect here; the progress bar "
                    "shows the mean completion_tokens of sampled turns on its own.")


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup] | TrajectoryGroup],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
    max_metrics: int | None = None,
    after_each: AfterEach | None = None,
    max_concurrency: int | None = None,
) -> list[TrajectoryGroup]:
    """Await every group concurrently; returns them in the order given (after `after_each`).

    Args:
        groups: awaitables of `TrajectoryGroup` (e.g. `TrajectoryGroup(rollout() for _ in range(8))`).
        pbar_desc: description of the progress bar; None hides it (ART shows one without a description).
        pbar_total_completion_tokens: deprecated in ART; accepted with a notice.
        max_exceptions: failed rollouts tolerated: a count, or a fraction of all rollouts when
            below 1. One more raises that rollout's exception and cancels the rest.
        max_metrics: show at most this many running means in the progress bar.
        after_each: called with each finished group (may be async); returns the group, a
            replacement, a list of groups, or None to drop it.
        max_concurrency: at most this many rollouts run at once (None: no limit). Not in ART.
    """
    warn_deprecated_completion_tokens(pbar_total_completion_tokens)
    awaitables = list(groups)
    context = GatherContext(
        max_exceptions=max_exceptions,
        max_metrics=max_metrics,
        total=sum(_expected_rollouts(g) for g in awaitables),
        semaphore=asyncio.Semaphore(max_concurrency) if max_concurrency else None,
    )

    async def forward(g: Awaitable[TrajectoryGroup] | TrajectoryGroup) -> Any:
        group = await wrap_group_awaitable(g)
        if group is None or after_each is None:
            return group
        result = after_each(group)
        return await result if inspect.isawaitable(result) else result

    with set_gather_context(context):
        tasks = [asyncio.ensure_future(forward(g)) for g in awaitables]
        context.pbar = progress_bar(desc=pbar_desc, total=context.total, disable=pbar_desc is None)
        try:
            results = await asyncio.gather(*tasks)
        finally:
            await cancel_and_wait(tasks)
            context.pbar.close()
    out: list[TrajectoryGroup] = []
    for i, result in enumerate(results):
        if result is None:
            continue
        for group in result if isinstance(result, list) else [result]:
            if not isinstance(group, TrajectoryGroup):
                raise GatherError(f"group {i} came back as a {type(group).__name__}, not a TrajectoryGroup; a "
                                  "group awaitable must give a TrajectoryGroup, and after_each must return it, a "
                                  "replacement, a list of groups, or None to drop it.")
            out.append(group)
    if context.exceptions:
        log.warning("%d of %d rollouts raised (within max_exceptions=%s); they are kept in their groups' "
                    "`exceptions`", context.exceptions, context.total, max_exceptions)
    return out


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]] | Iterable[Awaitable[Iterable[Trajectory]]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
) -> list[Any]:
    """Await rollouts that each return a Trajectory (or an iterable of them); results in the order given.

    Within `max_exceptions`, a failed rollout's exception takes its place in the result;
    past it, that exception is raised and the rest are cancelled.
    """
    warn_deprecated_completion_tokens(pbar_total_completion_tokens)
    awaitables = list(trajectories)
    context = GatherContext(pbar=progress_bar(desc=pbar_desc, total=len(awaitables), disable=pbar_desc is None),
                            max_exceptions=max_exceptions,
                            total=len(awaitables))
    with set_gather_context(context):
        tasks = [asyncio.ensure_future(wrap_trajectories_awaitable(t)) for t in awaitables]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            await cancel_and_wait(tasks)
            context.pbar.close()


def _expected_rollouts(g: Any) -> int:
    if isinstance(g, TrajectoryGroup):
        return len(g)
    return getattr(g, "_num_trajectories", 1)


async def wrap_group_awaitable(awaitable: Awaitable[TrajectoryGroup] | TrajectoryGroup) -> TrajectoryGroup | None:
    """Await one group under the open gather context; a failing custom group counts as one failure.

    As in ART, an awaitable that gives a list or tuple of trajectories is reported and returned as it is.
    """
    context = get_gather_context()
    if isinstance(awaitable, TrajectoryGroup):  # already built: report its trajectories
        _report(context, awaitable)
        return awaitable
    if hasattr(awaitable, "_num_trajectories"):  # TrajectoryGroup(rollouts): reports each rollout itself
        return await awaitable
    try:
        group = await awaitable
        # ART's rule: anything iterable of trajectories is reported (some scripts gather tuples of them)
        if not isinstance(group, TrajectoryGroup) and not (
                isinstance(group, (list, tuple)) and all(isinstance(t, Trajectory) for t in group)):
            raise TypeError(f"a group awaitable returned {type(group).__name__}, expected a TrajectoryGroup")
    except Exception as e:  # noqa: BLE001 - counted against max_exceptions, raised past it
        if context.record_exception(e):
            raise
        log.warning("a group raised and is left out (counted against max_exceptions=%s): %s: %s",
                    context.max_exceptions, type(e).__name__, e)
        return None
    _report(context, group)
    return group


def _report(context: GatherContext, group: TrajectoryGroup) -> None:
    for trajectory in group:
        record_metrics(context, trajectory)
    context.update_pbar(n=len(group))


async def wrap_trajectories_awaitable(awaitable: Awaitable[Any]) -> Trajectory | list[Trajectory] | BaseException:
    context = get_gather_context()
    try:
        result = await awaitable
        trajectories = [result] if isinstance(result, Trajectory) else list(result)
        for t in trajectories:
            if not isinstance(t, Trajectory):
                raise TypeError(f"a rollout returned {type(t).__name__} among its results, expected Trajectory")
    except Exception as e:  # noqa: BLE001 - returned in place within max_exceptions, raised past it
        if context.record_exception(e):
            raise
        return e
    for t in trajectories:
        record_metrics(context, t)
    context.update_pbar(n=1)
    return result if isinstance(result, Trajectory) else trajectories
