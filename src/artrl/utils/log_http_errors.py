"""`log_http_errors`: an async function's HTTP status errors re-raised with the server's `detail` (ART's).

An `httpx.HTTPStatusError` (or httpx2's) whose response is JSON becomes
`Exception("[HTTP <status>] <url> <detail>")` (the original kept as its cause);
a response that is not JSON re-raises the original error.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any


def _status_errors() -> tuple[type[BaseException], ...]:
    """HTTPStatusError of whichever httpx flavours are installed (the openai client uses httpx or httpx2)."""
    found = []
    for name in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(name).HTTPStatusError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def log_http_errors(func: Any) -> Any:
    status_errors = _status_errors()

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await func(*args, **kwargs)
        except status_errors as e:
            try:
                detail = e.response.json().get("detail", None)
            except Exception:  # noqa: BLE001 - not JSON: the original error says it best
                raise e from None
            raise Exception(f"[HTTP {e.response.status_code}] {e.request.url} {detail}") from e

    return wrapper
