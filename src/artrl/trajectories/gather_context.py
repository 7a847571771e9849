"""What rollouts report into while they are gathered: progress, running metrics, the exception budget.

`gather_trajectory_groups`, `gather_trajectories` and `trajectory_group_batches` each
open a `GatherContext`; a `TrajectoryGroup` awaited inside one reports every finished
rollout to it (ART's `art.gather.GatherContext`, same fields and rules):

* the progress bar advances by one per rollout and shows the running mean of
  `reward`, of every trajectory metric and the count of `exceptions`
  (at most `max_metrics` of them);
* a rollout that raised is counted; once the count exceeds `max_exceptions`
  (a number, or a fraction of all rollouts when below 1) the rollout's own
  exception is raised, with a note saying how many failed and what to change.

What we add: `semaphore` (the `max_concurrency` limit of `gather_trajectory_groups`), and
a fresh context for a group awaited outside any gather (ART shares one module-wide
context whose sums never reset); there, as in ART, the first failed rollout raises.

This module sits below `trajectory.py` (it knows trajectories only by their fields),
so `trajectories -> gather_context` and `gather -> trajectories` point one way.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion import Choice

from ..runtime.progress import ProgressBar
from .exchanges import exchange_completion_tokens


@dataclass
class GatherContext:
    """Progress bar, metric sums and exception budget shared by the rollouts of one gather."""

    pbar: ProgressBar | None = None
    metric_sums: Counter[str] = field(default_factory=Counter)
    metric_divisors: Counter[str] = field(default_factory=Counter)
    max_metrics: int | None = None
    max_exceptions: int | float = 0
    increment_pbar: bool = True
    total: int | None = None  # rollouts expected: the base of a fractional max_exceptions
    semaphore: asyncio.Semaphore | None = None

    def update_pbar(self, n: int) -> None:
        """Advance the bar by `n` rollouts and show the running means (reward, metrics, exceptions)."""
        if self.pbar is None:
            return
        names = list(self.metric_sums)
        if self.max_metrics is not None:
            names = names[: self.max_metrics]
        postfix = {name: self.metric_sums[name] / max(1, self.metric_divisors[name]) for name in names}
        if "completion_tokens" in postfix:  # last, as in ART
            postfix["completion_tokens"] = postfix.pop("completion_tokens")
        # the redraw is the bar's own (at most every `mininterval`, progress.py): ART's set_postfix redraws
        # on every rollout, which floods a log
        self.pbar.set_postfix(postfix, refresh=False)
        self.pbar.update(n if self.increment_pbar else 0)

    @property
    def exceptions(self) -> int:
        return int(self.metric_sums["exceptions"])

    def too_many_exceptions(self) -> bool:
        """True once the failed rollouts exceed `max_exceptions` (a count, or a fraction of `total` below 1)."""
        total = self.total if self.total is not None else (self.pbar.total if self.pbar is not None else None)
        if 0 < self.max_exceptions < 1 and total:
            if self.exceptions / total <= self.max_exceptions:
                return False
        return self.exceptions > self.max_exceptions

    def record_exception(self, error: BaseException) -> bool:
        """Count a failed rollout; returns True (and adds a note to `error`) when the budget is exceeded."""
        self.metric_sums["exceptions"] += 1
        self.update_pbar(n=0)
        if not self.too_many_exceptions():
            return False
        of = f" of {self.total}" if self.total else ""
        error.add_note(
            f"{self.exceptions}{of} rollouts raised, more than max_exceptions={self.max_exceptions} allows (0 "
            "when a group is awaited outside gather_trajectory_groups); the unfinished rollouts were cancelled. "
            "Fix the rollout, or pass a higher max_exceptions to gather_trajectory_groups to train on the groups "
            "that succeeded (each failure is then kept in its group's `exceptions`)."
        )
        return True

    def reset(self) -> None:
        """Start a new batch: a new bar and new sums (the exception budget stays)."""
        self.pbar = None
        self.metric_sums = Counter()
        self.metric_divisors = Counter()


def record_metrics(context: GatherContext, trajectory: Any) -> None:
    """Add a finished trajectory's reward and metrics to the running means.

    As ART 0.5.23 does, a trajectory gets `metrics["completion_tokens"]`: the sum of the tokens sampled in all
    its Choices (its additional histories' too), when every Choice says how many (`choice_completion_tokens`;
    ART 0.5.18 recorded the mean per turn instead); a trajectory of captured exchanges, the total its responses
    report in `usage`.
    """
    exchanges = getattr(trajectory, "exchanges", None)
    if exchanges:  # captured exchanges: the tokens their responses generated (ART 0.5.23's count)
        tokens = exchange_completion_tokens(exchanges)
        if tokens is not None:
            trajectory.metrics["completion_tokens"] = tokens
    else:
        counts = [choice_completion_tokens(item)
                  for history in (trajectory, *getattr(trajectory, "additional_histories", ()))
                  for item in history.messages_and_choices if isinstance(item, Choice)]
        if counts and all(c is not None and c > 0 for c in counts):
            trajectory.metrics["completion_tokens"] = sum(counts)
    context.metric_sums["reward"] += trajectory.reward
    context.metric_divisors["reward"] += 1
    context.metric_sums.update(trajectory.metrics)
    context.metric_divisors.update(trajectory.metrics.keys())


ART_COMPLETION_TOKENS_KEY = "art_completion_tokens"  # where ART's client notes a Choice's count from the usage


def choice_completion_tokens(choice: Choice) -> int | None:
    """How many tokens a Choice sampled: ART's own note of it, else the token record's ids (our server's
    `token_ids`), else its logprobs; None when it says nothing."""
    extra = choice.model_extra or {}
    noted = extra.get(ART_COMPLETION_TOKENS_KEY)
    if isinstance(noted, int) and not isinstance(noted, bool):
        return noted
    if isinstance(extra.get("token_ids"), list):
        return len(extra["token_ids"])
    if choice.logprobs is not None:
        return len(choice.logprobs.content or choice.logprobs.refusal or [])
    return None


_CONTEXT: contextvars.ContextVar[GatherContext | None] = contextvars.ContextVar("artrl_gather_context", default=None)


@contextlib.contextmanager
def set_gather_context(context: GatherContext) -> Iterator[None]:
    token = _CONTEXT.set(context)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def context_with(context: GatherContext) -> contextvars.Context:
    """A copy of the current contextvars context in which `context` is the open gather (for create_task)."""
    ctx = contextvars.copy_context()
    ctx.run(_CONTEXT.set, context)
    return ctx


def get_gather_context() -> GatherContext:
    """The open gather's context, or a fresh one (no bar, no exception allowed) outside any gather."""
    context = _CONTEXT.get()
    return context if context is not None else GatherContext()


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel the unfinished tasks (after a failure past the budget) and wait until they stopped."""
    unfinished = [t for t in tasks if not t.done()]
    for t in unfinished:
        t.cancel()
    if unfinished:
        await asyncio.gather(*unfinished, return_exceptions=True)
