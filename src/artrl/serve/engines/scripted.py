"""A scripted inference engine: returns the completion it is told to, samples nothing.

For exercising the HTTP server (prompt building, the token record, stop handling,
error shapes) without a model: tests and benchmarks/record_splits.py set `next`
(sampled ids and their logprobs) or build it from text, and read back the prompt
ids the server sent in `prompts`. Not for serving users.

Paced (`token_time_s > 0`), it stands for an engine whose time is not this machine's
CPU (an accelerator, another host): each row holds one of `max_batch_size` decode slots
for `token_time_s` per token it returns, sleeping meanwhile; rows beyond the slots wait
for one. `python benchmarks/bench.py replicas` measures inference replicas on it, so that a small CPU
machine is not what limits them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .base import BASE_WEIGHTS, GenerationRequest, GenerationResult, InferenceEngine


class ScriptedEngine(InferenceEngine):
    """Answers every request with `next` (ids, logprobs); remembers each prompt in `prompts`.

    `finish_reason` is "stop" when the ids end with one of `end_ids` (default: the tokenizer's eos), else
    "length". `ScriptedEngine.from_text(tok, "hi")` answers "hi" followed by eos, with placeholder logprobs.
    Requests are checked as every engine checks them (`GenerationRequest.check`). It holds no weights:
    `set_live_weights` only records the checkpoint it was given (`live_weights`, and `policy_version` of what
    `adapter=None` answers from then on), `load_adapter` the name it was given.
    `token_time_s`, `max_batch_size`: the pace of the module docstring (0: answer at once).
    """

    def __init__(self, tokenizer: Any, end_ids: frozenset[int] | None = None, *, max_model_len: int = 100_000,
                 token_time_s: float = 0.0, max_batch_size: int = 32) -> None:
        self._tokenizer = tokenizer
        self._end_ids = end_ids if end_ids is not None else frozenset({tokenizer.eos_token_id})
        self._max_model_len = max_model_len
        self.next: tuple[list[int], list[float]] = ([], [])
        self.prompts: list[list[int]] = []
        self.live_weights: tuple[str, int] | None = None
        self.adapters: dict[str, str] = {}  # name -> path, as loaded
        self.token_time_s = token_time_s
        self.max_batch_size = max_batch_size
        self._slots: asyncio.Semaphore | None = None  # made on the loop that serves, at the first paced request

    @classmethod
    def from_text(cls, tokenizer: Any, text: str, **kwargs: Any) -> "ScriptedEngine":
        engine = cls(tokenizer, **kwargs)
        ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        engine.next = (ids, [-1.0] * len(ids))
        return engine

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        self.check(request)
        self.prompts.append(list(request.prompt_ids))
        ids, lps = self.next
        if self.token_time_s > 0:
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.max_batch_size)
            for _ in range(request.n):  # one slot per row
                await self._slots.acquire()
            try:
                await asyncio.sleep(self.token_time_s * len(ids))
            finally:
                for _ in range(request.n):
                    self._slots.release()
        finish = "stop" if ids and ids[-1] in self._end_ids else "length"
        version = self.live_weights[1] if request.adapter is None and self.live_weights is not None else None
        return [GenerationResult(list(ids), list(lps), None, finish, policy_version=version)
                for _ in range(request.n)]

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        return self._end_ids

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def load_adapter(self, name: str, path: str) -> None:
        self.adapters[name] = str(path)

    def unload_adapter(self, name: str) -> bool:
        self.adapters.pop(name, None)
        return True

    def has_adapter(self, name: str) -> bool:
        return name == BASE_WEIGHTS or name in self.adapters

    def set_live_weights(self, path: str, step: int) -> None:
        self.live_weights = (path, step)

    @property
    def live_step(self) -> int | None:
        return None if self.live_weights is None else self.live_weights[1]
