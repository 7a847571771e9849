"""ART 0.5.23's capture scopes and the four wire protocols, against a local HTTP server of recorded payloads.

The payloads have the shape ART 0.5.23's `_protocols.py` and `_tokenize.py` read (vLLM's token-record
extensions: `prompt_token_ids`, `token_ids`, `compact_logprobs`, `token_generations`, ...), plain and
streamed. The clients are the real ones (httpx sync and async, aiohttp, requests).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import httpx
import pytest
import requests

import artrl as art
from artrl.trajectories.capture.clients import installed
from artrl.errors import TrajectoryError
from artrl.trajectories.exchanges import build_exchange, endpoint_for_url
from artrl.trajectories.tokenization import tokenize_groups
from artrl.trajectories.token_record import exchange_turns

PROMPT, IDS, LPS = [1, 2, 3], [4, 5], [-0.5, -0.25]
LOGPROBS = {"content": [{"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": []},
                        {"token": "i", "logprob": -0.25, "bytes": [105], "top_logprobs": []}]}

CHAT = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "prompt_token_ids": PROMPT,
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": IDS, "logprobs": LOGPROBS,
                     "message": {"role": "assistant", "content": "hi"}}]}
CHAT_SSE = [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": PROMPT,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "h"}, "finish_reason": None,
                          "logprobs": {"content": LOGPROBS["content"][:1]}}]},
            {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "i"}, "finish_reason": "stop", "token_ids": IDS,
                          "logprobs": {"content": LOGPROBS["content"][1:]}}]}]
COMPLETION = {"id": "t", "object": "text_completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": "hi", "finish_reason": "stop", "prompt_token_ids": PROMPT,
                           "token_ids": IDS, "logprobs": {"tokens": ["token_id:4", "token_id:5"],
                                                          "token_logprobs": LPS, "text_offset": [0, 1]}}]}
COMPLETION_SSE = [{"id": "t", "object": "text_completion", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": "h", "finish_reason": None, "prompt_token_ids": PROMPT,
                                "token_ids": IDS[:1], "compact_logprobs": LPS[:1]}]},
                  {"id": "t", "object": "text_completion", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": "i", "finish_reason": "stop", "token_ids": IDS[1:],
                                "compact_logprobs": LPS[1:]}]}]
RESPONSE = {"id": "r", "object": "response", "created_at": 1, "model": "m", "status": "completed",
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "output": [{"type": "message", "id": "o", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "hi", "annotations": []}]}],
            "token_generations": [{"prompt_token_ids": PROMPT, "output_indices": [0],
                                   "output_tokens": [{"token": "token_id:4", "logprob": -0.5},
                                                     {"token": "token_id:5", "logprob": -0.25}]}]}
RESPONSE_SSE = [("response.created", {"type": "response.created", "response": {**RESPONSE, "output": []}}),
                ("response.completed", {"type": "response.completed", "response": RESPONSE})]
MESSAGE = {"id": "a", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn",
           "content": [{"type": "text", "text": "hi"}], "usage": {"input_tokens": 3, "output_tokens": 2},
           "prompt_token_ids": PROMPT, "token_ids": IDS, "logprobs": LPS}
MESSAGE_SSE = [("message_start", {"type": "message_start", "message": {**MESSAGE, "content": [], "token_ids": None,
                                                                      "logprobs": None}}),
               ("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "text", "text": ""}}),
               ("ping", {"type": "ping"}),
               ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": "h"}}),
               ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": "i"}}),
               ("content_block_stop", {"type": "content_block_stop", "index": 0}),
               ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                  "usage": {"output_tokens": 2}, "token_ids": IDS, "logprobs": LPS}),
               ("message_stop", {"type": "message_stop"})]


def sse(events: list[Any], done: bool) -> bytes:
    out = b""
    for e in events:
        name, payload = e if isinstance(e, tuple) else (None, e)
        out += (f"event: {name}\n".encode() if name else b"") + b"data: " + json.dumps(payload).encode() + b"\n\n"
    return out + (b"data: [DONE]\n\n" if done else b"")


PAYLOADS = {  # protocol: (path, plain body, streamed body)
    "chat_completions": ("/v1/chat/completions", CHAT, sse(CHAT_SSE, True)),
    "completions": ("/v1/completions", COMPLETION, sse(COMPLETION_SSE, True)),
    "responses": ("/v1/responses", RESPONSE, sse(RESPONSE_SSE, False)),
    "messages": ("/v1/messages", MESSAGE, sse(MESSAGE_SSE, False)),
}


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        endpoint = endpoint_for_url(self.path)
        if endpoint is None:
            payload, status = b'{"object": "list", "data": []}', 200
        elif body.get("fail"):
            payload, status = b'{"error": "bad"}', 400
        elif body.get("stream"):
            payload, status = PAYLOADS[endpoint][2], 200
            if body.get("truncate"):
                payload = payload[: len(payload) // 2]
        else:
            payload, status = json.dumps(PAYLOADS[endpoint][1]).encode(), 200
        status = body.get("status", status)  # an error status over a protocol's body, where the test asks
        self.send_response(status)
        if self.headers.get("X-Gzip"):
            payload = gzip.compress(payload)
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Type", "text/event-stream" if body.get("stream") else "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def counts(t: art.Trajectory) -> dict[str, int]:
    return {name: len(getattr(t.exchanges, name)) for name in PAYLOADS}


# --------------------------------------------------------------------------- parsing recorded payloads


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", list(PAYLOADS))
def test_each_protocol_gives_its_token_record(endpoint: str, stream: bool) -> None:
    _, plain, streamed = PAYLOADS[endpoint]
    now = datetime.now(timezone.utc)
    exchange = build_exchange(endpoint, {"model": "m", "stream": stream}, streamed if stream else
                              json.dumps(plain).encode(), start_time=now, end_time=now)
    assert exchange.model == "m"
    [turn] = exchange_turns(endpoint, exchange)
    assert turn.message.content == "hi"
    assert turn.model_extra["prompt_token_ids"] == PROMPT and turn.model_extra["token_ids"] == IDS
    assert [lp.logprob for lp in turn.logprobs.content] == LPS


@pytest.mark.parametrize("endpoint", list(PAYLOADS))
def test_an_incomplete_stream_is_refused(endpoint: str) -> None:
    streamed = PAYLOADS[endpoint][2]
    now = datetime.now(timezone.utc)
    with pytest.raises(ValueError, match="(?i)incomplete|never finished"):
        build_exchange(endpoint, {"stream": True}, streamed[: streamed.rfind(b"data:")], start_time=now,
                       end_time=now)


# --------------------------------------------------------------------------- clients


def test_every_client_captures_every_protocol(url: str) -> None:
    def sync_clients() -> None:
        for name, (path, _, _) in PAYLOADS.items():
            for stream in (False, True):
                with httpx.Client() as c:
                    if stream:
                        with c.stream("POST", url + path, json={"model": "m", "stream": True}) as r:
                            for _ in r.iter_lines():
                                pass
                    else:
                        c.post(url + path, json={"model": "m"})
                r = requests.post(url + path, json={"model": "m", "stream": stream}, stream=stream)
                if stream:
                    for _ in r.iter_lines():
                        pass

    async def agent() -> None:
        async with httpx.AsyncClient() as c, aiohttp.ClientSession() as s:
            for path, _, _ in PAYLOADS.values():
                for stream in (False, True):
                    if stream:
                        async with c.stream("POST", url + path, json={"model": "m", "stream": True}) as r:
                            async for _ in r.aiter_bytes():
                                pass
                    else:
                        await c.post(url + path, json={"model": "m"})
                    async with s.post(url + path, json={"model": "m", "stream": stream}) as r:
                        if stream:
                            async for _ in r.content:
                                pass
                        else:
                            await r.read()
        await asyncio.to_thread(sync_clients)

    t = asyncio.run(art.trajectory(agent()))
    assert counts(t) == {name: 8 for name in PAYLOADS}  # 4 clients x plain and streamed
    for name, exchanges in t.exchanges.all():
        [turn] = exchange_turns(name, exchanges)
        assert turn.model_extra["token_ids"] == IDS, name
    assert not installed()  # the clients are as they were once no scope is open
    assert httpx.Client.send.__module__.startswith("httpx") and requests.Session.send.__module__ == "requests.sessions"


def test_compressed_bodies_are_captured_as_the_client_reads_them(url: str) -> None:
    gz = {"X-Gzip": "1"}
    path = PAYLOADS["messages"][0]

    async def agent() -> None:
        async with httpx.AsyncClient() as c, aiohttp.ClientSession() as s:
            async with c.stream("POST", url + path, json={"stream": True}, headers=gz) as r:
                async for _ in r.aiter_lines():
                    pass
            await c.post(url + path, json={}, headers=gz)
            async with s.post(url + path, json={"stream": True}, headers=gz) as r:
                async for _ in r.content.iter_any():
                    pass
        r = await asyncio.to_thread(requests.post, url + path, json={"stream": True}, headers=gz, stream=True)
        for _ in r.iter_lines():
            pass

    t = asyncio.run(art.trajectory(agent()))
    assert len(t.exchanges.messages) == 4
    assert all(exchange_turns("messages", e)[0].model_extra["token_ids"] == IDS for e in t.exchanges.messages)


def test_langchain_chat_models_are_captured(url: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="x", model="m", max_retries=0)

    async def agent() -> None:
        await llm.ainvoke("Hi")
        await asyncio.to_thread(llm.invoke, "Hi")

    t = asyncio.run(art.trajectory(agent()))
    assert [e.request["messages"] for e in t.exchanges.chat_completions] == [[{"role": "user", "content": "Hi"}]] * 2
    assert t.exchanges.chat_completions[0].response.model_extra["prompt_token_ids"] == PROMPT


def test_failed_and_incomplete_responses_are_not_captured(url: str, caplog) -> None:
    with art.Trajectory() as t, caplog.at_level(logging.WARNING, logger="artrl.trajectories.capture.core"):
        httpx.post(url + "/v1/messages", json={"fail": True})
        with httpx.stream("POST", url + "/v1/messages", json={"stream": True, "truncate": True}) as r:
            r.read()
        httpx.post(url + "/v1/models", json={})  # not a model endpoint
        httpx.post(url + "/v1/messages", json={"model": "m"})
    assert counts(t)["messages"] == 1
    assert "incomplete Messages stream" in caplog.text


@pytest.mark.parametrize(("status", "captured"), [(200, 2), (400, 0), (429, 0), (500, 0), (503, 0)])
def test_an_error_status_is_not_captured_even_when_its_body_reads_as_a_reply(url: str, status: int,
                                                                             captured: int) -> None:
    """A 4xx or 5xx whose body is a whole protocol reply (a proxy's or a gateway's, say) records no exchange: the
    same bodies under 200 record one each, plain and streamed."""
    with art.Trajectory() as t:
        for path, _, _ in PAYLOADS.values():
            for stream in (False, True):
                response = httpx.post(url + path, json={"model": "m", "stream": stream, "status": status})
                assert response.status_code == status
    assert counts(t) == {name: captured for name in PAYLOADS}


# --------------------------------------------------------------------------- scopes


def test_scopes_nest_hide_and_do_not_mix_across_tasks(url: str) -> None:
    def post() -> None:
        httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": []})

    assert art.current_trajectory() is None
    with pytest.raises(RuntimeError, match="No trajectory is active"):
        art.current_trajectory(require=True)
    with art.Trajectory() as outer:
        post()
        with art.Trajectory() as inner:
            assert art.current_trajectory() is inner
            post()
            with art.no_capture():
                assert art.current_trajectory() is None
                post()
                with art.Trajectory() as hidden:  # a new scope inside no_capture captures
                    post()
        assert art.current_trajectory() is outer
    assert [len(t.exchanges.chat_completions) for t in (outer, inner, hidden)] == [1, 1, 1]
    assert "duration" in outer.metrics

    async def rollout(n: int) -> art.Trajectory:
        with art.Trajectory() as t:
            for _ in range(n):
                await asyncio.to_thread(post)
                await asyncio.sleep(0)
        return t

    async def main() -> list[art.Trajectory]:
        return await asyncio.gather(*(rollout(n) for n in (1, 2, 3)))

    assert [len(t.exchanges.chat_completions) for t in asyncio.run(main())] == [1, 2, 3]

    a, b = art.Trajectory(), art.Trajectory()
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="stack order"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    assert not installed()


def test_trajectory_group_keeps_order_runs_each_awaitable_once_and_hides_enclosing_scopes(url: str) -> None:
    runs: list[int] = []

    async def rollout(k: int) -> art.Trajectory:
        await asyncio.sleep(0.01 * (3 - k))  # finish in reverse order
        runs.append(k)
        art.current_trajectory(require=True).reward = float(k)
        await asyncio.to_thread(httpx.post, url + "/v1/chat/completions", json={"model": "m", "messages": []})

    async def unscoped() -> art.Trajectory:  # a rollout that opens no scope of its own
        await asyncio.to_thread(httpx.post, url + "/v1/chat/completions", json={"model": "m", "messages": []})
        return art.Trajectory(reward=5.0)

    async def main() -> tuple[art.TrajectoryGroup, art.Trajectory]:
        shared = art.trajectory(rollout(0))
        given = art.Trajectory(reward=9.0)
        with art.Trajectory() as outer:
            group = await art.trajectory_group([shared, art.trajectory(rollout(1)), given, shared,
                                                ValueError("lost"), unscoped()], metadata={"task": "t"},
                                               exceptions=[KeyError("k")])
        return group, outer

    group, outer = asyncio.run(main())
    assert [t.reward for t in group] == [0.0, 1.0, 9.0, 0.0, 5.0]
    assert group.trajectories[0] is group.trajectories[3]
    assert sorted(runs) == [0, 1] and group.metadata == {"task": "t"}
    assert sorted(e.message for e in group.exceptions) == ["'k'", "lost"]
    assert not outer.exchanges  # the group's rollouts ran under no_capture
    assert [len(t.exchanges.chat_completions) for t in group.trajectories[:2]] == [1, 1]


def test_trajectory_group_failures() -> None:
    async def bad() -> art.Trajectory:
        raise ValueError("boom")

    async def slow() -> art.Trajectory:
        await asyncio.sleep(10)
        return art.Trajectory()

    async def not_a_trajectory() -> int:
        return 1

    async def main() -> None:
        with pytest.raises(ValueError, match="boom"):
            await art.trajectory_group([bad(), slow()])  # the slow one is cancelled, not awaited for 10 s
        group = await art.trajectory_group([bad(), art.trajectory(asyncio.sleep(0))], return_exceptions=True)
        assert len(group) == 1 and group.exceptions[0].message == "boom"
        with pytest.raises(TypeError, match="gave int"):
            await art.trajectory_group([not_a_trajectory()])
        with pytest.raises(TypeError, match="coroutine object"):
            await art.trajectory(asyncio.ensure_future(asyncio.sleep(0)))

    asyncio.run(asyncio.wait_for(main(), 5))


def test_a_trajectory_holds_exchanges_or_legacy_histories_never_both(url: str, caplog, tok) -> None:
    with art.Trajectory() as captured:
        httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": []})
    with pytest.raises(TrajectoryError, match="never both"):
        art.Trajectory(exchanges=captured.exchanges, messages_and_choices=[{"role": "user", "content": "x"}])
    legacy = art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}])
    with caplog.at_level(logging.WARNING, logger="artrl.trajectories.capture.core"), legacy:
        httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": []})
    assert not legacy.exchanges and "never both" in caplog.text
    captured.messages_and_choices.append({"role": "user", "content": "x"})  # assignment is not checked...
    with pytest.raises(TrajectoryError, match="never both"):  # ...the check before use is
        tokenize_groups([art.TrajectoryGroup([captured, art.Trajectory(reward=1.0)])], tok)


# --------------------------------------------------------------------------- training data of other protocols


def _completions_trajectory(turns: list[tuple[list[int], list[int]]], reward: float) -> art.Trajectory:
    now = datetime.now(timezone.utc)
    t = art.Trajectory(reward=reward)
    for prompt, ids in turns:
        body = {**COMPLETION, "choices": [{**COMPLETION["choices"][0], "prompt_token_ids": prompt, "token_ids": ids,
                                           "logprobs": None, "compact_logprobs": [-0.1] * len(ids)}]}
        t.exchanges.append(build_exchange("completions", {"model": "m", "prompt": prompt}, json.dumps(body).encode(),
                                          start_time=now, end_time=now))
    return t


def test_exchanges_of_other_protocols_chain_on_their_tokens(tok) -> None:
    first = ([10, 11, 12], [13, 14])
    second = ([10, 11, 12, 13, 14, 15], [16])  # extends the first turn: one sequence
    other = ([20, 21], [22])  # another conversation of the same rollout
    group = art.TrajectoryGroup([_completions_trajectory([first, second, other], 1.0),
                                 _completions_trajectory([first], 0.0)])
    result = tokenize_groups([group], tok, scale_rewards=False)
    seqs = result.groups[0]
    assert [s.token_ids for s in seqs] == [[10, 11, 12, 13, 14, 15, 16], [20, 21, 22], [10, 11, 12, 13, 14]]
    assert seqs[0].trainable_mask == [False] * 3 + [True] * 2 + [False, True]
    assert seqs[0].logprobs[3:5] == [-0.1, -0.1]
    assert result.stats.record_turns == 4 and result.stats.rendered_turns == 0 and result.stats.record_splits == 0

    no_record = _completions_trajectory([first], 1.0)
    del no_record.exchanges.completions[0].response.choices[0].model_extra["prompt_token_ids"]
    with pytest.raises(TrajectoryError, match=r"exchanges.completions\[0\] carries no complete token record"):
        tokenize_groups([art.TrajectoryGroup([no_record, art.Trajectory()])], tok)


def test_a_captured_trajectory_is_logged_with_its_exchanges_whole(url: str, tmp_path) -> None:
    import pyarrow.parquet as pq

    from artrl.run.trajectory_logs import read_trajectory_groups_parquet, write_trajectory_groups_parquet

    question = {"role": "user", "content": "q"}
    with art.Trajectory(reward=1.0) as t:
        httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": [question]})
        httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    path = tmp_path / "log.parquet"
    write_trajectory_groups_parquet([art.TrajectoryGroup([t])], path)
    assert pq.read_table(path).column("messages").to_pylist() == [None]  # ART's column is null for exchanges
    [group] = read_trajectory_groups_parquet(path)
    [back] = group.trajectories
    assert not back.messages_and_choices and not back.additional_histories
    assert [e.request for e in back.exchanges.chat_completions] == [e.request for e in t.exchanges.chat_completions]
    assert [e.response for e in back.exchanges.chat_completions] == [e.response for e in t.exchanges.chat_completions]
    assert [(e.start_time, e.end_time) for e in back.exchanges.chat_completions] == [
        (e.start_time, e.end_time) for e in t.exchanges.chat_completions]
    assert back.reward == 1.0


# --------------------------------------------------------------------------- art.tokenize / art.tensorize


def test_tokenize_and_tensorize_give_the_record_with_its_flags(tok) -> None:
    from artrl.trajectories.tokens import TokenFlag

    end = tok.eos_token_id
    first, second = ([10, 11, 12], [13, end]), ([10, 11, 12, 13, end, 15], [16])
    chained = _completions_trajectory([first, second], 1.0)
    two = _completions_trajectory([first, ([20], [21])], 0.0)

    async def main() -> None:
        [t] = await art.tokenize([chained], tokenizer=tok)
        assert t.tokens == [10, 11, 12, 13, end, 15, 16] and t.trajectory is chained and t.reward == 1.0
        sampled = TokenFlag.EXACT | TokenFlag.SAMPLED | TokenFlag.OUTPUT | TokenFlag.ASSISTANT
        assert t.flags == [TokenFlag.EXACT] * 3 + [sampled, sampled | TokenFlag.STOP, TokenFlag.EXACT, sampled]
        assert [lp if k in (3, 4, 6) else None for k, lp in enumerate(t.logprobs)] == \
            [None] * 3 + [-0.1, -0.1, None, -0.1]
        assert all(lp != lp for k, lp in enumerate(t.logprobs) if k not in (3, 4, 6))  # NaN elsewhere

        with pytest.raises(ValueError, match="exactly one history; found 2"):
            await art.tokenize([two], tokenizer=tok)
        [multi] = await art.tokenize([two], tokenizer=tok, multi_history=True)
        assert [h.tokens for h in multi.histories] == [[10, 11, 12, 13, end], [20, 21]]

        [group] = await art.tensorize([art.TrajectoryGroup([chained])], tokenizer=tok)
        [tensors] = group.trajectories
        assert tensors.tokens.tolist() == t.tokens and tensors.flags.tolist() == [int(f) for f in t.flags]
        assert str(tensors.tokens.dtype) == "torch.int64" and str(tensors.logprobs.dtype) == "torch.float32"

        with pytest.raises(art.ConfigError, match="chat_template"):
            await art.tokenize([chained], tokenizer=tok, chat_template="{{ x }}")
        with pytest.raises(art.ConfigError, match="needs a tokenizer"):
            await art.tokenize([chained])
        # base_model names the tokenizer only: it selects no exchanges, whose served model ("m") names the sequence
        [named] = await art.tokenize([chained], base_model="artrl/tiny")
        assert named.tokens == t.tokens and named.model == "m"
        with pytest.raises(ValueError, match="found 0"):
            await art.tokenize([chained], tokenizer=tok, model="other")

    asyncio.run(main())


def test_tokenize_renders_legacy_data_without_a_record_and_says_so(tok) -> None:
    from artrl.trajectories.tokens import TokenFlag

    sft = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "a"}}
    rl = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice])
    [t] = asyncio.run(art.tokenize([rl], tokenizer=tok))
    assert not any(f & TokenFlag.EXACT for f in t.flags)  # rendered from text: nothing exact
    assert any(f & TokenFlag.ASSISTANT for f in t.flags) and not any(f & TokenFlag.SAMPLED for f in t.flags)
    assert tok.decode([x for x, f in zip(t.tokens, t.flags) if f & TokenFlag.ASSISTANT]).startswith("a")
    with pytest.raises(ValueError, match="found 0"):  # a plain assistant dict is not a sampled turn
        asyncio.run(art.tokenize([sft], tokenizer=tok))


def test_messages_and_for_logging_of_a_captured_trajectory(url: str) -> None:
    q = {"role": "user", "content": "q"}
    with art.Trajectory() as t:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": [q]}).json()
        httpx.post(url + "/v1/chat/completions",
                   json={"model": "m", "messages": [q, r["choices"][0]["message"], {"role": "user", "content": "r"}]})
    with pytest.raises(ValueError, match="exactly one history; found 2"):  # the payloads' ids do not chain (ART's)
        t.messages()
    t.exchanges.chat_completions[1].response.model_extra["prompt_token_ids"] = [*PROMPT, *IDS, 6]  # now they do
    assert t.messages() == [q, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "r"},
                            {"role": "assistant", "content": "hi"}]
    logged = t.for_logging()
    assert len(logged["exchanges"]["chat_completions"]) == 2 and "start_time" not in logged
    with art.Trajectory() as two:
        httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": [q]})
        httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        httpx.post(url + "/v1/messages", json={"model": "m"})
    with pytest.raises(ValueError, match="multiple protocol histories"):  # ART's: one protocol's history
        two.messages()
    two.exchanges.messages.clear()
    with pytest.raises(ValueError, match="exactly one history; found 2"):
        two.messages()


def test_a_gather_counts_the_completion_tokens_of_captured_exchanges(url: str) -> None:
    async def rollout() -> art.Trajectory:
        with art.Trajectory() as t:
            await asyncio.to_thread(httpx.post, url + "/v1/messages", json={"model": "m"})  # usage: 2 output tokens
            await asyncio.to_thread(httpx.post, url + "/v1/messages", json={"model": "m"})
        return t

    async def main() -> list[art.TrajectoryGroup]:
        return await art.gather_trajectory_groups([art.TrajectoryGroup(rollout() for _ in range(2))], pbar_desc=None)

    [group] = asyncio.run(main())
    assert [t.metrics["completion_tokens"] for t in group] == [4, 4]


def test_a_trajectory_of_exchanges_survives_a_json_round_trip() -> None:
    now = datetime.now(timezone.utc)
    t = art.Trajectory(reward=0.5)
    for name, (_, _, streamed) in PAYLOADS.items():
        t.exchanges.append(build_exchange(name, {"model": "m", "stream": True}, streamed, start_time=now,
                                          end_time=now))
    dumped = t.model_dump(mode="json")
    back = art.Trajectory.model_validate(dumped)
    assert back.model_dump(mode="json") == dumped and counts(back) == {name: 1 for name in PAYLOADS}
    assert [exchange_turns(n, e)[0].model_extra["token_ids"] for n, e in back.exchanges.all()] == [IDS] * 4


@pytest.mark.parametrize("endpoint, body", [
    ("chat_completions", {**CHAT, "prompt_token_ids": None, "choices": [
        {**CHAT["choices"][0], "logprobs": None, "prompt_token_ids": PROMPT, "compact_logprobs": LPS}]}),
    ("completions", {**COMPLETION, "prompt_token_ids": PROMPT, "choices": [
        {"index": 0, "text": "hi", "finish_reason": "length", "logprobs": {"tokens": ["token_id:4", "token_id:5"],
                                                                           "token_logprobs": LPS}}]}),
    ("responses", {**RESPONSE, "token_generations": [{"prompt_token_ids": PROMPT, "output_indices": [0],
                                                      "token_ids": IDS, "compact_logprobs": LPS}]}),
    ("messages", {**MESSAGE, "logprobs": None, "compact_logprobs": LPS}),
])
def test_the_other_spellings_of_the_record(endpoint: str, body: dict) -> None:
    """vLLM's compact logprobs, a response-level prompt, ids spelled `token_id:N` in classic logprobs."""
    now = datetime.now(timezone.utc)
    exchange = build_exchange(endpoint, {"model": "m"}, json.dumps(body).encode(), start_time=now, end_time=now)
    [turn] = exchange_turns(endpoint, exchange)
    assert turn.model_extra["prompt_token_ids"] == PROMPT and turn.model_extra["token_ids"] == IDS
    assert [lp.logprob for lp in turn.logprobs.content] == LPS


def test_logprobs_that_do_not_match_the_ids_leave_the_turn_without_logprobs() -> None:
    now = datetime.now(timezone.utc)
    body = {**MESSAGE, "logprobs": [-0.5]}  # one logprob for two ids
    exchange = build_exchange("messages", {"model": "m"}, json.dumps(body).encode(), start_time=now, end_time=now)
    [turn] = exchange_turns("messages", exchange)
    assert turn.model_extra["token_ids"] == IDS and turn.logprobs is None  # trained as on-policy, and counted
