"""What the server checks before a request reaches a route: the API key, and a body read within bounds.

Two ASGI middlewares in front of the app (serve/http/server.py, `create_app`), and the counts they keep:

1. **The API key** (`ApiKey`): every route needs `Authorization: Bearer <key>` or `x-api-key: <key>`
   (Anthropic's header). The scheme is case-insensitive (RFC 9110, section 11.1: `bearer` and `BEARER`
   are the same scheme), the key is compared in constant time.
2. **The body** (`BodyLimit`), as the app reads it:
   * at most `max_bytes` (413; refused before the app reads it when `Content-Length` already says so);
   * no pause longer than `pause` seconds between two of its parts (408): a client that stops;
   * all of it within `deadline` seconds of the request head (408): a client that trickles a byte
     a second never pauses long, and without a total deadline it would hold its connection (and a
     file descriptor) for as long as it likes.
   A 408, or a 413 found while reading, closes the connection (`connection: close`): the rest of
   the body is not read.
3. **Large bodies take turns** (`BodyLane`): the scan and the parse of a body over `INLINE_PARSE_BYTES`
   (serve/http/request.py) run one at a time, and the next one starts no sooner than the last one took after
   it ended, so bodies of megabytes sent back to back hold the interpreter lock at most half the time and
   the small requests between them keep their latency.
4. **A client that disconnects before its body is whole** is normal (a cancelled rollout, a
   killed process): one DEBUG line and `ServerMetrics.disconnects_mid_body`, no traceback, nothing
   sent back.

Every refusal is OpenAI's error JSON (`error_response`; Anthropic's on `/v1/messages`) and is counted in
`ServerMetrics`, which `GET /metrics` answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

DEFAULT_BODY_TIMEOUT_S = 30.0
"""Seconds a request body may pause between two of its parts before the request is answered 408."""
DEFAULT_BODY_DEADLINE_S = 60.0
"""Seconds the whole request body has, from the request head, before the request is answered 408 (16 MiB, the
largest body, at 280 KB/s)."""


@dataclass
class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"


ANTHROPIC_PATHS = frozenset({"/v1/messages"})
"""Routes that speak Anthropic's Messages API: their errors take Anthropic's shape."""

_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                          429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
"""The routes that sample, one per wire protocol."""


def not_found(path: str) -> APIError:
    """The 404 for a path no route serves; one that ends with a model route under a prefix too many (the anthropic
    SDK given `inference_base_url`, which already ends with /v1, posts to /v1/v1/messages) says what to send."""
    route = next((r for r in MODEL_ROUTES if path.endswith(r) and path != r), None)
    if route is None:
        return APIError(404, f"No route {path}; this server samples at {', '.join(MODEL_ROUTES)}.")
    return APIError(404, f"No route {path}: this server answers {route}, and the client's base URL holds "
                         f"{path[:-len(route)]!r} in front of it. The anthropic SDK appends /v1/messages to its "
                         "base_url: give it the server's root (the inference base URL without /v1).")


def anthropic_error(error: APIError) -> dict[str, Any]:
    """`error` in Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}` (the parameter at
    fault, when there is one, is named in the message, as Anthropic's are: `max_tokens: Field required`)."""
    kind = _ANTHROPIC_ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    message = error.message if error.param is None or error.param in error.message \
        else f"{error.param}: {error.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError, path: str | None = None) -> JSONResponse:
    """`error` as the route at `path` spells errors: Anthropic's shape on `ANTHROPIC_PATHS`, OpenAI's
    `{"error": {"message", "type", "param", "code"}}` everywhere else."""
    if path in ANTHROPIC_PATHS or (error.status == 404 and path is not None and path.endswith("/v1/messages")):
        return JSONResponse(anthropic_error(error), status_code=error.status)
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    return JSONResponse(body, status_code=error.status)


@dataclass
class ServerMetrics:
    """What the server refused or dropped since it started (`GET /metrics`). Updated on the server's event loop."""

    disconnects_mid_body: int = 0
    """Clients that went away before their request body was whole."""
    disconnects_while_generating: int = 0
    """Clients that went away while their request waited for or took tokens (its generation was dropped)."""
    bodies_too_large: int = 0
    """Bodies over `max_body_bytes` (413)."""
    bodies_paused: int = 0
    """Bodies that paused longer than `body_timeout` between two parts (408)."""
    bodies_over_deadline: int = 0
    """Bodies not whole within `body_deadline` of their request head (408)."""
    refused_by_count: int = 0
    """Requests with more messages or tools than the limits allow, refused before they were parsed whole (400)."""
    unknown_fields_refused: int = 0
    """Requests refused for a field their route does not take (400; serve/http/body_policy.py)."""
    requests_with_unknown_fields: int = 0
    """Requests served with fields their route does not take (a server set to `unknown_fields="warn"`)."""

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class ApiKey:
    """ASGI middleware: every route needs `Authorization: Bearer <api_key>`, the scheme in any case, or
    `x-api-key: <api_key>` (Anthropic's header; 401 otherwise), except the paths in `open_paths` (an inference
    replica's `/health`, which its router probes without a key, as vLLM's server leaves it open)."""

    def __init__(self, app: Any, api_key: str, open_paths: tuple[str, ...] = ()) -> None:
        self.app, self.expected = app, api_key.encode()
        self.open_paths = frozenset(open_paths)

    def _authorised(self, header: bytes, x_api_key: bytes | None) -> bool:
        scheme, _, key = header.partition(b" ")
        # compare_digest for every header, so the time taken does not tell a wrong scheme from a wrong key
        bearer = hmac.compare_digest(key.strip(b" "), self.expected) & (scheme.lower() == b"bearer")
        return bearer | (x_api_key is not None and hmac.compare_digest(x_api_key.strip(b" "), self.expected))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if not self._authorised(headers.get(b"authorization", b""), headers.get(b"x-api-key")):
            error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or "
                                  "'x-api-key: <key>').", type="invalid_request_error", code="invalid_api_key")
            return await error_response(error, scope.get("path"))(scope, receive, send)
        return await self.app(scope, receive, send)


class _BodyEnded(Exception):
    """Raised out of the app's `receive` to stop it: the body was refused, or its client left."""


class BodyLimit:
    """ASGI middleware bounding how a request body arrives (module docstring, point 2): `max_bytes` (413), `pause`
    seconds between two parts and `deadline` seconds for all of it (408); a client gone mid-body is counted
    (point 3)."""

    def __init__(self, app: Any, max_bytes: int, pause: float, deadline: float, metrics: ServerMetrics) -> None:
        if pause <= 0 or deadline <= 0:
            raise ValueError(f"body_timeout and body_deadline must be > 0 seconds, got {pause} and {deadline}")
        self.app, self.max_bytes, self.pause, self.deadline = app, max_bytes, pause, deadline
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(
            413, f"Request body exceeds the limit of {self.max_bytes} bytes.", code="request_too_large"
        )
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                self.metrics.bodies_too_large += 1  # uvicorn reads and drops the body: the connection stays usable
                return await error_response(too_large, scope.get("path"))(scope, receive, send)
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + self.deadline  # the whole body's deadline, from the request head
        seen, body_done, gone = 0, False, False
        failed: APIError | None = None

        async def limited_receive() -> dict:
            nonlocal seen, body_done, gone, failed
            if body_done:  # afterwards the app only waits for a disconnect: no deadline
                return await receive()
            paused_at = loop.time() + self.pause
            try:
                async with asyncio.timeout_at(min(paused_at, ends_at)):
                    message = await receive()
            except TimeoutError:
                if ends_at <= paused_at:
                    self.metrics.bodies_over_deadline += 1
                    failed = APIError(408, f"The request body was not whole within {self.deadline:g} s of the "
                                           f"request head ({seen} bytes arrived); send it faster.",
                                      code="request_timeout")
                else:
                    self.metrics.bodies_paused += 1
                    failed = APIError(408, f"The request body stopped arriving: nothing for {self.pause:g} s "
                                           f"after {seen} bytes.", code="request_timeout")
                raise _BodyEnded() from None
            if message["type"] == "http.disconnect":
                gone = True
                raise _BodyEnded()
            seen += len(message.get("body", b""))
            body_done = not message.get("more_body", False)
            if seen > self.max_bytes:
                self.metrics.bodies_too_large += 1
                failed = too_large
                raise _BodyEnded()
            return message

        async def guarded_send(message: dict) -> None:
            if failed is None and not gone:  # the app may turn _BodyEnded into its own error; ours goes out
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyEnded:
            pass
        if gone:
            self.metrics.disconnects_mid_body += 1
            logger.debug("%s %s: the client disconnected after %d bytes of its request body", scope.get("method"),
                         scope.get("path"), seen)
        elif failed is not None:
            await _closing(error_response(failed, scope.get("path")))(scope, receive, send)


def _closing(response: JSONResponse) -> JSONResponse:
    """`response`, closing the connection after it (the rest of the request body is never read)."""
    response.headers["connection"] = "close"
    return response


class BodyLane:
    """Where the scans and parses of large bodies run (module docstring, 3): on a worker thread (`off_loop`),
    one at a time, each starting no sooner than the one before took after it ended.

    pydantic-core's JSON parser holds the interpreter lock for all of a body (a 4 MB one: 50-100 ms), so two
    clients sending such bodies back to back held it nearly all the time: the server's event loop, and every
    small request, waited behind them (p50 of one-token requests from 3 ms to 89 ms). With the lane the lock is
    theirs at most half the time. A single large request is not delayed (the rest falls on the next one);
    `waited_s` adds up the rests.
    """

    def __init__(self, off_loop: Any) -> None:
        self.off_loop = off_loop
        self._lock: asyncio.Lock | None = None  # made on the server's loop, at the first large body
        self._free_at = 0.0  # monotonic seconds before which the next large body rests
        self.waited_s = 0.0

    async def run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` (a scan or a parse of a large body) in its turn."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            rest = self._free_at - time.monotonic()
            if rest > 0:
                self.waited_s += rest
                await asyncio.sleep(rest)
            started = time.monotonic()
            try:
                return await self.off_loop(fn, *args)
            finally:
                ended = time.monotonic()
                self._free_at = ended + (ended - started)

