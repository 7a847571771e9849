"""The inference server under load and under attack (issue 6, point 4). Loopback only.

* 64 concurrent clients send 320 requests (with hostile ones mixed in): every good
  request succeeds, every hostile one gets a 4xx, the engine decodes exactly the good
  requests' rows, and resident memory stays bounded.
* Oversized requests (huge max_tokens, n, body, prompt) get a 4xx before any decoding.
* A client that disconnects frees its slot: a queued request never runs, a running one
  stops at its next decoding step.
* Security defaults: loopback bind, an API key required off loopback and checked on
  every route, no trust_remote_code unless asked for.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psutil
import pytest

from artrl.errors import ConfigError
from artrl.serve import ServedModels, ServerHandle, TransformersEngine, create_app, start_server
from engine_helpers import one_thread_engine

CLIENTS = 64
REQUESTS_PER_CLIENT = 5
MAX_RSS_GROWTH_BYTES = 64 * 1024 * 1024  # over a second round of the same load
LONG = 256  # tokens a greedy request would decode if nobody stopped it


def wait_for(predicate: Callable[[], bool], timeout: float = 120.0) -> bool:
    """Poll until `predicate()`; the timeout only bounds a hung test, nothing asserts on time."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    with one_thread_engine(max_batch_size=32) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine: TransformersEngine) -> Iterator[ServerHandle]:
    handle = start_server(create_app(ServedModels("m", engine)))
    assert handle.host == "127.0.0.1"
    yield handle
    handle.stop()


def chat(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **kw}


def counters(engine: TransformersEngine) -> dict[str, int]:
    return {"rows": engine.rows_served, "batches": engine.batches_served, "steps": engine.decode_steps,
            "pending": engine.pending_requests}


# --------------------------------------------------------------------------- hostile requests

HUGE_BODY = 17 * 1024 * 1024  # over the default 16 MiB limit


def _nested() -> bytes:
    return b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


