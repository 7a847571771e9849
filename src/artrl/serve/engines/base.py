"""The inference engine contract: what the server and the training session ask of a model runner.

An engine turns token ids into sampled token ids plus their logprobs. It knows
nothing about HTTP, chat messages or JSON; the server (`serve/http/server.py`) renders
and tokenizes prompts, and the engine only samples. What every engine promises
(tests/test_engine_contract.py checks each one):

1. **Raw logprobs.** `GenerationResult.logprobs[i]` is the model's log-softmax of the
   next-token logits at step i, taken *before* temperature and top-p reshape the
   sampling distribution. It is what a trainer computing `log_softmax(logits)` over
   the same prefix gets, so sampled and trained logprobs line up (importance ratios
   start at exactly 1 for unchanged weights). Under a grammar (`request.structured`,
   serve/structured.py) too: the grammar masks the logits that are *sampled* from, the
   logprob reported is still the unmasked one, so the sampled-vs-trained delta stays 0
   and an importance ratio is taken against the unconstrained policy, the one the
   trainer updates. (The masked distribution's logprob would be this minus the log of
   the mass the grammar allowed; nobody trains on it.)
2. **Tokens in, tokens out.** `token_ids` are the sampled ids, including the
   end-of-turn (or stop) token when generation stopped on one, so nobody re-tokenises
   text. A stop string ends a sequence with the token that completed it.
3. **One end-of-turn set.** `end_of_turn_ids` is given to the engine when it is
   built: the session computes `chat_format.end_of_turn_ids(tokenizer, model)` once and
   hands the same set to the trainer, so sampling stops on the ids the trainer closes a
   turn on.
4. **One request check.** `GenerationRequest.check` is the only place a request's
   fields are checked; every engine calls it first thing in `generate`, and the
   server turns its `InvalidRequestError` into a 400.
5. **Seeds reproduce.** The same request with the same `seed` samples the same ids.
6. **Live weights, as policy versions.** `adapter=None` serves the live weights. The
   session calls `set_live_weights(path, step)` with every checkpoint it completes
   (and once when it opens); from then on `adapter=None` samples from that
   checkpoint's adapter, policy version `step`. A sequence keeps the version it
   started on to its end (a call during a batch changes no running row), and
   `GenerationResult.policy_version` says which version sampled it (None where the
   engine cannot tell: the base weights, an adapter of unknown step). The exception is
   the built-in engine with in-flight updates (`in_flight_updates=True`, ART's
   `rollout_weight_update_mode="in_flight_lora"`): a running `adapter=None` sequence
   takes each new version at the next step boundary, and `policy_token_spans` says which
   version sampled each token.
7. **Training turns.** The session holds `training()` around a whole train call. The
   built-in engine decodes its own copy of the trainer's model and holds nothing
   there, so no request waits for a train call (an engine built to share a model its
   owner steps in place holds its model lock there); vLLM may free the device
   meanwhile (sleep mode).
8. **Images (a vision-language model's).** `GenerationRequest.images` are the prompt's images in order,
   processed (models/vision.py), their image tokens already expanded in `prompt_ids`; an engine with a
   `vision` (the model's `VisionInputs`, which the server asks it for) runs them through the vision tower at
   prefill, with the model's 3-D positions. A request with images to an engine without one is refused.
9. **Tokens as they are sampled (optional).** An engine with `streams_tokens` takes
   `generate(request, on_token=f)` and calls `f(sample, token_id, logprob, top_logprobs)`
   on the caller's event loop for every token as its row takes it (in order within a
   sample, all of them before `generate` returns; `top_logprobs` None unless asked); the
   server streams from it (serve/http/streaming.py). Without `on_token` nothing is handed over.

Two implementations: `TransformersEngine` (serve/engines/transformers_engine.py, the
built-in one) and vLLM's; `serve/engines/factory.py` picks one.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ...models import adapter_switch
from ..errors import InvalidRequestError, RequestProblem

if TYPE_CHECKING:
    from ..structured import StructuredOutput

FinishReason = Literal["stop", "length"]

TokenSink = Callable[[int, int, float, "list[tuple[int, float]] | None"], None]
"""`on_token(sample, token_id, logprob, top_logprobs)`: a sampled token handed over (module docstring, point 9)."""

#: Most `top_logprobs` one request may ask for (OpenAI's and vLLM's default limit).
MAX_TOP_LOGPROBS = 20
#: The sampling temperatures a request may ask for (OpenAI's range).
MAX_TEMPERATURE = 2.0


#: `GenerationRequest.adapter` value for the base model's own weights: every LoRA adapter switched off
#: (defined with the adapter switching it names, artrl/models/adapter_switch.py).
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
    images: list[Any] = field(default_factory=list)  # the prompt's processed images, in order (point 8)

    def check(self, *, vocab_size: int, max_model_len: int, has_adapter: Callable[[str], bool],
              vision: Any = None) -> None:
        """Raise `InvalidRequestError` listing every problem of this request (the one request check)."""
        problems: list[RequestProblem] = []

        def refuse(name: str, message: str) -> None:
            problems.append(RequestProblem(name, message))

        prompt = len(self.prompt_ids)
        if not self.prompt_ids:
            refuse("prompt_ids", "prompt_ids is empty; a request needs at least one prompt token")
        else:
            bad = next((t for t in self.prompt_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                refuse("prompt_ids", f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
        if self.n < 1:
            refuse("n", f"n must be >= 1, got {self.n}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            refuse("temperature", f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            refuse("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            refuse("top_logprobs", f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        room = max_model_len - prompt
        if self.prompt_ids and room < 1:
            refuse("prompt_ids", f"The prompt has {prompt} tokens, which leaves no room to generate within "
                   f"max_model_len={max_model_len}. Shorten the messages.")
        elif self.max_tokens < 1:
            refuse("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        elif self.max_tokens > room:
            refuse("max_tokens", f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                   f"{prompt} tokens and max_tokens={self.max_tokens} asks for more than the {room} left. "
                   "Lower max_tokens.")
        if self.adapter is not None and not has_adapter(self.adapter):
            refuse("adapter", f"adapter {self.adapter!r} is not loaded")
        if self.images and vision is None:
            refuse("images", f"the request holds {len(self.images)} images and this model has no vision tower")
        elif self.images and self.prompt_ids:
            try:
                vision.spans(self.prompt_ids, self.images, "prompt_ids")
            except ArtrlError as error:
                refuse("images", str(error))
        if problems:
            raise InvalidRequestError("; ".join(p.message for p in problems), tuple(problems))


@dataclass
class GenerationResult:
    """One sampled sequence.

    `logprobs[i]` is the raw log-softmax probability of `token_ids[i]`;
    `top_logprobs[i]` (when asked for) lists the `top_logprobs` most likely
    `(token_id, logprob)` pairs at step i, most likely first. `policy_version`: see
    the module docstring, point 6.
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: FinishReason
    #: The policy version (training step of the checkpoint) that sampled it; None when unknown (point 6). With
    #: in-flight updates, the version it started on (`policy_token_spans` has every token's).
    policy_version: int | None = None
    #: With in-flight adapter updates (docs/pipeline.md): `(start, end, version, adapter)` for each run of tokens
    #: `token_ids[start:end]` sampled by one policy version (`adapter`: the engine's name for that version's
    #: weights), in order, covering every token; None where the engine swaps no adapter under a running sequence.
    policy_token_spans: list[tuple[int, int, int | None, str | None]] | None = None
    #: A mixture-of-experts model's routing record: [len(token_ids), moe layers, top_k] expert ids (int16) each
    #: layer picked when the token was fed back in, -1 where there is none (the last token); None for a dense
    #: model or an engine that does not record it (models/moe.py).
    routed_experts: Any = None
    #: With `routed_experts`: [moe layers, top_k] the experts each layer picked at the prompt's last position (the
    #: position whose output is the first sampled token's distribution); None where the engine has none.
    prompt_routed_experts: Any = None


