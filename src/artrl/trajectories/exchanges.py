"""What a captured HTTP exchange is: one request to a model and its whole response, per wire protocol.

ART 0.5.23's data model for captured traffic. A `Trajectory` opened as a capture scope
(`with art.Trajectory() as t:`, capture.py) collects, in `t.exchanges`, one exchange per
successful request the agent made to

| URL path ends with     | protocol (list in `TrajectoryExchanges`) | response type |
|---|---|---|
| `/chat/completions`    | `chat_completions` (OpenAI Chat Completions) | `openai.types.chat.ChatCompletion` |
| `/completions`         | `completions` (OpenAI Completions)            | `openai.types.Completion` |
| `/responses`           | `responses` (OpenAI Responses)                | `openai.types.responses.Response` |
| `/messages`            | `messages` (Anthropic Messages)               | `anthropic.types.Message`, or `AnthropicMessage` below when the anthropic SDK is not installed |

Each exchange keeps the request's JSON body as sent (`request`), the response (a streamed one
is assembled from its server-sent events into the response a non-streamed request would have
got, with the token-record fields kept), and its start and end times. `build_exchange` reads
the response bytes; an incomplete stream (no terminal event) is a ValueError, never half an
exchange. The token record each response carries, and how it becomes training data, is
token_record.py.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Literal
from urllib.parse import urlsplit

import pydantic
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from ..chat.chunks import choice_from_chunks

Endpoint = Literal["chat_completions", "completions", "responses", "messages"]

#: URL path suffix -> protocol; the first that matches wins (so `/chat/completions` is not `/completions`).
ENDPOINT_PATHS: dict[str, Endpoint] = {"/chat/completions": "chat_completions", "/completions": "completions",
                                       "/responses": "responses", "/messages": "messages"}


def endpoint_for_url(url: str) -> Endpoint | None:
    """The protocol a request to `url` speaks, by its path (query and trailing slash ignored); None for others."""
    path = urlsplit(url).path.rstrip("/")
    return next((endpoint for suffix, endpoint in ENDPOINT_PATHS.items() if path.endswith(suffix)), None)


class AnthropicMessage(pydantic.BaseModel):
    """An Anthropic Messages response, kept whole (every field the server sent, the token record included).

    Used when the `anthropic` SDK is not installed; with it, `MessagesExchange.response` is
    `anthropic.types.Message`, as in ART.
    """

    model_config = pydantic.ConfigDict(extra="allow")

    id: str = ""
    type: str = "message"
    role: str = "assistant"
    content: list[dict[str, Any]] = []
    model: str | None = None
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: dict[str, Any] | None = None


try:  # ART's type when the SDK is there
    from anthropic.types import Message as _MessagesResponse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    _MessagesResponse = AnthropicMessage  # type: ignore[misc, assignment]


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class _Exchange(pydantic.BaseModel):
    start_time: datetime
    end_time: datetime
    request: dict[str, Any]

    @pydantic.field_validator("start_time", "end_time")
    @classmethod
    def _in_utc(cls, value: datetime) -> datetime:
        return _utc(value)

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def model(self) -> str | None:
        """The model the request named (else the one the response names)."""
        requested = self.request.get("model")
        response = getattr(self, "response", None)  # each protocol's subclass has its own response type
        return requested if isinstance(requested, str) else getattr(response, "model", None)


class ChatCompletionsExchange(_Exchange):
    response: ChatCompletion


class CompletionsExchange(_Exchange):
    response: Completion


class ResponsesExchange(_Exchange):
    response: Response


class MessagesExchange(_Exchange):
    response: _MessagesResponse  # type: ignore[valid-type]


Exchange = ChatCompletionsExchange | CompletionsExchange | ResponsesExchange | MessagesExchange


class TrajectoryExchanges(pydantic.BaseModel):
    """A trajectory's captured exchanges, one list per protocol, each in the order the responses completed."""

    chat_completions: list[ChatCompletionsExchange] = pydantic.Field(default_factory=list)
    completions: list[CompletionsExchange] = pydantic.Field(default_factory=list)
    responses: list[ResponsesExchange] = pydantic.Field(default_factory=list)
    messages: list[MessagesExchange] = pydantic.Field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.chat_completions or self.completions or self.responses or self.messages)

    def append(self, exchange: Exchange) -> None:
        """Add `exchange` to its protocol's list."""
        getattr(self, _LIST_OF[type(exchange)]).append(exchange)

    def all(self) -> list[tuple[Endpoint, Exchange]]:
        """Every exchange with its protocol: chat completions first, then completions, responses, messages."""
        return [(name, e) for name in ("chat_completions", "completions", "responses", "messages")
                for e in getattr(self, name)]


