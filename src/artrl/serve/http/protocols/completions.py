"""`POST /v1/completions`: OpenAI's legacy Completions API over the request core, with the token record.

The prompt is text or token ids, one per request (a string, a list of ids, or a list holding one of them;
several prompts are a 400: send one request each). Text is tokenized as the tokenizer spells text given to it
whole (its own special tokens added, e.g. a BOS, as vLLM does); ids are taken as they are. No chat template.
`n`, `max_tokens` (16 when not set, as OpenAI's API), `temperature`, `top_p`, `stop`, `seed` are the core's;
`logprobs: k` asks for the `k` most likely tokens at each step (`top_logprobs`).

Refused with a 400 naming the field, never ignored: a field this route does not take (serve/http/body_policy.py),
`frequency_penalty`, `presence_penalty` or `logit_bias` other than their neutral values, `echo: true` (the reply would hold the prompt's text and
logprobs, which the engines do not compute), `suffix`, `best_of` other than `n`.

Each choice is `{index, text, finish_reason, logprobs}`, `logprobs` on every choice whether or not the request
asked (as the chat route's): `tokens`, `token_logprobs` (one per sampled id, the final end-of-turn id included),
`text_offset`, and `top_logprobs` when asked. The token record rides on the choice: `prompt_token_ids`,
`token_ids`, `policy_version` (and the response carries `prompt_token_ids`). Streamed, each chunk is a
`text_completion` with the piece's `text` and `logprobs`; a choice's last chunk (with its `finish_reason`)
carries the logprobs no piece held and the whole record, so a client that appends every chunk's `token_ids`
(ART's capture) or keeps the last one's gets the same ids; then `data: [DONE]`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import fastapi
from fastapi.responses import JSONResponse, StreamingResponse

from ..core import Prepared, RequestCore
from ..guards import APIError
from .common import read_body, record_fields, renamed_params
from ..request import (PENALTY_DEFAULTS, ROUTER_DEFAULTS, VLLM_SAMPLING_DEFAULTS, ChatCompletionRequest,
                       OpenAIRequest, StreamOptions, include_usage)
from ..streaming import SSE_DONE, sse_event

PATH = "/v1/completions"
DEFAULT_MAX_TOKENS = 16
"""OpenAI's Completions default budget."""
_NAMES = {"messages": "prompt", "top_logprobs": "logprobs"}


class CompletionRequest(OpenAIRequest):
    """The Completions request fields this route takes (any other is refused: serve/http/body_policy.py). Strict
    types, as the chat route's."""

    DEFAULT_ONLY: ClassVar[dict[str, Any]] = {**ROUTER_DEFAULTS, **PENALTY_DEFAULTS, **VLLM_SAMPLING_DEFAULTS}

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    n: int | None = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_tokens_as_token_ids: bool | None = False
    top_k: int | None = None  # vLLM's sampling extras, at their neutral values only (request.py)
    min_p: float | None = None
    repetition_penalty: float | None = None


def prompt_of(body: CompletionRequest) -> str | list[int]:
    """The one prompt of the request, as text or ids."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise APIError(400, "prompt is empty; send a string or a list of token ids.", param="prompt")
    if isinstance(prompt[0], int):
        return list(prompt)  # type: ignore[arg-type]
    if len(prompt) != 1:
        raise APIError(400, f"prompt holds {len(prompt)} prompts; this server takes one per request (send one "
                            "request each).", param="prompt")
    return prompt[0]  # type: ignore[return-value]


def chat_request(body: CompletionRequest) -> ChatCompletionRequest:
    """The core's canonical request (no messages: the prompt goes to `RequestCore.prepare` as it is)."""
    if body.echo:
        raise APIError(400, "echo=true: this server does not return the prompt's text and logprobs with the "
                            "completion (the prompt's ids are in prompt_token_ids); send echo=false.", param="echo")
    if body.suffix is not None:
        raise APIError(400, "suffix: this server does not insert completions before a suffix; send the request "
                            "without it.", param="suffix")
    n = 1 if body.n is None else body.n
    if body.best_of is not None and body.best_of != n:
        raise APIError(400, f"best_of={body.best_of}: this server returns every sampled choice (best_of equal to n, "
                            f"{n}); send best_of={n} or none.", param="best_of")
    return ChatCompletionRequest(
        model=body.model, messages=[], n=body.n,
        max_tokens=body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS,
        temperature=body.temperature, top_p=body.top_p, stop=body.stop, seed=body.seed,
        logprobs=bool(body.logprobs), top_logprobs=body.logprobs,
        return_tokens_as_token_ids=body.return_tokens_as_token_ids)


