"""A chat completion request as the server reads it: its fields, its bounds, and the order of the checks.

From the raw body to a `ChatCompletionRequest` (serve/http/server.py calls these in this order):

1. `check_content_type`: a body sent as anything but JSON (`text/plain`, a form) is a 400, as in
   OpenAI's API; a request without a `Content-Type` is read as JSON.
2. `scan_body`: the body's field names (every body), and, checked for a body over `INLINE_PARSE_BYTES`
   only (`check_counts`), how many messages and tools it holds, read by pydantic-core's JSON parser
   without building one Python object per message, tool or value (a 6 MB body of 50,000 tools: about 0.06 s, against 0.5-1 s to build them; the
   interpreter lock is held either way, so every other request waited that long). A count over its
   limit is refused here, before the body is parsed whole.
3. `parse_body`: the fields, strictly typed as in OpenAI's API (`max_tokens: "8"`, a string, is a
   400, not 8); a field the route does not take was refused at step 2 (serve/http/body_policy.py), from the
   names the scan read, and is skipped here.
4. `check_counts` again (a small body skipped step 2), `check_tools`: each tool is
   `{"type": "function", "function": {"name": ...}}` (a tool without its function is a 400), and
   `check_tool_choice`.

Each refusal is an `APIError` naming the parameter (OpenAI's `param`) and, for a limit, the
`create_app` argument that sets it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

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


ROUTER_DEFAULTS = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                   "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                   "return_hidden_states": False, "include_reasoning": True}
"""Fields vllm-router adds to every request it forwards (replicas/router.py), with the values it gives them: at
these values they ask for nothing artrl's server does not do anyway, so they are taken (another value is a 400)."""


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`, strictly typed: `{"include_usage": "yes"}`, a string, or an unknown key is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events; this server sends none


class OpenAIRequest(BaseModel):
    """What every OpenAI route takes besides its own fields: fields that ask nothing of sampling (`user`,
    `metadata`...), taken and not used, and vllm-router's fields (`ROUTER_DEFAULTS`), taken at their values only.

    Every request model is the list of what its route takes: a field it does not declare is refused before the
    body is parsed (serve/http/body_policy.py); the parse itself skips such fields (`extra="ignore"`) so that,
    where a server is set to serve them with a warning, their values are never built. Strict: a number sent as a
    string, or a boolean as a number, is refused (OpenAI's API refuses them too). `DEFAULT_ONLY`: fields taken at
    the value that asks for nothing only (`check_defaults`)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    DEFAULT_ONLY: ClassVar[dict[str, Any]] = ROUTER_DEFAULTS

    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    no_stop_trim: bool | None = None
    ignore_eos: bool | None = None
    continue_final_message: bool | None = None
    skip_special_tokens: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    return_hidden_states: bool | None = None
    include_reasoning: bool | None = None


PENALTY_DEFAULTS: dict[str, Any] = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}
"""OpenAI's sampling adjustments the engines do not apply: taken at the value that changes nothing only."""
VLLM_SAMPLING_DEFAULTS: dict[str, Any] = {"top_k": (-1, 0), "min_p": 0, "repetition_penalty": 1}
"""vLLM's sampling extras, which its clients send (often at these values): the built-in sampler has none of them
(and the token record's logprobs are those of temperature and top_p alone), so each is taken at the value (or
values: vLLM reads top_k -1 and 0 both as "off") that changes nothing only."""


class ChatCompletionRequest(OpenAIRequest):
    """The Chat Completions fields this server takes (the core's canonical request: every protocol's request
    becomes one)."""

    DEFAULT_ONLY: ClassVar[dict[str, Any]] = {**ROUTER_DEFAULTS, **PENALTY_DEFAULTS, **VLLM_SAMPLING_DEFAULTS}

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
    stream_options: StreamOptions | None = None
    store: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extension: logprob tokens read "token_id:<id>" instead of the token text.
    return_tokens_as_token_ids: bool | None = False
    # vLLM's extensions: variables the chat template reads (`{"enable_thinking": false}`), each one the tokenizer's
    # template reads (core.py, prompts.py: `template_kwargs_problem`); sampling extras at their neutral values only
    chat_template_kwargs: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


def check_defaults(body: BaseModel) -> None:
    """A field of `DEFAULT_ONLY` at another value than the one that asks for nothing is a 400 naming it."""
    for name, default in getattr(type(body), "DEFAULT_ONLY", {}).items():
        value = getattr(body, name, None)
        neutral = default if isinstance(default, tuple) else (default,)
        check(value is None or value in neutral,
              f"{name}={value!r:.100}: this server does not do what it asks; send "
              f"{' or '.join(json.dumps(v) for v in neutral)} or leave it out.", name)


def include_usage(body: Any) -> bool:
    """Whether `stream_options` asks for a usage chunk at the end of a stream."""
    options = getattr(body, "stream_options", None)
    return options is not None and bool(options.include_usage)


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


# What the scan (module docstring, step 2) keeps of a value it does not count: None, whatever the value (a failed
# match falls back to the default; the value is never built as Python objects).
_SKIPPED = core_schema.with_default_schema(core_schema.none_schema(), default=None, on_error="default")
_SCANNERS: dict[str, SchemaValidator] = {}


def _scanner(items: str | None) -> SchemaValidator:
    """A validator that keeps the top-level names of a body, the lists `items` (chat's `messages`, the Responses
    `input`...) and `tools` as lists of None (their members skipped), and every other value as None; a non-list
    `items` (the Responses API's string input) counts as none."""
    key = items or ""
    if key not in _SCANNERS:
        listed = core_schema.union_schema([core_schema.list_schema(_SKIPPED), _SKIPPED], mode="left_to_right")
        fields = {"tools": core_schema.typed_dict_field(listed, required=False)}
        if items:
            fields[items] = core_schema.typed_dict_field(listed, required=False)
        _SCANNERS[key] = SchemaValidator(core_schema.typed_dict_schema(
            fields, extra_behavior="allow", extras_schema=_SKIPPED))
    return _SCANNERS[key]


@dataclass(frozen=True)
class BodyShape:
    """What the scan of a body found: its top-level field names and how many messages and tools it holds."""

    names: tuple[str, ...]
    counts: ItemCounts


def scan_body(raw: bytes, items: str | None = "messages") -> BodyShape | None:
    """The field names of the JSON body `raw` and how many messages (the list named `items`) and tools it holds,
    without building any of its values (module docstring, step 2); None when the body is not a JSON object (the
    parser then says what is wrong)."""
    try:
        shape = _scanner(items).validate_json(raw)
    except pydantic.ValidationError as error:
        if any(e["type"] == "json_invalid" for e in error.errors(include_input=False)):
            raise RequestValidationError(error.errors(include_url=False, include_input=False)) from error
        return None
    listed = shape.get(items) if items else None
    tools = shape.get("tools")
    return BodyShape(tuple(shape), ItemCounts(len(listed) if isinstance(listed, list) else 0,
                                              len(tools) if isinstance(tools, list) else 0))


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


def check_tool_results(messages: list[Any]) -> None:
    """Each `tool` message answers a call: its `tool_call_id` is the id of a tool call of an earlier assistant
    message (OpenAI's API refuses one that is not, as the other protocols' routes refuse a tool result that
    answers no call). A tool message without a `tool_call_id` is left to the chat template, as vLLM does."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue  # said by the message check (prompts.py: request_messages)
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or ():
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    calls.add(call["id"])
        elif message.get("role") == "tool" and message.get("tool_call_id") is not None:
            call_id = message["tool_call_id"]
            check(isinstance(call_id, str) and call_id in calls,
                  f"Invalid parameter: 'tool_call_id' of {call_id!r:.100} not found in 'tool_calls' of an earlier "
                  f"assistant message (messages[{i}] answers no call).", f"messages[{i}].tool_call_id")
