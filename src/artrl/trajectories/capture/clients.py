"""The HTTP clients a capture sees: httpx (the openai and anthropic SDKs, LangChain, litellm), aiohttp, requests.

Each client offers hooks only per client instance (and agents build their own clients), so
there is no process-wide hook to attach to. While at least one capture scope is open in the
process, one method per client class is wrapped; when the last scope closes the originals are
put back (a wrapper that someone replaced in the meantime is left as it is, with a warning).
Outside a scope, in this context, a wrapper only calls the original.

| client | wrapped | how the response body is read |
|---|---|---|
| httpx / httpx2 `Client`, `AsyncClient` | `send` | a read body (`response.content`) at once; a streamed one through its byte stream, decoded (gzip, ...) as the client decodes it, as the client reads it |
| aiohttp `ClientSession` | `_request` | the response's `content` stream, as the client reads it (aiohttp has decompressed it) |
| requests `Session` | `send` | `response.content` at once; a streamed one through `iter_content`, as the client reads it |

What is done with the bytes is the capture core's (core.py). ART 0.5.23 patches these
classes (and httpx's `Response`) once for the whole process at first capture.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from . import core as capture
from .core import CaptureState, begin, end

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- scopes


def open_scope(scope: capture.Scope) -> None:
    """Open `scope` in this context (the clients are wrapped while any scope is open)."""
    acquire()
    capture.push(scope)


def close_scope(scope: capture.Scope) -> None:
    try:
        capture.pop(scope)
    finally:
        release()


# --------------------------------------------------------------------------- httpx


def _httpx_body(request: Any) -> Any:
    try:
        return request.content
    except Exception:  # noqa: BLE001 - httpx's RequestNotRead: a streamed request body is not a JSON request
        return None


def _httpx_decoder(response: Any) -> Any:
    """A fresh decoder for the response's Content-Encoding (httpx keeps one per response; sharing it would corrupt
    the client's own decoding)."""
    shadow = type(response)(response.status_code, headers=response.headers, content=b"")
    return shadow._get_content_decoder()


def _httpx_attach(state: CaptureState, response: Any) -> None:
    state.status_code = response.status_code
    try:
        content = response.content  # read already (a non-streamed request)
    except Exception:  # noqa: BLE001 - httpx's ResponseNotRead: the client streams it
        try:
            decoder = _httpx_decoder(response)
        except Exception as e:  # noqa: BLE001
            log.warning("a streamed %s response with Content-Encoding %r cannot be decoded for capture (%s); it is "
                        "not captured", state.endpoint, response.headers.get("content-encoding"), e)
            state.discard()
            return
        response.stream = _tee_class(type(response.stream))(response.stream, state, decoder)
        return
    state.add(content)
    state.finish()


def _joined(decoded: Any) -> bytes:
    """A decoder's output as bytes (httpx's decoders give bytes, httpx2's a list of them)."""
    return decoded if isinstance(decoded, (bytes, bytearray)) else b"".join(decoded)


@functools.cache
def _tee_class(stream_type: type) -> type:
    """_Tee, also an instance of the byte-stream interfaces (sync, async) the original stream implements.

    httpx checks them (`isinstance(response.stream, AsyncByteStream)`) before reading.
    """
    bases = tuple(c for c in stream_type.__mro__ if c.__name__ in ("SyncByteStream", "AsyncByteStream"))
    return type(f"Tee{stream_type.__name__}", (_Tee, *bases), {})


class _Tee:
    """A byte stream that passes the response's raw bytes through and feeds their decoded copy to the capture."""

    def __init__(self, inner: Any, state: CaptureState, decoder: Any) -> None:
        self._inner, self._state, self._decoder = inner, state, decoder

    def _feed(self, part: bytes) -> None:
        if self._state.done:
            return
        try:
            self._state.add(_joined(self._decoder.decode(part)))
        except Exception as e:  # noqa: BLE001 - never break the agent's read because recording failed
            log.warning("a streamed %s response could not be decoded for capture (%s); it is not captured",
                        self._state.endpoint, e)
            self._state.discard()

    def _finish(self) -> None:
        if not self._state.done:
            try:
                self._state.add(_joined(self._decoder.flush()))
            except Exception:  # noqa: BLE001
                self._state.discard()
            self._state.finish()

    def __iter__(self) -> Iterator[bytes]:
        for part in self._inner:
            self._feed(part)
            yield part
        self._finish()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._inner:
            self._feed(part)
            yield part
        self._finish()

    def close(self) -> None:
        self._inner.close()
        self._finish()

    async def aclose(self) -> None:
        await self._inner.aclose()
        self._finish()


class BytesSink:
    """A stand-in for a CaptureState that hands the whole (undecoded) body to `on_done` when it ends; lets a
    client-specific recorder (artrl.langgraph) read a stream through the same tee."""

    class _Identity:
        def decode(self, data: bytes) -> bytes:
            return data

        def flush(self) -> bytes:
            return b""

    def __init__(self, endpoint: str, on_done: Any) -> None:
        self.endpoint, self._on_done, self._parts, self.done = endpoint, on_done, [], False

    def add(self, chunk: bytes) -> None:
        self._parts.append(chunk)

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self._on_done(b"".join(self._parts))

    def discard(self) -> None:
        self.done = True

    def tee(self, stream: Any) -> Any:
        """`stream` (an httpx response's byte stream) passing its bytes through and here."""
        return _tee_class(type(stream))(stream, self, BytesSink._Identity())


