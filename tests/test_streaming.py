"""`stream: true` through the local server with the `openai` client: the chunks add up to the non-streamed
reply, tool calls come as deltas, usage and [DONE] close the stream, and the token record of a streamed choice is
the non-streamed one (on each choice's last chunk)."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artrl.serve import ServedModels, ServerHandle, TransformersEngine, create_app, start_server
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.serve.http.stream_text import TextStream
from artrl.serve.tool_calls import TOOL_CALL_START, parse_tool_calls
from artrl.models.tiny import load_tiny
from engine_helpers import one_thread_engine

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Tell me a story about the weather."}]


@functools.cache
def _tiny_tokenizer() -> Any:
    return load_tiny()[1]


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    with one_thread_engine(max_batch_size=8) as engine:
        yield engine


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


def test_a_choice_rebuilt_from_the_stream_is_the_non_streamed_choice(server: ServerHandle) -> None:
    """What a recorder of streamed replies (auto_trajectory, artrl.langgraph) rebuilds: the same text, logprobs
    and token record as the non-streamed choice, every record key included."""
    from artrl.chat.chunks import choice_from_chunks, parse_sse

    body = {"model": "m", "messages": ASK, "n": 2, "seed": 7, "max_tokens": 16, "logprobs": True}
    whole = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120).json()
    raw = httpx.post(f"{server.base_url}/chat/completions", json={**body, "stream": True}, timeout=120).content
    for expected in whole["choices"]:
        rebuilt = choice_from_chunks(parse_sse(raw), index=expected["index"]).model_dump(exclude_none=True)
        want = openai.types.chat.chat_completion.Choice.model_validate(expected).model_dump(exclude_none=True)
        assert rebuilt == want
        assert rebuilt["prompt_token_ids"] and rebuilt["token_ids"] and "policy_version" in expected


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


# ---------------------------------------------------------------------------------------------- live streaming

LONG = {"model": "m", "messages": ASK, "seed": 3, "max_tokens": 200, "temperature": 1.0}


def _data(line: str) -> dict[str, Any]:
    return json.loads(line.removeprefix("data: "))


@pytest.fixture
def gate(engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold the decode worker after each step of a streamed request (its token handed over) until the test sets
    it; batches of plain requests run freely."""
    go = threading.Event()
    step = engine._step

    def gated(batch: Any) -> None:
        streamed = any(row.pending.on_token is not None for row in batch.rows)
        step(batch)
        if streamed and not go.wait(timeout=30):  # bounds a broken run only: the test sets it once it has read what it needs
            go.set()

    monkeypatch.setattr(engine, "_step", gated)
    yield go
    go.set()


def _first_content(lines: Iterator[str]) -> dict[str, Any]:
    for line in lines:
        if line and line != "data: [DONE]":
            chunk = _data(line)
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                return chunk
    raise AssertionError("the stream ended without content")


def test_the_first_content_chunk_comes_while_the_row_is_still_decoding(
        client: openai.OpenAI, server: ServerHandle, engine: TransformersEngine, gate: threading.Event) -> None:
    whole = client.chat.completions.create(**LONG, logprobs=True)
    ids = whole.choices[0].model_extra["token_ids"]
    assert whole.choices[0].finish_reason == "length" and engine.tokenizer.decode(ids[:1]).isascii()  # as designed
    rows, steps = engine.rows_served, engine.decode_steps
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**LONG, "stream": True},
                      timeout=120) as response:
        lines = response.iter_lines()
        first = _first_content(lines)
        assert engine.rows_served == rows and engine.decode_steps == steps + 1  # one token sampled, row decoding
        gate.set()
        chunks = [first] + [_data(line) for line in lines if line and line != "data: [DONE]"]
    assert first["choices"][0]["delta"]["content"] == engine.tokenizer.decode(ids[:1])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole.choices[0].message.content
    streamed = [e["logprob"] for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content") or []]
    assert streamed == [e.logprob for e in whole.choices[0].logprobs.content]
    assert chunks[-1]["choices"][0]["token_ids"] == ids
    assert chunks[-1]["choices"][0]["policy_version"] == whole.choices[0].model_extra["policy_version"]


def test_a_streamed_request_the_engine_refuses_is_an_error_response(server: ServerHandle) -> None:
    body = {"model": "m", "messages": ASK, "max_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 50}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


def test_a_client_that_leaves_mid_stream_frees_its_row(
        server: ServerHandle, engine: TransformersEngine, gate: threading.Event) -> None:
    rows, abandoned, cut = engine.rows_served, engine.requests_abandoned, engine.rows_abandoned
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**LONG, "stream": True},
                      timeout=120) as response:
        _first_content(response.iter_lines())
    deadline = time.monotonic() + 60  # bounds a hung test only
    while engine.requests_abandoned != abandoned + 1:  # the server cancelled the generation
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.set()
    while engine.rows_abandoned != cut + 1:  # the row left at its next step
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.rows_served == rows


