"""Parse Hermes/Qwen-style tool calls out of generated text.

Qwen-family chat templates render a tool call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and models are trained to emit the same. `parse_tool_calls` turns such blocks into
OpenAI `tool_calls` entries; text outside the blocks stays the message content.
The parser never raises on model output: a block whose body is not a JSON object
with a string `name` (malformed JSON, or a block never closed) is kept as content,
since the model produced it and the caller should see it.

`HERMES` writes the same syntax down as data (`ToolCallSyntax`), for the grammars
that make a reply call a tool (`serve/structured.py`): what they produce is what
this parser reads and what the chat template renders back.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCallSyntax:
    """How a chat family writes tool calls in a reply.

    One call is `begin + '{"name": "<name>", "arguments": <arguments JSON>}' + end`,
    several are joined by `separator`, and the reply holds nothing else when it only
    calls tools (what the chat template renders for an assistant message with
    `tool_calls` and no content).
    """

    name: str
    begin: str
    end: str
    separator: str


HERMES = ToolCallSyntax("hermes", begin=TOOL_CALL_START + "\n", end="\n" + TOOL_CALL_END, separator="\n")
"""Qwen / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, calls one per line."""


def tool_call_syntax(tokenizer: Any) -> ToolCallSyntax | None:
    """The tool-call syntax of `tokenizer`'s chat template, or None when it is not one this module parses."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    return HERMES if any(isinstance(t, str) and TOOL_CALL_START in t for t in texts) else None


_DECODER = json.JSONDecoder()


def new_tool_call_id() -> str:
    """An OpenAI-style tool call id, `call_` + 24 random hex digits."""
    return f"call_{secrets.token_hex(12)}"


def _read_block(text: str, body_start: int) -> tuple[dict[str, Any], int] | None:
    """The tool call whose JSON body starts at `body_start` (after whitespace) and the
    index just past its closing tag, or None if no valid call with a closing tag is there.

    The body is read as JSON, not up to the first closing tag, so a name or an argument
    that contains the tag itself stays inside its string.
    """
    index = _skip_space(text, body_start)
    try:
        payload, index = _DECODER.raw_decode(text, index)
    except json.JSONDecodeError:
        return None
    index = _skip_space(text, index)
    if not text.startswith(TOOL_CALL_END, index):
        return None
    call = _as_tool_call(payload)
    return None if call is None else (call, index + len(TOOL_CALL_END))


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index].isspace():
        index += 1
    return index


def _as_tool_call(payload: Any) -> dict[str, Any] | None:
    """The OpenAI tool call for one decoded block body, or None if it is not a valid call."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):
        arguments_json = arguments  # already serialised by the model; pass it on as is
    else:
        arguments_json = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_tool_call_id(),
        "type": "function",
        "function": {"name": payload["name"], "arguments": arguments_json},
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated `text` into (content, tool_calls).

    content is the text outside valid tool call blocks, stripped, or None when
    nothing is left; tool_calls is a list of OpenAI tool call dicts (possibly empty).
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0  # end of the last valid block
    search = 0
    while (start := text.find(TOOL_CALL_START, search)) != -1:
        body_start = start + len(TOOL_CALL_START)
        block = _read_block(text, body_start)
        if block is None:
            # malformed: leave the whole block in the content and look after its end
            end = text.find(TOOL_CALL_END, body_start)
            if end == -1:
                break
            search = end + len(TOOL_CALL_END)
            continue
        call, block_end = block
        kept.append(text[position:start])
        position = search = block_end
        calls.append(call)
    kept.append(text[position:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls
