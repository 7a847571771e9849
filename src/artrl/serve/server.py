"""The OpenAI-compatible HTTP server: `/v1/chat/completions` over any InferenceEngine.

Compared with OpenAI's API (and vLLM's server), this one:

1. adds what training needs to every response (the token record,
   docs/token-record.md): each choice carries `prompt_token_ids` (the exact
   prompt it was sampled from) and `token_ids` (the sampled ids, a final
   end-of-turn id included), and logprobs on every choice whether or not the
   request asked (as ART's server does; `top_logprobs` only when asked); the
   response carries `prompt_token_ids` too. Logprobs are the raw model logprobs
   (see `serve/engine.py`). A later prompt spells an assistant message this
   server returned with the ids it sampled, where the chat template renders that
   message unchanged (`chat_format.render_prompt`), so the turns of a multi-turn
   rollout extend one another's record. Each choice also says which policy version
   (training step) sampled it: `policy_version`;
2. streams (`stream: true`) as OpenAI's server-sent chunks, the token record on each
   choice's last chunk (serve/streaming.py). From an engine that hands tokens over as
   they are sampled (`streams_tokens`: the built-in one) content deltas go out as they
   come, stop strings and tool calls held back (serve/stream_text.py), tool-call deltas
   and the last chunks when the generation ends; from others (vLLM) the chunks are cut
   from the finished reply. An error before the first token is an error response, one
   after it an `{"error": ...}` event;
3. stop strings cut the text at the first stop string; the token ids (and
   logprobs) end with the token that completed it;
4. parses Qwen/Hermes `<tool_call>` blocks into `tool_calls` when the request
   offered tools; `tool_choice` "none" drops the tools from the prompt, "auto"
   leaves the choice to the model, and "required" or a named function is enforced
   by a grammar, as are `response_format` `json_object` and `json_schema`
   (serve/structured.py: the reply is valid JSON for the schema, or calls the
   tools with valid arguments, unless `max_tokens` cuts it: `finish_reason`
   "length"). A schema the grammar library cannot compile, or one whose recursion
   cannot end (a required self-reference), is a 400 naming `response_format`, `tools`
   or `tool_choice`; so is a structured request to an engine that cannot enforce it;
5. returns every error as OpenAI's `{"error": {"message", "type", "param",
   "code"}}` with a 4xx status for anything the client got wrong, including
   request-body validation errors (400, never a 500 with a traceback; types are
   strict: `max_tokens: "8"` is a 400), a body that is not JSON (400), a tool
   without its function (400), a body that stops arriving (408, `body_timeout`) or
   that is not whole within `body_deadline` of its head (408, serve/guards.py) and,
   from the HTTP layer below the app, malformed or too slow request heads
   (serve/http_protocol.py);
6. refuses oversized work before doing it: bodies over `max_body_bytes` (413),
   `n` over `max_n`, more messages or tools than `max_messages` / `max_tools`, a
   `response_format` over `max_schema_chars`, `max_tokens` beyond the context, and
   messages and tool definitions with more characters than the context could hold
   as tokens (400 naming the limit, before validating or rendering; the counts of a
   large body are read before it is parsed whole, serve/request.py). A large prompt
   (`INLINE_RENDER_CHARS`) is rendered and tokenized on a worker thread, at most
   `RENDER_THREADS` at once, so it never delays another request's answer;
7. takes images (`image_url` parts: data:, file:// under `allowed_local_media_path`, http(s)) for a
   vision-language model: each is loaded, checked and run through the model's image processor on a worker
   thread (artrl/images.py, models/vision.py), the prompt's image tokens expanded, and each choice's record
   names the prompt's images (`prompt_images`: content hash and grid). An image that does not decode, is
   too large, comes from where it may not, or goes to a model without a vision tower is a 400 naming the
   part (`messages[1].content[0]`);
8. drops a request whose client disconnects: the engine is told to stop (a queued
   request never runs, a running one stops at its next decoding step). A disconnect
   is normal, not an error: a DEBUG line, no traceback, counted in `GET /metrics`
   (serve/guards.py: `ServerMetrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from artrl.chat_format import completion_text, cut_at_stop, image_urls
from artrl.errors import CheckpointError, ImageError
from artrl.heap import release_free_memory
from artrl.images import RECORD_KEY as IMAGES_RECORD_KEY, record_entries
from artrl.models.moe import RECORD_KEY as ROUTING_RECORD_KEY, encode_routing
from artrl.serve.background import ServerHandle, start_server
from artrl.serve.chat import DEFAULT_RECORD_CACHE_BYTES, PromptBuilder, request_messages
from artrl.serve.control_routes import ReplicaHeader, add_control_routes
from artrl.serve.engine import EngineClosedError, GenerationRequest, GenerationResult, InvalidRequestError
from artrl.serve.guards import (DEFAULT_BODY_DEADLINE_S, DEFAULT_BODY_TIMEOUT_S, APIError, ApiKey, BodyLimit,
                                ServerMetrics, error_response)
from artrl.serve.models import LiveSwitchingError, ModelNotFoundError, ServedModels
from artrl.serve.request import (DEFAULT_MAX_MESSAGES, DEFAULT_MAX_N, DEFAULT_MAX_SCHEMA_CHARS, DEFAULT_MAX_TOOLS,
                                 IGNORED_FIELDS, INLINE_PARSE_BYTES, ROUTER_DEFAULTS, ChatCompletionRequest,
                                 RequestLimits, check,
                                 check_content_type, check_counts, check_parsed, count_items, parse_body)
from artrl.serve.stream_text import TextStream
from artrl.serve.streaming import LiveStream, sse
from artrl.serve.structured import StructuredOutput, StructuredOutputError, structured_output
from artrl.serve.tool_calls import TOOL_CALL_START, parse_tool_calls, tool_call_syntax

__all__ = ["ServedModels", "ServerHandle", "create_app", "start_server"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_TOKENS = 1024
INLINE_RENDER_CHARS = 16_384
"""Requests with more characters to render than this (or more than `INLINE_RENDER_MESSAGES` messages) render and
tokenize on a worker thread, so they never hold up the event loop; smaller ones render in place (about 0.1 ms,
less than the hand-off to a thread would cost them)."""
INLINE_RENDER_MESSAGES = 64
RENDER_THREADS = 2
"""Large prompts rendered at once; more wait their turn (bounds the memory abusive requests can take)."""




@functools.lru_cache(maxsize=16)
def _tool_call_syntax(tokenizer: Any) -> Any:
    return tool_call_syntax(tokenizer)


def _structured(body: ChatCompletionRequest, engine: Any) -> StructuredOutput | None:
    """The grammar constraint `response_format` / `tool_choice` ask for, checked against what the engine can do."""
    try:
        structured = structured_output(body.response_format, body.tools, body.tool_choice, body.parallel_tool_calls,
                                       _tool_call_syntax(engine.tokenizer))
    except StructuredOutputError as error:
        raise APIError(400, str(error), param=error.param) from error
    if structured is not None and not getattr(engine, "structured_outputs", False):
        raise APIError(400, f"The engine serving {body.model!r} ({type(engine).__name__}) cannot hold a reply to a "
                            f"schema or to tool calls; send the request without {structured.param}, or serve the model "
                            "with an engine that supports structured outputs.", param=structured.param)
    return structured


def _max_tokens_param(body: ChatCompletionRequest) -> str:
    return "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"


def _generation_request(body: ChatCompletionRequest, prompt_ids: list[int], adapter: str | None, max_model_len: int,
                        default_max_tokens: int, structured: StructuredOutput | None = None) -> GenerationRequest:
    """The request's sampling parameters as a GenerationRequest (checked by the engine: `GenerationRequest.check`)."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens, max_model_len - len(prompt_ids))
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenerationRequest(
        prompt_ids=prompt_ids,
        n=1 if body.n is None else body.n,
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop_token_ids=[],
        seed=body.seed,
        top_logprobs=body.top_logprobs or 0,
        adapter=adapter,
        stop_strings=[s for s in stop if s],
        structured=structured,
    )


