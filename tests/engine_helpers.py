"""Helpers the engine tests share: submitting to an engine from the test thread, the unbatched logprobs a
sampled sequence must match, and the tiny model's engine decoding on one thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from artrl.serve import TransformersEngine
from artrl.serve.engine import GenerationRequest
from artrl.tiny import load_tiny


def submit(loop: asyncio.AbstractEventLoop, engine: Any, request: GenerationRequest) -> concurrent.futures.Future:
    """`engine.generate(request)` on `loop` (running in another thread, the `loop` fixture's)."""
    return asyncio.run_coroutine_threadsafe(engine.generate(request), loop)


def recompute(model: Any, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """Unbatched log_softmax(logits)[sampled] for each sampled token."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0].float().log_softmax(-1)  # [seq, vocab]
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(token_ids))
    return logprobs[positions, torch.tensor(token_ids)].tolist()


def prompt_of(tokenizer: Any, text: str) -> list[int]:
    """`text`'s ids, no special tokens."""
    return tokenizer(text, add_special_tokens=False).input_ids


@contextlib.contextmanager
def one_thread_engine(max_batch_size: int) -> Iterator[TransformersEngine]:
    """The tiny model's built-in engine with torch on one intra-op thread (restored on exit): its decode steps
    are microseconds of work, and on a small shared CPU spinning OpenMP workers starve the server's event loop
    (a 50x slowdown)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = load_tiny()
    engine = TransformersEngine(model, tokenizer, max_batch_size=max_batch_size)
    try:
        yield engine
    finally:
        engine.close()
        torch.set_num_threads(threads)
