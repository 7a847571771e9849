"""The protocol adapters' streams when the engine fails after the stream began: each ends with its protocol's
error event (no model: the core's chunks are given)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from artrl.serve.http.core import Prepared
from artrl.serve.http.protocols.completions import CompletionRequest, completion_events
from artrl.serve.http.protocols.messages import message_events
from artrl.serve.http.protocols.responses import ResponsesRequest, response_events
from artrl.serve.http.request import ChatCompletionRequest

HEAD = {"id": "chatcmpl-abc", "created": 0, "model": "m"}
FAILURE = {"error": {"message": "the engine was closed", "type": "server_error", "param": None,
                     "code": "engine_closed"}}


def prepared() -> Prepared:
    return Prepared(ChatCompletionRequest(model="m", messages=[]), engine=None, request=None,  # type: ignore[arg-type]
                    prompt_ids=[1, 2, 3], parse_tools=False, images=[], raw=False, head=dict(HEAD))


async def failing(closed: list[bool]) -> AsyncIterator[dict[str, Any]]:
    """A role chunk, one piece of text, then the failure; `closed` records that the consumer closed it."""
    try:
        yield {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]}
        yield {**HEAD, "choices": [{"index": 0, "delta": {"content": "Hel"},
                                    "logprobs": {"content": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
                                                              "top_logprobs": []}]}, "finish_reason": None}]}
        yield FAILURE
    finally:
        closed.append(True)


def events(stream: AsyncIterator[bytes]) -> list[tuple[str | None, Any]]:
    async def collect() -> list[bytes]:
        return [chunk async for chunk in stream]

    out = []
    for block in b"".join(asyncio.run(collect())).decode().split("\n\n"):
        if not block:
            continue
        name = next((line[7:] for line in block.splitlines() if line.startswith("event: ")), None)
        data = next(line[6:] for line in block.splitlines() if line.startswith("data: "))
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


def test_messages_stream_ends_with_an_anthropic_error_event() -> None:
    closed: list[bool] = []
    got = events(message_events(prepared(), failing(closed)))
    assert [name for name, _ in got][:3] == ["message_start", "content_block_start", "content_block_delta"]
    name, data = got[-1]
    assert name == "error" and data == {"type": "error", "error": {"type": "overloaded_error",
                                                                   "message": "the engine was closed"}}
    assert closed == [True]


def test_responses_stream_ends_with_an_error_event_then_response_failed() -> None:
    closed: list[bool] = []
    got = events(response_events(prepared(), ResponsesRequest(model="m", input="hi"), failing(closed), print))
    assert [name for name, _ in got][:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    name, data = got[-2]
    assert name == "error" and data["code"] == "engine_closed" and data["message"] == "the engine was closed"
    name, data = got[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed", data
    assert data["response"]["error"] == {"code": "engine_closed", "message": "the engine was closed"}
    assert data["sequence_number"] == len(got) - 1 and closed == [True]
    assert not any(name == "response.completed" for name, _ in got)


def test_completions_stream_ends_with_the_error_then_done() -> None:
    closed: list[bool] = []
    got = events(completion_events(prepared(), CompletionRequest(model="m", prompt="hi"), failing(closed)))
    assert got[0][1]["choices"][0]["text"] == "Hel" and got[0][1]["object"] == "text_completion"
    assert got[-2][1] == FAILURE and got[-1][1] == "[DONE]" and closed == [True]