# GenerationRequest fields -> the chat completion parameter they come from (others keep their name)
_PARAM_OF_FIELD = {"prompt_ids": "messages", "adapter": "model", "stop_strings": "stop", "images": "messages"}


def _refused(error: InvalidRequestError, body: ChatCompletionRequest) -> APIError:
    """The engine's refusal of a request as a 400 naming the first faulty parameter."""
    if not error.problems:
        return APIError(400, str(error))
    field = error.problems[0].field
    param = _max_tokens_param(body) if field == "max_tokens" else _PARAM_OF_FIELD.get(field, field)
    message = str(error)
    if param == "max_completion_tokens":
        message = message.replace("max_tokens", param)  # the request's own name for the same budget
    return APIError(400, message, param=param)


@functools.lru_cache(maxsize=16)
def _max_token_chars(tokenizer: Any) -> int:
    """Most characters one token of `tokenizer` can stand for (its longest vocabulary entry)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def _rendered_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """Characters of what the chat template will render: contents, tool call names and arguments, tool schemas."""
    chars = 0
    for message in messages:
        content = message.get("content") or ""
        chars += len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            chars += len(str(function.get("name", ""))) + (
                len(arguments) if isinstance(arguments, str) else len(json.dumps(arguments)))
    return chars + (len(json.dumps(tools)) if tools else 0)


def _precheck(body: ChatCompletionRequest, chars: int, tokenizer: Any, max_model_len: int, max_n: int) -> None:
    """Refuse what is too big before rendering or tokenizing anything (the rest: `GenerationRequest.check`)."""
    n = 1 if body.n is None else body.n
    check(n <= max_n, f"n must be between 1 and {max_n}, got {n}", "n")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = _max_tokens_param(body)
    if max_tokens is not None:
        check(
            max_tokens < max_model_len,
            f"{param}={max_tokens}; it must be between 1 and {max_model_len - 1} (this model's maximum context "
            f"length is {max_model_len} tokens, prompt included). Lower {param}.",
            param,
        )
    most = max_model_len * _max_token_chars(tokenizer)
    check(
        chars <= most,
        f"The messages and tools hold {chars} characters, more than {max_model_len} tokens (this model's maximum "
        f"context length) can spell with this tokenizer (at most {most} characters). Shorten the messages or the "
        "tool definitions.",
        "messages",
    )


async def _generate_unless_disconnected(engine: Any, request: GenerationRequest, http: fastapi.Request,
                                        metrics: ServerMetrics) -> Any:
    """`engine.generate(request)`, cancelled as soon as the HTTP client disconnects (counted in `metrics`)."""

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    generation = asyncio.ensure_future(engine.generate(request))
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        generation.cancel()
        raise
    finally:
        watcher.cancel()
    if generation not in done:
        generation.cancel()
        metrics.disconnects_while_generating += 1
        logger.debug("client disconnected; its generation request was dropped")
        raise APIError(499, "client closed the request", code="client_closed_request")
    return generation.result()


def _processed_images(vision: Any, urls: list[tuple[int, str, str]]) -> list[Any]:
    """Load, check and process each image part (module docstring, point 7); a bad one is a 400 naming it."""
    out = []
    for _, place, url in urls:
        try:
            out.append(vision.process(vision.load(url, place)))
        except ImageError as error:
            raise APIError(400, str(error), param=place, code="invalid_image") from error
    return out


def _head(body: ChatCompletionRequest) -> dict[str, Any]:
    """A new completion's id, creation time and model."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model}


