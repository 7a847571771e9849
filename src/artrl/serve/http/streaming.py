"""`stream: true`: a chat completion as OpenAI's server-sent chunks, the token record on each choice's last one.

Per choice (`n` > 1: each choice's chunks carry its `index`, interleaved as its tokens come):

1. a first chunk with `delta: {"role": "assistant", "content": ""}`;
2. the content in pieces, each with its tokens' `logprobs` (a token's logprob goes out
   with the piece that completes its text);
3. tool calls (when the reply called tools) as one delta each: `index`, `id`, `type`, the
   function's `name` and its whole `arguments` string, after the content before them;
4. a last chunk with `delta: {}` and `finish_reason` (and the logprobs of tokens no piece
   carried: the end-of-turn id, a tool call's tokens), carrying the choice's token record
   (`token_ids`, `prompt_token_ids`, and any other key the server adds to a choice), exactly
   as the non-streamed choice has them, so a client that keeps the last chunk of each choice
   keeps the record (docs/token-record.md);
5. with `stream_options: {"include_usage": true}`, a final chunk with no choices and the
   `usage`; every chunk has `"usage": null` before it, as OpenAI's do; then `data: [DONE]`.

Two ways to get there:

- **Live** (`LiveStream`, engines with `streams_tokens`: the built-in one): the engine hands
  each token over as its row takes it, and content pieces go out as they are sampled,
  decoded incrementally with stop strings and tool calls held back
  (serve/http/stream_text.py). The last chunks of every choice (what is left of the content, tool
  calls, the record) go out when the whole generation has ended, from the same final
  choice the non-streamed answer has, so the assembled stream equals it. A client that
  disconnects cancels the generation: its rows stop at the next decode step. An engine
  failure after the first chunk is one `{"error": ...}` event before `[DONE]`.
- **Finished** (`sse`, other engines: vLLM's, the scripted one): the chunks are cut from
  the finished response (`chunks`: one piece per sampled token whose text is complete), so
  the first byte comes when a non-streamed request would get its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .stream_text import TextStream

logger = logging.getLogger(__name__)


_OPENAI_CHOICE_KEYS = frozenset({"index", "message", "finish_reason", "logprobs"})
"""A choice's keys that chunks spell their own way; every other key (the token record) rides on the last chunk."""


