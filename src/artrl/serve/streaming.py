"""`stream: true`: a chat completion as OpenAI's server-sent chunks, the token record on each choice's last one.

`chunks(response, ...)` turns a finished chat completion (the server's non-streamed JSON, token
record and all) into the `chat.completion.chunk` objects OpenAI streams, and `sse` writes them as
server-sent events ending with `data: [DONE]`:

1. per choice, a first chunk with `delta: {"role": "assistant", "content": ""}`;
2. the content in pieces that end on token boundaries (one piece per sampled token whose
   text is complete: a token holding part of a UTF-8 character waits for the rest), each
   with its tokens' `logprobs` when the request asked for them;
3. tool calls (when the reply called tools) as one delta each: `index`, `id`, `type`, the
   function's `name` and its whole `arguments` string, after the content before them;
4. a last chunk with `delta: {}` and `finish_reason` (and the logprobs of tokens no piece
   carried: the end-of-turn id, a tool call's tokens), carrying the choice's token record
   (`token_ids`, `prompt_token_ids`, and any other key the server adds to a choice), exactly
   as the non-streamed choice has them, so a
   client that keeps the last chunk of each choice keeps the record (docs/token-record.md);
5. with `stream_options: {"include_usage": true}`, a final chunk with no choices and the
   `usage`; every chunk has `"usage": null` before it, as OpenAI's do.

What this simplifies: the chunks are written when the generation has finished (the record,
stop strings and tool calls are then settled), so a streamed request gets its first byte
when a non-streamed one would get its answer; a client that disconnects while it is
generated drops the generation as for any request. Sending tokens as they are sampled
needs a per-token hand-off from the engine's decode loop, which neither engine has yet.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


_OPENAI_CHOICE_KEYS = frozenset({"index", "message", "finish_reason", "logprobs"})
"""A choice's keys that chunks spell their own way; every other key (the token record) rides on the last chunk."""


def _chunk(response: dict[str, Any], choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"], "choices": choices, **extra}


def _pieces(tokenizer: Any, token_ids: list[int], content: str) -> Iterator[tuple[str, int, int]]:
    """(text, first token, end token) pieces of `content`, each ending where a sampled token's text is complete."""
    emitted, start = 0, 0
    for k in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:k], skip_special_tokens=False)
        if len(text) > emitted and content.startswith(text[:len(content)]) and not text.endswith("\ufffd"):
            end = min(len(text), len(content))
            if end > emitted:
                yield content[emitted:end], start, k
                emitted, start = end, k
        if emitted >= len(content):
            break
    if emitted < len(content):  # what no prefix of the ids spelled (cannot happen for plain text), in one piece
        yield content[emitted:], start, len(token_ids)


def chunks(response: dict[str, Any], tokenizer: Any, include_usage: bool) -> Iterator[dict[str, Any]]:
    """The chunk objects of a finished chat completion `response` (module docstring)."""
    usage = {"usage": None} if include_usage else {}
    for choice in response["choices"]:
        index, message = choice["index"], choice["message"]
        logprobs = choice.get("logprobs")
        entries = (logprobs or {}).get("content") or []
        yield _chunk(response, [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], **usage)
        content = message.get("content") or ""
        sent = 0  # tokens whose logprobs went out
        if content:
            for text, first, end in _pieces(tokenizer, choice["token_ids"], content):
                piece_logprobs = {"content": entries[first:end]} if logprobs is not None else None
                yield _chunk(response, [{"index": index, "delta": {"content": text}, "logprobs": piece_logprobs,
                                         "finish_reason": None}], **usage)
                sent = end
        for k, call in enumerate(message.get("tool_calls") or []):
            yield _chunk(response, [{"index": index, "delta": {"tool_calls": [{
                "index": k, "id": call["id"], "type": call.get("type", "function"),
                "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}]},
                "logprobs": None, "finish_reason": None}], **usage)
        rest = {"content": entries[sent:]} if logprobs is not None and entries[sent:] else None  # e.g. end of turn
        record = {k: v for k, v in choice.items() if k not in _OPENAI_CHOICE_KEYS}  # token_ids, prompt_token_ids...
        yield _chunk(response, [{"index": index, "delta": {}, "logprobs": rest,
                                 "finish_reason": choice["finish_reason"], **record}], **usage)
    if include_usage:
        yield _chunk(response, [], usage=response["usage"])


def sse(response: dict[str, Any], tokenizer: Any, include_usage: bool) -> Iterator[bytes]:
    """`chunks` as server-sent events, then `data: [DONE]`."""
    for chunk in chunks(response, tokenizer, include_usage):
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
