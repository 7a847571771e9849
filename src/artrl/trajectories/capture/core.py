"""The capture core: which scope is open in this context, and one request's capture from first byte to exchange.

One core serves both capture APIs: ART 0.5.23's scopes (`with art.Trajectory() as t:`,
`art.trajectory(...)`, trajectories/scopes.py), which collect exchanges, and ART 0.5.18's
`capture_auto_trajectory` (auto_trajectory.py), which files chat completions as `Choice`s.

* **Scopes** are a stack held in a context variable, as in ART: the innermost open scope of the
  current context receives what is captured; `asyncio` tasks and `asyncio.to_thread` copy the
  context, so concurrent rollouts never mix; `no_capture()` hides every enclosing scope (new
  scopes may open inside it). A scope is anything with `trajectory` and `on_exchange(exchange)`.
* **A request** to a model endpoint (a POST whose URL path ends with one of exchanges.ENDPOINT_PATHS
  and whose body is a JSON object), made while a scope is open, gets a `CaptureState`: the client
  adapter (capture_http.py) feeds it the response's decoded bytes as the client reads them and
  calls `finish` when the body ends (a streamed one also ends at its protocol's terminal event, so
  an agent that stops reading after it is still captured). `finish` builds the exchange and hands
  it to the scope that was innermost when the request was sent, even if that scope has closed
  since. A non-2xx response is not captured. A response that cannot be read (an incomplete
  stream, a body that is not the protocol's) is not captured and logged as a warning naming the
  URL path, never raised into the agent.
* While one adapter is sending, another is not (`adapter_active`): an httpx transport built on
  aiohttp records once.
"""

from __future__ import annotations

import contextvars
import copy
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol
from urllib.parse import urlsplit

from ..exchanges import Endpoint, build_exchange, endpoint_for_url, is_terminal_event

log = logging.getLogger(__name__)

_EVENT_ENDS = (b"\r\n\r\n", b"\n\n", b"\r\r")  # a server-sent event ends with a blank line


class Scope(Protocol):
    """An open capture: what it records into, and what it does with each captured exchange."""

    trajectory: Any

    def on_exchange(self, exchange: Any) -> None: ...


_scopes: contextvars.ContextVar[tuple[Scope, ...]] = contextvars.ContextVar("artrl_capture_scopes", default=())
adapter_active: contextvars.ContextVar[bool] = contextvars.ContextVar("artrl_capture_adapter_active", default=False)


def current_scope() -> Scope | None:
    """The innermost open scope of this context, or None."""
    stack = _scopes.get()
    return stack[-1] if stack else None


def scopes() -> tuple[Scope, ...]:
    """Every open scope of this context, outermost first."""
    return _scopes.get()


def push(scope: Scope) -> None:
    _scopes.set((*_scopes.get(), scope))


def pop(scope: Scope) -> None:
    """Close `scope`, which must be the innermost one (scopes close in the order they opened)."""
    stack = _scopes.get()
    if not stack or stack[-1] is not scope:
        raise RuntimeError("Trajectory capture scopes must exit in stack order: the scope closing is not the "
                           "innermost open one in this context (was it entered in another task or thread?).")
    _scopes.set(stack[:-1])


@contextmanager
def no_capture() -> Iterator[None]:
    """Hide every enclosing capture scope inside the block; scopes opened inside it capture as usual."""
    token = _scopes.set(())
    try:
        yield
    finally:
        _scopes.reset(token)


class TrajectoryScope:
    """ART 0.5.23's scope: exchanges go to `trajectory.exchanges`.

    A trajectory that already holds legacy histories (`messages_and_choices`, `tools` or
    `additional_histories`) takes no exchanges (ART's rule: one or the other); each refused
    exchange is logged as a warning.
    """

    def __init__(self, trajectory: Any) -> None:
        self.trajectory = trajectory

    def on_exchange(self, exchange: Any) -> None:
        t = self.trajectory
        if t.messages_and_choices or t.tools is not None or t.additional_histories:
            log.warning("a captured %s exchange is not recorded: its trajectory holds legacy histories "
                        "(messages_and_choices, tools or additional_histories), and a trajectory holds either "
                        "exchanges or those, never both", type(exchange).__name__)
            return
        t.exchanges.append(exchange)


