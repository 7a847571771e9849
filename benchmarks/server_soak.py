"""Soak and abuse of the local server: what hostile and careless clients cost the others, and where memory goes.

    python benchmarks/server_soak.py [--phases abuse,...] [--rounds 10] [--requests 100] [--n 32]
        [--slow-connections 200] [--trickles 100] [--disconnects 200] [--load-requests 1000]
        [--load-concurrency 64] [--routes chat,completions,responses,messages]
        [--unknown-requests 400] [--unknown-names 5000] [--store-mib 16] [--store-requests 600]
        [--big-clients 2] [--big-seconds 8] [--big-repeats 3]

Every phase covers each wire protocol the server speaks (`--routes`; Chat Completions, Completions, Responses,
Anthropic Messages): the abuse bodies in each protocol's spelling (`abuse` is keyed by route; Completions has
only a prompt to abuse), the connection phases' requests spread over the routes' paths, a load run per route and
soak rounds that send each route's requests in turn.

Loopback only, bounded (each phase has a fixed number of requests; slow and trickling connections
are ended by the server's own deadlines). Serves the tiny model with the built-in engine in this
process, as `LocalBackend` does, and prints one JSON line:

1. `abuse`: requests a careless or hostile client sends (200,000 empty messages, one tool with a
   10 MB description, 50,000 small tools (6.3 MB), a 10 MB tool-call argument, a recursive schema
   that cannot end and one that can, invalid JSON), each sent `--abuse-repeats` times: their HTTP
   statuses and seconds, and for each kind the latency of normal `max_tokens=1` requests sent one
   after another while it runs (`normal_ms`: p50 / max / count), next to the same normal requests
   alone (`normal_alone_ms`);
2. `slow`: `--slow-connections` connections that send half a request head and stop: how many the
   server had closed once its head deadline passed, and the open file descriptors before and after;
3. `trickle`: `--trickles` connections that send a whole head and then their body a byte every
   `--trickle-interval` seconds (each pause far under the body timeout): how many the server ended
   with a 408 once `--body-deadline` passed, how many were still open, the file descriptors;
4. `disconnect`: `--disconnects` clients that send half a body and close: the server's count of them
   (`GET /metrics`) and the log records with a traceback or at ERROR they caused (none expected);
5. `load`: `--load-requests` requests at `--load-concurrency` in flight (`max_tokens` 16, seeded), once
   with each of `--load-clients`: latency p50 / p99 / max, the engine's longest queue wait before
   admission (`oldest_waiter_s`) and its p99, the send order of the ten slowest requests (all early
   ones would mean the first sent wait longest) and, for the bare httpx client, how long each
   request waited inside the client before its headers went out (`client_wait_s`);
6. `soak`: `--rounds` rounds of `--requests` requests of `n=--n` distinct completions (the record
   cache fills, then evicts): resident memory after each round, to see it level off;
7. `unknown_names`: `--unknown-requests` requests (the routes in turn), each with `--unknown-names` field names
   no route takes and no other request sends, on a server of each `--unknown-policies` (refuse, warn): every
   `--sample-every` requests resident memory, the bytes and records artrl logged (as a log file would hold them)
   and the names the body policy remembers; they should stay flat;
8. `store`: `--store-requests` stored Responses requests of `--store-messages` empty messages on a server whose
   store holds `--store-mib`: resident memory, the bytes the store counts and the responses it keeps, filling to
   the limit and beyond (`rss_growth_once_full_mib`, flat);
9. `big_unknown`: one-token chat requests one after another for `--big-seconds`, alone, then while
   `--big-clients` other processes send 4.3 MB bodies (50,000 tools under an unknown name) as fast as they are
   answered, `--big-repeats` times: each window's latency and the min / median of the p50s;
10. `rss_mib`: resident memory at the start and after each phase.

`--phases` picks the phases (default: all); each line carries its `command`.

Runs on an older tree too (`PYTHONPATH=<tree>/src`): what that tree lacks (the body deadline, the
metrics route, the engine's admission waits) is reported as null.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import json
import logging
import select
import socket
import statistics
import sys
import threading
import time
from typing import Any

import httpx
import psutil
import torch


def _rss_mib() -> float:
    return round(psutil.Process().memory_info().rss / 2**20, 1)


def _chat(content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


TREE = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "child": {"$ref": "#"}},
        "required": ["v"], "additionalProperties": False}
ABUSE: dict[str, Any] = {
    "200k_empty_messages": {"model": "m", "messages": [{"role": "user", "content": ""}] * 200_000},
    "10MB_tool_description": _chat(tools=[{"type": "function", "function": {"name": "f",
                                                                           "description": "d" * 10_000_000}}]),
    "50k_small_tools": _chat(tools=[{"type": "function", "function": {
        "name": f"tool_{i:05d}", "description": "one small tool",
        "parameters": {"type": "object"}}} for i in range(50_000)]),
    "10MB_tool_call_arguments": {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": json.dumps({"a": "x" * 10_000_000})}}]}]},
    "recursive_schema_that_cannot_end": _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}}}),
    "recursive_schema_that_can_end": _chat(max_tokens=64, response_format={"type": "json_schema", "json_schema": {
        "name": "tree", "schema": TREE}}),
}


ROUTES = ("chat", "completions", "responses", "messages")
PATHS = {"chat": "/chat/completions", "completions": "/completions", "responses": "/responses",
         "messages": "/messages"}


def _normal(route: str, content: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    """A normal request on `route` (each protocol's spelling of one user question)."""
    if route == "chat":
        return _chat(content, max_tokens=max_tokens, **kw)
    if route == "completions":
        return {"model": "m", "prompt": content, "max_tokens": max_tokens, **kw}
    if route == "responses":
        return {"model": "m", "input": content, "max_output_tokens": max_tokens, "store": False, **kw}
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **kw}


