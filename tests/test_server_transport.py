"""The server against careless and hostile clients: its connections, and the bounds on what one request may cost."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import select
import socket
import threading
from collections.abc import Iterator
from typing import Any

import fastapi
import httpx
import pytest

from artrl.serve import ServedModels, ServerHandle, create_app, start_server
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.serve.http.server import DEFAULT_MAX_MESSAGES, DEFAULT_MAX_SCHEMA_CHARS, DEFAULT_MAX_TOOLS, INLINE_RENDER_MESSAGES
from artrl.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def handle() -> Iterator[ServerHandle]:
    app = fastapi.FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    with start_server(app) as running:
        yield running


def test_connections_have_nagle_off(handle: ServerHandle) -> None:
    """With Nagle's algorithm on, a response sent in two writes waits for the client's delayed ACK (~40 ms)."""
    client = http.client.HTTPConnection(handle.host, handle.port)
    client.request("GET", "/health")
    assert client.getresponse().read() == b'{"status":"ok"}'
    local = client.sock.getsockname()
    served = [c.transport.get_extra_info("socket") for c in handle._server.server_state.connections]
    ours = [s for s in served if s.getpeername() == local]
    assert len(ours) == 1, f"the server's end of {local} among {[s.getpeername() for s in served]}"
    assert ours[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    client.close()


# --------------------------------------------------------------------------- bounds before the work


class GatedTokenizer:
    """The tiny tokenizer, whose chat template waits for `release` (after setting `entered`) on long conversations:
    a request's rendering held open for as long as a test needs. Counts its renders and its tokenizations."""

    def __init__(self, tokenizer: Any, min_messages: int) -> None:
        self._tokenizer, self._min = tokenizer, min_messages
        self.entered, self.release = threading.Event(), threading.Event()
        self.renders = self.tokenized = 0

    def apply_chat_template(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        self.renders += 1
        if len(messages) >= self._min:
            self.entered.set()
            assert self.release.wait(60), "the test never released the gate"
        return self._tokenizer.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.tokenized += 1
        return self._tokenizer(*args, **kwargs)


@pytest.fixture()
def gated() -> Iterator[tuple[ServerHandle, GatedTokenizer]]:
    tokenizer = GatedTokenizer(build_tiny_tokenizer(), min_messages=INLINE_RENDER_MESSAGES + 1)
    engine = ScriptedEngine.from_text(tokenizer, "ok", max_model_len=8192)
    with start_server(create_app(ServedModels("m", engine))) as running:
        yield running, tokenizer


def chat(messages: int, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}] * messages, "max_tokens": 1, **kw}


def test_a_request_answers_while_a_large_one_renders(gated: tuple[ServerHandle, GatedTokenizer]) -> None:
    """Ordered by events: the large request is inside its rendering when the small one is sent and answered."""
    handle, tokenizer = gated

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=handle.base_url, timeout=60) as client, asyncio.timeout(20):
            large = asyncio.create_task(client.post("/chat/completions", json=chat(INLINE_RENDER_MESSAGES + 1)))
            assert await asyncio.to_thread(tokenizer.entered.wait, 30)
            try:
                small = await client.post("/chat/completions", json=chat(1))
                assert small.status_code == 200, small.text
                assert not large.done()  # still rendering: the small one did not wait for it
            finally:
                tokenizer.release.set()
            answer = await large
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] > small.json()["usage"]["prompt_tokens"]

    asyncio.run(scenario())


LIMITED = {
    "messages": (chat(DEFAULT_MAX_MESSAGES + 1), f"at most {DEFAULT_MAX_MESSAGES}"),
    "many_empty_messages": ({"model": "m", "messages": [{"role": "user", "content": ""}] * 200_000}, "at most"),
    "tools": (chat(1, tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(DEFAULT_MAX_TOOLS + 1)]),
              f"at most {DEFAULT_MAX_TOOLS}"),
    "tool_description": (chat(1, tools=[{"type": "function", "function": {"name": "f", "description": "d" * 5_000_000}}]),
                         "characters"),
    "tool_call_arguments": ({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": json.dumps({"a": "x" * 5_000_000})}}]}]}, "characters"),
    "response_format": (chat(1, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "d" * (DEFAULT_MAX_SCHEMA_CHARS + 1)}}}), f"at most {DEFAULT_MAX_SCHEMA_CHARS}"),
}


