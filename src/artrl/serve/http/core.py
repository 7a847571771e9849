"""The request core every wire protocol shares: one canonical request in, sampled choices and the token record out.

Each protocol the server speaks (OpenAI Chat Completions, Completions, Responses; Anthropic
Messages) is a thin adapter (serve/http/protocols/) that turns its request body into the one
canonical request (`ChatCompletionRequest`: messages or prompt ids, tools, sampling
parameters) and turns what this core returns (a chat completion and its chunks, each choice
with its token record) into its own response and stream events. What the core does, for
all of them, as vLLM's entrypoints share one serving base:

1. resolves the model (404 for an unknown one), applies the limits (`RequestLimits`: `n`,
   messages, tools, schema size, `max_tokens` against the context, characters the context
   could hold) and checks tools and `tool_choice`, before anything is rendered;
2. renders the messages with the chat template (a large prompt on a worker thread), spelling
   assistant messages this server returned with the ids it sampled (serve/http/prompts.py), or takes
   the prompt ids as given (`Prepared.raw`: Completions);
3. builds the engine's `GenerationRequest` (sampling parameters, stop strings, structured
   output), runs it (a client that disconnects drops it), and refuses what the engine
   refuses as a 400 naming the request's parameter;
4. turns each result into a choice: the text cut at a stop string, tool calls parsed when
   tools were offered, logprobs for every sampled token, and the token record
   (`prompt_token_ids`, `token_ids`, `policy_version`; docs/token-record.md);
5. streams: live from an engine that hands tokens over (`streams_tokens`), else cut from the
   finished reply (serve/http/streaming.py); `Prepared.response` holds the finished response when
   the stream's last chunks go out, for adapters that send the whole record at the end.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fastapi

from ...chat.format import completion_text, cut_at_stop, image_urls
from ...errors import CheckpointError, ImageError
from ...chat.images import RECORD_KEY as IMAGES_RECORD_KEY, record_entries
from ...models.moe import RECORD_KEY as ROUTING_RECORD_KEY, encode_routing
from .prompts import PromptBuilder, request_messages, template_kwargs_problem
from ..errors import EngineClosedError, InvalidRequestError
from ..engines.base import GenerationRequest, GenerationResult
from .guards import APIError, BodyLane, ServerMetrics
from .served_models import LiveSwitchingError, ModelNotFoundError, ServedModels
from .body_policy import BodyPolicy
from .request import ChatCompletionRequest, RequestLimits, check, check_parsed
from .stream_text import TextStream
from .streaming import LiveStream, chunks as finished_chunks
from ..structured import StructuredOutput, StructuredOutputError, structured_output
from ..tool_calls import TOOL_CALL_START, parse_tool_calls, tool_call_syntax

logger = logging.getLogger(__name__)

INLINE_RENDER_CHARS = 16_384
"""Requests with more characters to render than this (or more than `INLINE_RENDER_MESSAGES` messages) render and
tokenize on a worker thread, so they never hold up the event loop; smaller ones render in place (about 0.1 ms,
less than the hand-off to a thread would cost them)."""
INLINE_RENDER_MESSAGES = 64


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
        policy_token_spans=[(a, min(b, keep), v, n) for a, b, v, n in result.policy_token_spans if a < keep]
        if result.policy_token_spans is not None else None,
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
    remember: bool = True,
) -> dict[str, Any]:
    text, _ = completion_text(tokenizer, result.token_ids, end_ids)
    text, result = _cut_at_stop(tokenizer, result, text, stops)
    content: str | None = text
    tool_calls: list[dict[str, Any]] = []
    if parse_tools:
        content, tool_calls = parse_tool_calls(text)
    finish_reason = "tool_calls" if tool_calls and result.finish_reason == "stop" else result.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": tool_calls or None}
    if remember:  # a chat prompt's: a later request holding `message` spells it with these ids
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
    spans = policy_token_spans_json(result)
    if spans is not None:  # in-flight adapter updates: which version sampled each token (ART's field)
        choice[POLICY_TOKEN_SPANS_KEY] = spans
    if result.routed_experts is not None:  # an MoE model's routing record (models/moe.py), replayed in training
        choice[ROUTING_RECORD_KEY] = encode_routing(result.routed_experts, result.prompt_routed_experts)
    if images:  # the prompt's images: each one's content hash and grid (never the pixels)
        choice[IMAGES_RECORD_KEY] = record_entries(images)
    return choice




#: ART's choice field (0.5.23, `rollout_weight_update_mode="in_flight_lora"`): the version that sampled each token.
POLICY_TOKEN_SPANS_KEY = "policy_token_spans"
#: The `lora_slot` of a span: the live weights that `adapter=None` (a request for the model's own name) runs.
LIVE_SLOT = "live"


def policy_token_spans_json(result: GenerationResult) -> list[dict[str, Any]] | None:
    """ART's `policy_token_spans` of a result whose engine swapped versions under running rows: one
    `{start_token, end_token, generation_id, policy_version, lora_slot, update_seq}` per run of tokens one version
    sampled (`generation_id`: the engine's name for that version's weights; `update_seq`: the version). None
    without spans, or when a run's version is unknown (weights loaded before any version)."""
    spans = result.policy_token_spans
    if spans is None or any(version is None for _, _, version, _ in spans):
        return None
    return [{"start_token": a, "end_token": b, "generation_id": adapter or f"v{version}", "policy_version": version,
             "lora_slot": LIVE_SLOT, "update_seq": version} for a, b, version, adapter in spans]


