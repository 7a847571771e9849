"""`limit_concurrency`: at most `n` calls of an async function run at once (ART's decorator).

With `derive_key(*args, **kwargs)`, each key gets its own limit of `n` (e.g. per
model name or per host). The semaphores are created on first use, inside the
running event loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

DEFAULT_KEY = "default"


def limit_concurrency(n: int, derive_key: Callable[..., str] | None = None) -> Callable[[Any], Any]:
    if n < 1:
        raise ValueError(f"limit_concurrency(n={n}): at least one call must be allowed to run.")
    semaphores: dict[Any, asyncio.Semaphore] = {}

    def decorator(func: Any) -> Any:
        @functools.wraps(func)
        async def limited(*args: Any, **kwargs: Any) -> Any:
            key = derive_key(*args, **kwargs) if derive_key else DEFAULT_KEY
            if key not in semaphores:
                semaphores[key] = asyncio.Semaphore(n)
            async with semaphores[key]:
                return await func(*args, **kwargs)
        return limited

    return decorator
