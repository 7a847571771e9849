"""A scripted inference engine: returns the completion it is told to, samples nothing.

For exercising the HTTP server (prompt building, the token record, stop handling,
error shapes) without a model: tests and benchmarks/record_splits.py set `next`
(sampled ids and their logprobs) or build it from text, and read back the prompt
ids the server sent in `prompts`. Not for serving users.
"""

from __future__ import annotations

from typing import Any

from artrl.serve.engine import GenerationRequest, GenerationResult, InferenceEngine


class ScriptedEngine(InferenceEngine):
    """Answers every request with `next` (ids, logprobs); remembers each prompt in `prompts`.

    `finish_reason` is "stop" when the ids end with one of `end_ids` (default: the tokenizer's eos), else
    "length". `ScriptedEngine.from_text(tok, "hi")` answers "hi" followed by eos, with placeholder logprobs.
    Requests are checked as every engine checks them (`GenerationRequest.check`). It holds no weights:
    `set_live_weights` only records the checkpoint it was given (`live_weights`).
    """

    def __init__(self, tokenizer: Any, end_ids: frozenset[int] | None = None, *, max_model_len: int = 100_000) -> None:
        self._tokenizer = tokenizer
        self._end_ids = end_ids if end_ids is not None else frozenset({tokenizer.eos_token_id})
        self._max_model_len = max_model_len
        self.next: tuple[list[int], list[float]] = ([], [])
        self.prompts: list[list[int]] = []
        self.live_weights: tuple[str, int] | None = None

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
        finish = "stop" if ids and ids[-1] in self._end_ids else "length"
        return [GenerationResult(list(ids), list(lps), None, finish) for _ in range(request.n)]

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
        raise NotImplementedError("a scripted engine holds no adapters")

    def has_adapter(self, name: str) -> bool:
        return False

    def set_live_weights(self, path: str, step: int) -> None:
        self.live_weights = (path, step)
