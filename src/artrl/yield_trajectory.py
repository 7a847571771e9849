"""`yield_trajectory` / `capture_yielded_trajectory`: hand a trajectory out of code that returns something else.

ART's pair. Agent code keeps its own return value and, where it knows the episode
is done, calls `art.yield_trajectory(trajectory)`; a training loop runs that code
under `await art.capture_yielded_trajectory(agent(...))` and gets the trajectory.
The slot is a context variable, so concurrent captures (one per asyncio task) do
not see each other's trajectories. Outside a capture, `yield_trajectory` does
nothing, as in ART (the agent runs unchanged without training around it).
"""

from __future__ import annotations

import contextvars
from collections.abc import Coroutine
from typing import Any

from .trajectories.data import Trajectory


class YieldTrajectoryContext:
    """The slot one `capture_yielded_trajectory` call reads (the last trajectory yielded wins)."""

    def __init__(self) -> None:
        self.trajectory: Trajectory | None = None
        self._token: contextvars.Token[YieldTrajectoryContext | None] | None = None

    def __enter__(self) -> None:
        self._token = _CONTEXT.set(self)

    def __exit__(self, *exc_info: Any) -> None:
        if self._token is not None:
            _CONTEXT.reset(self._token)


_CONTEXT: contextvars.ContextVar[YieldTrajectoryContext | None] = contextvars.ContextVar(
    "artrl_yield_trajectory", default=None)


def yield_trajectory(trajectory: Trajectory) -> None:
    """Hand `trajectory` to the enclosing `capture_yielded_trajectory` (no effect outside one)."""
    context = _CONTEXT.get()
    if context is not None:
        context.trajectory = trajectory


async def capture_yielded_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run `coroutine` and return the last trajectory it passed to `yield_trajectory`.

    Raises RuntimeError("No trajectory yielded") when it passed none, as ART does.
    """
    with YieldTrajectoryContext():
        await coroutine
        trajectory = _CONTEXT.get().trajectory  # type: ignore[union-attr]
        if trajectory is None:
            raise RuntimeError("No trajectory yielded: the coroutine finished without calling "
                               "art.yield_trajectory(trajectory).")
        return trajectory
