"""`POST /v1/responses`: OpenAI's Responses API over the request core, with the token record.

The request maps onto the core's canonical (chat) request:

* `instructions` is a first `system` message; `input`, a string (one user message) or a list of items:
  messages (`user` / `assistant` / `system` / `developer`, the last read as `system`; content a string or
  `input_text` / `output_text` / `input_image` parts), `function_call` items (consecutive ones, and those
  right after an assistant message, are that assistant turn's tool calls) and `function_call_output` items
  (a `tool` message answering `call_id`);
* `previous_response_id` puts the conversation of a response this server gave (its input, without its
  `instructions`, as OpenAI's API does, and its output) before `input`. The server keeps the responses it gave
  in a bounded store (`ResponseStore`: least recently used out past `max_bytes` of memory held); `store: false`
  keeps one out of it; an unknown id is a 404 naming `previous_response_id`;
* function `tools` and `tool_choice` as chat's; `text.format` (`json_object`, `json_schema`) is chat's
  `response_format`; `max_output_tokens` is `max_tokens`; `top_logprobs`.

Refused with a 400 naming the field, never ignored: built-in tools (web search, file search...), `reasoning`
with an effort or summary, `truncation: "auto"`, `background: true`, `conversation`, input items of other types
(`reasoning`, `item_reference`...).

The reply is a `response`: a `message` item (one `output_text` part; its `logprobs` are those of the text's
tokens when `include` asks for `message.output_text.logprobs`, else empty) and one `function_call` item per
call; `status` `completed`, or `incomplete` with `incomplete_details.reason` `max_output_tokens`; `usage`. The
token record is one entry of `token_generations` (the field ART's capture reads): `prompt_token_ids`,
`token_ids`, `compact_logprobs` (one float per sampled id), `output_indices` (the output items it sampled: all
of them) and `policy_version`. Streamed, the events are OpenAI's (`response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` / `.done`,
`response.function_call_arguments.delta` / `.done`, `response.output_item.done`, ...), ending as OpenAI's do with
the event of the response's `status`, carrying the whole response and its record: `response.completed`, or
`response.incomplete` for a reply cut by `max_output_tokens`; an engine failure after the stream began is an
`error` event, then `response.failed` (a response of status `failed` with its `error`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

import fastapi
from fastapi.responses import JSONResponse, StreamingResponse

from ..core import Prepared, RequestCore
from ..guards import APIError
from .common import TOOL_FIELDS_AT_TOP, named_event, read_body, record_fields, renamed_params, sampled_logprobs
from ..request import ChatCompletionRequest, OpenAIRequest, StreamOptions
from ..streaming import text_pieces

PATH = "/v1/responses"
DEFAULT_STORE_BYTES = 64 * 1024 * 1024
"""Bytes of memory the conversations the server keeps for `previous_response_id` may hold (`ResponseStore`)."""
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


_ENTRY_BYTES = sys.getsizeof((None, 0)) + 104
"""What one entry adds around its conversation: its (messages, size) tuple and its place in the ordered dict."""


class ResponsesRequest(OpenAIRequest):
    """The Responses request fields this route takes (any other, `n` included, is refused:
    serve/http/body_policy.py). Strict types, as the chat route's."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = True
    prompt_cache_retention: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: Any = None
    max_tool_calls: int | None = None


def held_bytes(value: Any) -> int:
    """The memory the Python objects of a JSON-like `value` take: `sys.getsizeof` of every dict, list and string
    in it (each object once) and of the scalars, what tracemalloc sees held, up to the allocator's rounding."""
    seen: set[int] = set()
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


