"""The server against careless and hostile clients: its connections, and the bounds on what one request may cost."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import fastapi
import httpx
import pytest

from artrl.serve import ServedModels, ServerHandle, create_app, start_server
from artrl.serve.scripted import ScriptedEngine
from artrl.serve.server import DEFAULT_MAX_MESSAGES, DEFAULT_MAX_SCHEMA_CHARS, DEFAULT_MAX_TOOLS, INLINE_RENDER_MESSAGES
from artrl.tiny import build_tiny_tokenizer


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
    a request's rendering held open for as long as a test needs."""

    def __init__(self, tokenizer: Any, min_messages: int) -> None:
        self._tokenizer, self._min = tokenizer, min_messages
        self.entered, self.release = threading.Event(), threading.Event()
        self.renders = 0

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
