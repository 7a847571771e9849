"""ART 0.5.23's capture API: `art.trajectory`, `art.trajectory_group`, `art.current_trajectory`, `art.no_capture`.

A rollout written for any agent framework becomes a trajectory without changing the agent:

    async def rollout(task):
        with art.Trajectory() as t:          # or: t = await art.trajectory(agent(task))
            await agent(task)                # any client, any of the four protocols
            t.reward = score(task)
        return t

    group = await art.trajectory_group(rollout(task) for _ in range(8))

Inside a scope, every successful request the agent makes to a model endpoint is captured whole
(a streamed one assembled) into `t.exchanges` (capture/core.py, capture/clients.py). Scopes nest: the
innermost open one captures, and a trajectory's scope may be opened again later.
`art.current_trajectory()` is the innermost open scope's trajectory (None outside one;
`require=True`: RuntimeError). Concurrent rollouts each capture their own (context variables).

`trajectory_group(items, ...)` (ART's semantics): `items` are trajectories, exceptions (kept as
the group's `exceptions`) and awaitables of trajectories, run concurrently (the same awaitable
object given twice runs once and fills both places) under `no_capture()`, so an enclosing scope
records nothing of them. Its trajectories keep the order of `items`. A rollout that raises an
`Exception` fails the call (the others are cancelled) unless `return_exceptions=True`, which
keeps the exception in the group instead; a `BaseException` that is not an `Exception` (e.g.
cancellation) always propagates. An awaitable that gives something other than a trajectory is a
TypeError.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Iterable
from typing import Any

from .capture import core as capture
from .capture.core import no_capture
from .data import MetadataValue, PydanticException, Trajectory, TrajectoryGroup

__all__ = ["current_trajectory", "no_capture", "trajectory", "trajectory_group"]


def current_trajectory(*, require: bool = False) -> Trajectory | None:
    """The trajectory of the innermost open capture scope in this context; None outside one (`require=True`:
    RuntimeError)."""
    scope = capture.current_scope()
    if scope is not None:
        return scope.trajectory
    if require:
        raise RuntimeError("No trajectory is active in this context: art.current_trajectory(require=True) must be "
                           "called inside `with art.Trajectory() as t:` or `await art.trajectory(...)`.")
    return None


async def trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run `coroutine` inside a new capture scope; return its trajectory (`metrics["duration"]` set).

    `coroutine` must be a coroutine object (not a Task or Future, which would run outside the scope).
    """
    if isinstance(coroutine, (asyncio.Task, asyncio.Future)) or not isinstance(coroutine, Coroutine):
        raise TypeError(f"art.trajectory(...) takes a coroutine object (e.g. agent(task)), got "
                        f"{type(coroutine).__name__}; a Task or Future would run outside the capture scope.")
    with Trajectory() as captured:
        await coroutine
    return captured


async def trajectory_group(
    trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]],
    *,
    exceptions: Iterable[BaseException | PydanticException] = (),
    metadata: dict[str, MetadataValue] | None = None,
    metrics: dict[str, float | int | bool] | None = None,
    logs: list[str] | None = None,
    return_exceptions: bool = False,
) -> TrajectoryGroup:
    """Await the rollouts among `trajectories` concurrently and build their group (module docstring)."""
    with no_capture():
        given = list(exceptions)
        for error in given:
            if isinstance(error, BaseException) and not isinstance(error, Exception):
                raise error
        results: list[Any] = []
        places: dict[asyncio.Future[Any], list[int]] = {}
        by_object: dict[int, asyncio.Future[Any]] = {}
        try:
            for item in trajectories:
                if isinstance(item, (Trajectory, BaseException)):
                    if isinstance(item, BaseException) and not isinstance(item, Exception):
                        raise item
                    results.append(item)
                    continue
                results.append(None)
                task = by_object.get(id(item))
                if task is None:
                    task = by_object[id(item)] = asyncio.ensure_future(item)
                    places[task] = []
                places[task].append(len(results) - 1)
            while places:
                done, _ = await asyncio.wait(places, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    indices = places.pop(task)
                    try:
                        result = task.result()
                    except asyncio.CancelledError:
                        raise
                    except Exception as error:  # noqa: BLE001 - kept in the group, as the caller asked
                        if not return_exceptions:
                            raise
                        result = error
                    if not isinstance(result, (Trajectory, BaseException)):
                        raise TypeError(f"an awaitable given to art.trajectory_group gave {type(result).__name__}; "
                                        "each must give a Trajectory (e.g. art.trajectory(agent(task))).")
                    if isinstance(result, BaseException) and not isinstance(result, Exception):
                        raise result
                    for i in indices:
                        results[i] = result
        except BaseException:
            for task in places:
                task.cancel()
            await asyncio.gather(*places, return_exceptions=True)
            raise
    return TrajectoryGroup([r for r in results if r is not None], exceptions=given, metadata=metadata,
                           metrics=metrics, logs=logs)
