"""`stream: true` through the local server with the `openai` client: the chunks add up to the non-streamed
reply, tool calls come as deltas, usage and [DONE] close the stream, and the token record of a streamed choice is
the non-streamed one (on each choice's last chunk)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from artrl.serve import ServedModels, ServerHandle, TransformersEngine, create_app, start_server
from artrl.serve.scripted import ScriptedEngine
from artrl.tiny import load_tiny

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Tell me a story about the weather."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = load_tiny()
    engine = TransformersEngine(model, tokenizer, max_batch_size=8)
    yield engine
    engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(engine: TransformersEngine) -> Iterator[ServerHandle]:
    models = ServedModels("m", engine)
    models.add("scripted", ScriptedEngine.from_text(engine.tokenizer, TOOL_TEXT, max_model_len=8192))
    with start_server(create_app(models)) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


def test_streamed_chunks_add_up_to_the_reply_and_carry_its_token_record(client: openai.OpenAI) -> None:
    kwargs = {"model": "m", "messages": ASK, "n": 3, "seed": 5, "max_tokens": 24, "logprobs": True,
              "top_logprobs": 2, "stop": ["the"]}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(m.delta.content or "" for m in mine) == choice.message.content
        assert [m.finish_reason for m in mine] == [None] * (len(mine) - 1) + [choice.finish_reason]
        streamed = [e for m in mine if m.logprobs for e in m.logprobs.content]
        assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
            [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in choice.logprobs.content]
        last = mine[-1].model_extra  # the token record, as the non-streamed choice has it
        assert last["token_ids"] == choice.model_extra["token_ids"]
        assert last["prompt_token_ids"] == choice.model_extra["prompt_token_ids"] == whole.model_extra[
            "prompt_token_ids"]
        assert len(mine) > 3  # content in several pieces, not one
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_tool_calls_stream_as_deltas(client: openai.OpenAI) -> None:
    kwargs = {"model": "scripted", "messages": ASK, "tools": [WEATHER_TOOL], "max_tokens": 64}
    whole = client.chat.completions.create(**kwargs).choices[0]
    deltas = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True)]
    assert "".join(d.delta.content or "" for d in deltas) == whole.message.content == "Let me check."
    calls = [call for d in deltas for call in d.delta.tool_calls or []]
    assert [(c.index, c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, w.type, w.function.name, json.loads(w.function.arguments)) for w in whole.message.tool_calls]
    assert all(c.id.startswith("call_") for c in calls)  # each request names its calls afresh
    assert deltas[-1].finish_reason == whole.finish_reason == "tool_calls"
    assert deltas[-1].model_extra["token_ids"] == whole.model_extra["token_ids"]


def test_the_stream_is_server_sent_events_ending_with_done(server: ServerHandle) -> None:
    body = {"model": "m", "messages": ASK, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_streamed_request_whose_client_left_is_dropped(server: ServerHandle, engine: TransformersEngine) -> None:
    """The client goes away while its streamed request waits for the engine: it is never decoded."""
    abandoned, rows = engine.requests_abandoned, engine.rows_served
    data = json.dumps({"model": "m", "messages": ASK, "max_tokens": 8, "stream": True}).encode()
    with engine.model_lock:  # hold the device, as a trainer would, so the request queues
        sock = socket.create_connection((server.host, server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        deadline = time.monotonic() + 120  # bounds a hung test only
        while engine.pending_requests != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sock.close()
        while engine.requests_abandoned != abandoned + 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert engine.rows_served == rows
