"""A chat completion request as the server reads it: its fields, its bounds, and the order of the checks.

From the raw body to a `ChatCompletionRequest` (serve/http/server.py calls these in this order):

1. `check_content_type`: a body sent as anything but JSON (`text/plain`, a form) is a 400, as in
   OpenAI's API; a request without a `Content-Type` is read as JSON.
2. `count_items` + `check_counts`, for a body over `INLINE_PARSE_BYTES` only: how many messages and
   tools it holds, read by pydantic-core's JSON parser without building one Python object per
   message or tool (a 6 MB body of 50,000 tools: about 0.06 s, against 0.5-1 s to build them; the
   interpreter lock is held either way, so every other request waited that long). A count over its
   limit is refused here, before the body is parsed whole.
3. `parse_body`: the fields, strictly typed as in OpenAI's API (`max_tokens: "8"`, a string, is a
   400, not 8); unknown fields are kept and logged once by the server.
4. `check_counts` again (a small body skipped step 2), `check_tools`: each tool is
   `{"type": "function", "function": {"name": ...}}` (a tool without its function is a 400), and
   `check_tool_choice`.

Each refusal is an `APIError` naming the parameter (OpenAI's `param`) and, for a limit, the
`create_app` argument that sets it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict
from pydantic_core import SchemaValidator, core_schema

from .guards import APIError

DEFAULT_MAX_N = 32
DEFAULT_MAX_MESSAGES = 2048
"""Most messages one request may hold (a long agent rollout of 1,000 tool calls holds about 2,000)."""
DEFAULT_MAX_TOOLS = 128
"""Most tools one request may offer (OpenAI's limit)."""
DEFAULT_MAX_SCHEMA_CHARS = 100_000
"""Longest `response_format` one request may send, in characters of its JSON (it is compiled into a grammar)."""
INLINE_PARSE_BYTES = 256 * 1024
"""Request bodies larger than this are counted (step 2 of the module docstring), then parsed and validated on a
worker thread; smaller ones are parsed in place."""


class ChatCompletionRequest(BaseModel):
    """The request fields we read; unknown fields are accepted and logged. Strict: a number sent as a string, or a
    boolean as a number, is refused (OpenAI's API refuses them too)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[Any]
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    stream: bool | None = False
    # vLLM's extension: logprob tokens read "token_id:<id>" instead of the token text.
    return_tokens_as_token_ids: bool | None = False


IGNORED_FIELDS = {"user", "stream_options", "metadata", "store", "service_tier"}
"""Fields of OpenAI's API the server accepts and does nothing with, without a warning."""
ROUTER_DEFAULTS = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                   "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                   "return_hidden_states": False, "include_reasoning": True}
"""Fields vllm-router adds to every request it forwards (replicas/router.py), with the values it gives them: at
these values they ask for nothing artrl's server does not do anyway, so they pass without a warning (another value
is warned about as any unsupported parameter)."""


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold, checked before any of it is validated, rendered or tokenized (`create_app`)."""

    max_n: int = DEFAULT_MAX_N
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_tools: int = DEFAULT_MAX_TOOLS
    max_schema_chars: int = DEFAULT_MAX_SCHEMA_CHARS


@dataclass(frozen=True)
class ItemCounts:
    """How many messages and tools a request holds."""

    messages: int
    tools: int


def check(condition: bool, message: str, param: str | None) -> None:
    if not condition:
        raise APIError(400, message, param=param)


def check_content_type(content_type: str | None) -> None:
    """A body in any media type but JSON is a 400 (module docstring, step 1)."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    check(media == "application/json" or media.endswith("+json"),
          f"Unsupported content type: {content_type!r}. This API method only accepts 'application/json' requests, "
          f"but you specified the header 'Content-Type: {content_type}'. Please try again with a supported content "
          "type.", None)


# Each message or tool, if it is an object, as an empty dict: its keys are skipped by the parser, not built.
_SKIPPED_ITEM = core_schema.union_schema(
    [core_schema.typed_dict_schema({}, extra_behavior="ignore"), core_schema.any_schema()], mode="left_to_right")
_COUNTERS: dict[str, SchemaValidator] = {}