def matched_stop(tokenizer: Any, token_ids: list[int], end_ids: frozenset[int], stops: list[str]) -> str | None:
    """The stop string that ended a choice whose sampled ids are `token_ids`, or None (no stop string in its text)."""
    text, _ = completion_text(tokenizer, token_ids, end_ids)
    found = [(text.find(s), k) for k, s in enumerate(stops) if s and s in text]
    return stops[min(found)[1]] if found else None


@dataclass
class Prepared:
    """One request, checked and rendered: what the engine is asked, and what a protocol needs to answer it."""

    body: ChatCompletionRequest
    engine: Any
    request: GenerationRequest
    prompt_ids: list[int]
    parse_tools: bool  # tools were offered: `<tool_call>` blocks become tool calls
    images: list[Any]
    raw: bool  # the prompt was given as text or ids (Completions), not rendered from messages
    response: dict[str, Any] | None = None  # the finished chat completion, once there is one
    head: dict[str, Any] = field(default_factory=dict)  # id, created, model

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def end_ids(self) -> frozenset[int]:
        return self.engine.end_of_turn_ids


class RequestCore:
    """What every protocol's route calls (module docstring): `prepare`, then `complete` or `stream`.

    `off_loop(fn, *args)` runs CPU work a large request brings on a worker thread (bounded by the server);
    `body_policy`: what the routes do with fields they do not take (refused, unless the server is set to warn);
    `body_lane`: where the scan and parse of a large body run, in turn with the others.
    """

    def __init__(self, resolver: ServedModels, prompts: PromptBuilder, limits: RequestLimits,
                 metrics: ServerMetrics, default_max_tokens: int,
                 off_loop: Callable[..., Awaitable[Any]], body_policy: BodyPolicy | None = None) -> None:
        self.resolver, self.prompts, self.limits, self.metrics = resolver, prompts, limits, metrics
        self.default_max_tokens, self.off_loop = default_max_tokens, off_loop
        #: Where large bodies are scanned and parsed, one at a time (serve/http/guards.py)
        self.body_lane = BodyLane(off_loop)
        #: What every route does with a field it does not take (serve/http/body_policy.py)
        self.body_policy = body_policy if body_policy is not None else BodyPolicy("refuse", metrics)

    async def _resolve(self, model: str) -> tuple[Any, str | None]:
        try:
            return await self.resolver.resolve(model)
        except ModelNotFoundError as error:
            raise APIError(404, str(error), param="model", code="model_not_found") from error
        except LiveSwitchingError as error:  # a replica holding the bare name past its bound (replicas/control.py)
            raise APIError(503, str(error), param="model", code="live_weights_switching", type="server_error") \
                from error
        except CheckpointError as error:
            logger.error("%s", error)
            raise APIError(500, str(error), param="model", code="checkpoint_unreadable", type="server_error") \
                from error

    async def _render(self, tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      end_ids: frozenset[int], chars: int, images: Any = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt's ids; a large prompt renders on a worker thread (`INLINE_RENDER_CHARS`)."""
        if chars <= INLINE_RENDER_CHARS and len(messages) <= INLINE_RENDER_MESSAGES:
            return self.prompts.prompt_ids(tokenizer, messages, tools, end_ids, images, template_kwargs)
        return await self.off_loop(self.prompts.prompt_ids, tokenizer, messages, tools, end_ids, images,
                                   template_kwargs)

    async def prepare(self, body: ChatCompletionRequest, *, prompt: str | list[int] | None = None) -> Prepared:
        """Resolve, check and render `body` (points 1-3); `prompt`: the prompt as text or ids instead of
        `body.messages` (no chat template; Completions)."""
        engine, adapter = await self._resolve(body.model)
        tokenizer = engine.tokenizer
        check_parsed(body, self.limits)
        structured = _structured(body, engine)
        end_ids = engine.end_of_turn_ids
        images: list[Any] = []
        # tool_choice "none" keeps the tools in the prompt (OpenAI's meaning, and vLLM's default): the model sees
        # them, and its reply is text (no tool call parsed); a prompt that extends the last one stays a prefix
        tools = body.tools
        if prompt is not None:
            chars = len(prompt) if isinstance(prompt, str) else 0
            _precheck(body, chars, tokenizer, engine.max_model_len, self.limits.max_n)
            if isinstance(prompt, str):
                prompt_ids = await self.off_loop(_encode_prompt, tokenizer, prompt) \
                    if chars > INLINE_RENDER_CHARS else _encode_prompt(tokenizer, prompt)
            else:
                prompt_ids = list(prompt)
        else:
            try:
                messages = request_messages(body.messages)
            except InvalidRequestError as error:
                raise APIError(400, str(error), param="messages") from error
            chars = _rendered_chars(messages, tools)
            _precheck(body, chars, tokenizer, engine.max_model_len, self.limits.max_n)
            urls = image_urls(body.messages, "messages")
            vision = getattr(engine, "vision", None)
            if urls and vision is None:
                raise APIError(400, f"{urls[0][1]} is an image, and model {body.model!r} has no vision tower: it "
                                    "reads text only. Send text, or serve a vision-language model (e.g. "
                                    "artrl/tiny-vl).", param=urls[0][1], code="invalid_image")
            images = await self.off_loop(_processed_images, vision, urls) if urls else []
            template_kwargs = getattr(body, "chat_template_kwargs", None)
            if template_kwargs:
                problem = template_kwargs_problem(tokenizer, template_kwargs)
                if problem is not None:
                    raise APIError(400, f"chat_template_kwargs.{problem[0]:.100}: {problem[1]}.",
                                   param=f"chat_template_kwargs.{problem[0]:.100}")
            try:
                prompt_ids = await self._render(tokenizer, messages, tools, end_ids, chars,
                                                vision.image_tokens(images) if images else None, template_kwargs)
            except InvalidRequestError as error:
                raise APIError(400, str(error), param="messages") from error
        request = _generation_request(body, prompt_ids, adapter, engine.max_model_len, self.default_max_tokens,
                                      structured)
        request.images = images
        return Prepared(body, engine, request, prompt_ids, bool(tools) and body.tool_choice != "none", images,
                        prompt is not None, head=_head(body))

    def respond(self, prepared: Prepared, results: list[GenerationResult]) -> dict[str, Any]:
        """The chat completion of the finished `results` (point 4; the record cache remembers each choice)."""
        body, tokenizer = prepared.body, prepared.tokenizer
        results = self.resolver.with_versions(body.model, results)  # `name@step` sampled version `step`
        if not body.logprobs:  # top_logprobs are checked whatever `logprobs` says, and shown only when asked
            results = [dataclasses.replace(result, top_logprobs=None) for result in results]
        choices = [
            _choice_json(i, result, body, tokenizer, prepared.request.stop_strings, prepared.parse_tools,
                         prepared.end_ids, prepared.prompt_ids, self.prompts, prepared.images,
                         remember=not prepared.raw)
            for i, result in enumerate(results)
        ]
        completion_tokens = sum(len(choice["token_ids"]) for choice in choices)
        prompt_ids = prepared.prompt_ids
        response = {
            "id": prepared.head["id"],
            "object": "chat.completion",
            "created": prepared.head["created"],
            "model": prepared.head["model"],
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
            "prompt_token_ids": prompt_ids,
        }
        prepared.response = response
        return response

    async def complete(self, prepared: Prepared, http: fastapi.Request) -> dict[str, Any]:
        """Run the request to its end and answer it as a chat completion (the client leaving drops it)."""
        with _engine_errors(prepared.body):
            results = await _generate_unless_disconnected(prepared.engine, prepared.request, http, self.metrics)
        return self.respond(prepared, results)

    async def stream(self, prepared: Prepared, http: fastapi.Request,
                     include_usage: bool = False) -> AsyncIterator[dict[str, Any]]:
        """The chat completion chunks of `prepared` (point 5): an async iterator whose last chunks carry the record;
        an engine failure before the first token is raised here (an error response), one after it is a last
        `{"error": ...}` chunk. Without `[DONE]`: the protocol's writer ends its stream its own way."""
        body, engine, request, tokenizer = prepared.body, prepared.engine, prepared.request, prepared.tokenizer
        if not getattr(engine, "streams_tokens", False):
            response = await self.complete(prepared, http)

            async def cut() -> AsyncIterator[dict[str, Any]]:
                for chunk in finished_chunks(response, tokenizer, include_usage):
                    yield chunk
            return cut()
        events: asyncio.Queue = asyncio.Queue()
        started = asyncio.Event()

        def on_token(*event: Any) -> None:  # on this loop (the engine schedules it here)
            events.put_nowait(event)
            started.set()

        generation = asyncio.ensure_future(engine.generate(request, on_token=on_token))
        with _engine_errors(body):
            await _until_started(generation, started, http, self.metrics)
        as_ids = bool(body.return_tokens_as_token_ids)

        def entry(token: int, logprob: float, top: list[tuple[int, float]] | None) -> dict[str, Any]:
            one = GenerationResult([token], [logprob], [top] if top is not None and body.logprobs else None, "length")
            return _logprobs_json(tokenizer, one, as_ids)["content"][0]

        tool_tag = TOOL_CALL_START if prepared.parse_tools else None
        live = LiveStream(
            generation, events,
            [TextStream(tokenizer, prepared.end_ids, request.stop_strings, tool_tag) for _ in range(request.n)],
            entry, functools.partial(self.respond, prepared), _stream_error, prepared.head, include_usage,
            self._dropped)
        return live.chunks()

    def _dropped(self) -> None:
        """A streaming client left before its generation ended: counted and logged as a non-streamed one's."""
        self.metrics.disconnects_while_generating += 1
        logger.debug("client disconnected mid-stream; its generation request was dropped")


def _encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A text prompt's ids as the tokenizer spells text given to it whole (its own special tokens added, e.g. a
    BOS), as vLLM's Completions endpoint tokenizes one."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])

