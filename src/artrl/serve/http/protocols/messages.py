"""`POST /v1/messages`: Anthropic's Messages API over the request core, with the token record.

The request maps onto the core's canonical (chat) request:

* `system` (text, or a list of text blocks) is the first message, role `system`;
* a user turn's `text` blocks are its content, `image` blocks (base64 or url source) image parts, and each
  `tool_result` block a `tool` message answering its `tool_use_id` (before the user's text, as Anthropic
  orders them; its text content only, and `is_error` is not rendered: chat templates have no place for it);
  an assistant turn's `text` blocks are its content and its `tool_use` blocks its tool calls
  (`input` as the arguments JSON), so that a reply this server gave, sent back, is spelled with the ids it
  sampled (docs/token-record.md);
* `output_config.format` (`json_schema`) is chat's `response_format` (the reply is held to the schema by a
  grammar, as chat's);
* `tools` (`name`, `description`, `input_schema`) are function tools; `tool_choice` `auto` / `any` / `tool` /
  `none` is chat's `auto` / `required` / a named function / `none` (`disable_parallel_tool_use`:
  one call at most); `stop_sequences` are stop strings, `max_tokens` (required) the budget.

Refused with a 400 naming the field, never ignored: `top_k` (the engines sample with temperature and top-p only),
`thinking` other than disabled, `output_config.effort`, a last assistant turn (Anthropic continues such a
prefill; this server does not), content blocks of other types (`thinking`, `document`, server tools).

The reply is Anthropic's `message`: a `text` block, then one `tool_use` block per call (`input`: the
arguments the model wrote, which must be a JSON object; a call whose arguments are not one stays text),
`stop_reason` `end_turn` / `max_tokens` / `stop_sequence` (with `stop_sequence`) / `tool_use`, `usage`, and the
token record at its top level: `prompt_token_ids`, `token_ids`, `logprobs` (one float per sampled id) and
`policy_version`. Streamed (`stream: true`), the events are Anthropic's (`message_start`, per block
`content_block_start` / `content_block_delta` / `content_block_stop`, `message_delta`, `message_stop`),
`message_start` carrying `prompt_token_ids` and `message_delta` the whole record; errors are Anthropic's
`{"type": "error", "error": {...}}`, as a response before the stream starts and an `error` event after.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import fastapi
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..core import Prepared, RequestCore, matched_stop
from ..guards import APIError, anthropic_error
from .common import named_event, read_body, record_fields, renamed_params, sampled_logprobs
from ..request import ChatCompletionRequest

logger = logging.getLogger(__name__)

PATH = "/v1/messages"
_NAMES = {"response_format": "output_config.format"}
"""Core refusals named as this protocol spells the field."""
_PATHS = ((r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
          (r"^tools\[(\d+)\]\.function\.(\w+)", r"tools[\1].\2"))
"""A chat tool's fields as a Messages tool spells them (`input_schema`, `name` at the tool's top)."""


class MessagesRequest(BaseModel):
    """The Messages request fields this route takes (any other, `n` included, is refused in Anthropic's words:
    serve/http/body_policy.py). Strict types, as the chat route's. `metadata`, `service_tier`, `cache_control`,
    `inference_geo` and `speed` ask nothing of sampling: taken, and not used."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int
    messages: list[Any]
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None


def _text_of(blocks: Any, where: str) -> str:
    """Text blocks (or a string) as one string; another block type is a 400."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks, got {blocks!r:.100}", param=where)
    texts = []
    for k, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{k}] must be a text block {{'type': 'text', 'text': ...}}, got "
                                f"{block!r:.100}", param=f"{where}[{k}]")
        texts.append(block["text"])
    return "".join(texts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise APIError(400, f"{where}.source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} or "
                            f"{{'type': 'url', 'url': ...}}, got {source!r:.100}", param=f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_turn(content: Any, where: str, calls: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """A user turn as chat messages: its tool results (one `tool` message each, answering one of `calls`, the ids of
    the previous assistant turn's `tool_use` blocks, as Anthropic's API requires), then its text and images."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", param=where)
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        at = f"{where}[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, f"{at}.tool_use_id must be the id of the tool_use block it answers",
                               param=f"{at}.tool_use_id")
            if call_id not in calls:
                raise APIError(400, f"{at}: unexpected `tool_use_id` found in `tool_result` blocks: {call_id:.100}. "
                                    "Each `tool_result` block must have a corresponding `tool_use` block in the "
                                    "previous message.", param=f"{at}.tool_use_id")
            inner = block.get("content", "")
            text = _text_of(inner, f"{at}.content") if inner is not None else ""
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise APIError(400, f"{at}: a user turn takes text, image and tool_result blocks, got "
                                f"{kind if kind else block!r:.100}", param=at)
    out = list(results)
    if parts:
        plain = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts) if plain else parts})
    return out