def _logprobs(entries: list[dict[str, Any]], offset: int, tops: bool) -> tuple[dict[str, Any], int]:
    """Chat logprob entries in the Completions shape, the first token's text at `offset`; (that, the offset after)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    top = [{t["token"]: t["logprob"] for t in entry.get("top_logprobs") or []} for entry in entries] if tops else None
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": top, "text_offset": offsets}, offset


def _choice(choice: dict[str, Any], tops: bool) -> dict[str, Any]:
    logprobs, _ = _logprobs((choice.get("logprobs") or {}).get("content") or [], 0, tops)
    return {"index": choice["index"], "text": choice["message"].get("content") or "",
            "finish_reason": choice["finish_reason"], "logprobs": logprobs,
            "prompt_token_ids": choice["prompt_token_ids"], "token_ids": choice["token_ids"], **record_fields(choice)}


def completion_json(prepared: Prepared, body: CompletionRequest, response: dict[str, Any]) -> dict[str, Any]:
    """The Completions reply for the core's finished chat completion."""
    tops = bool(body.logprobs)
    return {"id": _id(prepared), "object": "text_completion", "created": prepared.head["created"],
            "model": body.model, "choices": [_choice(c, tops) for c in response["choices"]],
            "usage": response["usage"], "prompt_token_ids": prepared.prompt_ids}


def _id(prepared: Prepared) -> str:
    return f"cmpl-{prepared.head['id'].removeprefix('chatcmpl-')}"


async def completion_events(prepared: Prepared, body: CompletionRequest,
                            chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The core's chat chunks as Completions chunks (module docstring), then `data: [DONE]`."""
    tops = bool(body.logprobs)
    head = {"id": _id(prepared), "object": "text_completion", "created": prepared.head["created"],
            "model": body.model}
    offsets: dict[int, int] = {}
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if "error" in chunk:
                yield sse_event(chunk)
                break
            if not chunk["choices"] and chunk.get("usage") is not None:
                yield sse_event({**head, "choices": [], "usage": chunk["usage"]})
                continue
            for part in chunk["choices"]:
                index, delta = part["index"], part.get("delta") or {}
                text = delta.get("content") or ""
                last = part.get("finish_reason") is not None
                if not text and not last:
                    continue  # the role chunk
                logprobs, offsets[index] = _logprobs((part.get("logprobs") or {}).get("content") or [],
                                                     offsets.get(index, 0), tops)
                out: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs,
                                       "finish_reason": part.get("finish_reason")}
                if last:  # the record, as the chat chunk carries it
                    out.update({k: v for k, v in part.items()
                                if k not in ("index", "delta", "logprobs", "finish_reason")})
                yield sse_event({**head, "choices": [out]})
    yield SSE_DONE


def add_route(app: fastapi.FastAPI, core: RequestCore) -> None:
    """`POST /v1/completions` on `app`."""

    @app.post(PATH)
    async def completions(http: fastapi.Request) -> fastapi.Response:
        body = await read_body(http, CompletionRequest, core)
        request = chat_request(body)
        with renamed_params(_NAMES):
            prepared = await core.prepare(request, prompt=prompt_of(body))
            if body.stream:
                chunks = await core.stream(prepared, http, include_usage(body))
                return StreamingResponse(completion_events(prepared, body, chunks), media_type="text/event-stream")
            response = await core.complete(prepared, http)
        return JSONResponse(completion_json(prepared, body, response))
