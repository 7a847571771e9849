"""Rebuild the `Choice` of a streamed chat completion from its `chat.completion.chunk` events.

A streamed response (`stream=True`) arrives as server-sent events, one JSON chunk
per `data:` line. The choice they add up to is what a non-streamed response would
have carried, built by the rules ART uses (`art.openai.update_chat_completion`):

* text pieces (`content`, `refusal`, `reasoning`) are concatenated; logprob entries
  (`logprobs.content`, `logprobs.refusal`) and sampled `token_ids` are appended;
* a tool call is addressed by its `index`: its `id`, `type` and function `name` are
  set (a server that repeats them in every chunk does not double them, unlike the
  openai SDK's own accumulator), its `arguments` are concatenated;
* `finish_reason` is the last one sent, "stop" when none was;
* every other key of a chunk's choice (the token record a server adds: artrl's server puts
  `token_ids`, `prompt_token_ids`, `policy_version`, ... on each choice's last chunk) is kept
  on the choice as it is, so a streamed choice carries the same record as a non-streamed one.
"""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat.chat_completion import Choice

DATA_PREFIX = "data:"
DONE = "[DONE]"
#: The keys of a chunk's choice that are added up above; any other is the server's record, kept as sent.
_CHUNK_CHOICE_KEYS = frozenset({"index", "delta", "logprobs", "finish_reason", "token_ids"})


def parse_sse(content: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of a server-sent event stream (`data: {...}` lines; `[DONE]` ends nothing)."""
    chunks: list[dict[str, Any]] = []
    for line in content.decode("utf-8").splitlines():
        line = line.strip()
        if not line.startswith(DATA_PREFIX):
            continue
        data = line[len(DATA_PREFIX):].strip()
        if data and data != DONE:
            chunks.append(json.loads(data))
    return chunks


def choice_from_chunks(chunks: list[dict[str, Any]], index: int = 0) -> Choice:
    """The choice number `index` the chunks add up to; ValueError when no chunk carries it."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None
    finish_reason = None
    tool_calls: list[dict[str, Any]] = []
    record: dict[str, Any] = {}  # the server's own keys (token record), last value wins
    seen = False
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != index:
                continue
            seen = True
            finish_reason = choice.get("finish_reason") or finish_reason
            if choice.get("logprobs"):
                logprobs = logprobs or {"content": None, "refusal": None}
                for key in ("content", "refusal"):
                    if choice["logprobs"].get(key):
                        logprobs[key] = (logprobs[key] or []) + list(choice["logprobs"][key])
            if choice.get("token_ids"):
                token_ids = (token_ids or []) + list(choice["token_ids"])
            record.update({k: v for k, v in choice.items() if k not in _CHUNK_CHOICE_KEYS})
            delta = choice.get("delta") or {}
            for key in ("content", "refusal", "reasoning", "reasoning_content"):
                if delta.get(key):
                    message[key] = (message.get(key) or "") + delta[key]
            for call in delta.get("tool_calls") or []:
                _add_tool_call_delta(tool_calls, call)
    if not seen:
        raise ValueError(f"no streamed chunk carries choice {index}")
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice_data: dict[str, Any] = {**record, "index": index, "finish_reason": finish_reason or "stop", "message": message,
                                   "logprobs": logprobs}
    if token_ids is not None:
        choice_data["token_ids"] = token_ids
    return Choice.model_validate(choice_data)


def _add_tool_call_delta(tool_calls: list[dict[str, Any]], delta: dict[str, Any]) -> None:
    k = delta.get("index", 0)
    while len(tool_calls) <= k:
        tool_calls.append({"id": "", "function": {"arguments": "", "name": ""}, "type": "function"})
    call = tool_calls[k]
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    function = delta.get("function") or {}
    if function.get("name"):
        call["function"]["name"] = function["name"]
    if function.get("arguments"):
        call["function"]["arguments"] += function["arguments"]
