"""yield_trajectory / capture_yielded_trajectory and auto_trajectory / capture_auto_trajectory.

The agent code under test talks to a real local HTTP server through the real openai
client (sync and async, plain and streamed), as an ART agent would.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from openai.types.chat.chat_completion import Choice

import artrl as art
from artrl.chat.chunks import choice_from_chunks, parse_sse

HI = {"role": "user", "content": "Hi!"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": {"type": "object", "properties": {}}}}]


def completion(text: str) -> dict:
    return {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [5, 6],
                         "message": {"role": "assistant", "content": text},
                         "logprobs": {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []},
                                                  {"token": "b", "logprob": -0.25, "bytes": [98],
                                                   "top_logprobs": []}]}}]}


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def chunk(delta: dict, logprob: float | None = None, finish: str | None = None) -> dict:
    lp = {"content": [{"token": "t", "logprob": logprob, "bytes": [116], "top_logprobs": []}]} if logprob else None
    return {"id": "s1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}


CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"ci"}}
STREAM = sse(chunk({"role": "assistant", "content": ""}),
             chunk({"role": "assistant", "tool_calls": [CALL]}, -0.1),
             chunk({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather",
                                                                              "arguments": "ty\": 1}"}}]}, -0.2),
             chunk({}, finish="tool_calls"))

UNFINISHED = sse(chunk({"role": "assistant", "content": "he"}, -0.1), chunk({"content": "llo"}, -0.2))


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = body["messages"][-1].get("content") or ""
        if last == "fail":
            payload, status, kind = json.dumps({"error": {"message": "bad"}}).encode(), 400, "application/json"
        elif body.get("stream") and last == "unfinished":  # a choice that never sends a finish_reason
            payload, status, kind = UNFINISHED, 200, "text/event-stream"
        elif body.get("stream"):
            payload, status, kind = STREAM, 200, "text/event-stream"
        else:
            payload, status, kind = json.dumps(completion(f"reply to {last}")).encode(), 200, "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def base_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)


# --------------------------------------------------------------------------- yield_trajectory


def test_capture_yielded_trajectory_returns_what_the_agent_yielded(base_url):
    async def agent(word: str) -> str:
        reply = await client(base_url).chat.completions.create(model="m", messages=[HI])
        art.yield_trajectory(art.Trajectory(messages_and_choices=[HI, reply.choices[0]], reward=len(word)))
        return reply.choices[0].message.content

    async def main():
        return await asyncio.gather(*(art.capture_yielded_trajectory(agent(w)) for w in ("a", "bb", "ccc")))

    trajectories = asyncio.run(main())
    assert [t.reward for t in trajectories] == [1.0, 2.0, 3.0]  # concurrent captures do not mix
    assert isinstance(trajectories[0].messages_and_choices[1], Choice)


def test_nothing_yielded_is_an_error_and_yielding_outside_a_capture_does_nothing():
    async def quiet():
        art.yield_trajectory(art.Trajectory())  # outside a capture: no effect
        return None

    asyncio.run(quiet())

    async def main():
        await art.capture_yielded_trajectory(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="No trajectory yielded"):
        asyncio.run(main())


# --------------------------------------------------------------------------- auto_trajectory


def test_auto_trajectory_files_completions_into_conversations(base_url):
    async def agent() -> None:
        c = client(base_url)
        first = await c.chat.completions.create(model="m", messages=[HI], tools=TOOLS)
        # the same conversation, the assistant turn sent back as the dumped message object
        await c.chat.completions.create(model="m", messages=[HI, first.choices[0].message.model_dump(),
                                                             {"role": "user", "content": "more"}], tools=TOOLS)
        await c.chat.completions.create(model="m", messages=[HI])  # no tools: another conversation
        stream = await c.chat.completions.create(model="m", messages=[HI], tools=TOOLS, stream=True)
        async for _ in stream:
            pass
        art.auto_trajectory(required=True).reward = 1.0

    trajectory = asyncio.run(art.capture_auto_trajectory(agent()))
    main_, extra = trajectory.messages_and_choices, trajectory.additional_histories
    assert trajectory.reward == 1.0 and trajectory.tools == TOOLS and "duration" in trajectory.metrics
    assert [type(m).__name__ for m in main_] == ["dict", "Choice", "dict", "Choice"]
    assert main_[1].message.content == "reply to Hi!" and main_[3].message.content == "reply to more"
    assert main_[1].model_extra["token_ids"] == [5, 6]  # the server's token record rides along
    assert len(extra) == 2 and extra[0].tools is None and extra[0].messages_and_choices[0] == HI
    streamed = extra[1].messages_and_choices[-1]
    assert extra[1].tools == TOOLS and streamed.finish_reason == "tool_calls"
    call = streamed.message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("call_1", "get_weather", '{"city": 1}')
    assert [lp.logprob for lp in streamed.logprobs.content] == [-0.1, -0.2]


def test_a_stream_whose_choice_never_finished_is_read_as_stop_by_auto_trajectory_only(base_url):
    """ART 0.5.17's auto_trajectory read a stream that ended ([DONE]) without its choice's finish_reason as finished
    with "stop" (its own test server sends one); 0.5.23's capture, `art.trajectory`, leaves such a response out."""
    ask = {"role": "user", "content": "unfinished"}

    async def agent() -> None:
        stream = await client(base_url).chat.completions.create(model="m", messages=[ask], stream=True)
        async for _ in stream:
            pass

    trajectory = asyncio.run(art.capture_auto_trajectory(agent()))
    choice = trajectory.messages_and_choices[-1]
    assert choice.finish_reason == "stop" and choice.message.content == "hello"
    assert [lp.logprob for lp in choice.logprobs.content] == [-0.1, -0.2]

    async def captured():
        return await art.trajectory(agent())

    assert asyncio.run(captured()).messages_and_choices == []  # refused: not captured


