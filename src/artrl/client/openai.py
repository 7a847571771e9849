"""The `openai.AsyncOpenAI` clients `Model.openai_client()` hands out: aiohttp for the local server.

Every turn of every rollout is a request to the model's server, and with `LocalBackend` that server
(and its decode thread) runs in the rollouts' own process: the client's Python work is paid on every
turn and competes with the server for the interpreter lock. With the `openai` SDK's default transport
(httpx) the client was the largest share of a lone request's cost, more than the server and the engine
together around the forward pass; its aiohttp transport (`openai.DefaultAioHttpClient`, the SDK's
`aiohttp` extra) costs less: docs/performance.md, "What a lone request costs besides the model".

An aiohttp session belongs to the event loop it first ran on, so:

1. **One client per running event loop**, for a loopback server (127.0.0.0/8, ::1, localhost) when
   aiohttp is installed. A later `asyncio.run` gets a client of its own instead of one bound to a closed
   loop.
2. **Closed with its loop.** An async generator is started on the loop when the client is made; the loop
   finalises it when it shuts down its async generators (`asyncio.run` does, at its end), and its
   `finally` closes the client, so no "Unclosed client session" is reported.
3. **Everything else keeps the SDK's default httpx client, one cached for all loops as before**: a call
   made outside a running loop (no loop to bind a session to), a server on another host (where the
   network, not the client, is the cost), or aiohttp missing.
4. **One session per rollout.** Every request carries the `X-Session-ID` of the asyncio task that sends
   it, which a router in front of several inference replicas keeps on one replica (client/affinity.py).
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from ..serve.http.background import is_loopback
from .affinity import event_hooks


@functools.cache
def aiohttp_available() -> bool:
    """Whether the `openai` SDK can make its aiohttp transport here (its `aiohttp` extra is installed)."""
    try:
        from openai import DefaultAioHttpClient

        DefaultAioHttpClient()  # the SDK checks its extra when the client is made (no session is opened yet)
    except (ImportError, RuntimeError):
        return False
    return True


def transport_of(client: Any) -> str:
    """The name of the HTTP transport under an `openai` client (`AiohttpTransport` or httpx's)."""
    return type(client._client._transport).__name__  # the SDK's http client, then its transport


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _close_with(loop: asyncio.AbstractEventLoop, client: Any) -> Any:
    """Start an async generator on `loop` whose finalisation closes `client`; returns it (keep it alive:
    a loop holds its generators weakly)."""

    async def closer() -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.close()

    generator = closer()
    asyncio.ensure_future(generator.__anext__(), loop=loop)
    return generator


class OpenAIClients:
    """The clients of one model, for one (base_url, api_key) at a time (module docstring). Called per request:
    a cached client costs a loop lookup."""

    def __init__(self) -> None:
        self._key: tuple[str, str] | None = None
        self._local = False  # the server is on this machine's loopback
        self._httpx: Any = None
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[Any, Any]] = \
            weakref.WeakKeyDictionary()

    def get(self, base_url: str, api_key: str, timeout: tuple[float, float]) -> Any:
        """The cached `openai.AsyncOpenAI` client for `base_url` and `api_key`; a new one is made with `timeout`
        (read, connect seconds)."""
        if (base_url, api_key) != self._key:
            self._key, self._httpx, self._per_loop = (base_url, api_key), None, weakref.WeakKeyDictionary()
            self._local = is_loopback(urlsplit(base_url).hostname or "")
        loop = _running_loop()
        if loop is not None and self._local and aiohttp_available():
            held = self._per_loop.get(loop)
            if held is None:
                from openai import DefaultAioHttpClient

                client = self._make(timeout, DefaultAioHttpClient(event_hooks=event_hooks()))
                held = (client, _close_with(loop, client))
                self._per_loop[loop] = held
            return held[0]
        if self._httpx is None:
            from openai import DefaultAsyncHttpxClient

            self._httpx = self._make(timeout, DefaultAsyncHttpxClient(event_hooks=event_hooks()))
        return self._httpx

    def _make(self, timeout: tuple[float, float], http_client: Any) -> Any:
        from openai import AsyncOpenAI, Timeout

        assert self._key is not None
        base_url, api_key = self._key
        extra = {"http_client": http_client} if http_client is not None else {}
        return AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=Timeout(timeout[0], connect=timeout[1]),
                           **extra)