class ResponseStore:
    """The conversations of the responses given (chat messages: input and output), by response id, for
    `previous_response_id`; bounded by the memory they hold (`held_bytes`: the dicts, lists and strings of each
    conversation, not its JSON, which is several times smaller for short messages), least recently used out
    first. One store per server, answering any holder of the server's key (a server has one key)."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """The bytes the kept conversations hold, as counted (at most `max_bytes`)."""
        return self._bytes

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        size = held_bytes(messages) + sys.getsizeof(response_id) + _ENTRY_BYTES
        with self._lock:
            old_entry = self._items.pop(response_id, None)
            if old_entry is not None:
                self._bytes -= old_entry[1]
            self._items[response_id] = (messages, size)
            self._bytes += size
            while self._bytes > self.max_bytes and self._items:
                _, (_, old) = self._items.popitem(last=False)
                self._bytes -= old

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is None:
                return None
            self._items.move_to_end(response_id)
            return list(item[0])

    def __len__(self) -> int:
        return len(self._items)


def _text_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: text, or text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise APIError(400, f"{where}[{k}]: a message takes input_text, output_text and input_image parts (an "
                                f"image by image_url), got {kind if kind else part!r:.100}", param=f"{where}[{k}]")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(items: str | list[Any], earlier: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """`input` as chat messages (module docstring), after the conversation `earlier` (a `previous_response_id`'s):
    a `function_call_output` must answer a `function_call` of one of them or of an item before it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    calls = {call.get("id") for message in earlier for call in message.get("tool_calls") or ()}
    out: list[dict[str, Any]] = []
    joinable = False  # the last message is an assistant turn that later function_call items belong to
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an input item object, got {item!r:.100}", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got "
                                    f"{role!r:.50}", param=f"{where}.role")
            content = _text_parts(item.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
            joinable = role == "assistant"
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and name and isinstance(arguments, str) and isinstance(call_id, str)):
                raise APIError(400, f"{where} must be {{'type': 'function_call', 'call_id': ..., 'name': ..., "
                                    f"'arguments': '<JSON>'}}, got {item!r:.150}", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if not joinable:
                out.append({"role": "assistant", "content": None})
                joinable = True
            out[-1].setdefault("tool_calls", []).append(call)
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or output is None:
                raise APIError(400, f"{where} must be {{'type': 'function_call_output', 'call_id': ..., 'output': "
                                    f"...}}, got {item!r:.150}", param=where)
            if call_id not in calls:
                raise APIError(400, f"No tool call found for function call output with call_id {call_id!r:.100} "
                                    f"({where}): a function_call_output answers a function_call item before it (or "
                                    "in the response previous_response_id names).", param=f"{where}.call_id")
            text = output if isinstance(output, str) else _text_parts(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            joinable = False
        else:
            raise APIError(400, f"{where}: input items of type {kind!r:.50} are not taken here (messages, "
                                "function_call and function_call_output are).", param=f"{where}.type")
    return out


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise APIError(400, f"tools[{k}] is a {kind!r:.50} tool; this server offers function tools only "
                                "({'type': 'function', 'name': ..., 'parameters': {...}}).", param=f"tools[{k}]")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, got "
                        f"{choice!r:.150}", param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": {"name": "output", **schema}}
    raise APIError(400, "text.format must be {'type': 'text' | 'json_object'} or {'type': 'json_schema', 'name': ..., "
                        f"'schema': {{...}}}}, got {fmt!r:.150}", param="text.format")


def _refuse_unsupported(body: ResponsesRequest) -> None:
    reasoning = body.reasoning or {}
    if any(reasoning.get(key) is not None for key in ("effort", "summary", "generate_summary")):
        raise APIError(400, f"reasoning={body.reasoning!r:.100}: this server has no reasoning settings; send the "
                            "request without them.", param="reasoning")
    if body.truncation not in (None, "disabled"):
        raise APIError(400, f"truncation={body.truncation!r}: this server never drops input to fit the context (a "
                            "prompt too long for it is a 400); send 'disabled' or nothing.", param="truncation")
    if body.background:
        raise APIError(400, "background=true: this server answers in the request; send the request without it.",
                       param="background")
    if body.conversation is not None:
        raise APIError(400, "conversation: this server keeps no conversations; chain responses with "
                            "previous_response_id.", param="conversation")
    if body.max_tool_calls is not None:
        raise APIError(400, "max_tool_calls limits built-in tool calls, which this server does not run; send the "
                            "request without it.", param="max_tool_calls")
    for k, item in enumerate(body.include or []):
        if item != LOGPROBS_INCLUDE:
            raise APIError(400, f"include[{k}]={item!r:.80}: this server can include {LOGPROBS_INCLUDE!r} only.",
                           param=f"include[{k}]")


def chat_request(body: ResponsesRequest, store: ResponseStore) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """(The core's canonical request, the conversation to keep for a later `previous_response_id`)."""
    _refuse_unsupported(body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        found = store.get(body.previous_response_id)
        if found is None:
            raise APIError(404, f"Previous response with id {body.previous_response_id!r} not found: this server "
                                f"keeps the {len(store)} most recent responses it stored (and none given with "
                                "store=false). Send the whole conversation as input instead.",
                           param="previous_response_id", code="previous_response_not_found")
        history = found
    conversation = history + input_messages(body.input, history)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    logprobs = LOGPROBS_INCLUDE in (body.include or []) or bool(body.top_logprobs)
    request = ChatCompletionRequest(
        model=body.model, messages=system + conversation, max_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, tools=_tools(body.tools) if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text), logprobs=logprobs, top_logprobs=body.top_logprobs)
    return request, conversation


def _ids(prepared: Prepared) -> tuple[str, str]:
    """(response id, message item id); function call item k is `fc_<hex>_<k>`."""
    hex_id = prepared.head["id"].removeprefix("chatcmpl-")
    return f"resp_{hex_id}", f"msg_{hex_id}"


def _text_logprobs(prepared: Prepared, choice: dict[str, Any], asked: bool) -> list[dict[str, Any]]:
    """The logprobs entries of the tokens that spell the message text (when `include` asks for them)."""
    content = choice["message"].get("content") or ""
    if not asked or not content:
        return []
    entries = choice["logprobs"]["content"]
    end = max((stop for _, _, stop in text_pieces(prepared.tokenizer, choice["token_ids"], content)), default=0)
    return [_entry(e) for e in entries[:end]]


def _entry(entry: dict[str, Any]) -> dict[str, Any]:
    return {"token": entry["token"], "bytes": entry["bytes"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "bytes": t["bytes"], "logprob": t["logprob"]}
                             for t in entry.get("top_logprobs") or []]}


def _message_item(item_id: str, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _call_item(response_id: str, k: int, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{response_id.removeprefix('resp_')}_{k}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def _skeleton(prepared: Prepared, body: ResponsesRequest, status: str) -> dict[str, Any]:
    response_id, _ = _ids(prepared)
    return {
        "id": response_id, "object": "response", "created_at": prepared.head["created"], "status": status,
        "model": body.model, "output": [], "error": None, "incomplete_details": None,
        "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "tools": body.tools or [], "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": body.text or {"format": {"type": "text"}}, "store": body.store is not False,
        "metadata": body.metadata or {}, "usage": None,
    }


def response_json(prepared: Prepared, body: ResponsesRequest, response: dict[str, Any]) -> dict[str, Any]:
    """The Responses reply for the core's finished chat completion (one choice)."""
    choice = response["choices"][0]
    message = choice["message"]
    response_id, message_id = _ids(prepared)
    output: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        asked = LOGPROBS_INCLUDE in (body.include or []) or bool(body.top_logprobs)
        output.append(_message_item(message_id, message.get("content") or "", _text_logprobs(prepared, choice, asked),
                                    "completed"))
    output.extend(_call_item(response_id, k, call, "completed") for k, call in enumerate(calls))
    incomplete = choice["finish_reason"] == "length"
    sampled = len(choice["token_ids"])
    generation = {"prompt_token_ids": prepared.prompt_ids, "token_ids": choice["token_ids"],
                  "compact_logprobs": sampled_logprobs(choice), "output_indices": list(range(len(output))),
                  **record_fields(choice)}
    return {
        **_skeleton(prepared, body, "incomplete" if incomplete else "completed"),
        "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "usage": {"input_tokens": len(prepared.prompt_ids),
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": sampled, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": len(prepared.prompt_ids) + sampled},
        "token_generations": [generation],
    }


def _assistant_message(response: dict[str, Any]) -> dict[str, Any]:
    """The reply as the chat message a later `previous_response_id` request continues from."""
    message = response["choices"][0]["message"]
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


async def response_events(prepared: Prepared, body: ResponsesRequest, chunks: AsyncIterator[dict[str, Any]],
                          keep: Any) -> AsyncIterator[bytes]:
    """The core's chat chunks as the Responses API's stream events (module docstring); `keep(response)` stores
    the finished one."""
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return named_event(kind, data)

    response_id, message_id = _ids(prepared)
    asked = LOGPROBS_INCLUDE in (body.include or []) or bool(body.top_logprobs)
    yield event("response.created", response=_skeleton(prepared, body, "in_progress"))
    yield event("response.in_progress", response=_skeleton(prepared, body, "in_progress"))
    output_index, text, message_open, calls = -1, "", False, 0
    text_entries: list[dict[str, Any]] = []

    def open_message() -> Iterator[bytes]:
        nonlocal output_index, message_open
        output_index, message_open = output_index + 1, True
        yield event("response.output_item.added", output_index=output_index,
                    item={**_message_item(message_id, "", [], "in_progress"), "content": []})
        yield event("response.content_part.added", item_id=message_id, output_index=output_index, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def close_message() -> Iterator[bytes]:
        nonlocal message_open
        message_open = False
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": text_entries}
        yield event("response.output_text.done", item_id=message_id, output_index=output_index, content_index=0,
                    text=text, logprobs=text_entries)
        yield event("response.content_part.done", item_id=message_id, output_index=output_index, content_index=0,
                    part=part)
        yield event("response.output_item.done", output_index=output_index,
                    item=_message_item(message_id, text, text_entries, "completed"))

    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if "error" in chunk:  # the engine failed after the stream began: an error, then the failed response
                error = chunk["error"]
                yield event("error", code=error.get("code"), message=error["message"], param=None)
                failed = {**_skeleton(prepared, body, "failed"),
                          "error": {"code": error.get("code") or "server_error", "message": error["message"]}}
                yield event("response.failed", response=failed)
                return
            for part in chunk.get("choices") or []:
                delta = part.get("delta") or {}
                if delta.get("content"):
                    if not message_open:
                        for out in open_message():
                            yield out
                    text += delta["content"]
                    entries = [_entry(e) for e in (part.get("logprobs") or {}).get("content") or []] if asked else []
                    text_entries.extend(entries)
                    yield event("response.output_text.delta", item_id=message_id, output_index=output_index,
                                content_index=0, delta=delta["content"], logprobs=entries)
                for call in delta.get("tool_calls") or []:
                    if message_open:
                        for out in close_message():
                            yield out
                    output_index += 1
                    item = _call_item(response_id, calls, call, "completed")
                    calls += 1
                    yield event("response.output_item.added", output_index=output_index,
                                item={**item, "arguments": "", "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=output_index, delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=output_index, arguments=item["arguments"], name=item["name"])
                    yield event("response.output_item.done", output_index=output_index, item=item)
                if part.get("finish_reason") is not None:
                    assert prepared.response is not None  # the core keeps it before the last chunks go out
                    final = response_json(prepared, body, prepared.response)
                    if not message_open and final["output"] and final["output"][0]["type"] == "message" \
                            and output_index < 0:  # an empty reply: its (empty) message item all the same
                        for out in open_message():
                            yield out
                    if message_open:
                        text_entries = final["output"][0]["content"][0]["logprobs"]  # the text's, as whole
                        for out in close_message():
                            yield out
                    keep(prepared.response)
                    yield event(f"response.{final['status']}", response=final)  # completed, or incomplete


def add_route(app: fastapi.FastAPI, core: RequestCore, store_bytes: int = DEFAULT_STORE_BYTES) -> None:
    """`POST /v1/responses` on `app`, with a `ResponseStore` of `store_bytes` (`app.state.responses`)."""
    store = ResponseStore(store_bytes)
    app.state.responses = store

    @app.post(PATH)
    async def responses(http: fastapi.Request) -> fastapi.Response:
        body = await read_body(http, ResponsesRequest, core, items="input")
        request, conversation = chat_request(body, store)
        with renamed_params(_NAMES, TOOL_FIELDS_AT_TOP):
            prepared = await core.prepare(request)
        response_id, _ = _ids(prepared)

        def keep(response: dict[str, Any]) -> None:
            if body.store is not False:
                store.put(response_id, conversation + [_assistant_message(response)])

        if body.stream:
            with renamed_params(_NAMES, TOOL_FIELDS_AT_TOP):
                chunks = await core.stream(prepared, http)
            return StreamingResponse(response_events(prepared, body, chunks, keep), media_type="text/event-stream")
        with renamed_params(_NAMES, TOOL_FIELDS_AT_TOP):
            response = await core.complete(prepared, http)
        keep(response)
        return JSONResponse(response_json(prepared, body, response))
