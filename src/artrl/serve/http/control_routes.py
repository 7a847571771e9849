"""The control routes of an inference replica: vLLM's adapter routes, and the live weights.

A replica (artrl/replicas/) is one server among several behind a router. The control plane
in the training process (replicas/control.py) reaches every replica directly, never through
the router, and needs the same few routes from each, whichever engine it runs; vLLM's server
has the first two (with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), so a vLLM server can be a
replica too:

* `POST /v1/load_lora_adapter {"lora_name": "<model>@<step>", "lora_path": DIR}` (vLLM's route
  and body): serve the checkpoint in DIR as `<model>@<step>`. 200 with vLLM's plain-text
  answer; 400 for a name that is not `<served model>@<step>`; 500 for a checkpoint that
  cannot be loaded.
* `POST /v1/unload_lora_adapter {"lora_name": "<model>@<step>"}` (vLLM's): 200 unloaded (with
  the engine's policy version of that step, unless it is the live one); 404 not loaded; 409 a
  running request still uses it (nothing changed; ask again later).
* `POST /artrl/hold_live {"model", "step", "wait_s"}` (artrl's): requests for the bare `<model>`
  wait from now on (each at most `wait_s`, then 503 `live_weights_switching`) until `step` is made
  live; `{"held": false}` when it already is. The first half of a switch that every replica makes
  at once (serve/http/served_models.py, replicas/control.py).
* `POST /artrl/live_weights {"model", "step", "lora_path"}` (artrl's): `<model>` serves that
  checkpoint from now on, as policy version `step` (what `set_live_weights` does in one process),
  and the requests held for it go on.
* `GET /artrl/replica`: what this replica is (its id, engine, base model, and for each served
  model the live step and the steps loaded as `<model>@<step>`); the control plane checks that
  every replica serves the same base model with it.

They exist only in an app made with `adapter_control=True` (vLLM too keeps runtime loading
behind a switch): loading reads any directory the server process can read. Every response of
an app made with a `replica_id` carries it in the `x-artrl-replica` header, so a client (and a
test) can tell which replica behind a router answered.
"""

from __future__ import annotations

import asyncio
from typing import Any

import fastapi
import pydantic
from fastapi.responses import PlainTextResponse

from ...errors import CheckpointError
from .headers import EXPECTED_HEADER, REPLICA_HEADER  # shared with the client (replicas/)
from ..errors import InvalidRequestError
from .guards import APIError, error_response
from .served_models import STEP_SEPARATOR, ModelNotFoundError, ServedModels

LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
LIVE_PATH, REPLICA_PATH = "/artrl/live_weights", "/artrl/replica"
HOLD_PATH = "/artrl/hold_live"


class _Load(pydantic.BaseModel):
    lora_name: str
    lora_path: str


class _Unload(pydantic.BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; names are what artrl goes by


class _Live(pydantic.BaseModel):
    model: str
    step: int = pydantic.Field(ge=0)
    lora_path: str


class _Hold(pydantic.BaseModel):
    model: str
    step: int = pydantic.Field(ge=0)
    wait_s: float = pydantic.Field(gt=0)


def _served_step(resolver: ServedModels, lora_name: str) -> tuple[str, int]:
    """`<model>@<step>` of a served model as (model, step); a 400 naming the form otherwise."""
    name, sep, step = lora_name.rpartition(STEP_SEPARATOR)
    if not sep or not step.isdigit() or name not in resolver.served():
        raise APIError(400, f"lora_name={lora_name!r}: an artrl replica loads checkpoints of the models it serves "
                            f"({resolver.served()}) as '<model>{STEP_SEPARATOR}<step>'.", param="lora_name")
    return name, int(step)


def add_control_routes(app: fastapi.FastAPI, resolver: ServedModels, *, replica_id: str | None = None,
                       engine_kind: str | None = None, base_model: str | None = None) -> None:
    """Add the routes of the module docstring to `app` (made by serve/http/server.py's `create_app`)."""

    @app.post(LOAD_PATH)
    async def load_lora_adapter(body: _Load) -> PlainTextResponse:
        name, step = _served_step(resolver, body.lora_name)
        try:
            await asyncio.to_thread(resolver.load, name, step, body.lora_path)
        except InvalidRequestError as error:
            raise APIError(400, str(error), param="lora_path") from error
        except CheckpointError as error:
            raise APIError(500, str(error), param="lora_path", code="checkpoint_unreadable",
                           type="server_error") from error
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post(UNLOAD_PATH)
    async def unload_lora_adapter(body: _Unload) -> PlainTextResponse:
        name, step = _served_step(resolver, body.lora_name)
        done = await asyncio.to_thread(resolver.unload, name, step)
        if done is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="not_found")
        if not done:
            raise APIError(409, f"The lora adapter '{body.lora_name}' is in use by a running request; nothing was "
                                "unloaded. Ask again once it has finished.", param="lora_name", code="in_use")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post(LIVE_PATH)
    async def live_weights(body: _Live) -> dict[str, Any]:
        try:
            await asyncio.to_thread(resolver.set_live, body.model, body.lora_path, body.step)
        except ModelNotFoundError as error:
            raise APIError(404, str(error), param="model", code="model_not_found") from error
        except Exception as error:  # an unreadable checkpoint: the engine's own error says which
            raise APIError(500, f"{body.model} cannot serve {body.lora_path} as step {body.step}: "
                                f"{type(error).__name__}: {error}", param="lora_path", type="server_error") from error
        resolver.release_live(body.model, body.step)
        return {"model": body.model, "step": body.step}

    @app.post(HOLD_PATH)
    async def hold_live(body: _Hold) -> dict[str, Any]:
        try:
            held = resolver.hold_live(body.model, body.step, body.wait_s)
        except ModelNotFoundError as error:
            raise APIError(404, str(error), param="model", code="model_not_found") from error
        return {"model": body.model, "step": body.step, "held": held}

    @app.get(REPLICA_PATH)
    async def replica() -> dict[str, Any]:
        return {"replica": replica_id, "engine": engine_kind, "base_model": base_model,
                "models": {name: {"live_step": resolver.live_step(name), "loaded_steps": resolver.loaded_steps(name),
                                  "held_for_step": resolver.held_steps().get(name)}
                           for name in resolver.served()}}


class ReplicaHeader:
    """ASGI middleware: every response carries `x-artrl-replica: <replica_id>`; a request whose
    `x-artrl-replica-expected` names another replica (a rollout whose own replica is gone, client/affinity.py)
    is answered 410 with `x-should-retry: false`, and never reaches the app."""

    def __init__(self, app: Any, replica_id: str) -> None:
        self.app = app
        self.replica_id = replica_id
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        expected = dict(scope.get("headers") or []).get(EXPECTED_HEADER.encode())
        if expected is not None and expected.decode(errors="replace") != self.replica_id:
            message = (f"This rollout's earlier turns were served by inference replica {expected.decode()!r}, which "
                       f"no longer serves (it died or was taken out); the router sent this turn to replica "
                       f"{self.replica_id!r}, which holds neither the record of those turns nor their cache. The "
                       "rollout fails here (a new rollout starts on a live replica).")
            response = error_response(APIError(410, message, code="replica_gone", type="server_error"))
            response.headers["x-should-retry"] = "false"
            response.headers[REPLICA_HEADER] = self.replica_id
            await response(scope, receive, send)
            return

        async def with_header(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, with_header)