def _wrap_httpx_send(original: Any) -> Any:
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def send_async(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            state, token = begin(request.method, str(request.url), _httpx_body(request))
            try:
                response = await original(self, request, *args, **kwargs)
            finally:
                end(token)
            if state is not None:
                _safely(_httpx_attach, state, response)
            return response
        return send_async

    @functools.wraps(original)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        state, token = begin(request.method, str(request.url), _httpx_body(request))
        try:
            response = original(self, request, *args, **kwargs)
        finally:
            end(token)
        if state is not None:
            _safely(_httpx_attach, state, response)
        return response
    return send


def _safely(attach: Any, state: CaptureState, response: Any) -> None:
    try:
        attach(state, response)
    except Exception as e:  # noqa: BLE001 - never break the agent's request because recording failed
        log.warning("a %s response could not be captured (%s: %s)", state.endpoint, type(e).__name__, e)
        state.discard()


# --------------------------------------------------------------------------- aiohttp


class _CapturedStream:
    """aiohttp's response `content` (a StreamReader), passing every read through and copying it to the capture."""

    def __init__(self, stream: Any, state: CaptureState) -> None:
        self._stream, self._state = stream, state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _record(self, value: Any) -> Any:
        chunk = value[0] if isinstance(value, tuple) else value
        if isinstance(chunk, (bytes, bytearray)):
            self._state.add(bytes(chunk))
        if self._stream.at_eof():
            self._state.finish()
        return value

    async def read(self, n: int = -1) -> bytes:
        return self._record(await self._stream.read(n))

    async def readany(self) -> bytes:
        return self._record(await self._stream.readany())

    async def readline(self) -> bytes:
        return self._record(await self._stream.readline())

    async def readexactly(self, n: int) -> bytes:
        return self._record(await self._stream.readexactly(n))

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        return self._record(await self._stream.readuntil(separator))

    def read_nowait(self, n: int = -1) -> bytes:
        return self._record(self._stream.read_nowait(n))

    async def readchunk(self) -> tuple[bytes, bool]:
        return self._record(await self._stream.readchunk())

    async def _iterate(self, iterator: Any) -> AsyncIterator[Any]:
        async for chunk in iterator:
            yield self._record(chunk)
        self._state.finish()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate(self._stream.__aiter__())

    def iter_any(self) -> AsyncIterator[bytes]:
        return self._iterate(self._stream.iter_any())

    def iter_chunked(self, size: int) -> AsyncIterator[bytes]:
        return self._iterate(self._stream.iter_chunked(size))

    def iter_chunks(self) -> AsyncIterator[tuple[bytes, bool]]:
        return self._iterate(self._stream.iter_chunks())


def _wrap_aiohttp_request(original: Any) -> Any:
    @functools.wraps(original)
    async def _request(self: Any, method: str, str_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        body = kwargs.get("json")
        state, token = begin(method, str(str_or_url), kwargs.get("data") if body is None else body)
        try:
            response = await original(self, method, str_or_url, *args, **kwargs)
        finally:
            end(token)
        if state is not None:
            state.status_code = response.status
            response.content = _CapturedStream(response.content, state)
        return response
    return _request


# --------------------------------------------------------------------------- requests


def _wrap_requests_send(original: Any) -> Any:
    @functools.wraps(original)
    def send(self: Any, request: Any, **kwargs: Any) -> Any:
        state, token = begin(request.method or "GET", request.url or "", request.body)
        try:
            response = original(self, request, **kwargs)
        finally:
            end(token)
        if state is not None:
            state.status_code = response.status_code
            if kwargs.get("stream"):  # not read yet: the client streams it
                response.iter_content = _captured_iter_content(response, state)
            else:
                state.add(response.content)
                state.finish()
        return response
    return send


def _captured_iter_content(response: Any, state: CaptureState) -> Any:
    read = type(response).iter_content

    def iter_content(chunk_size: int | None = 1, decode_unicode: bool = False) -> Iterator[Any]:
        for chunk in read(response, chunk_size=chunk_size, decode_unicode=decode_unicode):
            state.add(chunk.encode(response.encoding or "utf-8") if isinstance(chunk, str) else chunk)
            yield chunk
        state.finish()
    return iter_content


# --------------------------------------------------------------------------- installing


_lock = threading.Lock()
_holders = 0
_wrapped: list[tuple[type, str, Any, Any]] = []  # (class, attribute, original, wrapper)


def _targets() -> list[tuple[type, str, Any]]:
    """(class, attribute, wrapper factory) for every client library that is installed."""
    targets: list[tuple[type, str, Any]] = []
    for name in ("httpx", "httpx2"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        targets += [(module.Client, "send", _wrap_httpx_send), (module.AsyncClient, "send", _wrap_httpx_send)]
    try:
        import aiohttp
        targets.append((aiohttp.ClientSession, "_request", _wrap_aiohttp_request))
    except ImportError:
        pass
    try:
        import requests
        targets.append((requests.Session, "send", _wrap_requests_send))
    except ImportError:
        pass
    return targets


def acquire() -> None:
    """One more open scope; the first wraps the clients."""
    global _holders
    with _lock:
        _holders += 1
        if _holders > 1:
            return
        for cls, attribute, factory in _targets():
            original = cls.__dict__[attribute]
            wrapper = factory(original)
            setattr(cls, attribute, wrapper)
            _wrapped.append((cls, attribute, original, wrapper))


def release() -> None:
    """One scope fewer; the last puts the originals back."""
    global _holders
    with _lock:
        _holders -= 1
        if _holders:
            return
        for cls, attribute, original, wrapper in _wrapped:
            if cls.__dict__.get(attribute) is wrapper:
                setattr(cls, attribute, original)
            else:  # someone wrapped it after us: leave theirs (ours passes through outside a capture)
                log.warning("%s.%s was replaced while a trajectory capture was open; it is left as it is",
                            cls.__qualname__, attribute)
        _wrapped.clear()


def installed() -> bool:
    """Whether the clients are wrapped now (some scope is open somewhere in the process)."""
    return bool(_wrapped)
