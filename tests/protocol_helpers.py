"""What the protocol tests share: a server that counts a large body's items before it builds them, the refusals
it counted, and a scripted engine answering as a given policy version."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from artrl.serve import ServedModels, ServerHandle, create_app, start_server
from artrl.serve.engines.scripted import ScriptedEngine

COUNTED_MESSAGES = 10
"""The most messages (Responses: items) a request to `counting_server` may hold."""


@contextlib.contextmanager
def counting_server(tokenizer: Any) -> Iterator[ServerHandle]:
    """A scripted model ("scripted") served with the default body limit and `COUNTED_MESSAGES` messages a request
    at most: a body past INLINE_PARSE_BYTES is counted before it is built."""
    engine = ScriptedEngine.from_text(tokenizer, "ok", max_model_len=8192)
    with start_server(create_app(ServedModels("scripted", engine), max_messages=COUNTED_MESSAGES)) as handle:
        yield handle


def refused_by_count(handle: ServerHandle, send: Callable[[], httpx.Response]) -> tuple[httpx.Response, int]:
    """`send()`'s response, and how many requests the server refused by count while it ran."""
    def refused() -> int:
        return httpx.get(f"{handle.url}/metrics", timeout=20).json()["refused_by_count"]

    before = refused()
    response = send()
    return response, refused() - before


@contextlib.contextmanager
def live_step(engine: ScriptedEngine, step: int) -> Iterator[None]:
    """`engine` answers `adapter=None` requests as policy version `step` inside the block."""
    engine.set_live_weights(f"checkpoints/{step:04d}", step)
    try:
        yield
    finally:
        engine.live_weights = None