def _route_abuse(route: str) -> dict[str, Any]:
    """The abuse bodies of ABUSE in `route`'s protocol (those it has a place for: Completions has no messages,
    tools or schemas, only a prompt)."""
    if route == "chat":
        return ABUSE
    if route == "completions":
        return {"10MB_prompt": {"model": "m", "prompt": "x " * 5_000_000, "max_tokens": 4},
                "200k_token_id_prompt": {"model": "m", "prompt": [1] * 200_000, "max_tokens": 4},
                "prompt_ids_out_of_vocabulary": {"model": "m", "prompt": [10**9], "max_tokens": 4}}
    big = "d" * 10_000_000
    if route == "responses":
        tool = lambda name, description: {"type": "function", "name": name, "description": description,  # noqa: E731
                                          "parameters": {"type": "object"}}
        ask = {"model": "m", "input": "hi", "max_output_tokens": 4, "store": False}
        return {
            "200k_empty_messages": {**ask, "input": [{"role": "user", "content": ""}] * 200_000},
            "10MB_tool_description": {**ask, "tools": [tool("f", big)]},
            "50k_small_tools": {**ask, "tools": [tool(f"tool_{i:05d}", "one small tool") for i in range(50_000)]},
            "10MB_tool_call_arguments": {**ask, "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "1", "name": "f", "arguments": json.dumps({"a": "x" * 10_000_000})},
                {"type": "function_call_output", "call_id": "1", "output": "ok"}]},
            "recursive_schema_that_cannot_end": {**ask, "text": {"format": {
                "type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
                    "a": {"$ref": "#/properties/a"}}, "required": ["a"]}}}},
            "recursive_schema_that_can_end": {**ask, "max_output_tokens": 64, "text": {"format": {
                "type": "json_schema", "name": "tree", "schema": TREE}}},
            "unknown_previous_response_id": {**ask, "previous_response_id": "resp_unknown"},
        }
    tool = lambda name, description: {"name": name, "description": description,  # noqa: E731
                                      "input_schema": {"type": "object"}}
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {
        "200k_empty_messages": {**ask, "messages": [{"role": "user", "content": ""}] * 200_000},
        "10MB_tool_description": {**ask, "tools": [tool("f", big)]},
        "50k_small_tools": {**ask, "tools": [tool(f"tool_{i:05d}", "one small tool") for i in range(50_000)]},
        "10MB_tool_use_input": {**ask, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "1", "name": "f",
                                               "input": {"a": "x" * 10_000_000}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "1", "content": "ok"}]}]},
        "recursive_schema_that_cannot_end": {**ask, "output_config": {"format": {
            "type": "json_schema", "schema": {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}},
                                              "required": ["a"]}}}},
        "recursive_schema_that_can_end": {**ask, "max_tokens": 64, "output_config": {"format": {
            "type": "json_schema", "schema": TREE}}},
        "missing_max_tokens": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }


