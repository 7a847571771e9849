"""Soak and abuse of the local server: what hostile and careless clients cost the others, and where memory goes.

    python benchmarks/server_soak.py [--rounds 10] [--requests 100] [--n 32] [--slow-connections 200]

Loopback only, bounded (each phase has a fixed number of requests; the slow connections are
closed by the server's own deadlines). Serves the tiny model with the built-in engine in this
process, as `LocalBackend` does, and prints one JSON line:

1. `abuse`: requests a careless or hostile client sends (200,000 empty messages, one tool with a
   10 MB description, 50,000 small tools, a 10 MB tool-call argument, a recursive schema, invalid
   JSON, a body shorter than its Content-Length), each sent `--abuse-repeats` times: their HTTP
   statuses and seconds, and the latency of normal requests sent one after another while they
   run (`normal_during_abuse_ms`, p50 / max), next to the same normal requests alone
   (`normal_alone_ms`);
2. `slow`: `--slow-connections` connections that send half a request head and stop: how many the
   server had closed once its head deadline passed, and the open file descriptors before and after;
3. `soak`: `--rounds` rounds of `--requests` requests of `n=--n` distinct completions (the record
   cache fills, then evicts): resident memory after each round, to see it level off;
4. `rss_mib`: resident memory at the start, after the abuse, after the slow connections, after the soak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from typing import Any

import httpx
import psutil
import torch


def _rss_mib() -> float:
    return round(psutil.Process().memory_info().rss / 2**20, 1)


def _chat(content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


ABUSE: dict[str, Any] = {
    "200k_empty_messages": {"model": "m", "messages": [{"role": "user", "content": ""}] * 200_000},
    "10MB_tool_description": _chat(tools=[{"type": "function", "function": {"name": "f",
                                                                           "description": "d" * 10_000_000}}]),
    "50k_small_tools": _chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(50_000)]),
    "10MB_tool_call_arguments": {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": json.dumps({"a": "x" * 10_000_000})}}]}]},
    "recursive_schema": _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}}}),
}


async def _normal_latencies(client: httpx.AsyncClient, stop: asyncio.Event, count: int | None = None) -> list[float]:
    """Sequential normal requests until `stop` is set (or `count` of them): each one's milliseconds."""
    out: list[float] = []
    while not stop.is_set() and (count is None or len(out) < count):
        t0 = time.perf_counter()
        response = await client.post("/chat/completions", json=_chat("What is 2 + 3?", max_tokens=1))
        assert response.status_code == 200, response.text[:200]
        out.append(1000 * (time.perf_counter() - t0))
    return out


async def _abuse(base_url: str, repeats: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as normal, \
            httpx.AsyncClient(base_url=base_url, timeout=300) as hostile:
        alone = await _normal_latencies(normal, asyncio.Event(), count=50)
        stop = asyncio.Event()
        during = asyncio.create_task(_normal_latencies(normal, stop))
        results: dict[str, Any] = {}
        for name, body in ABUSE.items():
            payload = json.dumps(body).encode()
            statuses, seconds = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                response = await hostile.post("/chat/completions", content=payload,
                                              headers={"content-type": "application/json"})
                seconds.append(round(time.perf_counter() - t0, 3))
                statuses.append(response.status_code)
            results[name] = {"statuses": sorted(set(statuses)), "seconds_max": max(seconds),
                             "bytes": len(payload)}
        bad = b'{"model": "m", "messages": [}'
        results["invalid_json"] = {"statuses": [(await hostile.post(
            "/chat/completions", content=bad, headers={"content-type": "application/json"})).status_code]}
        stop.set()
        latencies = await during
    return {"requests": results, "normal_alone_ms": _p50_max(alone), "normal_during_abuse_ms": _p50_max(latencies),
            "normal_during_abuse_count": len(latencies)}


def _p50_max(values: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2)} if values else {}


def _slow(host: str, port: int, connections: int, head_timeout: float) -> dict[str, Any]:
    fds_before = psutil.Process().num_fds()
    socks = []
    for _ in range(connections):
        sock = socket.create_connection((host, port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # and never the rest
        socks.append(sock)
    fds_open = psutil.Process().num_fds()
    time.sleep(head_timeout + 2)  # past the server's head deadline
    closed = 0
    for sock in socks:
        sock.settimeout(5)
        try:
            data = sock.recv(65536)
            while data and b"408" in data[:20] and sock.recv(65536):
                pass
            closed += 1
        except OSError:
            pass
        sock.close()
    return {"connections": connections, "closed_by_server": closed, "fds_before": fds_before,
            "fds_with_them_open": fds_open, "fds_after": psutil.Process().num_fds()}


async def _soak(base_url: str, rounds: int, requests: int, n: int) -> list[float]:
    rss = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        for r in range(rounds):
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    body = _chat(f"Tell me something, number {r}-{i}.", n=n, max_tokens=8, seed=r * requests + i)
                    response = await client.post("/chat/completions", json=body)
                    assert response.status_code == 200, response.text[:200]

            await asyncio.gather(*(one(i) for i in range(requests)))
            rss.append(_rss_mib())
    return rss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--requests", type=int, default=100, help="requests a soak round")
    p.add_argument("--n", type=int, default=32, help="choices a soak request")
    p.add_argument("--abuse-repeats", type=int, default=2)
    p.add_argument("--slow-connections", type=int, default=200)
    p.add_argument("--head-timeout", type=float, default=5.0, help="the server's head deadline for this run")
    p.add_argument("--record-cache-mib", type=float, default=None, help="the server's record cache bound "
                   "(default: create_app's, 64 MiB; a smaller one shows the soak levelling off sooner)")
    args = p.parse_args()

    from artrl.serve import ServedModels, TransformersEngine, create_app, start_server
    from artrl.tiny import load_tiny

    torch.set_num_threads(1)
    model, tokenizer = load_tiny()
    engine = TransformersEngine(model, tokenizer, max_batch_size=32, num_threads=1)
    rss = {"start": _rss_mib()}
    try:
        cache = {} if args.record_cache_mib is None else {"record_cache_bytes": int(args.record_cache_mib * 2**20)}
        with start_server(create_app(ServedModels("m", engine), **cache), head_timeout=args.head_timeout) as handle:
            abuse = asyncio.run(_abuse(handle.base_url, args.abuse_repeats))
            rss["after_abuse"] = _rss_mib()
            slow = _slow(handle.host, handle.port, args.slow_connections, args.head_timeout)
            rss["after_slow"] = _rss_mib()
            soak = asyncio.run(_soak(handle.base_url, args.rounds, args.requests, args.n))
            rss["after_soak"] = _rss_mib()
    finally:
        engine.close()
    print(json.dumps({"bench": "server_soak", "record_cache_mib": args.record_cache_mib or 64, "abuse": abuse,
                      "slow": slow,
                      "soak_rss_mib_per_round": soak, "soak": {"rounds": args.rounds, "requests": args.requests,
                                                               "n": args.n}, "rss_mib": rss}))


if __name__ == "__main__":
    main()
