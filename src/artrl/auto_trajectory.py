"""`auto_trajectory` / `capture_auto_trajectory`: record the chat completions an agent makes, without changing it.

ART's pair. `trajectory = await art.capture_auto_trajectory(agent(...))` runs the
agent and returns a `Trajectory` holding every chat completion the agent made
through an OpenAI-compatible HTTP client inside that call (any `openai.OpenAI` /
`AsyncOpenAI` client, including ones the agent creates itself, and litellm's
OpenAI route). Inside, `art.auto_trajectory()` is that trajectory (e.g. to set the
reward); outside a capture it is None (`required=True`: RuntimeError).

How requests are sorted into conversations (ART's rule): a completion whose
request messages continue the main conversation (its messages so far are a
prefix of the request's, with the same tools) extends it; otherwise the first
additional history it continues; otherwise it starts a new additional history.
The request's new messages are appended, then the sampled `Choice` (streamed
responses are rebuilt from their chunks, chat_chunks.py). Prefix matching ignores
keys whose value is None or an empty `tool_calls` list, so an assistant turn sent
back as a dumped message object (`choice.message.model_dump()`) still continues
its conversation; ART compares the dicts exactly and would start a new history.

How completions are seen: every openai client owns its own httpx client, built
inside the agent's code, and httpx offers hooks (event hooks, transports) only per
client instance, so there is no process-wide hook to attach to. While at least one
capture is open, `send` of httpx's `Client` / `AsyncClient` (and httpx2's, which
newer openai releases use) is wrapped; the wrapper calls the original and, only
for a request made from inside a capture's context to a `.../chat/completions`
URL, reads the response: the body of a non-streamed one, or a copy of the bytes of
a streamed one as the client reads them (through httpx's own byte-stream
interface). When the last capture closes, the original `send` is put back. ART
instead patches httpx's `Response` for the whole process at import time.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
import threading
from collections.abc import Coroutine
from typing import Any

from openai.types.chat.chat_completion import ChatCompletion, Choice

from .chat_chunks import choice_from_chunks, parse_sse
from .errors import ArtrlError
from .trajectories import History, Trajectory
from .utils import choice_from_completion

log = logging.getLogger(__name__)

CHAT_COMPLETIONS_PATH = "/chat/completions"


class AutoTrajectoryContext:
    """One capture: the trajectory being recorded and the rule that files each completion."""

    def __init__(self) -> None:
        self.trajectory = Trajectory()
        self._token: contextvars.Token[AutoTrajectoryContext | None] | None = None

    def __enter__(self) -> Trajectory:
        _install()
        self._token = _CONTEXT.set(self)
        return self.trajectory

    def __exit__(self, *exc_info: Any) -> None:
        if self._token is not None:
            _CONTEXT.reset(self._token)
        _uninstall()
        self.trajectory.finish()

    def record(self, request: dict[str, Any], choice: Choice) -> None:
        """File one completion (its request's messages and tools, and the sampled choice)."""
        messages = list(request["messages"])
        tools = request.get("tools")
        history: Trajectory | History = self.trajectory
        k = -1
        while not _continues(history, messages, tools):
            k += 1
            if k == len(self.trajectory.additional_histories):
                history = History(messages_and_choices=[])
                self.trajectory.additional_histories.append(history)
                break
            history = self.trajectory.additional_histories[k]
        history.messages_and_choices.extend(messages[len(history.messages_and_choices):])
        history.messages_and_choices.append(choice)
        history.tools = tools


_CONTEXT: contextvars.ContextVar[AutoTrajectoryContext | None] = contextvars.ContextVar(
    "artrl_auto_trajectory", default=None)


def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """The trajectory of the enclosing `capture_auto_trajectory`, or None outside one."""
    context = _CONTEXT.get()
    if context is None:
        if required:
            raise RuntimeError("No auto trajectory in context. `auto_trajectory(required=True)` must be called "
                               "in a `capture_auto_trajectory(...)` scope.")
        return None
    return context.trajectory


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run `coroutine`; return the trajectory of the chat completions it made (its `duration` metric set)."""
    with AutoTrajectoryContext() as trajectory:
        await coroutine
        return trajectory


# --------------------------------------------------------------------------- prefix matching


def _normal(value: Any) -> Any:
    """A message without the keys that say nothing (None values, empty tool_calls); content None -> ""."""
    if isinstance(value, dict):
        out = {k: _normal(v) for k, v in value.items() if v is not None and not (k == "tool_calls" and v == [])}
        if "role" in out:
            out.setdefault("content", "")
        return out
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _continues(history: Trajectory | History, messages: list[Any], tools: Any) -> bool:
    so_far = history.messages()
    if len(so_far) > len(messages):
        return False
    try:
        same = _normal(so_far) == _normal([dict(m) for m in messages[:len(so_far)]])
    except (TypeError, ValueError):
        return False
    return same and (history.tools == tools or (not so_far and history.tools is None))


# --------------------------------------------------------------------------- reading responses


def _chat_request(request: Any) -> dict[str, Any] | None:
    """The JSON body of a chat completions request, or None for any other request."""
    if request.method != "POST" or not request.url.path.endswith(CHAT_COMPLETIONS_PATH):
        return None
    try:
        body = json.loads(request.content)
    except Exception:  # noqa: BLE001 - a streamed or non-JSON body is not a chat request we can read
        return None
    return body if isinstance(body, dict) and isinstance(body.get("messages"), list) else None


def _choice(body: bytes, streamed: bool) -> Choice:
    if streamed:
        return choice_from_chunks(parse_sse(body))
    data = json.loads(body)
    try:
        completion = ChatCompletion.model_validate(data)
    except ValueError:
        return Choice.model_validate(data["choices"][0])
    try:
        return choice_from_completion(completion)  # carries the server's token record as training expects it
    except ArtrlError:
        return completion.choices[0]


def _file(context: AutoTrajectoryContext, request: dict[str, Any], body: bytes) -> None:
    try:
        choice = _choice(body, bool(request.get("stream")))
    except Exception as e:  # noqa: BLE001 - the agent's request succeeded; only the recording failed
        log.warning("auto_trajectory could not read a chat completion response (%s: %s); it is not recorded",
                    type(e).__name__, e)
        return
    context.record(request, choice)


def _watch(response: Any) -> None:
    """Record `response` into the open capture, if it is a successful chat completion."""
    context = _CONTEXT.get()
    if context is None or not response.is_success:
        return
    request = _chat_request(response.request)
    if request is None:
        return
    try:
        body = response.content  # read already (a non-streamed request)
    except Exception:  # noqa: BLE001 - httpx's ResponseNotRead: the client streams it
        encoding = response.headers.get("content-encoding", "identity")
        if encoding != "identity":
            log.warning("auto_trajectory cannot read a streamed chat completion sent with Content-Encoding %r; "
                        "it is not recorded", encoding)
            return
        response.stream = _tee_class(type(response.stream))(response.stream, lambda b: _file(context, request, b))
        return
    _file(context, request, body)


@functools.cache
def _tee_class(stream_type: type) -> type:
    """_Tee, also an instance of the byte-stream interfaces (sync, async) the original stream implements.

    httpx checks them (`isinstance(response.stream, AsyncByteStream)`) before reading.
    """
    bases = tuple(c for c in stream_type.__mro__ if c.__name__ in ("SyncByteStream", "AsyncByteStream"))
    return type(f"Tee{stream_type.__name__}", (_Tee, *bases), {})


class _Tee:
    """A byte stream that passes the response's bytes through and hands a copy on when it ends."""

    def __init__(self, inner: Any, on_done: Any) -> None:
        self._inner = inner
        self._on_done = on_done
        self._parts: list[bytes] = []
        self._done = False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._on_done(b"".join(self._parts))

    def __iter__(self):
        for part in self._inner:
            self._parts.append(part)
            yield part
        self._finish()

    async def __aiter__(self):
        async for part in self._inner:
            self._parts.append(part)
            yield part
        self._finish()

    def close(self) -> None:
        self._inner.close()
        self._finish()

    async def aclose(self) -> None:
        await self._inner.aclose()
        self._finish()


# --------------------------------------------------------------------------- the send wrapper


_install_lock = threading.Lock()
_installs = 0
_wrapped: list[tuple[type, Any, Any]] = []  # (client class, original send, wrapper)


def _client_classes() -> list[type]:
    classes = []
    for name in ("httpx", "httpx2"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        classes += [module.Client, module.AsyncClient]
    return classes


def _wrap(original: Any) -> Any:
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def send_async(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            response = await original(self, request, *args, **kwargs)
            _watch_safely(response)
            return response
        return send_async

    @functools.wraps(original)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        response = original(self, request, *args, **kwargs)
        _watch_safely(response)
        return response
    return send


def _watch_safely(response: Any) -> None:
    if _CONTEXT.get() is None:
        return
    try:
        _watch(response)
    except Exception as e:  # noqa: BLE001 - never break the agent's request because recording failed
        log.warning("auto_trajectory could not record a response (%s: %s)", type(e).__name__, e)


def _install() -> None:
    global _installs
    with _install_lock:
        _installs += 1
        if _installs > 1:
            return
        for cls in _client_classes():
            original = cls.__dict__["send"]
            wrapper = _wrap(original)
            cls.send = wrapper
            _wrapped.append((cls, original, wrapper))


def _uninstall() -> None:
    global _installs
    with _install_lock:
        _installs -= 1
        if _installs:
            return
        for cls, original, wrapper in _wrapped:
            if cls.__dict__.get("send") is wrapper:
                cls.send = original
            else:  # someone wrapped it after us: leave theirs (ours passes through outside a capture)
                log.warning("%s.send was replaced while auto_trajectory was capturing; it is left as it is",
                            cls.__qualname__)
        _wrapped.clear()