def _unknown_field_abuse(route: str) -> dict[str, Any]:
    """Bodies whose size or number of names is under fields no route takes (serve/http/body_policy.py): 5,000
    invented names, and 50,000 tools under an unknown name (a counted name elsewhere is not counted there)."""
    names = {f"u0_{k:05d}_{'x' * 40}": 0 for k in range(5_000)}
    junk = [{"type": "function", "function": {"name": f"tool_{i:05d}", "description": "one small tool",
                                              "parameters": {"type": "object"}}} for i in range(50_000)]
    return {"5000_unknown_names": _normal(route, "hi", 4, **names),
            "50k_tools_under_an_unknown_name": _normal(route, "hi", 4, junk=junk)}


class _LogBytes(logging.Handler):
    """The bytes artrl's log records would take in a log file (one formatted line each), and how many there were."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
        self.bytes = self.records = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.bytes += len(self.format(record).encode()) + 1
        self.records += 1


def _with_names(route: str, r: int, names: int) -> bytes:
    """Request `r` on `route` with `names` unknown field names no other request sends (`u<r>_<k>_xxx...`)."""
    invented = {f"u{r}_{k:05d}_{'x' * 40}": 0 for k in range(names)}
    return json.dumps(_normal(route, "hi", 4, **invented)).encode()


async def _unknown_names(base_url: str, app: Any, requests: int, names: int, every: int,
                         routes: list[str]) -> dict[str, Any]:
    """`requests` requests (the routes' in turn, one after another), each with `names` unknown field names of its
    own: statuses, and every `every` requests resident memory, the bytes and records artrl logged so far and the
    names the body policy remembers."""
    log = _LogBytes()
    artrl_logger = logging.getLogger("artrl")
    artrl_logger.addHandler(log)
    statuses: dict[int, int] = {}
    samples: list[dict[str, Any]] = []
    policy = getattr(app.state, "body_policy", None)
    t0 = time.perf_counter()
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=300,
                                     headers={"anthropic-version": "2023-06-01",
                                              "content-type": "application/json"}) as client:
            for r in range(requests):
                route = routes[r % len(routes)]
                response = await client.post(PATHS[route], content=_with_names(route, r, names))
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if (r + 1) % every == 0 or r + 1 == requests:
                    samples.append({"requests": r + 1, "rss_mib": _rss_mib(), "log_bytes": log.bytes,
                                    "log_records": log.records,
                                    "names_remembered": policy.remembered if policy is not None else None})
    finally:
        artrl_logger.removeHandler(log)
    rss = [s["rss_mib"] for s in samples]
    return {"requests": requests, "names_per_request": names, "seconds": round(time.perf_counter() - t0, 1),
            "statuses": statuses, "samples": samples,
            "rss_growth_after_first_sample_mib": round(rss[-1] - rss[0], 1),
            "log_bytes_total": log.bytes, "log_records_total": log.records}


async def _store_fill(base_url: str, app: Any, requests: int, messages: int, every: int) -> dict[str, Any]:
    """`requests` stored Responses requests (one after another), each a conversation of `messages` empty user
    messages: every `every` requests resident memory, the bytes the store counts as held, its limit and how many
    responses it keeps."""
    store = getattr(app.state, "responses", None)
    samples: list[dict[str, Any]] = []
    body = {"model": "m", "input": [{"role": "user", "content": ""}] * messages, "max_output_tokens": 1,
            "store": True}
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=300,
                                 headers={"content-type": "application/json"}) as client:
        for r in range(requests):
            response = await client.post(PATHS["responses"], content=payload)
            assert response.status_code == 200, response.text[:200]
            if (r + 1) % every == 0 or r + 1 == requests:
                samples.append({"requests": r + 1, "rss_mib": _rss_mib(),
                                "store_held_bytes": getattr(store, "held", None),
                                "store_responses": len(store) if store is not None else None})
    full = next((s for s in samples if s["store_held_bytes"] is not None
                 and s["store_held_bytes"] >= 0.95 * store.max_bytes), None)
    after_full = [s["rss_mib"] for s in samples[samples.index(full):]] if full is not None else []
    return {"requests": requests, "messages_per_response": messages, "bytes_per_request": len(payload),
            "store_max_bytes": store.max_bytes if store is not None else None,
            "seconds": round(time.perf_counter() - t0, 1), "samples": samples,
            "requests_to_fill": full["requests"] if full is not None else None,
            "rss_growth_once_full_mib": round(after_full[-1] - after_full[0], 1) if after_full else None}


HOSTILE = r"""
import http.client, json, sys, time
host, port, paths, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), float(sys.argv[4])
junk = [{"type": "function", "function": {"name": f"tool_{i:05d}", "parameters": {"type": "object"}}}
        for i in range(50_000)]