def _assistant_turn(content: Any, where: str) -> dict[str, Any]:
    """An assistant turn as one chat message: its text, and its `tool_use` blocks as tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", param=where)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        at = f"{where}[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(arguments, dict):
                raise APIError(400, f"{at} must be {{'type': 'tool_use', 'id': ..., 'name': ..., 'input': {{...}}}}",
                               param=at)
            calls.append({"id": block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        else:
            raise APIError(400, f"{at}: an assistant turn takes text and tool_use blocks, got "
                                f"{kind if kind else block!r:.100}", param=at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or "input_schema" not in tool:
            raise APIError(400, f"tools[{k}] must be a client tool {{'name': ..., 'description': ..., "
                                f"'input_schema': {{...}}}}; server tools are not offered here, got {tool!r:.150}",
                           param=f"tools[{k}]")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat's `tool_choice`, `parallel_tool_calls`) for Anthropic's `tool_choice`."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, f"tool_choice must be {{'type': 'auto' | 'any' | 'none'}} or {{'type': 'tool', 'name': ...}}, "
                        f"got {choice!r:.150}", param="tool_choice")


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The core's canonical request for a Messages request (module docstring)."""
    if body.top_k is not None:
        raise APIError(400, f"top_k={body.top_k}: this server samples with temperature and top_p only; send the "
                            "request without top_k.", param="top_k")
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise APIError(400, f"thinking={body.thinking!r:.100}: extended thinking is not offered by this server; send "
                            "the request without it (or with {'type': 'disabled'}).", param="thinking")
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant") or "content" not in message:
            raise APIError(400, f"{where} must be {{'role': 'user' | 'assistant', 'content': ...}}, got "
                                f"{message!r:.150}", param=f"{where}.role")
        content = message["content"]
        if role == "user":
            previous = messages[-1] if messages and messages[-1]["role"] == "assistant" else {}
            calls = frozenset(call["id"] for call in previous.get("tool_calls") or ())
            messages.extend(_user_turn(content, f"{where}.content", calls))
        else:
            messages.append(_assistant_turn(content, f"{where}.content"))
    if body.messages and isinstance(body.messages[-1], dict) and body.messages[-1].get("role") == "assistant":
        last = len(body.messages) - 1
        raise APIError(400, f"messages[{last}] is an assistant turn: this server does not continue a prefilled "
                            "reply; end the messages with a user turn.", param=f"messages[{last}]")
    tool_choice, parallel = _tool_choice(body.tool_choice)
    return ChatCompletionRequest(
        model=body.model, messages=messages, max_tokens=body.max_tokens, temperature=body.temperature,
        top_p=body.top_p, stop=body.stop_sequences, tools=_tools(body.tools) if body.tools else None,
        tool_choice=tool_choice, parallel_tool_calls=parallel, response_format=_response_format(body.output_config))


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's `response_format` for `output_config` (`format`: `{"type": "json_schema", "schema": {...}}`)."""
    if not config:
        return None
    if config.get("effort") is not None:
        raise APIError(400, f"output_config.effort={config['effort']!r}: this server has no effort levels; send the "
                            "request without it.", param="output_config.effort")
    unknown = set(config) - {"effort", "format"}
    if unknown:
        raise APIError(400, f"output_config holds {sorted(unknown)}, which this server does not know.",
                       param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}, got "
                            f"{fmt!r:.150}", param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _tool_block(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed tool call as a `tool_use` block; one whose arguments are not a JSON object stays text."""
    arguments = call["function"]["arguments"]
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": parsed}
    logger.warning("A tool call's arguments are not a JSON object; it is returned as text: %.200s", arguments)
    return {"type": "text", "text": json.dumps({"name": call["function"]["name"], "arguments": arguments})}


def _stop(prepared: Prepared, choice: dict[str, Any]) -> tuple[str, str | None]:
    """(`stop_reason`, `stop_sequence`) of a finished chat choice."""
    if choice["finish_reason"] == "tool_calls":
        return "tool_use", None
    if choice["finish_reason"] == "length":
        return "max_tokens", None
    stop = matched_stop(prepared.tokenizer, choice["token_ids"], prepared.end_ids, prepared.request.stop_strings)
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def _record(prepared: Prepared, choice: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_token_ids": prepared.prompt_ids, "token_ids": choice["token_ids"],
            "logprobs": sampled_logprobs(choice), **record_fields(choice)}


def message_json(prepared: Prepared, response: dict[str, Any]) -> dict[str, Any]:
    """The Messages reply for the core's finished chat completion (one choice)."""
    choice = response["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content.extend(_tool_block(call) for call in message.get("tool_calls") or [])
    stop_reason, stop_sequence = _stop(prepared, choice)
    return {
        "id": f"msg_{prepared.head['id'].removeprefix('chatcmpl-')}", "type": "message", "role": "assistant",
        "model": prepared.body.model, "content": content, "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": len(prepared.prompt_ids), "output_tokens": len(choice["token_ids"])},
        **_record(prepared, choice),
    }


async def message_events(prepared: Prepared, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The core's chat chunks as Anthropic's stream events (module docstring)."""
    start = {"id": f"msg_{prepared.head['id'].removeprefix('chatcmpl-')}", "type": "message", "role": "assistant",
             "model": prepared.body.model, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": len(prepared.prompt_ids), "output_tokens": 0},
             "prompt_token_ids": prepared.prompt_ids}
    yield named_event("message_start", {"type": "message_start", "message": start})
    index, text_open = -1, False
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if "error" in chunk:  # the engine failed after the stream began
                error = chunk["error"]
                status = 503 if error.get("code") == "engine_closed" else 500
                yield named_event("error", anthropic_error(APIError(status, error["message"], type=error["type"])))
                return
            for part in chunk.get("choices") or []:
                delta = part.get("delta") or {}
                if delta.get("content"):
                    if not text_open:
                        index, text_open = index + 1, True
                        yield named_event("content_block_start", {"type": "content_block_start", "index": index,
                                                                  "content_block": {"type": "text", "text": ""}})
                    yield named_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                              "delta": {"type": "text_delta",
                                                                        "text": delta["content"]}})
                for call in delta.get("tool_calls") or []:
                    if text_open:
                        yield named_event("content_block_stop", {"type": "content_block_stop", "index": index})
                        text_open = False
                    index += 1
                    block = _tool_block(call)
                    if block["type"] == "tool_use":
                        opened = {**block, "input": {}}
                        step = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                    else:
                        opened, step = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
                    yield named_event("content_block_start", {"type": "content_block_start", "index": index,
                                                              "content_block": opened})
                    yield named_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                              "delta": step})
                    yield named_event("content_block_stop", {"type": "content_block_stop", "index": index})
                if part.get("finish_reason") is not None:
                    if text_open:
                        yield named_event("content_block_stop", {"type": "content_block_stop", "index": index})
                        text_open = False
                    assert prepared.response is not None  # the core keeps it before the last chunks go out
                    choice = prepared.response["choices"][0]
                    stop_reason, stop_sequence = _stop(prepared, choice)
                    yield named_event("message_delta", {
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": len(choice["token_ids"])},
                        **_record(prepared, choice)})
                    yield named_event("message_stop", {"type": "message_stop"})


def add_route(app: fastapi.FastAPI, core: RequestCore) -> None:
    """`POST /v1/messages` on `app`."""

    @app.post(PATH)
    async def messages(http: fastapi.Request) -> fastapi.Response:
        body = await read_body(http, MessagesRequest, core, items="messages")
        request = chat_request(body)
        with renamed_params(_NAMES, _PATHS):
            prepared = await core.prepare(request)
            if body.stream:
                return StreamingResponse(message_events(prepared, await core.stream(prepared, http)),
                                         media_type="text/event-stream")
            return JSONResponse(message_json(prepared, await core.complete(prepared, http)))