@pytest.mark.parametrize("name", sorted(LIMITED))
def test_oversized_requests_get_a_400_naming_the_limit_before_rendering(
        gated: tuple[ServerHandle, GatedTokenizer], name: str) -> None:
    handle, tokenizer = gated
    body, fragment = LIMITED[name]
    response = httpx.post(f"{handle.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert fragment in error["message"] and error["param"] in ("messages", "tools", "response_format"), error
    assert tokenizer.renders == 0, "refused after rendering"


def test_a_completions_prompt_longer_than_the_model_can_spell_is_refused_before_tokenizing(
        gated: tuple[ServerHandle, GatedTokenizer]) -> None:
    """A text prompt past what 8192 tokens (the engine's length) can spell, at the tokenizer's longest token, is
    refused by its character count, as chat's messages are: a 400 naming `prompt`, nothing tokenized."""
    handle, tokenizer = gated
    most = 8192 * max(len(token) for token in tokenizer.get_vocab())
    before = tokenizer.tokenized
    response = httpx.post(f"{handle.base_url}/completions", json={"model": "m", "prompt": "x" * (most + 1),
                                                                  "max_tokens": 1}, timeout=60)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith(f"The prompt and tools hold {most + 1} "
                                                                      "characters"), error
    assert f"at most {most} characters" in error["message"], error
    assert tokenizer.tokenized == before, "the prompt was tokenized before it was refused"


# --------------------------------------------------------------------------- timeouts, keep-alive, HTTP errors


@pytest.fixture(scope="module")
def strict() -> Iterator[ServerHandle]:
    """A server with short deadlines: 0.5 s for a request head, 0.5 s between two parts of a body."""
    engine = ScriptedEngine.from_text(build_tiny_tokenizer(), "ok", max_model_len=8192)
    with start_server(create_app(ServedModels("m", engine), body_timeout=0.5), head_timeout=0.5) as running:
        yield running


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP/1.1 response with a Content-Length: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a whole head: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (reads until end of stream)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def _connect(handle: ServerHandle) -> socket.socket:
    sock = socket.create_connection((handle.host, handle.port), timeout=20)  # bounds a hung test only
    return sock


GET_HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


def test_a_connection_is_reused_after_common_clients_idle_expiry(handle: ServerHandle) -> None:
    """httpx and Node keep an idle connection 5 s; the server keeps it longer, so reusing it at ~5 s never races."""
    import time

    sock = _connect(handle)
    sock.sendall(GET_HEALTH)
    assert _response(sock)[0] == 200
    time.sleep(5.5)  # past uvicorn's default keep-alive (5 s), the delay under test
    sock.sendall(GET_HEALTH)
    assert _response(sock)[0] == 200
    sock.close()


def test_a_request_head_sent_too_slowly_gets_408_and_is_closed(strict: ServerHandle) -> None:
    sock = _connect(strict)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # and never the rest of the head
    status, headers, body = _response(sock)
    assert (status, headers["content-type"]) == (408, "application/json")
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert _closed(sock)


def test_a_body_shorter_than_its_length_gets_408_and_is_closed(strict: ServerHandle) -> None:
    sock = _connect(strict)
    body = json.dumps(chat(1)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % (len(body) + 100) + body)
    status, headers, answer = _response(sock)
    assert (status, headers["content-type"]) == (408, "application/json")
    assert "stopped arriving" in json.loads(answer)["error"]["message"]
    assert _closed(sock)


def test_a_slow_request_that_completes_is_answered(strict: ServerHandle) -> None:
    """The deadlines are per request head and per pause: an idle kept-alive connection and a whole body pass."""
    sock = _connect(strict)
    body = json.dumps(chat(1)).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n" % len(body) + body)
    sock.sendall(request)
    assert _response(sock)[0] == 200
    sock.sendall(request)  # the same connection, for the next request
    assert _response(sock)[0] == 200
    sock.close()


def test_a_malformed_request_line_gets_openais_error_json(handle: ServerHandle) -> None:
    sock = _connect(handle)
    sock.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
    status, headers, body = _response(sock)
    assert (status, headers["content-type"]) == (400, "application/json")
    assert json.loads(body)["error"]["code"] == "invalid_http_request"
    assert _closed(sock)


def test_invalid_json_names_the_position_not_a_parameter(handle: ServerHandle, gated: Any) -> None:
    server, _ = gated
    response = httpx.post(f"{server.base_url}/chat/completions", content=b'{"model": "m", "messages": [}',
                          headers={"content-type": "application/json"}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is None and error["code"] == "invalid_json", error
    assert "not valid JSON" in error["message"], error


# --------------------------------------------------------------------------- a body trickled, a client gone mid-body


@pytest.fixture()
def deadlined() -> Iterator[tuple[ServerHandle, Any]]:
    """A server whose request bodies may pause 30 s between parts (the default) but must be whole within 1 s."""
    engine = ScriptedEngine.from_text(build_tiny_tokenizer(), "ok", max_model_len=8192)
    app = create_app(ServedModels("m", engine), body_deadline=1.0)
    with start_server(app) as running:
        yield running, app.state.metrics


def _head(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % length)


def test_a_body_trickled_a_byte_at_a_time_is_ended_by_the_deadline_with_408(
        deadlined: tuple[ServerHandle, Any]) -> None:
    """Each pause is far under the 30 s pause limit; the whole-body deadline ends the request before it is whole."""
    handle, metrics = deadlined
    body = json.dumps(chat(1, user="x" * 300)).encode()  # ~400 bytes: 20 s at the pace below
    sock = _connect(handle)
    sock.sendall(_head(len(body)))
    sent = 0
    readable = False
    while sent < len(body) and not readable:  # a byte, then wait for the server's answer up to 0.05 s
        sock.sendall(body[sent:sent + 1])
        sent += 1
        readable = bool(select.select([sock], [], [], 0.05)[0])
    assert readable and sent < len(body), f"the whole body ({len(body)} bytes) went through"
    status, headers, answer = _response(sock)
    assert (status, headers["content-type"], headers["connection"]) == (408, "application/json", "close")
    error = json.loads(answer)["error"]
    assert error["code"] == "request_timeout" and "not whole within 1 s" in error["message"], error
    assert _closed(sock)
    assert metrics.bodies_over_deadline == 1 and metrics.bodies_paused == 0


class _Records(logging.Handler):
    """Collects every record of the loggers it is attached to; `seen` is set by the first whose message has
    `marker`."""

    def __init__(self, marker: str) -> None:
        super().__init__(logging.DEBUG)
        self.marker, self.records, self.seen = marker, [], threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if self.marker in record.getMessage() or record.exc_info:
            self.seen.set()


@pytest.fixture()
def server_logs() -> Iterator[_Records]:
    """The records of artrl's and uvicorn's loggers (uvicorn's do not reach the root logger) at every level."""
    records = _Records("disconnected after")
    loggers = [logging.getLogger(name) for name in ("artrl", "uvicorn", "uvicorn.error", "uvicorn.asgi")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(records)
    logging.getLogger("artrl").setLevel(logging.DEBUG)
    yield records
    for lg, level in zip(loggers, levels):
        lg.removeHandler(records)
        lg.setLevel(level)


def test_a_client_that_disconnects_mid_body_writes_one_debug_line_and_is_counted(
        deadlined: tuple[ServerHandle, Any], server_logs: _Records) -> None:
    handle, metrics = deadlined
    sock = _connect(handle)
    sock.sendall(_head(1000) + b'{"model": "m", "mess')
    sock.close()  # gone, 20 bytes into a 1,000-byte body
    assert server_logs.seen.wait(20), "the server said nothing of the disconnect"
    ours = [r for r in server_logs.records if "disconnected after" in r.getMessage()]
    assert len(ours) == 1 and ours[0].levelno == logging.DEBUG, [r.getMessage() for r in ours]
    tracebacks = [r for r in server_logs.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    assert metrics.disconnects_mid_body == 1
    answer = httpx.get(f"{handle.url}/metrics", timeout=20)
    assert answer.json()["disconnects_mid_body"] == 1
    assert httpx.post(f"{handle.base_url}/chat/completions", json=chat(1), timeout=20).status_code == 200


# --------------------------------------------------------------------------- protocol points


def test_the_bearer_scheme_is_case_insensitive() -> None:
    """RFC 9110: the scheme is a case-insensitive token; the key is not."""
    engine = ScriptedEngine.from_text(build_tiny_tokenizer(), "ok", max_model_len=8192)
    with start_server(create_app(ServedModels("m", engine), api_key="s3cret")) as running:
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            for key, status in (("s3cret", 200), ("S3CRET", 401), ("wrong", 401)):
                response = httpx.post(f"{running.base_url}/chat/completions", json=chat(1), timeout=20,
                                      headers={"Authorization": f"{scheme} {key}"})
                assert response.status_code == status, (scheme, key, response.text)
        for header in ("Basic s3cret", "Bearers3cret", "s3cret", "Bearer"):
            response = httpx.get(f"{running.url}/health", headers={"Authorization": header}, timeout=20)
            assert response.status_code == 401, header


PROTOCOL_400 = {
    # name: (httpx.post keyword arguments, the error's param, a fragment of its message)
    "max_tokens_as_a_string": ({"json": chat(1, max_tokens="8")}, "max_tokens", "valid integer"),
    "temperature_as_a_string": ({"json": chat(1, temperature="0.5")}, "temperature", "valid number"),
    "logprobs_as_a_number": ({"json": chat(1, logprobs=1)}, "logprobs", "valid boolean"),
    "text_plain_body": ({"content": json.dumps(chat(1)), "headers": {"content-type": "text/plain"}}, None,
                        "Unsupported content type: 'text/plain'"),
    "form_body": ({"data": {"model": "m"}}, None, "application/x-www-form-urlencoded"),
    "tool_without_function": ({"json": chat(1, tools=[{"type": "function"}])}, "tools[0].function",
                              "Missing required parameter"),
    "tool_without_name": ({"json": chat(1, tools=[{"type": "function", "function": {"description": "d"}}])},
                          "tools[0].function.name", "non-empty string"),
    "tool_of_another_type": ({"json": chat(1, tools=[{"type": "retrieval", "function": {"name": "f"}}])},
                             "tools[0].type", "must be 'function'"),
}


@pytest.mark.parametrize("name", sorted(PROTOCOL_400))
def test_what_openai_refuses_gets_a_400(gated: tuple[ServerHandle, GatedTokenizer], name: str) -> None:
    handle, tokenizer = gated
    kwargs, param, fragment = PROTOCOL_400[name]
    response = httpx.post(f"{handle.base_url}/chat/completions", timeout=20, **kwargs)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert tokenizer.renders == 0, "refused after rendering"


def test_json_with_a_charset_and_the_well_typed_values_are_served(gated: tuple[ServerHandle, GatedTokenizer]) -> None:
    """The other side of the line: what OpenAI accepts is accepted (an int for a float, a charset, `+json`)."""
    handle, _ = gated
    body = chat(1, temperature=1, top_p=1, logprobs=True,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    for content_type in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json"):
        response = httpx.post(f"{handle.base_url}/chat/completions", content=json.dumps(body), timeout=20,
                              headers={"content-type": content_type})
        assert response.status_code == 200, (content_type, response.text[:300])


# --------------------------------------------------------------------------- 50,000 small tools

TOOLS_50K = chat(1, tools=[{"type": "function", "function": {
    "name": f"function_{i}", "description": "does a small thing",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}} for i in range(50_000)])


def test_a_request_answers_while_50000_tools_are_being_refused(
        gated: tuple[ServerHandle, GatedTokenizer], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ordered by events: the 50,000-tool request is held inside its count when the small one is sent and answered;
    then it is refused naming the limit, and nothing of it was rendered."""
    handle, tokenizer = gated
    from artrl.serve.http.protocols import common
    from artrl.serve.http.request import INLINE_PARSE_BYTES

    entered, release = threading.Event(), threading.Event()
    scan_body = common.scan_body

    def held(raw: bytes, items: str) -> Any:
        if len(raw) > INLINE_PARSE_BYTES:  # the large body's scan, on a worker thread; small ones pass
            entered.set()
            assert release.wait(60), "the test never released the count"
        return scan_body(raw, items)

    monkeypatch.setattr(common, "scan_body", held)
    payload = json.dumps(TOOLS_50K).encode()

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=handle.base_url, timeout=60) as client, asyncio.timeout(60):
            large = asyncio.create_task(client.post("/chat/completions", content=payload,
                                                    headers={"content-type": "application/json"}))
            assert await asyncio.to_thread(entered.wait, 30)
            try:
                small = await client.post("/chat/completions", json=chat(1))
                assert small.status_code == 200, small.text
                assert not large.done()  # still being counted: the small one did not wait for it
            finally:
                release.set()
            refused = await large
            assert refused.status_code == 400, refused.text[:300]
            error = refused.json()["error"]
            assert error["param"] == "tools" and "holds 50000 tools" in error["message"], error

    asyncio.run(scenario())
    assert tokenizer.renders == 1  # the small request's prompt only


def _refusal_against_building(payload: bytes, parse: Any, url: str,
                              headers: dict[str, str] | None = None) -> tuple[httpx.Response, int, int]:
    """(the server's response to `payload` posted to `url`, the bytes its handling allocated at its peak in this
    process, the peak bytes `parse(payload)` holds when the request is built whole), traced with tracemalloc."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        parsed = parse(payload)  # what parsing the request whole holds at its peak
        built = tracemalloc.get_traced_memory()[1]
        del parsed
        gc.collect()
        tracemalloc.reset_peak()
        with httpx.Client(timeout=60) as client:
            base = tracemalloc.get_traced_memory()[0]
            response = client.post(url, content=payload,
                                   headers={"content-type": "application/json", **(headers or {})})
            refusal = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return response, refusal, built


def test_50000_tools_are_refused_without_building_them(gated: tuple[ServerHandle, GatedTokenizer]) -> None:
    """What the refusal allocates, measured in this process (the server's thread included): a fraction of what
    building the request's objects takes."""
    from artrl.serve.http.request import parse_body

    handle, _ = gated
    payload = json.dumps(TOOLS_50K).encode()
    response, refusal, built = _refusal_against_building(payload, parse_body, f"{handle.base_url}/chat/completions")
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text[:300]
    # the refusal holds the body (received, joined) and one empty dict a tool; building holds every tool's dicts
    assert refusal < built / 2, (refusal, built, len(payload))


def _protocol_tools_50k(route: str) -> dict[str, Any]:
    if route == "responses":
        return {"model": "m", "input": "hi", "max_output_tokens": 1, "tools": [
            {"type": "function", "name": f"function_{i}", "description": "does a small thing",
             "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}} for i in range(50_000)]}
    return {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": f"function_{i}", "description": "does a small thing",
         "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}} for i in range(50_000)]}


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_the_other_protocols_refuse_50000_tools_without_building_them(
        gated: tuple[ServerHandle, GatedTokenizer], route: str) -> None:
    """As chat: a Responses or Messages body over the tool limit is counted and refused before its objects are
    built (a fraction of what parsing it whole holds), and the server counts the refusal."""
    from artrl.serve.http.protocols.messages import MessagesRequest
    from artrl.serve.http.protocols.responses import ResponsesRequest

    handle, _ = gated
    model = ResponsesRequest if route == "responses" else MessagesRequest
    metrics = httpx.get(f"{handle.url}/metrics", timeout=20).json()
    payload = json.dumps(_protocol_tools_50k(route)).encode()
    url, headers = f"{handle.base_url}/{route}", {"anthropic-version": "2023-06-01"}
    response, refusal, built = _refusal_against_building(payload, model.model_validate_json, url, headers)
    assert response.status_code == 400 and "holds 50000 tools" in response.text, response.text[:300]
    assert refusal < built / 2, (refusal, built, len(payload))
    after = httpx.get(f"{handle.url}/metrics", timeout=20).json()
    assert after["refused_by_count"] == metrics["refused_by_count"] + 1, (metrics, after)


def test_a_responses_input_over_the_message_limit_is_refused_by_count(gated: tuple[ServerHandle, GatedTokenizer]
                                                                     ) -> None:
    """200,000 input items: refused naming `input` before they are built, with the server's own setting named."""
    handle, _ = gated
    body = {"model": "m", "max_output_tokens": 1, "input": [{"role": "user", "content": ""}] * 200_000}
    response = httpx.post(f"{handle.base_url}/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "input" and error["message"].startswith("input holds 200000 items"), error
    assert "create_app(max_messages=...)" in error["message"], error