bodies = {p: json.dumps(dict(json.loads(b), junk=junk)).encode() for p, b in zip(paths, sys.argv[5:])}
print("ready", flush=True)
sys.stdin.readline()
statuses, longest, sent, end = {}, 0.0, 0, time.monotonic() + seconds
connection = http.client.HTTPConnection(host, port, timeout=300)
while time.monotonic() < end:
    path = paths[sent % len(paths)]
    t0 = time.perf_counter()
    connection.request("POST", "/v1" + path, body=bodies[path], headers={
        "content-type": "application/json", "anthropic-version": "2023-06-01"})
    response = connection.getresponse()
    response.read()
    if response.getheader("connection", "").lower() == "close":
        connection.close()
        connection = http.client.HTTPConnection(host, port, timeout=300)
    longest = max(longest, time.perf_counter() - t0)
    statuses[response.status] = statuses.get(response.status, 0) + 1
    sent += 1
print(json.dumps({"sent": sent, "statuses": statuses, "seconds_max": round(longest, 3),
                  "bytes": len(bodies[paths[0]])}), flush=True)
"""


async def _timed_normals(base_url: str, seconds: float) -> list[float]:
    """Normal chat requests (`max_tokens` 1), one after another for `seconds`: each one's milliseconds."""
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, stop.set)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        return await _normal_latencies(client, stop)


def _big_unknown_latency(host: str, port: int, base_url: str, clients: int, seconds: float, repeats: int,
                         routes: list[str]) -> dict[str, Any]:
    """Normal chat requests alone for `seconds`, then for `seconds` while `clients` other processes send bodies of
    50,000 tools under a field no route takes (`junk`, 4.3 MB; the routes' in turn), `repeats` times: each window's
    p50, and the min / median over the windows of each kind."""
    import subprocess

    bodies = [json.dumps(_normal(route, "hi", 4)) for route in routes]
    windows: list[dict[str, Any]] = []
    for _ in range(repeats):
        alone = asyncio.run(_timed_normals(base_url, seconds))
        hostile = [subprocess.Popen([sys.executable, "-c", HOSTILE, host, str(port),
                                     ",".join(PATHS[r] for r in routes), str(seconds), *bodies],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for _ in range(clients)]
        for process in hostile:  # each has built its bodies: they start together
            assert process.stdout.readline().strip() == "ready"
        for process in hostile:
            process.stdin.write("go\n")
            process.stdin.flush()
        during = asyncio.run(_timed_normals(base_url, seconds))
        sent = [json.loads(process.communicate(timeout=600)[0]) for process in hostile]
        windows.append({"alone_ms": _stats_ms(alone), "during_ms": _stats_ms(during), "hostile": sent})

    def spread(kind: str) -> dict[str, float]:
        p50s = [w[kind]["p50"] for w in windows]
        return {"min": min(p50s), "median": round(statistics.median(p50s), 2)}

    alone_p50, during_p50 = spread("alone_ms"), spread("during_ms")
    return {"clients": clients, "seconds_per_window": seconds, "repeats": repeats, "windows": windows,
            "alone_p50_ms": alone_p50, "during_p50_ms": during_p50,
            "ratio_of_median_p50": round(during_p50["median"] / alone_p50["median"], 2)}


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"p50": round(statistics.median(values), 2), "p99": round(ordered[round(0.99 * (len(ordered) - 1))], 2),
            "max": round(max(values), 2), "count": len(values)}


