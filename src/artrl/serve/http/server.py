"""The OpenAI-compatible HTTP server: `/v1/chat/completions` over any InferenceEngine, and the other wire protocols
(`/v1/completions`, `/v1/responses`, Anthropic's `/v1/messages`: serve/http/protocols/), all on one request core
(serve/http/core.py) with the same checks and token record.

Compared with OpenAI's API (and vLLM's server), this one:

1. adds what training needs to every response (the token record,
   docs/token-record.md): each choice carries `prompt_token_ids` (the exact
   prompt it was sampled from) and `token_ids` (the sampled ids, a final
   end-of-turn id included), and logprobs on every choice whether or not the
   request asked (as ART's server does; `top_logprobs` only when asked); the
   response carries `prompt_token_ids` too. Logprobs are the raw model logprobs
   (see `serve/engines/base.py`). A later prompt spells an assistant message this
   server returned with the ids it sampled, where the chat template renders that
   message unchanged (`chat_format.render_prompt`), so the turns of a multi-turn
   rollout extend one another's record. Each choice also says which policy version
   (training step) sampled it: `policy_version`;
2. streams (`stream: true`) as OpenAI's server-sent chunks, the token record on each
   choice's last chunk (serve/http/streaming.py). From an engine that hands tokens over as
   they are sampled (`streams_tokens`: the built-in one) content deltas go out as they
   come, stop strings and tool calls held back (serve/http/stream_text.py), tool-call deltas
   and the last chunks when the generation ends; from others (vLLM) the chunks are cut
   from the finished reply. An error before the first token is an error response, one
   after it an `{"error": ...}` event;
3. stop strings cut the text at the first stop string; the token ids (and
   logprobs) end with the token that completed it;
4. parses Qwen/Hermes `<tool_call>` blocks into `tool_calls` when the request
   offered tools; `tool_choice` "none" keeps the tools in the prompt (OpenAI's meaning,
   vLLM's default) and returns the reply as text, "auto"
   leaves the choice to the model, and "required" or a named function is enforced
   by a grammar, as are `response_format` `json_object` and `json_schema`
   (serve/structured.py: the reply is valid JSON for the schema, or calls the
   tools with valid arguments, unless `max_tokens` cuts it: `finish_reason`
   "length"). A schema the grammar library cannot compile, or one whose recursion
   cannot end (a required self-reference), is a 400 naming `response_format`, `tools`
   or `tool_choice`; so is a structured request to an engine that cannot enforce it;
5. returns every error as OpenAI's `{"error": {"message", "type", "param",
   "code"}}` (Anthropic's shape on `/v1/messages`) with a 4xx status for anything the
   client got wrong, including request-body validation errors (400, never a 500 with a
   traceback; types are strict: `max_tokens: "8"` is a 400), a field the route does not
   take (400 naming it, serve/http/body_policy.py), a body that is not JSON (400), a tool
   without its function (400), a body that stops arriving (408, `body_timeout`) or
   that is not whole within `body_deadline` of its head (408, serve/http/guards.py) and,
   from the HTTP layer below the app, malformed or too slow request heads
   (serve/http/h11_protocol.py);
6. refuses oversized work before doing it: bodies over `max_body_bytes` (413),
   `n` over `max_n`, more messages or tools than `max_messages` / `max_tools`, a
   `response_format` over `max_schema_chars`, `max_tokens` beyond the context, and
   messages and tool definitions with more characters than the context could hold
   as tokens (400 naming the limit, before validating or rendering; the counts of a
   large body are read before it is parsed whole, serve/http/request.py). A large prompt
   (`INLINE_RENDER_CHARS`) is rendered and tokenized on a worker thread, at most
   `RENDER_THREADS` at once, so it never delays another request's answer;
7. takes images (`image_url` parts: data:, file:// under `allowed_local_media_path`, http(s)) for a
   vision-language model: each is loaded, checked and run through the model's image processor on a worker
   thread (artrl/chat/images.py, models/vision.py), the prompt's image tokens expanded, and each choice's record
   names the prompt's images (`prompt_images`: content hash and grid). An image that does not decode, is
   too large, comes from where it may not, or goes to a model without a vision tower is a 400 naming the
   part (`messages[1].content[0]`);
8. drops a request whose client disconnects: the engine is told to stop (a queued
   request never runs, a running one stops at its next decoding step). A disconnect
   is normal, not an error: a DEBUG line, no traceback, counted in `GET /metrics`
   (serve/http/guards.py: `ServerMetrics`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .background import ServerHandle, start_server
from .body_policy import BodyPolicy, UnknownFields
from .prompts import DEFAULT_RECORD_CACHE_BYTES, PromptBuilder
from .control_routes import ReplicaHeader, add_control_routes
from .core import INLINE_RENDER_CHARS, INLINE_RENDER_MESSAGES, RequestCore  # noqa: F401 (re-exported)
from .guards import (DEFAULT_BODY_DEADLINE_S, DEFAULT_BODY_TIMEOUT_S, APIError, ApiKey, BodyLimit,
                                ServerMetrics, error_response, not_found)
from .served_models import ServedModels
from .request import (DEFAULT_MAX_MESSAGES, DEFAULT_MAX_N, DEFAULT_MAX_SCHEMA_CHARS, DEFAULT_MAX_TOOLS,
                                 RequestLimits)
from .protocols import (chat_completions as chat_completions_protocol,
                                       completions as completions_protocol, messages as messages_protocol)
from .protocols import responses as responses_protocol

__all__ = ["ServedModels", "ServerHandle", "create_app", "start_server"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_TOKENS = 1024
PROTOCOLS = (chat_completions_protocol, completions_protocol, messages_protocol)
"""The protocol adapters (serve/http/protocols/) whose routes every app has (and Responses, which keeps a store)."""
RENDER_THREADS = 2
"""Large prompts rendered at once; more wait their turn (bounds the memory abusive requests can take)."""


def create_app(
    resolver: ServedModels,
    *,
    max_n: int = DEFAULT_MAX_N,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    api_key: str | None = None,
    record_cache_bytes: int = DEFAULT_RECORD_CACHE_BYTES,
    max_messages: int = DEFAULT_MAX_MESSAGES,
    max_tools: int = DEFAULT_MAX_TOOLS,
    max_schema_chars: int = DEFAULT_MAX_SCHEMA_CHARS,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    body_deadline: float = DEFAULT_BODY_DEADLINE_S,
    adapter_control: bool = False,
    replica_id: str | None = None,
    engine_kind: str | None = None,
    base_model: str | None = None,
    responses_store_bytes: int = responses_protocol.DEFAULT_STORE_BYTES,
    unknown_fields: UnknownFields = "refuse",
) -> fastapi.FastAPI:
    """The FastAPI app serving `resolver`'s models.

    max_n: most choices one request may ask for; max_body_bytes: larger request
    bodies get 413; max_messages, max_tools, max_schema_chars: most messages, tools and
    characters of `response_format` JSON one request may hold (400 naming the limit,
    before anything is rendered); body_timeout: seconds a request body may pause
    (408 after); body_deadline: seconds the whole body has from the request head (408
    after: a client trickling it a byte at a time is ended); default_max_tokens: completion budget when the request sets none
    (capped by what the context leaves); api_key: when set, every route (health
    included) requires `Authorization: Bearer <api_key>` (the scheme in any case); record_cache_bytes: memory the
    cache of returned completions may take per tokenizer (serve/http/prompts.py), which spells
    earlier turns of later prompts with the ids the model sampled (module docstring,
    point 1); the least recently used go first. adapter_control: add the routes that load and unload checkpoints
    and set the live weights (serve/http/control_routes.py: what an inference replica's control plane calls);
    replica_id: every response says it in the `x-artrl-replica` header, and `/health` needs no key (the router
    probes it without one); engine_kind, base_model: what
    `GET /artrl/replica` reports. responses_store_bytes: memory the conversations kept for the Responses
    API's `previous_response_id` may hold (serve/http/protocols/responses.py), least recently used out first.
    unknown_fields: what every route does with a body field it does not take: "refuse" (a 400 in the route's
    error shape naming the field, as OpenAI's and Anthropic's APIs answer) or "warn" (served, for clients that send
    vendor extras: one bounded warning line and a count; serve/http/body_policy.py).
    """
    app = fastapi.FastAPI(title="artrl inference server")
    metrics = ServerMetrics()
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, pause=body_timeout, deadline=body_deadline,
                       metrics=metrics)
    if api_key:  # a replica's router probes /health without a key (serve/http/control_routes.py)
        app.add_middleware(ApiKey, api_key=api_key, open_paths=("/health",) if replica_id is not None else ())
    if replica_id is not None:
        app.add_middleware(ReplicaHeader, replica_id=replica_id)
    if adapter_control:
        add_control_routes(app, resolver, replica_id=replica_id, engine_kind=engine_kind, base_model=base_model)
    app.state.api_key = api_key
    #: What the server refused or dropped (serve/http/guards.py); `GET /metrics` answers it.
    app.state.metrics = metrics
    prompts = PromptBuilder(record_cache_bytes)
    limits = RequestLimits(max_n, max_messages, max_tools, max_schema_chars)
    render_slots: list[asyncio.Semaphore] = []  # made on the server's loop, at its first large prompt

    async def off_loop(fn: Any, *args: Any) -> Any:
        """`fn(*args)` on a worker thread, RENDER_THREADS at once: CPU work a large request brings."""
        if not render_slots:
            render_slots.append(asyncio.Semaphore(RENDER_THREADS))
        async with render_slots[0]:
            return await asyncio.to_thread(fn, *args)

    #: What every route does with a body field it does not take (serve/http/body_policy.py)
    app.state.body_policy = BodyPolicy(unknown_fields, metrics)
    core = RequestCore(resolver, prompts, limits, metrics, default_max_tokens, off_loop, app.state.body_policy)

    @app.exception_handler(APIError)
    async def _api_error(http: fastapi.Request, error: APIError) -> JSONResponse:
        return error_response(error, http.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(http: fastapi.Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        if first.get("type") == "json_invalid":  # its loc, if any, is a character offset, not a parameter
            reason = str(first.get("msg", "")).removeprefix("Invalid JSON: ")
            return error_response(APIError(400, f"The request body is not valid JSON: {reason}.",
                                            code="invalid_json"), http.url.path)
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in problems
        )
        return error_response(APIError(400, f"Invalid request: {message}", param=".".join(loc) or None),
                              http.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: fastapi.Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404 and error.detail == "Not Found":  # no route: say which there are
            return error_response(not_found(http.url.path), http.url.path)
        return error_response(APIError(error.status_code, str(error.detail)), http.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(http: fastapi.Request, error: Exception) -> JSONResponse:
        logger.exception("Unhandled error while serving a request")
        return error_response(
            APIError(500, f"Internal server error: {type(error).__name__}: {error}", type="server_error"),
            http.url.path)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def server_metrics() -> dict[str, int]:
        return metrics.as_dict()

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        now = int(time.time())
        data = [{"id": name, "object": "model", "created": now, "owned_by": "artrl"} for name in resolver.names()]
        return {"object": "list", "data": data}

    for protocol in PROTOCOLS:  # each wire protocol, a thin adapter over the same core
        protocol.add_route(app, core)
    responses_protocol.add_route(app, core, responses_store_bytes)

    return app
