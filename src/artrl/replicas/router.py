"""The router in front of the inference replicas: vllm-router, started and steered from here.

artrl writes no load balancer: every chat completion of a rollout goes through vllm-router
(`pip install "artrl[replicas]"`: a Rust router in its wheel, vLLM's project), in its own
process, with the `consistent_hash` policy: a request's `X-Session-ID` header picks its
replica, so every turn of one rollout reaches the same replica (its KV cache and the record
of its earlier turns, serve/http/prompts.py), and sessions spread over the replicas. The header is set
per rollout by `model.openai_client()` (client/affinity.py).

This process only tells the router which replicas take traffic, with the router's own
worker routes (`POST /add_worker?url=`, `POST /remove_worker?url=`, `GET /list_workers`):
a replica is added once it holds every version it must serve, and removed the moment it
dies. The router forwards the client's `Authorization` header to the replicas, which check
it; its worker routes have no key of their own, which is why it listens on loopback only.
"""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

from ..errors import ConfigError
from .client import Answer, http_call
from .spawn import ChildError, ChildProcess

log = logging.getLogger(__name__)

ROUTER_POLICY = "consistent_hash"
ROUTER_STARTUP_TIMEOUT_S = 60.0
INSTALL_HINT = 'pip install "artrl[replicas]" (vllm-router)'
#: The line vllm-router logs once it listens.
READY_LINE = "Starting server on"


def router_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_router") is not None


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Router:
    """vllm-router on `host:port` (0: a free port). `start()`, then `add` / `remove` replicas by URL; `stop()`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, request_timeout_s: float = 1800.0) -> None:
        if not router_installed():
            raise ConfigError(f"inference replicas need a router in front of them, and vllm-router is not installed: "
                              f"{INSTALL_HINT}. Or serve in this process (drop inference_replicas, "
                              "inference_endpoints, and all but one of inference_gpu_ids).")
        self.host, self.port = host, port or free_port(host)
        self.request_timeout_s = request_timeout_s
        self._child: ChildProcess | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as `base_url`."""
        return f"{self.url}/v1"

    def start(self) -> "Router":
        argv = [sys.executable, "-m", "artrl.replicas.router_main", "--host", self.host, "--port", str(self.port),
                "--policy", ROUTER_POLICY, "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port("127.0.0.1")), "--log-level", "info",
                "--request-timeout-secs", str(int(self.request_timeout_s)),
                # membership is this process's business (it adds a replica once it holds every version, removes one
                # the moment it dies); the router's own probes only back that up
                "--health-check-interval-secs", "10", "--health-failure-threshold", "2"]
        self._child = ChildProcess("router", argv, ready_prefix=READY_LINE, ready_in_stderr=False).start()
        try:
            self._child.wait_ready(ROUTER_STARTUP_TIMEOUT_S)
            self._get("/health")  # listening: the ready line is logged as it binds
        except (ChildError, OSError) as error:
            self.stop()
            raise ChildError(f"vllm-router did not start on {self.url}: {error}") from error
        log.info("router (vllm-router, %s) on %s", ROUTER_POLICY, self.url)
        return self

    def add(self, url: str) -> None:
        """Send traffic to the replica at `url` from now on."""
        self._post("/add_worker", url)

    def remove(self, url: str) -> None:
        """Send no more traffic to the replica at `url` (requests it is serving end as they end)."""
        self._post("/remove_worker", url)

    def workers(self) -> list[str]:
        """The replicas taking traffic, as the router lists them."""
        return list(self._get("/list_workers").json().get("urls", []))

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop(timeout=15.0)

    # ------------------------------------------------------------------ helpers
    def _get(self, path: str) -> Answer:
        answer = self._retrying(lambda: http_call(self.url, "GET", path, timeout=30.0))
        if answer.status >= 400:
            raise ChildError(f"vllm-router answered GET {path} with {answer.status}: {answer.text[:300]}")
        return answer

    def _post(self, path: str, url: str) -> None:
        answer = self._retrying(lambda: http_call(self.url, "POST", path, params={"url": url}, timeout=60.0))
        if answer.status >= 400:
            raise ChildError(f"vllm-router refused {path}?url={url}: {answer.status} {answer.text[:300]}")

    def _retrying(self, call: Any) -> Answer:
        """`call()`, once more if the connection was refused: the router's ready line comes as it binds."""
        try:
            return call()
        except ConnectionRefusedError:
            if self._child is None or not self._child.alive:
                raise
            self._child.wait_ended(0.5)
            return call()