HOSTILE: dict[str, tuple[dict[str, Any], int]] = {
    # name: (httpx.post keyword arguments, expected status)
    "huge_max_tokens": ({"json": chat("hi", max_tokens=10**9)}, 400),
    "max_tokens_over_context_left": ({"json": chat("hi " * 3000, max_tokens=8000)}, 400),
    "huge_n": ({"json": chat("hi", n=10**6, max_tokens=1)}, 400),
    "huge_top_logprobs": ({"json": chat("hi", logprobs=True, top_logprobs=10**6, max_tokens=1)}, 400),
    "huge_body": ({"content": b" " * HUGE_BODY, "headers": {"content-type": "application/json"}}, 413),
    "huge_body_without_length": ({"content": iter([b" " * (1024 * 1024)] * 17),
                                  "headers": {"content-type": "application/json"}}, 413),
    "prompt_far_over_context": ({"json": chat("hello world " * 500_000)}, 400),
    "prompt_over_context": ({"json": chat("tokens " * 9000)}, 400),
    "deeply_nested_json": ({"content": _nested(), "headers": {"content-type": "application/json"}}, 400),
    "not_json": ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_oversized_requests_are_refused_before_any_work(server, engine, name):
    kwargs, status = HOSTILE[name]
    before = counters(engine)
    response = httpx.post(f"{server.base_url}/chat/completions", timeout=120, **kwargs)
    assert response.status_code == status, response.text[:300]
    assert response.json()["error"]["message"]
    assert counters(engine) == before, "a refused request must not reach the engine"


# --------------------------------------------------------------------------- load


async def _client(url: str, i: int, log: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        for j in range(REQUESTS_PER_CLIENT):
            n, max_tokens = 1 + (i + j) % 2, 1 + (3 * i + j) % 6
            body = chat(f"client {i}, request {j}: " + "tell me more " * (i % 5), n=n, max_tokens=max_tokens,
                        temperature=0.8, seed=1000 * i + j, logprobs=j % 2 == 0)
            try:
                response = await client.post(url, json=body)
                ok = response.status_code == 200
                data = response.json()
                ok = ok and len(data["choices"]) == n and all(
                    0 < len(c["token_ids"]) <= max_tokens for c in data["choices"])
                log.append({"ok": ok, "n": n, "status": response.status_code})
            except Exception as error:  # noqa: BLE001 - a failure is counted, not raised
                log.append({"ok": False, "n": n, "status": repr(error)})


async def _attacker(url: str, name: str, log: list[dict[str, Any]]) -> None:
    kwargs, status = HOSTILE[name]
    if name == "huge_body_without_length":
        async def chunks():  # AsyncClient wants an async stream
            for _ in range(17):
                yield b" " * (1024 * 1024)

        kwargs = {**kwargs, "content": chunks()}
    async with httpx.AsyncClient(timeout=300) as client:
        response = await client.post(url, **kwargs)
    log.append({"name": name, "ok": response.status_code == status, "status": response.status_code})


def _round(server: ServerHandle, clients: int, attackers: list[str]) -> tuple[list[dict], list[dict]]:
    url = f"{server.base_url}/chat/completions"
    good: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []

    async def main() -> None:
        tasks = [_client(url, i, good) for i in range(clients)] + [_attacker(url, a, bad) for a in attackers]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)

    asyncio.run(main())
    return good, bad


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.mark.slow
def test_64_concurrent_clients_with_attackers_mixed_in(server, engine, capsys):
    attackers = sorted(HOSTILE) * 2
    warm_good, warm_bad = _round(server, CLIENTS, attackers)  # warm up: allocator pools, the largest bodies
    assert all(r["ok"] for r in warm_good + warm_bad) and len(warm_good) == CLIENTS * REQUESTS_PER_CLIENT
    rss_before, threads_before = _rss(), threading.active_count()
    before = counters(engine)
    good, bad = _round(server, CLIENTS, attackers)
    rss_after = _rss()
    after = counters(engine)

    failures = [r for r in good if not r["ok"]]
    assert len(good) == CLIENTS * REQUESTS_PER_CLIENT and not failures, failures[:5]
    assert len(bad) == len(attackers) and all(r["ok"] for r in bad), [r for r in bad if not r["ok"]]
    # the engine decoded exactly the good requests' rows: no hostile request did any work
    assert after["rows"] - before["rows"] == sum(r["n"] for r in good)
    assert after["pending"] == 0 and after["batches"] - before["batches"] < len(good)  # requests shared batches
    assert rss_after - rss_before < MAX_RSS_GROWTH_BYTES
    assert wait_for(lambda: threading.active_count() <= threads_before + 1, timeout=30)
    with capsys.disabled():
        print(f"\nload test: {CLIENTS} clients, 2 rounds of {len(good)} requests + {len(bad)} hostile, "
              f"{len(failures)} failures, {after['batches'] - before['batches']} batches, "
              f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")


# --------------------------------------------------------------------------- disconnects


def _send_and_keep(server: ServerHandle, body: dict[str, Any]) -> socket.socket:
    """Send a request on a raw socket and return it unread (closing it = the client going away)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


@pytest.fixture(scope="module")
def long_greedy(engine: TransformersEngine) -> dict[str, Any]:
    """A greedy request that, left alone, decodes LONG tokens (no end-of-turn token before that)."""
    from artrl.serve import GenerationRequest

    for k in range(20):
        body = chat(f"Write a long story, number {k}.", max_tokens=LONG, temperature=0)
        ids = engine.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        prompt = engine.tokenizer(ids, add_special_tokens=False).input_ids
        (result,) = asyncio.run(engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=LONG, temperature=0)))
        if result.finish_reason == "length":
            return body
    pytest.skip("no prompt found whose greedy continuation runs to max_tokens")


def test_a_queued_request_whose_client_left_never_runs(server, engine):
    before = counters(engine)
    abandoned = engine.requests_abandoned
    engine.model_lock.acquire()  # hold the device, as a trainer would, so the request queues
    try:
        sock = _send_and_keep(server, chat("never mind", max_tokens=50))
        assert wait_for(lambda: engine.pending_requests == 1)
        sock.close()
        assert wait_for(lambda: engine.requests_abandoned == abandoned + 1)
    finally:
        engine.model_lock.release()
    response = httpx.post(f"{server.base_url}/chat/completions", json=chat("hello", max_tokens=2), timeout=120)
    assert response.status_code == 200
    after = counters(engine)
    assert after["rows"] - before["rows"] == 1 and after["pending"] == 0  # only the second request ran


def test_a_running_request_whose_client_left_stops_early(server, engine, long_greedy):
    before = counters(engine)
    rows_abandoned = engine.rows_abandoned
    sock = _send_and_keep(server, long_greedy)
    assert wait_for(lambda: engine.decode_steps >= before["steps"] + 3)
    sock.close()
    # the row leaves the batch at the step that notices its client left (a batch counts when it starts)
    assert wait_for(lambda: engine.rows_abandoned == rows_abandoned + 1)
    assert engine.decode_steps - before["steps"] < LONG, "the batch ran on after its only client left"
    response = httpx.post(f"{server.base_url}/chat/completions", json=chat("hello", max_tokens=2), timeout=120)
    assert response.status_code == 200


# --------------------------------------------------------------------------- security defaults


def test_the_server_binds_to_loopback_by_default():
    import inspect

    from artrl.local import LocalBackend
    from artrl.commands.serve import add_arguments

    assert inspect.signature(start_server).parameters["host"].default == "127.0.0.1"
    assert LocalBackend()._host == "127.0.0.1"
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert args.host == "127.0.0.1" and args.api_key is None and args.trust_remote_code is False


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_binding_off_loopback_requires_an_api_key(engine, host):
    from artrl.local import LocalBackend
    from artrl.commands.serve import add_arguments, build_app

    with pytest.raises(ConfigError, match="API key"):
        start_server(create_app(ServedModels("m", engine)), host=host)
    with pytest.raises(ConfigError, match="api_key"):
        LocalBackend(host=host)
    LocalBackend(host=host, api_key="k")  # allowed with a key (nothing is bound until a model registers)
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="--api-key"):
        build_app(parser.parse_args(["--host", host]))  # refused before any model is loaded


def test_the_api_key_is_checked_on_every_route(engine):
    app = create_app(ServedModels("keyed", engine), api_key="s3cret")
    paths = sorted({route.path for route in app.routes} | {"/no/such/route"})
    assert {"/health", "/v1/models", "/v1/chat/completions", "/openapi.json", "/docs"} <= set(paths)
    with start_server(app) as handle:
        for path in paths:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                for method in ("GET", "POST"):
                    response = httpx.request(method, handle.url + path, headers=headers, json=chat("hi"), timeout=30)
                    assert response.status_code == 401, (method, path, headers, response.status_code)
        keyed = {"Authorization": "Bearer s3cret"}
        assert httpx.get(handle.url + "/health", headers=keyed, timeout=30).status_code == 200
        response = httpx.post(handle.base_url + "/chat/completions", headers=keyed,
                              json={**chat("hi", max_tokens=2), "model": "keyed"}, timeout=120)
        assert response.status_code == 200


def test_no_remote_code_unless_asked_for(monkeypatch, tiny_path):
    import transformers

    from artrl.models.loading import load_base_model
    from artrl.config.model import InternalModelConfig

    seen: list[Any] = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _original=original, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    assert InternalModelConfig().trust_remote_code is False
    load_base_model(str(tiny_path), InternalModelConfig(device="cpu"))
    assert seen and all(v is False for v in seen)
    seen.clear()
    load_base_model(str(tiny_path), InternalModelConfig(device="cpu", trust_remote_code=True))
    assert seen and all(v is True for v in seen)


def test_artrl_serve_passes_its_body_bounds_to_the_app():
    import argparse

    from artrl.commands.serve import add_arguments, build_app
    from artrl.serve.http.guards import BodyLimit

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, pause, deadline in (([], 30.0, 60.0), (["--body-timeout", "2", "--body-deadline", "5"], 2.0, 5.0)):
        app, _ = build_app(parser.parse_args(["--engine", "builtin", "--device", "cpu", *argv]))
        (limit,) = [m for m in app.user_middleware if m.cls is BodyLimit]
        assert (limit.kwargs["pause"], limit.kwargs["deadline"]) == (pause, deadline), argv


@pytest.mark.parametrize("mode", ["refuse", "warn"])
def test_artrl_serve_and_local_backend_pass_their_unknown_fields_policy_to_the_server(mode):
    """`artrl serve --unknown-fields` and `LocalBackend(unknown_fields=...)` set the server's answer to a field no
    route takes: a 400 naming it (refuse), or the request goes on (warn: here to the 404 of a model not served)."""
    import argparse

    from artrl.commands.serve import add_arguments, build_app
    from artrl.local.backend import LocalBackend

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    app, _ = build_app(parser.parse_args(["--engine", "builtin", "--device", "cpu", "--unknown-fields", mode]))
    backend = LocalBackend(unknown_fields=mode, path=None)
    backend._ensure_server()
    try:
        for served in (app, None):
            handle = start_server(served) if served is not None else backend._server
            key = None if served is not None else backend._api_key
            try:
                answer = httpx.post(f"{handle.base_url}/chat/completions", timeout=30,
                                    headers={"authorization": f"Bearer {key}"} if key else {},
                                    json={"model": "not-served", "messages": [{"role": "user", "content": "hi"}],
                                          "frobnicate": 1})
            finally:
                if served is not None:
                    handle.stop()
            assert answer.status_code == (400 if mode == "refuse" else 404), answer.text[:300]
            assert (answer.json()["error"]["param"] == "frobnicate") == (mode == "refuse")
    finally:
        backend._server.stop()
    with pytest.raises(ConfigError, match="unknown_fields='ignore'"):
        LocalBackend(unknown_fields="ignore")
    with pytest.raises(SystemExit):
        parser.parse_args(["--unknown-fields", "ignore"])


# --------------------------------------------------------------------------- fairness


def test_requests_are_answered_in_arrival_order_under_a_saturated_queue():
    """The engine is held (as a trainer holds it) while 8 requests arrive one after another, each sent once the
    one before it reached the engine; then 8 requests for 2 places: they are admitted, and so answered, in the
    order they arrived, two at a time."""
    count = 8
    with one_thread_engine(max_batch_size=2) as engine:
        reached = [threading.Event() for _ in range(count)]
        answered: list[int] = []
        generate = engine.generate

        async def watched(request, on_token=None):  # on the server's loop, around the engine's own generate
            reached[request.seed].set()
            results = await generate(request, on_token)
            answered.append(request.seed)
            return results

        engine.generate = watched
        admitted = engine.requests_admitted
        with start_server(create_app(ServedModels("m", engine))) as handle:

            async def scenario() -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=handle.base_url, timeout=120) as client, asyncio.timeout(300):
                    sent = []
                    engine.model_lock.acquire()  # nothing decodes: every request waits in the engine's queue
                    try:
                        for i in range(count):
                            sent.append(asyncio.create_task(client.post(
                                "/chat/completions", json=chat(f"request {i}", max_tokens=1, seed=i))))
                            assert await asyncio.to_thread(reached[i].wait, 60), f"request {i} never reached it"
                    finally:
                        engine.model_lock.release()
                    return await asyncio.gather(*sent)

            responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * count, [r.text[:200] for r in responses]
    assert answered == list(range(count))
    assert engine.requests_admitted - admitted == count


def test_large_bodies_take_turns_and_leave_the_interpreter_half_the_time():
    """The scans and parses of large bodies (guards.py: `BodyLane`) run one at a time, and each waits after the
    one before at least as long as that one took, so megabyte bodies sent back to back hold the interpreter lock
    at most half the time; the first one is not delayed."""
    from artrl.serve.http.guards import BodyLane

    spans: list[tuple[float, float]] = []

    async def off_loop(fn: Any, *args: Any) -> Any:
        start = time.monotonic()
        result = fn(*args)
        await asyncio.sleep(0.05)  # the work (a parse holding the lock)
        spans.append((start, time.monotonic()))
        return result

    async def scenario() -> tuple[list[int], float]:
        lane = BodyLane(off_loop)
        first = await lane.run(lambda x: x, 0)
        alone_waited = lane.waited_s
        rest = await asyncio.gather(*(lane.run(lambda x: x, i) for i in range(1, 4)))
        return [first, *rest], alone_waited

    results, alone_waited = asyncio.run(scenario())
    assert results == [0, 1, 2, 3] and alone_waited == 0
    for (start, end), (next_start, _) in zip(spans, spans[1:]):
        assert next_start >= end + (end - start) - 1e-3  # never together, and a rest as long as the work
