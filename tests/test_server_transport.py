"""The background server's connections: what `start_server` sets on its sockets, checked on live connections."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator

import fastapi
import pytest

from artrl.serve import ServerHandle, start_server


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
