"""Adapter leases: which checkpoint a rollout samples from, and which checkpoints are in use.

A pipelined run (pipeline_trainer/) starts a rollout on policy version `v` and must
sample every turn of it from `v`, while the trainer already produces `v + 1`. Two
small pieces do that, as ART 0.5.18's `art/local/adapter_leases.py` does:

* `pin_inference_step(model_name, step)`: inside it, in this asyncio context (a
  contextvar, so concurrent rollouts each keep their own), `model.get_inference_name()`
  answers `name@step` instead of `name` (the live weights). The checkpoint of every
  step is on disk (local/session.py writes one per step), so the server can always
  load `name@step`.
* `LeaseRegistry`: a reference count of the steps leased now. Whatever frees adapters
  or deletes checkpoints asks `active_steps()` first and keeps those.

Both are plain asyncio/contextvars code, tested without a backend.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar

_pinned_steps: ContextVar[dict[str, int]] = ContextVar("artrl_pinned_inference_steps", default={})


def pinned_inference_step(model_name: str) -> int | None:
    """The step pinned for `model_name` in the current context, or None."""
    return _pinned_steps.get().get(model_name)


@contextmanager
def _pinned(model_name: str, step: int) -> Iterator[None]:
    steps = dict(_pinned_steps.get())  # a copy: the outer context keeps its own mapping
    steps[model_name] = step
    token = _pinned_steps.set(steps)
    try:
        yield
    finally:
        _pinned_steps.reset(token)


@asynccontextmanager
async def pin_inference_step(model_name: str, step: int) -> AsyncIterator[None]:
    """Inside: `get_inference_name()` of `model_name` names checkpoint `step` (this context only)."""
    with _pinned(model_name, step):
        yield


class LeaseRegistry:
    """Reference counts of leased steps (one registry per model).

    `async with registry.hold(step):` counts the step as in use until the block ends, however it
    ends (exception or cancellation included). Synchronous bookkeeping: there is nothing to wait on.
    """

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()

    @asynccontextmanager
    async def hold(self, step: int) -> AsyncIterator[None]:
        self.acquire(step)
        try:
            yield
        finally:
            self.release(step)

    def acquire(self, step: int) -> None:
        self._counts[step] += 1

    def release(self, step: int) -> None:
        if self._counts[step] <= 0:
            raise RuntimeError(f"lease of step {step} released more often than acquired")
        self._counts[step] -= 1
        if self._counts[step] == 0:
            del self._counts[step]

    def active_steps(self) -> set[int]:
        """Steps held by at least one lease now."""
        return set(self._counts)

    def count(self, step: int) -> int:
        return self._counts.get(step, 0)