def _json_object(body: Any) -> dict[str, Any] | None:
    if isinstance(body, dict):
        try:
            return copy.deepcopy(body) if all(isinstance(k, str) for k in body) else None
        except Exception:  # noqa: BLE001 - an object that cannot be copied is not a JSON body
            return None
    if isinstance(body, str):
        body = body.encode()
    if not isinstance(body, (bytes, bytearray)):
        return None
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return parsed if isinstance(parsed, dict) else None


@dataclass
class CaptureState:
    """One request being captured: its scope, protocol and JSON body, and the response bytes read so far."""

    scope: Scope | None
    endpoint: Endpoint
    request: dict[str, Any]
    url_path: str = ""
    start_time: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    status_code: int | None = None
    body: bytearray = field(default_factory=bytearray)
    done: bool = False
    _event_start: int = 0

    @property
    def stream(self) -> bool:
        return self.request.get("stream") is True

    def add(self, chunk: bytes) -> None:
        """More decoded response bytes; a streamed body that reaches its terminal event finishes here."""
        if self.done or not chunk:
            return
        self.body.extend(chunk)
        if self.stream and self._reached_terminal_event():
            self.finish()

    def _reached_terminal_event(self) -> bool:
        """Whether an event completed since the last call is the protocol's last (events end with a blank line)."""
        while True:
            ends = [(i, len(d)) for d in _EVENT_ENDS if (i := self.body.find(d, self._event_start)) >= 0]
            if not ends:
                return False
            i, n = min(ends)
            block, self._event_start = bytes(self.body[self._event_start:i]), i + n
            if is_terminal_event(self.endpoint, block):
                return True

    def finish(self) -> None:
        """The body is complete: build the exchange and hand it to the scope (once; later calls do nothing)."""
        if self.done:
            return
        self.done = True
        scope, body = self.scope, bytes(self.body)
        self.scope, self.body = None, bytearray()  # a response may outlive its scope: keep nothing
        if scope is None or self.status_code is None or not 200 <= self.status_code < 300:
            return
        try:
            exchange = build_exchange(self.endpoint, self.request, body, start_time=self.start_time,
                                      end_time=datetime.now(timezone.utc),
                                      unfinished_as_stop=getattr(scope, "unfinished_as_stop", False))
        except Exception as e:  # noqa: BLE001 - the agent's request succeeded; only the recording failed
            log.warning("a %s response from %s could not be read (%s: %s); it is not captured", self.endpoint,
                        self.url_path, type(e).__name__, e)
            return
        try:
            scope.on_exchange(exchange)
        except Exception as e:  # noqa: BLE001 - never break the agent because recording failed
            log.warning("a captured %s exchange could not be recorded (%s: %s)", self.endpoint, type(e).__name__, e)

    def discard(self) -> None:
        """Drop this capture (its body could not be read as the server sent it)."""
        self.done, self.scope, self.body = True, None, bytearray()


def begin(method: str, url: str, body: Any) -> tuple[CaptureState | None, contextvars.Token[bool] | None]:
    """A CaptureState for a request about to be sent, when it is one to capture; and a token that marks an adapter
    as sending (pass it to `end` when the send returns)."""
    scope = current_scope()
    if scope is None or adapter_active.get() or method.upper() != "POST":
        return None, None
    endpoint = endpoint_for_url(url)
    if endpoint is None:
        return None, None
    request = _json_object(body)
    if request is None:
        return None, None
    state = CaptureState(scope=scope, endpoint=endpoint, request=request, url_path=urlsplit(url).path)
    return state, adapter_active.set(True)


def end(token: contextvars.Token[bool] | None) -> None:
    if token is not None:
        adapter_active.reset(token)
