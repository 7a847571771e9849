"""uvicorn's HTTP/1.1 protocol (h11) with a deadline for request heads and errors in OpenAI's JSON shape.

uvicorn bounds only the idle time between requests (`timeout_keep_alive`); a client that
sends its request line and headers a byte at a time, or never finishes them, holds its
connection (and a file descriptor) for as long as it likes. `GuardedH11Protocol` gives
every request head `head_timeout` seconds from its first byte (from the connection's
start, for the first request) and then answers 408 and closes. The body's deadline is
the app's (server.py: `_BodyLimit`), since only the app reads the body.

Errors this layer answers itself (a malformed request line or header: 400; a head that
timed out: 408) are sent as JSON in the shape of the route the request line names, as every
error of the app is (Anthropic's on `/v1/messages`, OpenAI's `{"error": {...}}` elsewhere or
before the path arrived), instead of uvicorn's plain text.

The keep-alive timeout is set by `start_server` (serve/http/background.py), longer than
common clients' idle expiry (httpx and Node: 5 s), so a client never reuses a
connection the server is closing at the same moment.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from .guards import ANTHROPIC_PATHS, APIError, anthropic_error

DEFAULT_HEAD_TIMEOUT_S = 30.0
"""Seconds a client has to send a request's line and headers once it started them."""
_HEAD_START_BYTES = 256
"""Bytes of a request head kept to read its path from, for an error answered before the head is whole."""


def _path_of(head_start: bytes) -> str | None:
    """The path of the request line that `head_start` begins with, or None when it is not there yet."""
    line = head_start.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) < 2 or not parts[1].startswith(b"/"):
        return None
    return parts[1].split(b"?", 1)[0].decode("latin-1")


def error_bytes(status: int, reason: str, message: str, code: str, path: str | None = None) -> bytes:
    """A whole HTTP/1.1 response carrying the error JSON of the route at `path` (Anthropic's on `/v1/messages`,
    OpenAI's elsewhere and when the path is unknown), closing the connection."""
    error = APIError(status, message, code=code)
    body = json.dumps(anthropic_error(error) if path in ANTHROPIC_PATHS else
                      {"error": {"message": message, "type": error.type, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request heads and JSON errors (module docstring)."""

    head_timeout: float = DEFAULT_HEAD_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._head_timer: Any = None
        self._head_start = b""  # the first bytes of the head being read (its request line: the route's path)
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head() and len(self._head_start) < _HEAD_START_BYTES:
            self._head_start += data[:_HEAD_START_BYTES - len(self._head_start)]
        super().data_received(data)
        if self._awaiting_head():
            self._arm()  # a deadline already running keeps its time
        else:
            self._disarm()
            self._head_start = b""

    def on_response_complete(self) -> None:
        self._disarm()  # idle from now on: the keep-alive timeout applies
        self._head_start = b""
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self.transport.write(error_bytes(400, "Bad Request", f"{msg} The request line or headers are malformed.",
                                         "invalid_http_request", _path_of(self._head_start)))
        self.transport.close()

    # ------------------------------------------------------------------ the head deadline

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return
        if self.cycle is not None and self.timeout_keep_alive_task is not None:
            return  # idle between requests, not inside a head: the keep-alive timeout's business
        self.transport.write(error_bytes(
            408, "Request Timeout", f"The request line and headers did not arrive within {self.head_timeout:g} s.",
            "request_timeout", _path_of(self._head_start)))
        self.transport.close()


def guarded_protocol(head_timeout: float) -> type[GuardedH11Protocol]:
    """`GuardedH11Protocol` with its own `head_timeout` (uvicorn takes a protocol class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"head_timeout": float(head_timeout)})
