"""ART 0.5.23's protocol-native histories other than Chat Completions, and their conversion to it.

| history | items | sources (one per item / span) |
|---|---|---|
| `AnthropicMessagesHistory` | `messages` (+ `system`, `tools`) | `AnthropicMessageSource` (`request_index`, or None for the response) |
| `ResponsesHistory` | `input` items (+ `instructions`, `tools`) | `ResponsesItemSource` (`request_index` or `output_index`) |
| `CompletionsTokenHistory` | `prompt` token ids (prompt + sampled ids) | `CompletionsTokenSourceSpan`s, `sampled_spans` |
| `CompletionsStringHistory` | `prompt` text (prompt + sampled text) | `CompletionsStringSourceSpan`s, `sampled_spans` |

`as_chat_completions_history()` maps Anthropic messages and Responses items onto chat messages with ART's rules
(below); the Completions views have no chat structure. The Chat Completions history and the conversation types
are history.py's; the views that build these from a trajectory's exchanges are branches.py's.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any, Union

import pydantic

from .exchanges import CompletionsExchange, MessagesExchange, ResponsesExchange
from .history import ChatCompletionsHistory, ChatCompletionsMessageSource, HistorySource, Kept, History, LegacyHistory


class AnthropicMessageSource(HistorySource):
    exchange: MessagesExchange
    request_index: pydantic.StrictInt | None = None  # None: the exchange's response


class ResponsesItemSource(HistorySource):
    exchange: ResponsesExchange
    request_index: pydantic.StrictInt | None = None
    output_index: pydantic.StrictInt | None = None
    generation_index: pydantic.StrictInt | None = None


class CompletionsSource(HistorySource):
    exchange: CompletionsExchange
    prompt_index: pydantic.StrictInt
    choice_index: pydantic.StrictInt | None = None  # None: the request's prompt


class CompletionsTokenSourceSpan(HistorySource):
    start: pydantic.StrictInt
    end: pydantic.StrictInt
    source: CompletionsSource | None


class CompletionsStringSourceSpan(HistorySource):
    start: pydantic.StrictInt
    end: pydantic.StrictInt
    source: CompletionsSource | None


class AnthropicMessagesHistory(History):
    model: str
    messages: Kept[list[dict[str, Any]]]
    message_sources: list[AnthropicMessageSource | None]
    system: Kept[str | list[dict[str, Any]] | None] = None
    system_source: MessagesExchange | None = None
    tools: Kept[list[dict[str, Any]] | None] = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        return anthropic_as_chat_completions_history(self)


class ResponsesHistory(History):
    model: str
    input: Kept[list[dict[str, Any]]]
    input_sources: list[ResponsesItemSource | None]
    instructions: str | None = None
    instructions_source: ResponsesExchange | None = None
    tools: Kept[list[dict[str, Any]] | None] = None
    conversation: Kept[Any] = None
    previous_response_id: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        return responses_as_chat_completions_history(self)


class CompletionsTokenHistory(History):
    model: str
    prompt: list[int]
    prompt_sources: list[CompletionsTokenSourceSpan]
    sampled_spans: list[tuple[int, int]]

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        raise ValueError("Raw Completions history has no chat-message structure")


class CompletionsStringHistory(History):
    model: str
    prompt: str
    prompt_sources: list[CompletionsStringSourceSpan]
    sampled_spans: list[tuple[int, int]]

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        raise ValueError("Raw Completions history has no chat-message structure")


TrajectoryHistory = Union[LegacyHistory, ChatCompletionsHistory, AnthropicMessagesHistory, ResponsesHistory,
                          CompletionsTokenHistory, CompletionsStringHistory]


# --------------------------------------------------------------------------- conversions to chat


def as_plain(value: Any) -> Any:
    """A pydantic item as the plain JSON-shaped value a history keeps (other values as they are)."""
    return value.model_dump(mode="json", exclude_none=True) if isinstance(value, pydantic.BaseModel) else value


def _content_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "".join(str(as_plain(b).get("text") or "") for b in value or [] if isinstance(as_plain(b), dict))


def _anthropic_messages(system: Any, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic messages as chat messages (ART's mapping: text -> content, thinking -> reasoning, tool_use ->
    tool_calls, tool_result -> a tool message)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _content_text(system)})
    for raw in messages:
        role, content = raw.get("role", "user"), raw.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        text, reasoning, calls = "", "", []
        for block in (as_plain(b) for b in content or []):
            kind = block.get("type")
            if kind == "text":
                text += str(block.get("text") or "")
            elif kind == "thinking":
                reasoning += str(block.get("thinking") or "")
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                if text:
                    out.append({"role": role, "content": text})
                    text = ""
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id", block.get("id")),
                            "content": result if isinstance(result, str) else _content_text(result)})
            else:
                raise ValueError(f"Unsupported Anthropic content block type: {kind!r}")
        message: dict[str, Any] = {"role": role, "content": text}
        if reasoning:
            message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = calls
        if text or reasoning or calls or role == "assistant":
            out.append(message)
    return out


def _openai_tools(tools: Any, *, schema_key: str) -> Any:
    """Anthropic (`input_schema`) or Responses (`parameters`) function tools as chat completion tools."""
    if not isinstance(tools, list):
        return tools
    out = []
    for tool in tools:
        data = as_plain(tool)
        if not isinstance(data, dict) or data.get("type", "function") not in ("function", "custom"):
            out.append(tool)
            continue
        function = {"name": data.get("name"), "description": data.get("description"),
                    "parameters": data.get(schema_key, {})}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def anthropic_as_chat_completions_history(history: AnthropicMessagesHistory) -> ChatCompletionsHistory:
    messages: list[dict[str, Any]] = []
    sources: list[ChatCompletionsMessageSource | None] = []
    if history.system:
        messages += _anthropic_messages(history.system, [])
        sources.append(ChatCompletionsMessageSource(exchange=history.system_source)
                       if history.system_source is not None else None)
    for message, source in zip(history.messages, history.message_sources, strict=True):
        converted = _anthropic_messages(None, [message])
        messages += converted
        sources += [ChatCompletionsMessageSource(exchange=source.exchange, request_index=source.request_index,
                                                 output_indices=(0,) if source.request_index is None else None)
                    if source is not None else None] * len(converted)
    return ChatCompletionsHistory(model=history.model, messages=messages, message_sources=sources,
                                  tools=_openai_tools(history.tools, schema_key="input_schema"),
                                  chat_template=history.chat_template,
                                  chat_template_kwargs=copy.deepcopy(history.chat_template_kwargs))


def _responses_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    text = ""
    for block in (as_plain(b) for b in content or []):
        kind = block.get("type")
        if kind not in ("input_text", "output_text", "refusal", "text"):
            raise ValueError(f"Unsupported Responses content block type: {kind!r}")
        text += str(block.get("refusal" if kind == "refusal" else "text") or "")
    return text


def _reasoning_text(item: Mapping[str, Any]) -> str:
    return "".join(b.get("text", "") for f in ("content", "summary") for b in item.get(f) or []
                   if isinstance(b, dict) and isinstance(b.get("text"), str))


def responses_as_chat_completions_history(history: ResponsesHistory) -> ChatCompletionsHistory:
    """Responses items as chat messages (ART's grouping): reasoning joins the assistant message or function calls
    after it; consecutive function calls make one assistant message with several tool calls; a function call output
    is a tool message. Each message's source cites its items' exchange (request index, or output indices)."""
    if history.previous_response_id is not None or history.conversation is not None:
        raise ValueError("Opaque Responses context cannot be represented as Chat Completions")
    messages: list[dict[str, Any]] = []
    sources: list[ChatCompletionsMessageSource | None] = []
    if history.instructions:
        messages.append({"role": "system", "content": history.instructions})
        sources.append(ChatCompletionsMessageSource(exchange=history.instructions_source)
                       if history.instructions_source is not None else None)
    groups: list[tuple[dict[str, Any], list[ResponsesItemSource | None]]] = []
    reasoning, reasoning_sources = "", []  # pending reasoning and its items' sources
    calls: dict[str, Any] | None = None  # the open assistant message of consecutive function calls
    for item, source in zip(history.input, history.input_sources, strict=True):
        kind = item.get("type")
        if kind == "reasoning":
            calls = None
            reasoning += _reasoning_text(item)
            reasoning_sources.append(source)
            continue
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if calls is None:
                calls = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    calls["reasoning"] = reasoning
                groups.append((calls, [*reasoning_sources, source]))
                reasoning, reasoning_sources = "", []
            else:
                calls["tool_calls"].append(call)
                groups[-1][1].append(source)
            continue
        calls = None
        if kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": item.get("call_id"),
                       "content": _responses_text(item.get("output", ""))}
        elif kind in (None, "message") and item.get("role"):
            message = {"role": item["role"], "content": _responses_text(item.get("content"))}
        else:
            raise ValueError(f"Unsupported Responses input item type: {kind!r}")
        if reasoning_sources:
            if message["role"] == "assistant":
                if reasoning:
                    message["reasoning"] = reasoning
                groups.append((message, [*reasoning_sources, source]))
            else:
                groups.append(({"role": "assistant", "content": "", "reasoning": reasoning}, reasoning_sources))
                groups.append((message, [source]))
            reasoning, reasoning_sources = "", []
        else:
            groups.append((message, [source]))
    if reasoning_sources:
        groups.append(({"role": "assistant", "content": "", "reasoning": reasoning}, reasoning_sources))
    for message, group in groups:
        messages.append(message)
        sources.append(_chat_source(group))
    return ChatCompletionsHistory(model=history.model, messages=messages, message_sources=sources,
                                  tools=_openai_tools(history.tools, schema_key="parameters"),
                                  chat_template=history.chat_template,
                                  chat_template_kwargs=copy.deepcopy(history.chat_template_kwargs))


def _chat_source(group: Sequence[ResponsesItemSource | None]) -> ChatCompletionsMessageSource | None:
    """One chat message's source from its Responses items' sources (None when any item has none)."""
    if not group or any(s is None for s in group):
        return None
    present = [s for s in group if s is not None]
    if len({id(s.exchange) for s in present}) != 1:
        raise ValueError("One projected Chat message cannot span multiple Responses exchanges")
    outputs = tuple(dict.fromkeys(s.output_index for s in present if s.output_index is not None))
    if outputs:
        return ChatCompletionsMessageSource(exchange=present[0].exchange, output_indices=outputs)
    return ChatCompletionsMessageSource(exchange=present[0].exchange,
                                        request_index=next(s.request_index for s in present
                                                           if s.request_index is not None))