_LIST_OF: dict[type, Endpoint] = {ChatCompletionsExchange: "chat_completions", CompletionsExchange: "completions",
                                  ResponsesExchange: "responses", MessagesExchange: "messages"}


# --------------------------------------------------------------------------- server-sent events


def sse_events(body: bytes) -> list[tuple[str | None, Any]]:
    """(event name, JSON payload or "[DONE]") of each complete event of a server-sent event stream.

    Events are separated by a blank line; an unfinished last event is left out; `ping` /
    `keepalive` data lines are skipped; a data line that is not JSON is a ValueError.
    """
    text = body.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    blocks = text.split("\n\n")
    if not text.endswith("\n\n"):
        blocks.pop()  # not terminated yet
    events: list[tuple[str | None, Any]] = []
    for block in blocks:
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value.strip()
            elif field == "data":
                data.append(value)
        if not data:
            continue
        raw = "\n".join(data)
        if raw.strip() == "[DONE]":
            events.append((name, "[DONE]"))
        elif raw.strip().lower() not in ("ping", "keepalive"):
            events.append((name, json.loads(raw)))
    return events


def is_terminal_event(endpoint: Endpoint, block: bytes) -> bool:
    """Whether one raw event block (without its blank line) ends a stream of `endpoint`."""
    try:
        events = sse_events(block + b"\n\n")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    for name, payload in events:
        if endpoint in ("chat_completions", "completions"):
            if payload == "[DONE]":
                return True
            continue
        kind = payload.get("type") if isinstance(payload, dict) else None
        if endpoint == "responses" and ({name, kind} & _RESPONSES_ENDS):
            return True
        if endpoint == "messages" and "message_stop" in (name, kind):
            return True
    return False


# --------------------------------------------------------------------------- building an exchange


def build_exchange(endpoint: Endpoint, request: dict[str, Any], body: bytes, *, start_time: datetime,
                   end_time: datetime, unfinished_as_stop: bool = False) -> Exchange:
    """The exchange of one request and its response bytes; ValueError when the response is incomplete or not
    the protocol's. `unfinished_as_stop`: a Chat Completions stream that ended ([DONE]) with a choice that never
    sent a finish_reason is read as finished with "stop", as ART 0.5.17's auto_trajectory read it (0.5.23's
    capture refuses such a stream, and so does this without the flag)."""
    stream = request.get("stream") is True
    times = {"request": request, "start_time": start_time, "end_time": end_time}
    if endpoint == "chat_completions":
        return ChatCompletionsExchange(response=_chat_response(body, stream, unfinished_as_stop), **times)
    if endpoint == "completions":
        return CompletionsExchange(response=_completion_response(body, stream), **times)
    if endpoint == "responses":
        return ResponsesExchange(response=_responses_response(body, stream), **times)
    if endpoint == "messages":
        return MessagesExchange(response=_messages_response(body, stream), **times)
    raise ValueError(f"unknown protocol {endpoint!r}; expected one of {sorted(set(ENDPOINT_PATHS.values()))}")


def _chat_response(body: bytes, stream: bool, unfinished_as_stop: bool = False) -> ChatCompletion:
    if not stream:
        return ChatCompletion.model_validate_json(body)
    events = sse_events(body)
    if not any(p == "[DONE]" for _, p in events):
        raise ValueError("incomplete Chat Completions stream (no [DONE])")
    chunks = [p for _, p in events if isinstance(p, dict)]
    indices = sorted({c.get("index", 0) for chunk in chunks for c in chunk.get("choices") or []})
    if not indices:
        raise ValueError("a Chat Completions stream without choices")
    unfinished = [i for i in indices if not any(c.get("index", 0) == i and c.get("finish_reason")
                                                for chunk in chunks for c in chunk.get("choices") or [])]
    if unfinished and not unfinished_as_stop:  # choice_from_chunks gives an unfinished choice "stop"
        raise ValueError(f"Chat Completions stream choices {unfinished} never finished")
    data: dict[str, Any] = {}
    for chunk in chunks:  # the response's own fields (id, model, usage, a response-level token record): last wins
        data.update({k: v for k, v in chunk.items() if k != "choices" and v is not None})
    data.update(object="chat.completion", choices=[choice_from_chunks(chunks, i).model_dump() for i in indices])
    return ChatCompletion.model_validate(data)


