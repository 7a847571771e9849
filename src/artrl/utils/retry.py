"""`retry`: a decorator that calls a function again after an exception, with exponential backoff (ART's).

Works on plain and `async` functions. After attempt `k` fails with one of
`exceptions`, it waits `delay * backoff_factor ** (k - 1)` seconds and tries again;
the last attempt's exception is raised as it is. `on_retry(exception, attempt)` is
called before each wait (default: a logged warning).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[Exception, int], None] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Retry the decorated function up to `max_attempts` times in all."""
    if max_attempts < 1:
        raise ValueError(f"retry(max_attempts={max_attempts}): at least one attempt is needed.")

    def notify(func: Callable[..., Any], error: Exception, attempt: int) -> None:
        if on_retry is not None:
            on_retry(error, attempt)
        else:
            log.warning("Retry %d/%d for %s after error: %s", attempt, max_attempts,
                        getattr(func, "__name__", func), error)

    def decorator(func: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def call_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                wait = delay
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await func(*args, **kwargs)
                    except exceptions as e:
                        if attempt == max_attempts:
                            raise
                        notify(func, e, attempt)  # type: ignore[arg-type]
                        await asyncio.sleep(wait)
                        wait *= backoff_factor
            return call_async  # type: ignore[return-value]

        @functools.wraps(func)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            wait = delay
            for attempt in range(1, max_attempts + 1):
                try:
                    return func(*args, **kwargs)
                except exceptions as e:
                    if attempt == max_attempts:
                        raise
                    notify(func, e, attempt)  # type: ignore[arg-type]
                    time.sleep(wait)
                    wait *= backoff_factor
            raise AssertionError("unreachable")  # the loop returns or raises
        return call

    return decorator
