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
from artrl.serve.engines.base import GenerationRequest
from artrl.models.tiny import load_tiny


RANDOM_LORA_TARGETS = ["q_proj", "v_proj", "up_proj"]


def random_adapter(cache: Any, seed: int) -> Any:
    """The tiny model (loaded from `cache`) with a rank-4 LoRA adapter whose B matrices are random (seeded), so
    that it changes the model's logprobs; in eval mode."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=RANDOM_LORA_TARGETS, lora_dropout=0.0,
                        init_lora_weights=False)
    model = get_peft_model(load_tiny(cache)[0], config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return model.eval()


class StepHook:
    """Wraps the engine's `_step` (on its decode worker, at a step boundary): runs `action` before step `at`."""

    def __init__(self, engine: Any, at: int, action: Any) -> None:
        self.engine, self.at, self.action, self.calls = engine, at, action, 0
        self.original = engine._step
        engine._step = self  # type: ignore[method-assign]

    def __call__(self, batch: Any) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.action()
        self.original(batch)

    def remove(self) -> None:
        self.engine._step = self.original  # type: ignore[method-assign]


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
