"""Run an ASGI app with uvicorn in a background thread of this process.

The training backend embeds the inference server next to the trainer (one process,
one copy of the weights), so the server gets its own thread and its own event loop
instead of the caller's. `start_server` binds the socket itself (port 0 picks a
free port, known before uvicorn starts; every connection with Nagle's algorithm
off, else each response waits for the client's delayed ACK), speaks HTTP through
serve/http/h11_protocol.py (a deadline on request heads, JSON errors), keeps idle
connections longer than clients do, and returns once `/health` answers. A
server still running when the interpreter exits is stopped by artrl/runtime/shutdown.py,
after the engines.
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from ...runtime import shutdown
from ...errors import ConfigError
from .h11_protocol import DEFAULT_HEAD_TIMEOUT_S, guarded_protocol

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"


class ServerHandle:
    """A running background server: `.base_url` ("http://host:port/v1") and `.stop()`."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, host: str, port: int) -> None:
        self._server, self._thread = server, thread
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as `base_url`."""
        return f"{self.url}/v1"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to finish in-flight requests and exit; wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("Server on %s did not stop within %.0fs; forcing exit", self.url, timeout)
            self._server.force_exit = True
            self._thread.join(5.0)
        shutdown.untrack(self, shutdown.SERVERS)

    def shutdown_at_exit(self) -> None:
        """Stopped at interpreter exit (artrl/runtime/shutdown.py), after the engines have failed what was in flight."""
        self.stop(timeout=10.0)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _healthy(host: str, port: int, api_key: str | None = None) -> bool:
    try:
        connection = http.client.HTTPConnection(host, port, timeout=2)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        connection.request("GET", HEALTH_PATH, headers=headers)
        ok = connection.getresponse().status == 200
        connection.close()
        return ok
    except OSError:
        return False


KEEP_ALIVE_TIMEOUT_S = 75.0
"""Seconds an idle connection stays open: longer than common clients keep one (httpx and Node: 5 s), so a client
never reuses a connection the server is closing at that moment (uvicorn's default, 5 s, raced them)."""


def start_server(
    app: Any, host: str = "127.0.0.1", port: int = 0, *, startup_timeout: float = 30.0, log_level: str = "warning",
    head_timeout: float = DEFAULT_HEAD_TIMEOUT_S, keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT_S,
) -> ServerHandle:
    """Serve `app` on host:port (0: a free port) in a daemon thread; returns when healthy.

    Binding anywhere but loopback needs an app created with an api_key. `head_timeout`: seconds a client has to
    send a request's line and headers (408 after, serve/http/h11_protocol.py); `keep_alive_timeout`: seconds an idle
    connection is kept.
    """
    api_key = getattr(getattr(app, "state", None), "api_key", None)
    if not is_loopback(host) and not api_key:
        raise ConfigError(
            f"refusing to serve on {host!r} without an API key: any host that can reach it could use the model. "
            "Create the app with create_app(..., api_key=...) or bind to 127.0.0.1."
        )
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    # protocol says TCP. With it on, a response written in two parts (headers, then body) waited for the
    # client's delayed ACK: about 40 ms added to every request on Linux.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False,
                            http=guarded_protocol(head_timeout), timeout_keep_alive=keep_alive_timeout)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"artrl-server-{port}", daemon=True
    )
    thread.start()
    handle = ServerHandle(server, thread, host, port)
    shutdown.track(handle, shutdown.SERVERS)
    deadline = time.monotonic() + startup_timeout
    while not (server.started and _healthy(host, port, api_key)):
        if not thread.is_alive():
            sock.close()
            raise RuntimeError(f"The server thread on {host}:{port} exited during startup; see the log above")
        if time.monotonic() > deadline:
            handle.stop()
            raise TimeoutError(f"The server on {host}:{port} did not answer {HEALTH_PATH} within {startup_timeout}s")
        time.sleep(0.02)
    logger.debug("Serving on %s", handle.base_url)  # its owner says where (the backend, `artrl serve`)
    return handle


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