def _counter(items: str) -> SchemaValidator:
    """A validator that keeps only the lists `items` (chat's `messages`, the Responses `input`...) and `tools`,
    their members skipped; a non-list `items` (the Responses API's string input) counts as none."""
    if items not in _COUNTERS:
        listed = core_schema.union_schema([core_schema.list_schema(_SKIPPED_ITEM), core_schema.any_schema()],
                                          mode="left_to_right")
        _COUNTERS[items] = SchemaValidator(core_schema.typed_dict_schema({
            items: core_schema.typed_dict_field(listed, required=False),
            "tools": core_schema.typed_dict_field(
                core_schema.nullable_schema(core_schema.list_schema(_SKIPPED_ITEM)), required=False),
        }, extra_behavior="ignore"))
    return _COUNTERS[items]


def count_items(raw: bytes, items: str = "messages") -> ItemCounts | None:
    """How many messages (the list named `items`) and tools the JSON body `raw` holds, without building them
    (module docstring, step 2); None when the body is not an object with those lists (the parser then says what
    is wrong)."""
    try:
        shape = _counter(items).validate_json(raw)
    except pydantic.ValidationError as error:
        if any(e["type"] == "json_invalid" for e in error.errors()):
            raise RequestValidationError(error.errors(include_url=False)) from error
        return None
    listed = shape.get(items)
    return ItemCounts(len(listed) if isinstance(listed, list) else 0, len(shape.get("tools") or ()))


def parse_body(raw: bytes) -> ChatCompletionRequest:
    """The request body, checked (a failure is the RequestValidationError FastAPI would raise, answered 400)."""
    try:
        return ChatCompletionRequest.model_validate_json(raw)
    except pydantic.ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False)) from error


def check_counts(counts: ItemCounts, limits: RequestLimits, items: str = "messages") -> None:
    """The cheap bounds: list lengths, before the messages are even validated (`items`: the field that holds
    them in the request's protocol)."""
    check(counts.messages <= limits.max_messages,
          f"{items} holds {counts.messages} {'messages' if items == 'messages' else 'items'}; this server takes at "
          f"most {limits.max_messages} per request (create_app(max_messages=...)).", items)
    check(counts.tools <= limits.max_tools,
          f"tools holds {counts.tools} tools; this server takes at most {limits.max_tools} per request "
          "(create_app(max_tools=...)).", "tools")


def check_parsed(body: ChatCompletionRequest, limits: RequestLimits) -> None:
    """The bounds and shapes of a parsed request that need no engine: counts, schema size, tools, tool_choice."""
    check_counts(ItemCounts(len(body.messages), len(body.tools or ())), limits)
    if body.response_format is not None:
        chars = len(json.dumps(body.response_format))
        check(chars <= limits.max_schema_chars,
              f"response_format is {chars} characters of JSON; this server takes at most {limits.max_schema_chars} "
              "(create_app(max_schema_chars=...)).", "response_format")
    check_tools(body.tools or [])
    check_tool_choice(body)


def check_tools(tools: list[dict[str, Any]]) -> None:
    """Each tool is `{"type": "function", "function": {"name": ..., "parameters": {...}}}` (OpenAI's shape)."""
    for k, tool in enumerate(tools):
        shape = ('each tool must be {"type": "function", "function": {"name": ..., "description": ..., '
                 '"parameters": {...}}}')
        check(tool.get("type") == "function", f"tools[{k}].type must be 'function', got {tool.get('type')!r:.100}; "
              f"{shape}.", f"tools[{k}].type")
        function = tool.get("function")
        check(isinstance(function, dict), f"Missing required parameter: 'tools[{k}].function' ({shape}).",
              f"tools[{k}].function")
        name = function.get("name")
        check(isinstance(name, str) and bool(name),
              f"tools[{k}].function.name must be a non-empty string, got {name!r:.100}.", f"tools[{k}].function.name")
        parameters = function.get("parameters")
        check(parameters is None or isinstance(parameters, dict),
              f"tools[{k}].function.parameters must be a JSON schema object, got {parameters!r:.100}.",
              f"tools[{k}].function.parameters")


def check_tool_choice(body: ChatCompletionRequest) -> None:
    """Accept "none" / "auto" / "required" / a named function offered in `tools` (enforced by a grammar)."""
    choice = body.tool_choice
    if choice is None or choice in ("none", "auto", "required"):
        return
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    check(
        isinstance(name, str),
        f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}, '
        f"got {choice!r:.200}",
        "tool_choice",
    )
    offered = [t.get("function", {}).get("name") for t in body.tools or []]
    check(name in offered, f"tool_choice names the function {name!r}, which is not in tools {offered}", "tool_choice")
