"""The HTTP transport under `init_chat_model`'s client: it records each chat completion as the server sent it.

LangChain's `ChatOpenAI` talks to the server through the `openai` package, which sends
through an httpx client; `init_chat_model` gives it one whose transport is wrapped here.
For a `.../chat/completions` request made inside a `wrap_rollout`, the wrapper copies the
response bytes as the client reads them (streamed or not) and, when they end, files the
request's messages and tools with the sampled `Choice` into that rollout's recorder, the way
`capture_auto_trajectory` sorts completions into conversations (auto_trajectory.py).

Why at the HTTP layer: the `AIMessage` LangChain builds keeps the text, tool calls and (when
asked) logprobs, but drops the fields it does not know, and the token record (the exact
prompt ids and sampled ids) is one of them. The response body has it. Only the clients
made by `init_chat_model` are wrapped: nothing process-wide changes, and completions the
rollout makes elsewhere (a judge, another client) are not taken for the agent's turns.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import weakref
from typing import Any

from ..auto_trajectory import AutoTrajectoryContext, chat_request, recorded_choice
from ..trajectories.capture.clients import BytesSink
from ..model import OPENAI_CLIENT_TIMEOUT_S, OPENAI_CONNECT_TIMEOUT_S
from ..trajectories.data import Trajectory

log = logging.getLogger(__name__)


class RolloutRecorder:
    """The conversations one `wrap_rollout` call has recorded so far."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._filer = AutoTrajectoryContext()  # used for its sorting rule only; never entered
        self.unreadable: list[str] = []  # completions whose response could not be read (named in the result)

    @property
    def trajectory(self) -> Trajectory:
        return self._filer.trajectory

    def file(self, request: dict[str, Any], body: bytes) -> None:
        try:
            choice = recorded_choice(body, bool(request.get("stream")))
        except Exception as e:  # noqa: BLE001 - the graph got its answer; only the record of it failed
            self.unreadable.append(f"a completion's response could not be read ({type(e).__name__}: {e})")
            log.warning("wrap_rollout could not read a chat completion response (%s: %s)", type(e).__name__, e)
            return
        self._filer.record(request, choice)


CURRENT: contextvars.ContextVar[RolloutRecorder | None] = contextvars.ContextVar("artrl_langgraph_rollout",
                                                                                 default=None)


def _recording(request: Any, response: Any) -> Any:
    recorder = CURRENT.get()
    if recorder is None or not response.is_success:
        return response
    body = chat_request(request)
    if body is None:
        return response
    response.stream = BytesSink("chat_completions", lambda b: recorder.file(body, b)).tee(response.stream)
    return response


def _identity(request: Any) -> None:
    """Ask for an uncompressed body: the transport sees the bytes before httpx decodes them."""
    if chat_request(request) is not None:
        request.headers["accept-encoding"] = "identity"


def _http_module() -> Any:
    """httpx2 where installed (what newer `openai` releases send with), else httpx; openai takes either."""
    try:
        import httpx2
        return httpx2
    except ImportError:
        import httpx
        return httpx


_sync_client: Any = None
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
_clients_lock = threading.Lock()


def recording_clients() -> tuple[Any, Any]:
    """The sync and async http clients whose transports record chat completions (for ChatOpenAI).

    Shared, so rollouts reuse connections (LangChain caches its default clients the same way):
    one sync client per process, one async client per event loop (an async client's
    connections belong to the loop that opened them). The recorder is looked up per request.
    """
    global _sync_client
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    with _clients_lock:
        if _sync_client is None:
            _sync_client = _new_client(sync=True)
        if loop is None:
            return _sync_client, _new_client(sync=False)
        if loop not in _async_clients:
            _async_clients[loop] = _new_client(sync=False)
        return _sync_client, _async_clients[loop]


def _new_client(sync: bool) -> Any:
    http = _http_module()
    timeout = http.Timeout(OPENAI_CLIENT_TIMEOUT_S, connect=OPENAI_CONNECT_TIMEOUT_S)  # as model.openai_client(): long rollouts
    if sync:
        return http.Client(transport=_transports(http)[0](), timeout=timeout)
    return http.AsyncClient(transport=_transports(http)[1](), timeout=timeout)


@functools.cache
def _transports(http: Any) -> tuple[type, type]:
    """Transport classes over `http` (httpx or httpx2) that record what they carry."""

    class RecordingTransport(http.BaseTransport):
        def __init__(self) -> None:
            self._inner = http.HTTPTransport()

        def handle_request(self, request: Any) -> Any:
            _identity(request)
            return _recording(request, self._inner.handle_request(request))

        def close(self) -> None:
            self._inner.close()

    class RecordingAsyncTransport(http.AsyncBaseTransport):
        def __init__(self) -> None:
            self._inner = http.AsyncHTTPTransport()

        async def handle_async_request(self, request: Any) -> Any:
            _identity(request)
            return _recording(request, await self._inner.handle_async_request(request))

        async def aclose(self) -> None:
            await self._inner.aclose()

    return RecordingTransport, RecordingAsyncTransport
