"""artrl's grammars inside vLLM: a vLLM logits processor that holds constrained rows to their grammar.

The vLLM engine serves `GenerationRequest.structured` with this processor, not with vLLM's own
structured outputs (`SamplingParams.structured_outputs`), because of where vLLM 0.32 applies the
mask. Its model runner applies the structured-output bitmask to the logits in place
(`GPUModelRunner.sample_tokens` -> `apply_grammar_bitmask`, which the CPU runner inherits) before
the sampler takes `raw_logprobs` from them, so the logprobs vLLM reports for a constrained row
are those of the masked distribution: each is the raw logprob minus the log of the probability
mass the grammar allowed (up to ~10 nats off on the untrained tiny model). The token record
needs the raw ones (serve/engines/base.py, point 1). Scoring the reply again is no way out either:
`prompt_logprobs` with LoRA enabled kills vLLM 0.32's CPU engine (its LoRA logits layer is
mapped per sequence, prompt logprobs come per token) and, on a GPU, leave out an adapter's
lm_head delta (vLLM issues 29955 and 51594); one scoring request per sampled token costs more
than the sampling.

vLLM's sampler takes the raw logprobs first and applies logits processors after
(`Sampler.forward`: raw logprobs, then allowed ids, bad words, non-argmax-invariant processors,
penalties, temperature, top-p), which is the built-in engine's order: raw logprobs, then the
grammar's mask, then temperature and top-p. So:

1. The engine compiles `request.structured` in its own process (`GrammarCompiler`, the checks and
   the 400 of the built-in engine) and passes the grammar's Lark text and its end-of-turn ids in
   `SamplingParams.extra_args[GRAMMAR_ARG]`.
2. `GrammarLogitsProcessor` (loaded in vLLM's worker through the `logits_processors` engine
   argument) compiles each distinct text once with the same `GrammarCompiler` on the same
   tokenizer files, keeps one matcher per running row (a row vLLM preempts and resumes starts a
   new matcher and is fed its tokens again), feeds it the row's new output ids each step and sets
   the logits of what the grammar forbids to -inf (serve/sampling.mask_logits). Rows without a
   grammar are not touched; a step with no constrained row does nothing.
3. Nothing here may raise into vLLM's step (that would end vLLM's engine): a grammar that fails
   to compile in the worker (the engine checked it, so only a mismatch between the two processes
   would) or a sampled token the grammar refuses leaves that row allowed only its end-of-turn ids,
   with an error in the log, as the built-in engine ends such a row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .sampling import mask_logits
from ..structured import GrammarCompiler, RowGrammar, bitmask_words

if TYPE_CHECKING:
    from vllm.v1.sample.logits_processor import BatchUpdate

try:
    from vllm.v1.sample.logits_processor import LogitsProcessor
except ImportError:  # vLLM is not installed: nothing loads the processor then, and the module still imports
    LogitsProcessor = object  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

#: The `SamplingParams.extra_args` key a request's grammar travels under (vllm_engine.py sets it; vllm_args.py names
#: this processor to vLLM by its module path, so this module imports neither of them).
GRAMMAR_ARG = "artrl_grammar"


class _Row:
    """One running row's grammar: its matcher (None once it failed), the output ids it has consumed."""

    def __init__(self, grammar: RowGrammar | None, output_ids: list[int], end_ids: Sequence[int]) -> None:
        self.grammar = grammar
        self.output_ids = output_ids  # vLLM's own list for this row, grown in place as tokens are sampled
        self.end_ids = list(end_ids)
        self.consumed = 0

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Advance past the tokens sampled since the last step, then write what may come next into `row`."""
        if self.grammar is not None:
            new = self.output_ids[self.consumed:]
            for token in new:
                if token < 0:  # a placeholder of vLLM's async scheduling, not yet filled in
                    break
                self.consumed += 1
                if not self.grammar.accept(token):
                    logger.error("A constrained row sampled token %d, which its grammar forbids (%s); ending it.",
                                 token, self.grammar.error)
                    self.grammar = None
                    break
        if self.grammar is not None:
            self.grammar.fill_bitmask(row)
            return
        row.zero_()
        for token in self.end_ids:
            row[token // 32] |= _bit(token % 32)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a Python int with int32's sign (bit 31 is the sign bit)."""
    return (1 << j) - (1 << 32) * (j == 31)


class GrammarLogitsProcessor(LogitsProcessor):
    """Holds rows whose `SamplingParams.extra_args` carry `GRAMMAR_ARG` to that grammar (module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        from vllm.v1.sample.logits_processor.builtin import process_dict_updates

        self._process_updates = process_dict_updates  # vLLM's bookkeeping of added, removed and moved rows
        self._model_config = vllm_config.model_config
        self._vocab_size = int(self._model_config.get_vocab_size())
        self._tokenizer: Any = None
        self._compilers: dict[tuple[int, ...], GrammarCompiler] = {}
        self._rows: dict[int, _Row] = {}  # batch index -> its grammar

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely: greedy rows need it too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self._process_updates(self._rows, batch_update, self._new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        indices = sorted(self._rows)
        bitmask = torch.empty((len(indices), bitmask_words(self._vocab_size)), dtype=torch.int32)  # [rows, words]
        for k, index in enumerate(indices):
            self._rows[index].fill_bitmask(bitmask[k])
        rows = torch.tensor(indices, dtype=torch.long, device=logits.device)  # [rows]
        return mask_logits(logits, bitmask, rows)  # [batch, vocab]

    def _new_row(self, params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
        spec = (getattr(params, "extra_args", None) or {}).get(GRAMMAR_ARG)
        if spec is None:
            return None
        end_ids = tuple(sorted(int(t) for t in spec["end_ids"]))
        try:
            grammar = self._compiler(end_ids).compile_lark(spec["grammar"]).row()
        except Exception:  # point 3: never into vLLM's step
            logger.exception("vLLM's worker could not compile a grammar the engine had compiled; the row may "
                             "only end.")
            grammar = None
        return _Row(grammar, output_ids, end_ids)

    def _compiler(self, end_ids: tuple[int, ...]) -> GrammarCompiler:
        if end_ids not in self._compilers:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                config = self._model_config
                self._tokenizer = AutoTokenizer.from_pretrained(
                    config.tokenizer, revision=config.tokenizer_revision, trust_remote_code=config.trust_remote_code)
            self._compilers[end_ids] = GrammarCompiler(self._tokenizer, self._vocab_size, end_ids)
        return self._compilers[end_ids]


__all__ = ["GrammarLogitsProcessor"]