async def _normal_latencies(client: httpx.AsyncClient, stop: asyncio.Event, count: int | None = None,
                           route: str = "chat") -> list[float]:
    """Sequential normal requests on `route` until `stop` is set (or `count` of them): each one's milliseconds."""
    out: list[float] = []
    while not stop.is_set() and (count is None or len(out) < count):
        t0 = time.perf_counter()
        response = await client.post(PATHS[route], json=_normal(route, "What is 2 + 3?", 1))
        assert response.status_code == 200, response.text[:200]
        out.append(1000 * (time.perf_counter() - t0))
    return out


async def _abuse(base_url: str, repeats: int, route: str = "chat") -> dict[str, Any]:
    """`route`'s abuse bodies, each `repeats` times, with normal requests on the same route running beside them."""
    headers = {"content-type": "application/json"}
    if route == "messages":
        headers["anthropic-version"] = "2023-06-01"
    async with httpx.AsyncClient(base_url=base_url, timeout=300, headers=headers) as normal, \
            httpx.AsyncClient(base_url=base_url, timeout=300, headers=headers) as hostile:
        alone = await _normal_latencies(normal, asyncio.Event(), count=50, route=route)
        results: dict[str, Any] = {}
        for name, body in {**_route_abuse(route), **_unknown_field_abuse(route)}.items():
            payload = json.dumps(body).encode()
            stop = asyncio.Event()
            during = asyncio.create_task(_normal_latencies(normal, stop, route=route))
            statuses, seconds, error = [], [], None
            for _ in range(repeats):
                t0 = time.perf_counter()
                response = await hostile.post(PATHS[route], content=payload)
                seconds.append(round(time.perf_counter() - t0, 3))
                statuses.append(response.status_code)
                if response.status_code >= 400:
                    error = response.text[:160]  # what the client is told
            stop.set()
            results[name] = {"statuses": sorted(set(statuses)), "seconds_max": max(seconds), "bytes": len(payload),
                             "error": error, "normal_ms": _stats_ms(await during)}
        bad = b'{"model": "m", "messages": [}'
        results["invalid_json"] = {"statuses": [(await hostile.post(PATHS[route], content=bad)).status_code]}
    return {"requests": results, "normal_alone_ms": _stats_ms(alone)}


def _paths(routes: list[str], count: int) -> list[bytes]:
    """`count` request paths, the routes' in turn."""
    return [b"/v1" + PATHS[routes[i % len(routes)]].encode() for i in range(count)]


def _slow(host: str, port: int, connections: int, head_timeout: float, routes: list[str]) -> dict[str, Any]:
    fds_before = psutil.Process().num_fds()
    socks = []
    for path in _paths(routes, connections):
        sock = socket.create_connection((host, port))
        sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\n" % path)  # and never the rest
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


def _trickle(host: str, port: int, connections: int, interval: float, deadline: float,
             routes: list[str]) -> dict[str, Any]:
    """Connections (the routes' in turn) sending their body a byte every `interval` s; run until each is answered
    or far past the server's `deadline`."""
    fds_before = psutil.Process().num_fds()
    body = json.dumps(_chat("x" * 4000)).encode()  # 4 KB: over an hour at a byte a second
    socks = {}
    for path in _paths(routes, connections):
        sock = socket.create_connection((host, port))
        sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % (path, len(body)))
        socks[sock] = 0
    fds_open = psutil.Process().num_fds()
    answered: dict[int, int] = {}
    started = time.monotonic()
    while socks and time.monotonic() - started < 3 * deadline + 10:
        for sock in list(socks):
            try:
                sock.sendall(body[socks[sock]:socks[sock] + 1])
                socks[sock] += 1
            except OSError:  # the server closed it
                pass
        readable, _, _ = select.select(list(socks), [], [], interval)
        for sock in readable:
            data = sock.recv(65536)
            status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
            answered[status] = answered.get(status, 0) + 1
            sock.close()
            del socks[sock]
    seconds = round(time.monotonic() - started, 1)
    for sock in socks:
        sock.close()
    return {"connections": connections, "interval_s": interval, "body_deadline_s": deadline,
            "answered_by_status": answered, "still_open": len(socks), "seconds": seconds,
            "fds_before": fds_before, "fds_with_them_open": fds_open, "fds_after": psutil.Process().num_fds()}


