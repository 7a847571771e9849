"""`log_http_errors`: an async function's HTTP status errors re-raised with the server's `detail` (ART's).

An `httpx.HTTPStatusError` whose response is JSON becomes
`Exception("[HTTP <status>] <url> <detail>")` (the original kept as its cause);
a response that is not JSON re-raises the original error.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx


def log_http_errors(func: Any) -> Any:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await func(*args, **kwargs)
        except httpx.HTTPStatusError as e:
            try:
                detail = e.response.json().get("detail", None)
            except Exception:  # noqa: BLE001 - not JSON: the original error says it best
                raise e from None
            raise Exception(f"[HTTP {e.response.status_code}] {e.request.url} {detail}") from e

    return wrapper