def test_sync_clients_are_recorded_too(base_url):
    def agent() -> None:
        openai.OpenAI(base_url=base_url, api_key="x").chat.completions.create(model="m", messages=[HI])

    async def main():
        return await art.capture_auto_trajectory(asyncio.to_thread(agent))

    trajectory = asyncio.run(main())
    assert trajectory.messages_and_choices[-1].message.content == "reply to Hi!"


def test_only_requests_inside_the_capture_are_recorded_and_send_is_restored(base_url):
    original = (httpx.Client.send, httpx.AsyncClient.send)

    async def other() -> None:
        await asyncio.sleep(0.01)
        await client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "other"}])

    async def agent() -> None:
        await client(base_url).chat.completions.create(model="m", messages=[HI])
        with pytest.raises(openai.BadRequestError):
            await client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "fail"}])

    async def main():
        outside = asyncio.create_task(other())  # runs concurrently, outside any capture
        trajectories = await asyncio.gather(art.capture_auto_trajectory(agent()),
                                            art.capture_auto_trajectory(agent()))
        await outside
        return trajectories

    for trajectory in asyncio.run(main()):
        assert len(trajectory.messages_and_choices) == 2 and trajectory.additional_histories == []
    assert (httpx.Client.send, httpx.AsyncClient.send) == original
    assert art.auto_trajectory() is None
    with pytest.raises(RuntimeError, match="capture_auto_trajectory"):
        art.auto_trajectory(required=True)


# --------------------------------------------------------------------------- rebuilding streamed choices


def test_streamed_chunks_add_up_to_the_choice():
    choice = choice_from_chunks(parse_sse(STREAM))
    assert choice.message.role == "assistant" and choice.message.content is None  # "" pieces add nothing
    assert choice.message.tool_calls[0].id == "call_1"  # repeated ids and names are not doubled


def test_text_pieces_logprobs_and_token_ids_are_concatenated():
    chunks = [chunk({"role": "assistant", "content": "Hel"}, -0.5), chunk({"content": "lo"}, -0.25)]
    chunks[0]["choices"][0]["token_ids"] = [1]
    chunks[1]["choices"][0]["token_ids"] = [2]
    raw = b"".join(b"data:" + json.dumps(c).encode() + b"\r\n" for c in chunks)  # no space after "data:"
    choice = choice_from_chunks(parse_sse(raw))
    assert choice.message.content == "Hello" and choice.finish_reason == "stop"
    assert [lp.logprob for lp in choice.logprobs.content] == [-0.5, -0.25]
    assert choice.model_extra["token_ids"] == [1, 2]
    with pytest.raises(ValueError, match="no streamed chunk carries choice 1"):
        choice_from_chunks(chunks, index=1)