@contextlib.contextmanager
def _engine_errors(body: ChatCompletionRequest) -> Iterator[None]:
    """The engine's refusals and closing as the API errors the client gets."""
    try:
        yield
    except InvalidRequestError as error:  # a StructuredOutputError's problem names response_format / tool_choice
        raise _refused(error, body) from error
    except EngineClosedError as error:  # the program is exiting or the backend was closed
        raise APIError(503, str(error), code="engine_closed", type="server_error") from error


def _stream_error(error: BaseException) -> dict[str, Any]:
    """An engine failure after a stream began, as the `{"error": ...}` event OpenAI's streams end with."""
    if isinstance(error, EngineClosedError):
        return {"error": {"message": str(error), "type": "server_error", "param": None, "code": "engine_closed"}}
    return {"error": {"message": f"Internal server error: {type(error).__name__}: {error}", "type": "server_error",
                      "param": None, "code": None}}


async def _until_started(generation: asyncio.Future, started: asyncio.Event, http: fastapi.Request,
                         metrics: ServerMetrics) -> None:
    """Wait until the generation's first token (or its end); a failure before it is raised here, answered as an
    error response; a client that disconnects before it drops the generation (499)."""

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    first = asyncio.ensure_future(started.wait())
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({generation, first, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        generation.cancel()
        raise
    finally:
        watcher.cancel()
        first.cancel()
    if watcher in done and not (generation in done or first in done):
        generation.cancel()
        metrics.disconnects_while_generating += 1
        logger.debug("client disconnected; its generation request was dropped")
        raise APIError(499, "client closed the request", code="client_closed_request")
    if generation.done() and generation.exception() is not None:
        generation.result()  # raises it


def _cut_at_stop(tokenizer: Any, result: GenerationResult, text: str, stops: list[str]) -> tuple[str, GenerationResult]:
    """Cut `text` before the first stop string and the tokens after the one that completed it."""
    cut = cut_at_stop(tokenizer, result.token_ids, text, stops)
    if cut is None:
        return text, result
    text, keep = cut
    return text, dataclasses.replace(
        result,
        token_ids=result.token_ids[:keep],
        logprobs=result.logprobs[:keep],
        top_logprobs=result.top_logprobs[:keep] if result.top_logprobs is not None else None,
        routed_experts=result.routed_experts[:keep] if result.routed_experts is not None else None,
        finish_reason="stop",
    )


def _token_texts(tokenizer: Any, token_ids: list[int], as_ids: bool) -> list[str]:
    """Each token's text (one batched decode), or "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
    if as_ids:
        return [f"token_id:{t}" for t in token_ids]
    return tokenizer.batch_decode([[t] for t in token_ids]) if token_ids else []


def _logprobs_json(tokenizer: Any, result: GenerationResult, as_ids: bool) -> dict[str, Any]:
    tokens = _token_texts(tokenizer, result.token_ids, as_ids)
    tops = result.top_logprobs or [[] for _ in result.token_ids]
    content = []
    for token, logprob, top in zip(tokens, result.logprobs, tops):
        top_tokens = _token_texts(tokenizer, [t for t, _ in top], as_ids)
        entries = [{"token": text, "logprob": lp, "bytes": list(text.encode())} for text, (_, lp) in zip(top_tokens, top)]
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": entries})
    return {"content": content}


def _choice_json(
    index: int,
    result: GenerationResult,
    body: ChatCompletionRequest,
    tokenizer: Any,
    stops: list[str],
    parse_tools: bool,
    end_ids: frozenset[int],
    prompt_ids: list[int],
    prompts: PromptBuilder,
    images: list[Any] | None = None,
) -> dict[str, Any]:
    text, _ = completion_text(tokenizer, result.token_ids, end_ids)
    text, result = _cut_at_stop(tokenizer, result, text, stops)
    content: str | None = text
    tool_calls: list[dict[str, Any]] = []
    if parse_tools:
        content, tool_calls = parse_tool_calls(text)
    finish_reason = "tool_calls" if tool_calls and result.finish_reason == "stop" else result.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": tool_calls or None}
    sampled_text, end_id = completion_text(tokenizer, result.token_ids, end_ids)
    prompts.remember(tokenizer, message, prompt_ids, result.token_ids, sampled_text, end_id)
    choice = {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": _logprobs_json(tokenizer, result, bool(body.return_tokens_as_token_ids)),
        "token_ids": result.token_ids,
        "prompt_token_ids": prompt_ids,
        "policy_version": result.policy_version,
    }
    if result.routed_experts is not None:  # an MoE model's routing record (models/moe.py), replayed in training
        choice[ROUTING_RECORD_KEY] = encode_routing(result.routed_experts)
    if images:  # the prompt's images: each one's content hash and grid (never the pixels)
        choice[IMAGES_RECORD_KEY] = record_entries(images)
    return choice


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
    cache of returned completions may take per tokenizer (serve/chat.py), which spells
    earlier turns of later prompts with the ids the model sampled (module docstring,
    point 1); the least recently used go first. adapter_control: add the routes that load and unload checkpoints
    and set the live weights (serve/control_routes.py: what an inference replica's control plane calls);
    replica_id: every response says it in the `x-artrl-replica` header, and `/health` needs no key (the router
    probes it without one); engine_kind, base_model: what
    `GET /artrl/replica` reports.
    """
    app = fastapi.FastAPI(title="artrl inference server")
    metrics = ServerMetrics()
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, pause=body_timeout, deadline=body_deadline,
                       metrics=metrics)
    if api_key:  # a replica's router probes /health without a key (serve/control_routes.py)
        app.add_middleware(ApiKey, api_key=api_key, open_paths=("/health",) if replica_id is not None else ())
    if replica_id is not None:
        app.add_middleware(ReplicaHeader, replica_id=replica_id)
    if adapter_control:
        add_control_routes(app, resolver, replica_id=replica_id, engine_kind=engine_kind, base_model=base_model)
    app.state.api_key = api_key
    #: What the server refused or dropped (serve/guards.py); `GET /metrics` answers it.
    app.state.metrics = metrics
    prompts = PromptBuilder(record_cache_bytes)
    limits = RequestLimits(max_n, max_messages, max_tools, max_schema_chars)
    render_slots: list[asyncio.Semaphore] = []  # made on the server's loop, at its first large prompt
    warned_fields: set[str] = set()

    async def off_loop(fn: Any, *args: Any) -> Any:
        """`fn(*args)` on a worker thread, RENDER_THREADS at once: CPU work a large request brings."""
        if not render_slots:
            render_slots.append(asyncio.Semaphore(RENDER_THREADS))
        async with render_slots[0]:
            return await asyncio.to_thread(fn, *args)

    async def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     end_ids: frozenset[int], chars: int, images: Any = None) -> list[int]:
        """The prompt's ids; a large prompt renders on a worker thread (`INLINE_RENDER_CHARS`)."""
        if chars <= INLINE_RENDER_CHARS and len(messages) <= INLINE_RENDER_MESSAGES:
            return prompts.prompt_ids(tokenizer, messages, tools, end_ids, images)
        return await off_loop(prompts.prompt_ids, tokenizer, messages, tools, end_ids, images)

    @app.exception_handler(APIError)
    async def _api_error(_: fastapi.Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: fastapi.Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        if first.get("type") == "json_invalid":  # its loc, if any, is a character offset, not a parameter
            reason = str(first.get("msg", "")).removeprefix("Invalid JSON: ")
            return error_response(APIError(400, f"The request body is not valid JSON: {reason}.",
                                            code="invalid_json"))
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in problems
        )
        return error_response(APIError(400, f"Invalid request: {message}", param=".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: fastapi.Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_: fastapi.Request, error: Exception) -> JSONResponse:
        logger.exception("Unhandled error while serving a request")
        return error_response(
            APIError(500, f"Internal server error: {type(error).__name__}: {error}", type="server_error")
        )

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

    @app.post("/v1/chat/completions")
    async def chat_completions(http: fastapi.Request) -> fastapi.Response:
        raw = await http.body()  # parsed here, not by FastAPI: a large body is counted, then parsed off the loop
        check_content_type(http.headers.get("content-type"))
        if len(raw) <= INLINE_PARSE_BYTES:
            return await answer(parse_body(raw), http)
        try:
            counts = await off_loop(count_items, raw)
            if counts is not None:
                try:
                    check_counts(counts, limits)
                except APIError:
                    metrics.refused_by_count += 1
                    raise
            return await answer(await off_loop(parse_body, raw), http)
        finally:
            del raw
            await off_loop(release_free_memory)  # what parsing a large body took goes back to the system

    async def answer(body: ChatCompletionRequest, http: fastapi.Request) -> fastapi.Response:
        extra = body.model_extra or {}
        unknown = {k for k in extra if k not in ROUTER_DEFAULTS or extra[k] != ROUTER_DEFAULTS[k]} \
            - IGNORED_FIELDS - warned_fields
        if unknown:
            logger.warning("Ignoring unsupported chat completion parameters: %s", sorted(unknown))
            warned_fields.update(unknown)
        try:
            engine, adapter = await resolver.resolve(body.model)
        except ModelNotFoundError as error:
            raise APIError(404, str(error), param="model", code="model_not_found") from error
        except LiveSwitchingError as error:
            raise APIError(503, str(error), param="model", code="live_weights_switching", type="server_error") \
                from error
        except CheckpointError as error:
            logger.error("%s", error)
            raise APIError(500, str(error), param="model", code="checkpoint_unreadable", type="server_error") \
                from error
        tokenizer = engine.tokenizer
        check_parsed(body, limits)
        structured = _structured(body, engine)
        try:
            messages = request_messages(body.messages)
        except InvalidRequestError as error:
            raise APIError(400, str(error), param="messages") from error
        tools = body.tools if body.tool_choice != "none" else None
        chars = _rendered_chars(messages, tools)
        _precheck(body, chars, tokenizer, engine.max_model_len, max_n)
        end_ids = engine.end_of_turn_ids
        urls = image_urls(body.messages, "messages")
        vision = getattr(engine, "vision", None)
        if urls and vision is None:
            raise APIError(400, f"{urls[0][1]} is an image, and model {body.model!r} has no vision tower: it reads "
                                "text only. Send text, or serve a vision-language model (e.g. artrl/tiny-vl).",
                           param=urls[0][1], code="invalid_image")
        images = await off_loop(_processed_images, vision, urls) if urls else []
        try:
            prompt_ids = await render(tokenizer, messages, tools, end_ids, chars,
                                      vision.image_tokens(images) if images else None)
        except InvalidRequestError as error:
            raise APIError(400, str(error), param="messages") from error
        request = _generation_request(body, prompt_ids, adapter, engine.max_model_len, default_max_tokens, structured)
        request.images = images
        as_ids = bool(body.return_tokens_as_token_ids)

        def respond(results: list[GenerationResult]) -> dict[str, Any]:
            """The chat completion of the finished `results` (the record cache remembers each choice)."""
            results = resolver.with_versions(body.model, results)  # `name@step` sampled version `step`
            if not body.logprobs:  # top_logprobs are checked whatever `logprobs` says, and shown only when asked
                results = [dataclasses.replace(result, top_logprobs=None) for result in results]
            choices = [
                _choice_json(i, result, body, tokenizer, request.stop_strings, bool(tools), end_ids, prompt_ids,
                             prompts, images)
                for i, result in enumerate(results)
            ]
            completion_tokens = sum(len(choice["token_ids"]) for choice in choices)
            head = _head(body)
            return {
                "id": head["id"],
                "object": "chat.completion",
                "created": head["created"],
                "model": head["model"],
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": completion_tokens,
                    "total_tokens": len(prompt_ids) + completion_tokens,
                },
                "prompt_token_ids": prompt_ids,
            }

        options = (body.model_extra or {}).get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        if body.stream and getattr(engine, "streams_tokens", False):
            events: asyncio.Queue = asyncio.Queue()
            started = asyncio.Event()

            def on_token(*event: Any) -> None:  # on this loop (the engine schedules it here)
                events.put_nowait(event)
                started.set()

            generation = asyncio.ensure_future(engine.generate(request, on_token=on_token))
            with _engine_errors(body):
                await _until_started(generation, started, http, metrics)

            def entry(token: int, logprob: float, top: list[tuple[int, float]] | None) -> dict[str, Any]:
                one = GenerationResult([token], [logprob], [top] if top is not None and body.logprobs else None,
                                       "length")
                return _logprobs_json(tokenizer, one, as_ids)["content"][0]

            tool_tag = TOOL_CALL_START if tools else None
            live = LiveStream(
                generation, events,
                [TextStream(tokenizer, end_ids, request.stop_strings, tool_tag) for _ in range(request.n)],
                entry, respond, _stream_error, _head(body), include_usage)
            return StreamingResponse(live.sse(), media_type="text/event-stream")
        with _engine_errors(body):
            results = await _generate_unless_disconnected(engine, request, http, metrics)
        response = respond(results)
        if body.stream:
            return StreamingResponse(sse(response, tokenizer, include_usage), media_type="text/event-stream")
        return JSONResponse(response)

    return app