# keys of a streamed completion choice that are added up over the chunks; any other is kept as last sent
_COMPLETION_LISTS = ("token_ids", "compact_logprobs", "art_completion_logprobs", "routed_experts")


def _completion_response(body: bytes, stream: bool) -> Completion:
    if not stream:
        return Completion.model_validate_json(body)
    events = sse_events(body)
    chunks = [p for _, p in events if isinstance(p, dict)]
    if not chunks or not any(p == "[DONE]" for _, p in events):
        raise ValueError("incomplete Completions stream (no [DONE])")
    data: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        data.update({k: v for k, v in chunk.items() if k != "choices" and v is not None})
        for raw in chunk.get("choices") or []:
            current = choices.setdefault(raw.get("index", 0), {"index": raw.get("index", 0), "text": "",
                                                                "finish_reason": "stop"})
            current["text"] += raw.get("text") or ""
            for key in _COMPLETION_LISTS:
                if isinstance(raw.get(key), list):
                    current.setdefault(key, []).extend(raw[key])
            if isinstance(raw.get("logprobs"), dict):
                target = current.setdefault("logprobs", {})
                for key, values in raw["logprobs"].items():
                    if isinstance(values, list):
                        target.setdefault(key, []).extend(values)
                    elif values is not None:
                        target[key] = values
            for key, value in raw.items():
                if key not in ("index", "text", "logprobs", *_COMPLETION_LISTS) and value is not None:
                    current[key] = value
    data.update(object="text_completion", choices=[choices[i] for i in sorted(choices)])
    return Completion.model_validate(data)


_RESPONSES_FINISHED = {"response.completed", "response.incomplete"}
"""The events that end a Responses stream with the whole response (an `incomplete` one: cut by max_output_tokens)."""
_RESPONSES_ENDS = _RESPONSES_FINISHED | {"response.failed"}


def _responses_response(body: bytes, stream: bool) -> Response:
    if not stream:
        return Response.model_validate_json(body)
    finished = [p.get("response") for name, p in sse_events(body) if isinstance(p, dict)
                and ({name, p.get("type")} & _RESPONSES_FINISHED)]
    if not finished or not isinstance(finished[-1], dict):
        raise ValueError("incomplete Responses stream (no response.completed or response.incomplete event)")
    return Response.model_validate(finished[-1])


# token-record keys a Messages stream carries on its events, copied onto the assembled message
_MESSAGES_RECORD_KEYS = ("prompt_token_ids", "token_ids", "logprobs", "compact_logprobs", "compact_top_logprobs",
                         "logprobs_mode", "routed_experts", "prompt_routed_experts", "policy_version")