class _Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.count += 1


def _disconnects(handle: Any, metrics: Any, clients: int, routes: list[str]) -> dict[str, Any]:
    """`clients` clients that send half a body and close; `metrics`: the app's ServerMetrics (None: a tree
    without them)."""
    tracebacks = _Tracebacks()
    loggers = [logging.getLogger(n) for n in ("artrl", "uvicorn", "uvicorn.error", "uvicorn.asgi")]
    for lg in loggers:
        lg.addHandler(tracebacks)
    before = metrics.disconnects_mid_body if metrics is not None else None
    try:
        for path in _paths(routes, clients):
            sock = socket.create_connection((handle.host, handle.port))
            sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000\r\n\r\n" % path + b'{"model": "m", "mess')
            sock.close()
        counted = None
        if metrics is not None:
            deadline = time.monotonic() + 30
            while metrics.disconnects_mid_body - before < clients and time.monotonic() < deadline:
                time.sleep(0.05)
            counted = metrics.disconnects_mid_body - before
        else:
            time.sleep(2)
    finally:
        for lg in loggers:
            lg.removeHandler(tracebacks)
    return {"clients": clients, "counted_by_server": counted, "tracebacks_or_errors_logged": tracebacks.count}


async def _load(base_url: str, engine: Any, requests: int, concurrency: int, client_kind: str) -> dict[str, Any]:
    """`requests` requests, `concurrency` in flight, with the `openai` client a rollout gets
    (`model.openai_client()`: the SDK on aiohttp, chat) or a bare `httpx.AsyncClient` (`httpx` on chat,
    `httpx:<route>` on another route; its requests also report how long each waited in the client before its
    headers went out: `client_wait_s`)."""
    sem = asyncio.Semaphore(concurrency)
    admitted = getattr(engine, "requests_admitted", None)
    done: list[tuple[int, float, float]] = []  # (send order, latency, seconds in the client before sending)
    route = client_kind.partition(":")[2] or "chat"
    body = functools.partial(_normal, route, max_tokens=16)

    if client_kind == "openai":
        from artrl.model import Model

        user = Model(name="m", project="soak", inference_base_url=base_url, inference_api_key="x")
        client = user.openai_client()  # the model caches it (and closes it with the loop): keep `user` alive

        async def post(i: int) -> float:
            await client.chat.completions.create(**body(f"Question {i}: tell me more.", seed=i))
            return 0.0
    else:
        http = httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=concurrency),
                                 headers={"anthropic-version": "2023-06-01"} if route == "messages" else None)

        async def post(i: int) -> float:
            sent: list[float] = []

            async def trace(name: str, _: Any) -> None:
                if name == "http11.send_request_headers.started":
                    sent.append(time.perf_counter())

            t0 = time.perf_counter()
            ask = body(f"Question {i}: tell me more.", **({"seed": i} if route in ("chat", "completions") else {}))
            response = await http.post(PATHS[route], json=ask, extensions={"trace": trace})
            assert response.status_code == 200, response.text[:200]
            return sent[0] - t0

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            waited = await post(i)
            done.append((i, time.perf_counter() - t0, waited))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        if client_kind != "openai":
            await http.aclose()
    wall = time.perf_counter() - t0
    slowest = sorted(done, key=lambda x: -x[1])[:10]
    out: dict[str, Any] = {"client": client_kind.partition(":")[0], "route": route, "requests": requests, "concurrency": concurrency,
                           "seconds": round(wall, 2),
                           "latency_s": {k: round(v / 1000, 3) for k, v in _stats_ms(
                               [1000 * x for _, x, _ in done]).items() if k != "count"},
                           "slowest_10_send_order": sorted(i for i, _, _ in slowest),
                           "oldest_waiter_s": None, "admission_wait_p99_s": None}
    if client_kind != "openai":  # httpx, on any route
        out["client_wait_s"] = {k: round(v / 1000, 3) for k, v in _stats_ms(
            [1000 * w for _, _, w in done]).items() if k != "count"}
    if admitted is not None:
        waits = sorted(list(engine.admission_waits)[-(engine.requests_admitted - admitted):])
        out["oldest_waiter_s"] = round(waits[-1], 3)
        out["admission_wait_p99_s"] = round(waits[round(0.99 * (len(waits) - 1))], 3)
    return out