@pytest.mark.parametrize("seed", [1, 2])
def test_stop_strings_never_reach_the_stream(client: openai.OpenAI, seed: int) -> None:
    """Stop strings cut from a reply's middle, several tokens long: the stream ends where the reply does."""
    kwargs = {"model": "m", "messages": ASK, "seed": seed, "max_tokens": 48, "logprobs": True}
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert len(text) > 20
    for stop in (text[8:14], text[len(text) // 2:len(text) // 2 + 5]):
        whole = client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
        deltas = [c.choices[0] for c in client.chat.completions.create(**kwargs, stop=[stop], stream=True)]
        content = "".join(d.delta.content or "" for d in deltas)
        assert stop not in content and content == whole.message.content
        assert deltas[-1].model_extra["token_ids"] == whole.model_extra["token_ids"]
        assert [e.logprob for d in deltas if d.logprobs for e in d.logprobs.content] == \
            [e.logprob for e in whole.logprobs.content]


def test_structured_replies_stream_as_they_answer(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}},
                  {"tools": [WEATHER_TOOL], "tool_choice": "required"}):
        kwargs = {"model": "m", "messages": ASK, "seed": 4, "max_tokens": 60, "n": 2, **extra}
        whole = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        for choice in whole.choices:
            mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
            assert "".join(m.delta.content or "" for m in mine) == (choice.message.content or "")
            calls = [(c.function.name, c.function.arguments) for m in mine for c in m.delta.tool_calls or []]
            assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            assert mine[-1].finish_reason == choice.finish_reason
            assert mine[-1].model_extra["token_ids"] == choice.model_extra["token_ids"]


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab é🌍世界, the\n<tool_call>")), min_size=1, max_size=40),
       data=st.data())
def test_text_stream_lets_out_only_a_prefix_of_the_final_content(text: str, data: st.DataObject) -> None:
    """Fed a reply token by token, whatever is let out never holds a split character or a stop string, and is a
    prefix of the content the server answers (cut at the first stop string, tool calls parsed)."""
    tokenizer = _tiny_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids)
    start = data.draw(st.integers(0, len(whole) - 1))
    stop = whole[start:start + data.draw(st.integers(1, 4))]
    tools = data.draw(st.booleans())
    stream = TextStream(tokenizer, frozenset(), [stop], TOOL_CALL_START if tools else None)
    out = ""
    for token in ids:
        stream.add(token)
        piece, _ = stream.take()
        assert "\ufffd" not in piece
        out += piece
    content = whole[:whole.find(stop)]
    if tools:
        content = parse_tool_calls(content)[0] or ""
    assert content.startswith(out) and stop not in out
    assert stream.text == whole


@pytest.mark.parametrize("text", [TOOL_TEXT, "  " + TOOL_TEXT + "\n", " no call here ", "<tool_call>\n{bad}\n</tool_call>"])
def test_text_stream_holds_back_what_parsing_tool_calls_strips(text: str) -> None:
    tokenizer = _tiny_tokenizer()
    stream = TextStream(tokenizer, frozenset(), [], TOOL_CALL_START)
    out = ""
    for token in tokenizer.encode(text, add_special_tokens=False):
        stream.add(token)
        out += stream.take()[0]
    assert (parse_tool_calls(text)[0] or "").startswith(out)
    assert out == ("Let me check." if text == TOOL_TEXT else "")