def _messages_response(body: bytes, stream: bool) -> Any:
    if not stream:
        return _MessagesResponse.model_validate_json(body)
    message: dict[str, Any] | None = None
    partial_json: dict[int, str] = {}
    done = False
    for name, payload in sse_events(body):
        if not isinstance(payload, dict):
            continue
        kind = payload.get("type") or name
        if kind == "error":
            raise ValueError(f"the Messages stream returned an error event: {payload!r:.200}")
        if kind == "message_start":
            message = dict(payload.get("message") or {})
            message["content"] = list(message.get("content") or [])
            continue
        if message is None:
            continue
        index = payload.get("index")
        if kind == "content_block_start" and isinstance(index, int):
            while len(message["content"]) <= index:
                message["content"].append({})
            message["content"][index] = dict(payload.get("content_block") or {})
            _add_block_record(message["content"][index], payload)
        elif kind == "content_block_delta" and isinstance(index, int) and index < len(message["content"]):
            block, delta = message["content"][index], payload.get("delta") or {}
            for key, field in (("text_delta", "text"), ("thinking_delta", "thinking"),
                               ("signature_delta", "signature")):
                if delta.get("type") == key:
                    block[field] = (block.get(field) or "") + (delta.get(field) or "")
            if delta.get("type") == "input_json_delta":
                partial_json[index] = partial_json.get(index, "") + (delta.get("partial_json") or "")
            _add_block_record(block, payload)
        elif kind == "content_block_stop" and isinstance(index, int) and index in partial_json:
            message["content"][index]["input"] = json.loads(partial_json.pop(index) or "{}")
        elif kind == "message_delta":
            message.update({k: v for k, v in (payload.get("delta") or {}).items() if v is not None})
            if isinstance(payload.get("usage"), dict):
                message["usage"] = {**(message.get("usage") or {}), **payload["usage"]}
            message.update({k: payload[k] for k in _MESSAGES_RECORD_KEYS if payload.get(k) is not None})
        elif kind == "message_stop":
            done = True
    if message is None or not done:
        raise ValueError("incomplete Messages stream (no message_stop event)")
    return _MessagesResponse.model_validate(message)


def _add_block_record(block: dict[str, Any], payload: dict[str, Any]) -> None:
    """A content block's own sampled ids and logprobs, when the server streams them per block."""
    for key in ("token_ids", "logprobs"):
        if isinstance(payload.get(key), list):
            block[key] = [*block.get(key, []), *payload[key]]


def exchange_policy_versions(exchanges: TrajectoryExchanges) -> list[int]:
    """The policy version (training step) each sampled turn of `exchanges` records (artrl's server puts
    `policy_version` on each chat / completions choice, on a Responses generation or response, and on a Messages
    response), in the order of `TrajectoryExchanges.all()`; turns that record none are left out."""
    found: list[Any] = []
    for _, exchange in exchanges.all():
        response = exchange.response
        extra = getattr(response, "model_extra", None) or {}
        if isinstance(exchange, (ChatCompletionsExchange, CompletionsExchange)):
            found += [(c.model_extra or {}).get("policy_version") for c in response.choices]
        elif isinstance(exchange, ResponsesExchange) and isinstance(extra.get("token_generations"), list):
            found += [g.get("policy_version", extra.get("policy_version")) for g in extra["token_generations"]
                      if isinstance(g, dict)]
        else:
            found.append(extra.get("policy_version"))
    return [v for v in found if isinstance(v, int) and not isinstance(v, bool)]


def exchange_policy_token_spans(exchanges: TrajectoryExchanges) -> list[Any]:
    """The `policy_token_spans` (ART's field: which version sampled each run of tokens, recorded with in-flight
    adapter updates) of each sampled turn of `exchanges` that carries them, where `exchange_policy_versions`
    reads `policy_version`."""
    found: list[Any] = []
    for _, exchange in exchanges.all():
        response = exchange.response
        extra = getattr(response, "model_extra", None) or {}
        if isinstance(exchange, (ChatCompletionsExchange, CompletionsExchange)):
            found += [(c.model_extra or {}).get("policy_token_spans") for c in response.choices]
        elif isinstance(exchange, ResponsesExchange) and isinstance(extra.get("token_generations"), list):
            found += [g.get("policy_token_spans") for g in extra["token_generations"] if isinstance(g, dict)]
        else:
            found.append(extra.get("policy_token_spans"))
    return [spans for spans in found if isinstance(spans, list) and spans]


def exchange_completion_tokens(exchanges: TrajectoryExchanges) -> int | None:
    """The tokens the responses of `exchanges` generated, from their `usage` (ART's count); None when any
    response reports no usage."""
    counts: list[Any] = []
    for _, exchange in exchanges.all():
        usage = getattr(exchange.response, "usage", None)
        if isinstance(usage, dict):
            counts.append(usage.get("output_tokens"))
        elif isinstance(exchange, (ChatCompletionsExchange, CompletionsExchange)):
            counts.append(getattr(usage, "completion_tokens", None))
        else:
            counts.append(getattr(usage, "output_tokens", None))
    if not counts or not all(isinstance(c, int) for c in counts):
        return None
    return sum(counts)
