"""The control plane's calls to one replica, straight to its address (never through the router).

An artrl replica (replicas/process.py, `artrl serve --replica`) and a vLLM server with runtime
LoRA loading answer the same adapter routes (serve/http/control_routes.py); an artrl replica also
sets its live weights and says what it is (`GET /artrl/replica`). A vLLM server answers 404
there: it is told apart by that (`kind` "vllm"), and its served default is the name
`model@step` that the control plane publishes, since it has no live weights of its own.

Plain HTTP/1.1 from the standard library: a few small JSON calls per checkpoint.
"""

from __future__ import annotations

import http.client
import json
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import ArtrlError
from ..serve.http.control_routes import HOLD_PATH, LIVE_PATH, LOAD_PATH, REPLICA_PATH, UNLOAD_PATH

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 600.0  # a load reads a checkpoint and may wait for a decode step boundary
HEALTH_TIMEOUT_S = 5.0


class ReplicaError(ArtrlError, RuntimeError):
    """A replica did not do what the control plane asked (unreachable, or an error answer)."""


@dataclass
class Answer:
    status: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def http_call(url: str, method: str, path: str, *, body: Any = None, api_key: str | None = None,
              timeout: float = CONTROL_TIMEOUT_S, params: dict[str, str] | None = None) -> Answer:
    """One HTTP request to `url` (scheme, host, port); OSError when it cannot be made."""
    parts = urlsplit(url)
    connection_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_type(parts.hostname, parts.port, timeout=timeout)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if params:
        from urllib.parse import urlencode

        path = f"{path}?{urlencode(params)}"
    try:
        connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        response = connection.getresponse()
        return Answer(response.status, response.read().decode(errors="replace"))
    finally:
        connection.close()


class ReplicaClient:
    """Control calls to the replica at `url` ('http://host:port'), with `api_key` when it checks one."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key

    def healthy(self) -> bool:
        try:
            return self._call("GET", "/health", timeout=HEALTH_TIMEOUT_S).status == 200
        except OSError:
            return False

    def identity(self) -> dict[str, Any] | None:
        """What an artrl replica says it is (`GET /artrl/replica`); None for another server (vLLM's)."""
        answer = self._call("GET", REPLICA_PATH)
        if answer.status == 404:
            return None
        self._check(answer, "GET", REPLICA_PATH)
        return answer.json()

    def models(self) -> list[dict[str, Any]]:
        answer = self._call("GET", "/v1/models")
        self._check(answer, "GET", "/v1/models")
        return list(answer.json().get("data", []))

    def load(self, lora_name: str, path: str) -> None:
        """vLLM's `/v1/load_lora_adapter`: serve the checkpoint in `path` as `lora_name` (already loaded: fine)."""
        answer = self._call("POST", LOAD_PATH, {"lora_name": lora_name, "lora_path": path})
        if answer.status == 400 and "already" in answer.text:
            return  # vLLM: "The lora adapter 'x' has already been loaded."
        self._check(answer, "POST", LOAD_PATH, lora_name)

    def unload(self, lora_name: str) -> bool:
        """vLLM's `/v1/unload_lora_adapter`; False while a request still uses it (ask again later)."""
        answer = self._call("POST", UNLOAD_PATH, {"lora_name": lora_name})
        if answer.status in (404,) or (answer.status == 400 and "cannot be found" in answer.text):
            return True  # not loaded (any more)
        if answer.status == 409:
            return False
        self._check(answer, "POST", UNLOAD_PATH, lora_name)
        return True

    def hold_live(self, model: str, step: int, wait_s: float) -> bool:
        """artrl's `/artrl/hold_live`: requests for the bare `model` wait until `step` is made live (`set_live`);
        False when it already is."""
        answer = self._call("POST", HOLD_PATH, {"model": model, "step": step, "wait_s": wait_s})
        self._check(answer, "POST", HOLD_PATH, f"{model} step {step}")
        return bool(answer.json().get("held"))

    def set_live(self, model: str, step: int, path: str) -> None:
        """artrl's `/artrl/live_weights`: `model` serves the checkpoint in `path` (step `step`) from now on."""
        answer = self._call("POST", LIVE_PATH, {"model": model, "step": step, "lora_path": path})
        self._check(answer, "POST", LIVE_PATH, f"{model} step {step}")

    # ------------------------------------------------------------------ helpers
    def _call(self, method: str, path: str, body: Any = None, *, timeout: float = CONTROL_TIMEOUT_S) -> Answer:
        return http_call(self.url, method, path, body=body, api_key=self.api_key, timeout=timeout)

    def _check(self, answer: Answer, method: str, path: str, what: str = "") -> None:
        if answer.status >= 400:
            raise ReplicaError(f"replica {self.url}: {method} {path}{' (' + what + ')' if what else ''} answered "
                               f"{answer.status}: {answer.text[:400]}")
