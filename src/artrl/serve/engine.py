"""The inference engine interface: what the HTTP server asks of a model runner.

An engine turns token ids into sampled token ids plus their logprobs. It knows
nothing about HTTP, chat messages or JSON; the server (`serve/server.py`) renders
and tokenizes prompts, and the engine only samples. Two choices matter to training:

1. **Raw logprobs.** `GenerationResult.logprobs[i]` is the model's log-softmax of the
   next-token logits at step i, taken *before* temperature and top-p reshape the
   sampling distribution. It is what a trainer computing `log_softmax(logits)` over
   the same prefix gets, so sampled and trained logprobs line up (importance ratios
   start at exactly 1 for unchanged weights). Under a grammar (`request.structured`,
   serve/structured.py) too: the grammar masks the logits that are *sampled* from, the
   logprob reported is still the unmasked one, so the sampled-vs-trained delta stays 0
   and an importance ratio is taken against the unconstrained policy, the one the
   trainer updates. (The masked distribution's logprob would be this plus the log of
   the mass the grammar allowed; nobody trains on it.)
2. **Tokens in, tokens out.** `token_ids` are the sampled ids, including the stop
   token when generation stopped on one (as vLLM does), so nobody re-tokenises text.

`model_lock` is how inference and training share one device: whoever changes the
weights (a trainer step, loading an adapter) holds it; the engine holds it for each
batch it runs. It is re-entrant, so a trainer that holds it may still call
`load_adapter`.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from artrl.chat_format import end_of_turn_ids
from artrl import adapter_switch
from artrl.errors import ArtrlError

if TYPE_CHECKING:
    from artrl.serve.structured import StructuredOutput

FinishReason = Literal["stop", "length"]


class InvalidRequestError(ArtrlError, ValueError):
    """A generation request the engine cannot serve (bad parameter, unknown adapter, too long)."""


class EngineClosedError(ArtrlError, RuntimeError):
    """The engine was closed (e.g. the program is exiting) while the request was queued or decoding."""


#: `GenerationRequest.adapter` value for the base model's own weights: every LoRA adapter switched off
#: (defined with the adapter switching it names, artrl/adapter_switch.py).
BASE_WEIGHTS = adapter_switch.BASE_WEIGHTS


@dataclass
class GenerationRequest:
    """One prompt to sample `n` continuations of.

    `stop_token_ids` end a sequence (the engine always adds its `end_of_turn_ids`).
    `stop_strings` end a sequence once its decoded text contains one of them; the
    token that completes the string is the last one returned. `adapter` names a LoRA
    adapter loaded with `InferenceEngine.load_adapter`; None means the live weights,
    `BASE_WEIGHTS` the base model with every adapter switched off. `structured` holds
    every sequence to a JSON schema or to tool calls (serve/structured.py); an engine
    that cannot enforce it says so (`InferenceEngine.structured_outputs`).
    """

    prompt_ids: list[int]
    n: int = 1
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    adapter: str | None = None
    stop_strings: list[str] = field(default_factory=list)
    structured: StructuredOutput | None = None


@dataclass
class GenerationResult:
    """One sampled sequence.

    `logprobs[i]` is the raw log-softmax probability of `token_ids[i]`;
    `top_logprobs[i]` (when asked for) lists the `top_logprobs` most likely
    `(token_id, logprob)` pairs at step i, most likely first.
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: FinishReason


class InferenceEngine(abc.ABC):
    """Samples continuations of token-id prompts; see the module docstring."""

    #: Held by the engine while it runs a batch and by anyone changing the weights.
    model_lock: Any
    #: Whether `generate` enforces `GenerationRequest.structured`; the server refuses such requests otherwise.
    structured_outputs: bool = False

    def __init__(self) -> None:
        self.model_lock = threading.RLock()

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        """Sample `request.n` sequences; returns them in order (len == n)."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Most tokens (prompt + completion) one sequence may have."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer whose ids the engine reads and writes."""

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        """Ids that end a completion: `chat_format.end_of_turn_ids`, the same the trainer closes a turn on."""
        return end_of_turn_ids(self.tokenizer)

    @abc.abstractmethod
    def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA adapter saved in directory `path` under `name`."""

    @abc.abstractmethod
    def has_adapter(self, name: str) -> bool:
        """Whether `name` was loaded with `load_adapter`."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release background workers; the engine must not be used afterwards."""