def _chunk(response: dict[str, Any], choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"], "choices": choices, **extra}


def text_pieces(tokenizer: Any, token_ids: list[int], content: str) -> Iterator[tuple[str, int, int]]:
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


def _tail(response: dict[str, Any], choice: dict[str, Any], sent: int, usage: dict[str, Any]
          ) -> Iterator[dict[str, Any]]:
    """A choice's tool call deltas and last chunk; the tokens from `sent` on have not had their logprobs sent."""
    index, message, logprobs = choice["index"], choice["message"], choice.get("logprobs")
    entries = (logprobs or {}).get("content") or []
    for k, call in enumerate(message.get("tool_calls") or []):
        yield _chunk(response, [{"index": index, "delta": {"tool_calls": [{
            "index": k, "id": call["id"], "type": call.get("type", "function"),
            "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}]},
            "logprobs": None, "finish_reason": None}], **usage)
    rest = {"content": entries[sent:]} if logprobs is not None and entries[sent:] else None  # e.g. end of turn
    record = {k: v for k, v in choice.items() if k not in _OPENAI_CHOICE_KEYS}  # token_ids, prompt_token_ids...
    yield _chunk(response, [{"index": index, "delta": {}, "logprobs": rest,
                             "finish_reason": choice["finish_reason"], **record}], **usage)


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
            for text, first, end in text_pieces(tokenizer, choice["token_ids"], content):
                piece_logprobs = {"content": entries[first:end]} if logprobs is not None else None
                yield _chunk(response, [{"index": index, "delta": {"content": text}, "logprobs": piece_logprobs,
                                         "finish_reason": None}], **usage)
                sent = end
        yield from _tail(response, choice, sent, usage)
    if include_usage:
        yield _chunk(response, [], usage=response["usage"])


def sse_event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse(response: dict[str, Any], tokenizer: Any, include_usage: bool) -> Iterator[bytes]:
    """`chunks` as server-sent events, then `data: [DONE]`."""
    for chunk in chunks(response, tokenizer, include_usage):
        yield sse_event(chunk)
    yield SSE_DONE


async def chat_sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Chunk objects as server-sent events, then `data: [DONE]`; `chunks` is closed when this is (a client that
    leaves ends the generation at once, not when the chunks are collected)."""
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield sse_event(chunk)
    yield SSE_DONE


TokenEvent = tuple[int, int, float, "list[tuple[int, float]] | None"]
"""What the engine hands over per sampled token: (sample, token id, raw logprob, top logprobs or None)."""


@dataclass
class LiveStream:
    """The live stream of one request (module docstring): `sse` is the body of the streaming response.

    `generation`: the engine's `generate` task, started with `on_token=events.put_nowait`;
    `streams`: one TextStream per choice; `entry(token, logprob, top)`: a token's logprobs
    entry as the non-streamed choice spells it; `finish(results)`: the non-streamed response
    of the finished generation (the record cache is updated there); `error_json(error)`: an
    engine failure in OpenAI's error shape; `dropped()`: called when the stream is closed before the generation
    ended (its client left), after the generation is cancelled.
    """

    generation: asyncio.Future
    events: asyncio.Queue
    streams: list[TextStream]
    entry: Callable[[int, float, list[tuple[int, float]] | None], dict[str, Any]]
    finish: Callable[[Any], dict[str, Any]]
    error_json: Callable[[BaseException], dict[str, Any]]
    head: dict[str, Any]  # id, created, model
    include_usage: bool
    dropped: Callable[[], None] = lambda: None  # the client left before the generation ended (counted by the server)
    _entries: list[list[dict[str, Any]]] = field(default_factory=list)  # per choice, per token so far
    _sent: list[int] = field(default_factory=list)  # per choice, tokens whose logprobs went out

    async def sse(self) -> AsyncIterator[bytes]:
        """`chunks` as server-sent events, then `data: [DONE]`."""
        async for event in chat_sse(self.chunks()):
            yield event

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The chunk objects, as they come; an engine failure after the first is a last `{"error": ...}` one."""
        usage = {"usage": None} if self.include_usage else {}
        self._entries = [[] for _ in self.streams]
        self._sent = [0] * len(self.streams)
        try:
            for index in range(len(self.streams)):
                yield _chunk(self.head, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}], **usage)
            async for events in self._batches():
                touched: dict[int, None] = {}
                for sample, token, logprob, top in events:
                    self.streams[sample].add(token)
                    self._entries[sample].append(self.entry(token, logprob, top))
                    touched[sample] = None
                for sample in touched:
                    text, within = self.streams[sample].take()
                    if text:
                        yield self._piece(sample, text, within, usage)
            try:
                response = self.finish(self.generation.result())
            except Exception as error:  # the engine failed (closed, out of memory) after the stream began
                logger.warning("A streamed generation failed: %s", error)
                yield self.error_json(error)
                return
            response_head = {**response, **self.head}
            for choice in response["choices"]:
                for chunk in self._rest(response_head, choice, usage):
                    yield chunk
            if self.include_usage:
                yield _chunk(response_head, [], usage=response["usage"])
        finally:
            if not self.generation.done():  # the client left mid-stream: the rows stop
                self.generation.cancel()
                self.dropped()

    async def _batches(self) -> AsyncIterator[list[TokenEvent]]:
        """The token events, as many at once as have arrived, until the generation ends (every event of a
        generation is queued before it ends: the engine schedules them on this loop first)."""
        events, generation = self.events, self.generation
        while not (generation.done() and events.empty()):
            if events.empty():
                getter = asyncio.ensure_future(events.get())
                try:
                    await asyncio.wait({getter, generation}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if not getter.done() or getter.cancelled():
                    continue
                batch = [getter.result()]
            else:
                batch = []
            while not events.empty():
                batch.append(events.get_nowait())
            yield batch

    def _piece(self, index: int, text: str, within: int, usage: dict[str, Any]) -> dict[str, Any]:
        sent, self._sent[index] = self._sent[index], max(within, self._sent[index])
        logprobs = {"content": self._entries[index][sent:within]}
        return _chunk(self.head, [{"index": index, "delta": {"content": text}, "logprobs": logprobs,
                                   "finish_reason": None}], **usage)

    def _rest(self, response: dict[str, Any], choice: dict[str, Any], usage: dict[str, Any]
              ) -> Iterator[dict[str, Any]]:
        """What is left of a finished choice: the content not sent yet, tool calls, the last chunk."""
        index, stream = choice["index"], self.streams[choice["index"]]
        content = choice["message"].get("content") or ""
        sent_text = stream.text[:stream.emitted]
        entries = (choice.get("logprobs") or {}).get("content") or []
        sent = self._sent[index]
        if not content.startswith(sent_text):  # cannot happen for byte-level or sentencepiece tokenizers
            logger.warning("The streamed text of choice %d (%d characters) is not a prefix of its content; the "
                           "rest of the content is not streamed.", index, len(sent_text))
        elif len(content) > len(sent_text):
            within = max(stream.tokens_within(len(content)), sent)
            yield _chunk(response, [{"index": index, "delta": {"content": content[len(sent_text):]},
                                     "logprobs": {"content": entries[sent:within]}, "finish_reason": None}],
                         **usage)
            sent = within
        yield from _tail(response, choice, sent, usage)