class InferenceEngine(abc.ABC):
    """Samples continuations of token-id prompts; see the module docstring for the contract."""

    #: Whether `generate` enforces `GenerationRequest.structured`; the server refuses such requests otherwise.
    structured_outputs: bool = False
    #: Whether `generate` takes `on_token` and hands each token over as it is sampled (module docstring, point 9).
    streams_tokens: bool = False
    #: A vision-language model's image processing (models/vision.py): the server processes a request's images
    #: with it; None for a text-only model, or an engine that takes no images (point 8).
    vision: Any = None

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        """Sample `request.n` sequences; returns them in order (len == n). Calls `request.check` first."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer whose ids the engine reads and writes."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Most tokens (prompt + completion) one sequence may have."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Prompt ids must lie in [0, vocab_size) (the model's embedding rows)."""

    @property
    @abc.abstractmethod
    def end_of_turn_ids(self) -> frozenset[int]:
        """Ids that end a completion, as given at construction (the trainer closes a turn on the same set)."""

    @abc.abstractmethod
    def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA adapter saved in directory `path` under `name` (served as `adapter=name`)."""

    @abc.abstractmethod
    def has_adapter(self, name: str) -> bool:
        """Whether requests may name `name` as their adapter (`load_adapter`ed, or `BASE_WEIGHTS`)."""

    @abc.abstractmethod
    def set_live_weights(self, path: str, step: int) -> None:
        """Serve the peft adapter saved in checkpoint directory `path` (training step `step`) for
        `adapter=None` from now on. Called by the session once when it opens (outside `training()`) and right
        after each train call's checkpoint is complete, while the session still holds `training()`."""

    def training(self) -> contextlib.AbstractContextManager[Any]:
        """Held by the session around a whole train call (default: nothing to do)."""
        return contextlib.nullcontext()

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release background workers; the engine must not be used afterwards."""

    def check(self, request: GenerationRequest) -> None:
        """`request.check` against this engine's vocabulary, context length and adapters."""
        request.check(vocab_size=self.vocab_size, max_model_len=self.max_model_len, has_adapter=self.has_adapter,
                      vision=self.vision)