async def _soak(base_url: str, rounds: int, requests: int, n: int, routes: list[str]) -> list[float]:
    """`rounds` rounds of `requests` requests, the routes' in turn: chat and Completions with `n` distinct
    completions each (the record cache fills), Responses stored (the response store fills), Messages; resident
    memory after each round."""
    rss = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300, headers={"anthropic-version": "2023-06-01"}) as client:
        for r in range(rounds):
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    route = routes[i % len(routes)]
                    extra: dict[str, Any] = {}
                    if route in ("chat", "completions"):
                        extra = {"n": n, "seed": r * requests + i}
                    elif route == "responses":  # stored: the response store fills, then evicts
                        extra = {"store": True}
                    body = _normal(route, f"Tell me something, number {r}-{i}.", 8, **extra)
                    response = await client.post(PATHS[route], json=body)
                    assert response.status_code == 200, response.text[:200]

            await asyncio.gather(*(one(i) for i in range(requests)))
            rss.append(_rss_mib())
    return rss


PHASES = ("abuse", "slow", "trickle", "disconnect", "load", "soak", "unknown_names", "store", "big_unknown")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default=",".join(PHASES), help=f"phases to run, in this order (default: all, "
                   f"{','.join(PHASES)})")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--requests", type=int, default=100, help="requests a soak round")
    p.add_argument("--n", type=int, default=32, help="choices a soak request")
    p.add_argument("--abuse-repeats", type=int, default=2)
    p.add_argument("--slow-connections", type=int, default=200)
    p.add_argument("--head-timeout", type=float, default=5.0, help="the server's head deadline for this run")
    p.add_argument("--trickles", type=int, default=100, help="connections trickling their body")
    p.add_argument("--trickle-interval", type=float, default=1.0, help="seconds between two bytes of a trickle")
    p.add_argument("--body-deadline", type=float, default=5.0, help="the server's body deadline for this run")
    p.add_argument("--disconnects", type=int, default=200, help="clients that close mid-body")
    p.add_argument("--load-requests", type=int, default=1000)
    p.add_argument("--load-concurrency", type=int, default=64)
    p.add_argument("--routes", default=",".join(ROUTES), help="routes the abuse, connection, soak and unknown-name "
                   f"phases cover and the big unknown bodies go to (default: all, {','.join(ROUTES)})")
    p.add_argument("--load-clients", default="openai,httpx,httpx:completions,httpx:responses,httpx:messages",
                   help="clients of the load phase, in turn: openai (model.openai_client(), the SDK on aiohttp, "
                   "chat), httpx (a bare httpx.AsyncClient, pool of --load-concurrency connections, chat), "
                   "httpx:<route> (the same on completions, responses or messages)")
    p.add_argument("--record-cache-mib", type=float, default=None, help="the server's record cache bound "
                   "(default: create_app's, 64 MiB; a smaller one shows the soak levelling off sooner)")
    p.add_argument("--unknown-requests", type=int, default=400, help="requests of the unknown_names phase")
    p.add_argument("--unknown-names", type=int, default=5000, help="unknown field names each of them sends")
    p.add_argument("--unknown-policies", default="refuse,warn",
                   help="create_app(unknown_fields=...) of the unknown_names phase, a server each in turn")
    p.add_argument("--sample-every", type=int, default=50,
                   help="requests between two samples of the unknown_names and store phases")
    p.add_argument("--store-mib", type=float, default=16.0, help="the Responses store's limit in the store phase")
    p.add_argument("--store-requests", type=int, default=600, help="stored responses the store phase sends")
    p.add_argument("--store-messages", type=int, default=200, help="empty user messages in each of them")
    p.add_argument("--big-clients", type=int, default=2, help="processes sending big unknown bodies (big_unknown)")
    p.add_argument("--big-seconds", type=float, default=8.0, help="seconds of each big_unknown window")
    p.add_argument("--big-repeats", type=int, default=3, help="alone / during windows of the big_unknown phase")
    args = p.parse_args()
    routes = args.routes.split(",")
    if not routes or set(routes) - set(ROUTES):
        p.error(f"--routes takes some of {','.join(ROUTES)}, got {args.routes!r}")
    phases = args.phases.split(",")
    if not phases or set(phases) - set(PHASES):
        p.error(f"--phases takes some of {','.join(PHASES)}, got {args.phases!r}")

    from artrl.serve import ServedModels, TransformersEngine, create_app, start_server
    from artrl.models.tiny import load_tiny

    torch.set_num_threads(1)
    model, tokenizer = load_tiny()
    engine = TransformersEngine(model, tokenizer, max_batch_size=32, num_threads=1)
    rss = {"start": _rss_mib()}
    options: dict[str, Any] = {}
    if args.record_cache_mib is not None:
        options["record_cache_bytes"] = int(args.record_cache_mib * 2**20)
    if "body_deadline" in inspect.signature(create_app).parameters:  # an older tree has none
        options["body_deadline"] = args.body_deadline
    out: dict[str, Any] = {"bench": "server_soak", "phases": phases, "routes": routes}
    try:
        app = create_app(ServedModels("m", engine), **options)
        with start_server(app, head_timeout=args.head_timeout) as handle:
            if "abuse" in phases:
                out["abuse"] = {route: asyncio.run(_abuse(handle.base_url, args.abuse_repeats, route))
                                for route in routes}
                rss["after_abuse"] = _rss_mib()
            if "slow" in phases:
                out["slow"] = _slow(handle.host, handle.port, args.slow_connections, args.head_timeout, routes)
            if "trickle" in phases:
                out["trickle"] = _trickle(handle.host, handle.port, args.trickles, args.trickle_interval,
                                          args.body_deadline, routes)
            if "disconnect" in phases:
                out["disconnect"] = _disconnects(handle, getattr(app.state, "metrics", None), args.disconnects,
                                                 routes)
            if {"slow", "trickle", "disconnect"} & set(phases):
                rss["after_slow_trickle_disconnect"] = _rss_mib()
            if "load" in phases:
                out["load"] = [asyncio.run(_load(handle.base_url, engine, args.load_requests, args.load_concurrency,
                                                 kind)) for kind in args.load_clients.split(",")]
                rss["after_load"] = _rss_mib()
            if "soak" in phases:
                out["soak_rss_mib_per_round"] = asyncio.run(_soak(handle.base_url, args.rounds, args.requests, args.n,
                                                                  routes))
                out["soak"] = {"rounds": args.rounds, "requests": args.requests, "n": args.n}
                out["record_cache_mib"] = args.record_cache_mib or 64
                rss["after_soak"] = _rss_mib()
            if "big_unknown" in phases:  # the default policy: big bodies under unknown names are refused unparsed
                out["big_unknown"] = _big_unknown_latency(handle.host, handle.port, handle.base_url, args.big_clients,
                                                          args.big_seconds, args.big_repeats, routes)
                rss["after_big_unknown"] = _rss_mib()
        if "unknown_names" in phases:  # a server for each policy
            out["unknown_names"] = {}
            takes_policy = "unknown_fields" in inspect.signature(create_app).parameters  # an older tree has none
            for policy in args.unknown_policies.split(",") if takes_policy else ["default"]:
                policy_app = create_app(ServedModels("m", engine), **options,
                                        **({"unknown_fields": policy} if takes_policy else {}))
                with start_server(policy_app, head_timeout=args.head_timeout) as handle:
                    out["unknown_names"][policy] = asyncio.run(_unknown_names(
                        handle.base_url, policy_app, args.unknown_requests, args.unknown_names, args.sample_every,
                        routes))
                rss[f"after_unknown_names_{policy}"] = _rss_mib()
        if "store" in phases:  # a server whose Responses store is --store-mib
            store_app = create_app(ServedModels("m", engine), responses_store_bytes=int(args.store_mib * 2**20),
                                   **options)
            with start_server(store_app, head_timeout=args.head_timeout) as handle:
                out["store"] = asyncio.run(_store_fill(handle.base_url, store_app, args.store_requests,
                                                       args.store_messages, args.sample_every))
            rss["after_store"] = _rss_mib()
    finally:
        engine.close()
    out["rss_mib"] = rss
    out["command"] = " ".join(["python benchmarks/server_soak.py", *sys.argv[1:]])
    print(json.dumps(out))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
