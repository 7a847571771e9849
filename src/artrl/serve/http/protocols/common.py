"""What the protocol adapters share: reading a body into a strict pydantic model, and server-sent events."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import fastapi
import pydantic
from fastapi.exceptions import RequestValidationError

from ....runtime.heap import release_free_memory
from ..guards import ANTHROPIC_PATHS, APIError
from ..request import INLINE_PARSE_BYTES, check_content_type, check_counts, check_defaults, scan_body

if TYPE_CHECKING:
    from ..core import RequestCore

Body = TypeVar("Body", bound=pydantic.BaseModel)


def parse(raw: bytes, model: type[Body]) -> Body:
    """`raw` as `model` (a failure is the RequestValidationError the server answers with a 400 naming the field)."""
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False)) from error


async def read_body(http: fastapi.Request, model: type[Body], core: RequestCore, items: str | None = None) -> Body:
    """The request body as `model`, its route's list of fields: a body sent as anything but JSON is a 400; its
    field names are read first without building their values (request.py: `scan_body`), and a field `model` does
    not take is refused in the route's error shape (serve/http/body_policy.py); a body over `INLINE_PARSE_BYTES` is
    also counted there (its list of messages, named `items` in this protocol, and its tools: over the server's
    limits is a 400 before anything is built, as on the chat route), then parsed on a worker thread (the core
    checks the rest of the limits on what it holds, after it is parsed); its scan and its parse take turns with
    other large bodies' (guards.py: `BodyLane`). Fields taken at one value only
    (`DEFAULT_ONLY`) are checked last."""
    raw = await http.body()
    check_content_type(http.headers.get("content-type"))
    large = len(raw) > INLINE_PARSE_BYTES
    try:
        shape = await core.body_lane.run(scan_body, raw, items) if large else scan_body(raw, items)
        if shape is not None:
            core.body_policy.check(shape.names, model, model.__name__.removesuffix("Request"),
                                   anthropic=http.url.path in ANTHROPIC_PATHS)
            if large and items is not None:
                try:
                    check_counts(shape.counts, core.limits, items)
                except APIError:
                    core.metrics.refused_by_count += 1
                    raise
        body = await core.body_lane.run(parse, raw, model) if large else parse(raw, model)
    finally:
        if large:
            del raw
            await core.off_loop(release_free_memory)
    check_defaults(body)
    return body


def named_event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with an `event:` name (Anthropic's and the Responses API's streams)."""
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


def record_fields(choice: dict[str, Any]) -> dict[str, Any]:
    """A chat choice's token record besides its ids and logprobs (`policy_version`, and `routed_experts` /
    `prompt_images` where the model has them), to carry over as they are."""
    return {k: v for k, v in choice.items()
            if k not in ("index", "message", "finish_reason", "logprobs", "token_ids", "prompt_token_ids", "text")}


def sampled_logprobs(choice: dict[str, Any]) -> list[float]:
    """The logprob of every sampled id of a chat choice, in order."""
    return [entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content") or []]


TOOL_FIELDS_AT_TOP = ((r"^tools\[(\d+)\]\.function\.(\w+)", r"tools[\1].\2"),)
"""The Responses API's tools: a chat tool's `tools[k].function.name` is its `tools[k].name`."""


@contextlib.contextmanager
def renamed_params(names: dict[str, str], paths: tuple[tuple[str, str], ...] = ()) -> Iterator[None]:
    """Core refusals named in the protocol's own words: the canonical parameter `messages` is the Completions
    `prompt`, chat's `max_tokens` the Responses `max_output_tokens` (`names`: a parameter's first part); a chat
    tool's `tools[0].function.parameters` is a Messages tool's `tools[0].input_schema` (`paths`: a regular
    expression and its replacement, applied to the whole parameter first)."""
    try:
        yield
    except APIError as error:
        if error.param is None:
            raise
        param = error.param
        for pattern, replacement in paths:
            param = re.sub(pattern, replacement, param)
        head, dot, rest = param.partition(".")
        base, bracket, index = head.partition("[")
        if base in names:
            param = names[base] + bracket + index + dot + rest
        if param == error.param:
            raise
        if error.param in error.message:
            message = error.message.replace(error.param, param, 1)
        else:  # the field's name where the message names it first; later words (`create_app(max_messages=...)`,
            # "holds 5000 messages") stay as they are
            message = re.sub(rf"\b{re.escape(base)}\b", names.get(base, base), error.message, count=1)
        raise dataclasses.replace(error, param=param, message=message) from error
