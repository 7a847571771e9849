"""The built-in engine's decode loop: one batch, from its first row to its last, whatever their adapters.

`DecodeLoop` is the half of `TransformersEngine` (serve/engines/transformers_engine.py) that runs
on its worker thread while it holds the model lock; the other half queues requests and
owns the worker. At every step boundary:

1. waiting rows join while there is room (`_join`), in the order their requests reached
   `generate`, whatever their adapter: nothing overtakes a waiting row (a request of `n` rows
   with fewer free places takes those, its other rows the next ones), and each request's wait
   from `generate` to its first row joining is kept (`admission_waits`). A request's adapter
   is resolved when its first row joins (serve/engines/adapter_versions.py: `adapter=None` is the
   live policy version *now*; its `n` rows all take it) and held by each row until it ends,
   so a row never sees its weights change and no version it uses is unloaded;
2. every row samples one token (`_step`): grammar masks first (serve/structured.py),
   then one batched draw on the device and one host transfer;
3. each row records its token (handing it over at once when its request streams:
   `Pending.on_token`) and checks its ends (end-of-turn or stop ids, stop
   strings, `max_tokens`, a grammar that allows nothing); a finished row leaves the batch
   and its request is answered when its last row is done; a row whose caller left, or
   whose request failed, leaves too;
4. the rows that remain run their next forward.

**Adapters in one forward.** When every row of a forward runs one adapter, the model runs
it as its active adapter (`_enter`: peft's `set_adapter`, or `disable_adapter` for the base
weights), with merged weights when enabled (serve/engines/merged_lora.py) and a CUDA graph when the
batch has one (serve/engines/static_batch.py): the plain, fastest path. When rows of several
adapters (or the base weights) share a forward, it passes peft's `adapter_names`, one per
row ("mixed adapter batches": each LoRA layer runs the base matmul for all rows, then each
adapter's A and B on its own rows); merged weights and graphs are left for that forward.
A row's logits are the same either way (tests/test_adapter_versions.py). A newcomers'
prefill never switches the running rows' mode: it runs mixed unless the batch is empty.
On the engine's own serving copy (`serve_copy`, what a training session serves) the mode
stays entered after a batch, so the next batch of the same adapter, the usual case, switches
nothing: peft's `set_adapter` walks every module, and switching in and back out cost a lone
request on the tiny model about as much as its forward. On a model someone else holds (the
trainer's, or a caller's) the mode is left after every batch, so its active adapter and its
tensors are its own between batches; on any model, before adapters are loaded or unloaded.

**In-flight updates** (`in_flight_updates`, ART's `rollout_weight_update_mode="in_flight_lora"`).
Point 1's rule then has one exception: when `set_live_weights` makes a new version live (a task
run at a step boundary), every running or waiting row whose request asked for the live weights
(`adapter=None`) moves to it before the next token (`_follow_live`), without leaving the batch:
its cache is recomputed under the new version (one prefill of its prompt and the tokens it has
sampled, like a newcomer's, with its sampling counter kept so a seeded row draws the same
uniforms), so each token is sampled from exactly one version's distribution over the whole
sequence, and the record's logprob is that version's (a cache kept from the old version would
make later tokens' distributions neither version's). Each row keeps where each version began
(`version_starts`); its result carries them as `policy_token_spans` (serve/engines/base.py). Rows that
named an adapter (`name@step`) keep it. Not for an MoE model (the engine refuses): its routing
record would mix the versions.

The batch ends when no row is left and no waiting row can join. Around it: eval mode (on a
model shared with the trainer, with every module's mode and `requires_grad` restored
afterwards, artrl/models/adapter_switch.py; a model the engine has to itself just stays in eval:
`_serving_mode`), the serving attention (serve/engines/attention_switch.py), inference mode.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from ...models.adapter_switch import preserved_training_state
from .adapter_versions import PEFT_BASE, AdapterVersions
from .attention_switch import attention_for_serving
from .decode_batch import DecodeBatch
from ..errors import EngineClosedError
from .base import GenerationRequest, GenerationResult
from .sampling import mask_logits
from .static_batch import SlotCache, StaticDecodeBatch, StaticStep
from ..structured import CompiledGrammar, RowGrammar, bitmask_words

logger = logging.getLogger(__name__)

# How many trailing tokens to decode, per character of the longest stop string, when
# checking whether a stop string was just completed (a token can be a partial
# UTF-8 byte sequence that decodes to no character at all).
_STOP_WINDOW_TOKENS_PER_CHAR = 4


@dataclass
class Pending:
    """A queued `generate` call and the future its caller awaits."""

    request: GenerationRequest
    future: concurrent.futures.Future
    abandoned: bool = False  # the caller stopped waiting (e.g. the HTTP client disconnected)
    grammar: CompiledGrammar | None = None  # request.structured, compiled
    results: list[GenerationResult | None] = field(default_factory=list)  # one per sample, as rows finish
    remaining: int = 0  # rows not finished yet
    on_token: Callable[[int, int, float, list[tuple[int, float]] | None], None] | None = None  # streaming
    queued_at: float = field(default_factory=time.monotonic)  # when `generate` queued it

    @property
    def over(self) -> bool:
        """Answered, failed, or its caller left: its rows need no more work."""
        return self.future.done() or self.abandoned


@dataclass
class DecodeRow:
    """One sequence being sampled: request `pending`, sample number `sample`."""

    pending: Pending
    sample: int
    key: int  # sampling key (serve/sampling.row_key)
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    grammar: RowGrammar | None = None  # this row's grammar state, when the request is structured
    adapter: str | None = None  # the adapter it runs, resolved when it joins (adapter_versions.resolve)
    version: int | None = None  # the policy version (training step) that adapter holds, if known
    held: bool = False  # it holds `adapter` (released when it leaves)
    # in-flight updates: (index of the first token, version, adapter) each time the row took a version
    version_starts: list[tuple[int, int | None, str | None]] = field(default_factory=list)
    # MoE: [moe layers, top_k] expert ids of each token fed back in (models/moe.py); None once a step had none
    routing: list[torch.Tensor] | None = field(default_factory=list)
    # MoE: [moe layers, top_k] the experts of the prompt's last position in the prefill (its output is the first
    # sampled token's distribution); None when the prefill recorded none
    prompt_routing: torch.Tensor | None = None

    @property
    def request(self) -> GenerationRequest:
        return self.pending.request


@dataclass
class EngineTask:
    """Work on the engine's model (load or unload an adapter) the decode worker runs at a step boundary."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


#: `DecodeLoop._entered` values besides an adapter name: nothing switched in, or a mixed-adapter forward.
NOTHING_ENTERED, _MIXED = object(), object()


class DecodeLoop:
    """The decode-loop half of `TransformersEngine`; the engine sets every attribute used here."""

    _model: Any
    _versions: AdapterVersions
    _entered: Any
    _mode: contextlib.ExitStack | None
    _tokenizer: Any
    _vocab_size: int
    _cache_kwarg: str
    _pad_id: int
    _closed: bool
    shares_trainer_weights: bool
    serve_copy: bool
    _stopping: bool
    _merger: Any
    _attn_implementation: str | None
    static_cache: bool
    static_cache_len: int
    cuda_graphs: bool
    _static_step: StaticStep | None
    _routing: Any  # models/moe.RoutingRecorder of an MoE model, else None
    vision: Any  # models/vision.VisionInputs of a vision-language model, else None
    max_batch_size: int
    batches_served: int
    rows_served: int
    rows_abandoned: int
    decode_steps: int
    admission_waits: collections.deque[float]
    requests_admitted: int
    in_flight_updates: bool
    rows_updated_in_flight: int
    _live_changed: bool  # set_live_weights made a new version live: rows that follow it move (in-flight mode)

    def _drain(self, waiting: collections.deque[DecodeRow]) -> None:  # the engine's: takes what is queued
        raise NotImplementedError

    def _skip_over(self, waiting: collections.deque[DecodeRow]) -> None:
        """Drop waiting rows whose request needs nothing more (failed, or its caller left)."""
        if any(row.pending.over for row in waiting):
            self._release([row for row in waiting if row.pending.over])
            kept = [row for row in waiting if not row.pending.over]
            waiting.clear()
            waiting.extend(kept)

    def _fail(self, pending: Pending, error: BaseException) -> None:
        if not pending.future.done():
            pending.future.set_exception(error)

    def _finish(self, row: DecodeRow) -> None:
        """Record a finished row; answer its request when it was the last."""
        pending = row.pending
        self.rows_served += 1
        pending.results[row.sample] = GenerationResult(
            token_ids=row.token_ids, logprobs=row.logprobs,
            top_logprobs=row.top_logprobs if row.request.top_logprobs > 0 else None,
            finish_reason=row.finish_reason or "length",  # type: ignore[arg-type]
            policy_version=row.version_starts[0][1] if row.version_starts else row.version,
            policy_token_spans=_spans(row) if self.in_flight_updates else None,
            routed_experts=self._routing_record(row),
            prompt_routed_experts=row.prompt_routing.cpu() if row.prompt_routing is not None else None)
        pending.remaining -= 1
        if pending.remaining == 0 and not pending.future.done():
            pending.future.set_result(list(pending.results))

    def _routing_record(self, row: DecodeRow) -> torch.Tensor | None:
        """[tokens, moe layers, top_k] int16 on the host: each sampled token's experts when it was fed back in,
        -1 for the last one (never fed); None without a recorder or when a step recorded nothing."""
        if self._routing is None or row.routing is None or len(row.routing) != len(row.token_ids) - 1:
            return None
        layers, k = len(self._routing.routers), self._routing.routers[0][1].top_k if self._routing.routers else 0
        fed = torch.stack(row.routing).cpu() if row.routing else torch.empty((0, layers, k), dtype=torch.int16)
        return torch.cat([fed, torch.full((1, layers, k), -1, dtype=torch.int16)])

    def _run(self, waiting: collections.deque[DecodeRow]) -> None:
        """Decode one batch from the first waiting row, taking in newcomers of any adapter, until it drains."""
        device = next(self._model.parameters()).device
        self.batches_served += 1
        static = self.static_cache and self._fits(waiting[0])
        batch = DecodeBatch(self._model, self._cache_kwarg, self._pad_id, device, vision=self.vision)
        attention = "sdpa" if static else self._attn_implementation  # the static step's 4-D mask needs sdpa
        try:
            with self._serving_mode(), attention_for_serving(self._model, attention), torch.inference_mode():
                try:
                    if static:
                        batch = StaticDecodeBatch(self._model, self._cache_kwarg, self._pad_id, device,
                                                  self._slot_step(device), graph=self.cuda_graphs)
                    while True:
                        if not self._stopping:
                            self._drain(waiting)
                        self._skip_over(waiting)
                        if self._live_changed:
                            self._follow_live(batch, waiting)
                        self._join(batch, waiting)
                        if not batch.rows:
                            break
                        if self._closed:
                            raise EngineClosedError(
                                f"the inference engine was closed while decoding {len(batch)} rows")
                        self._step(batch)
                finally:
                    if not self.serve_copy:  # a model others hold gets its own adapter and tensors back
                        self._leave_mode()
        except Exception as error:
            self._leave_mode()  # whatever the failed batch had switched in
            if isinstance(error, EngineClosedError):
                logger.debug("%s", error)  # closed mid-decode: each request is told
            else:
                logger.exception("Decoding %d rows (adapters %s) failed", len(batch),
                                 sorted({str(r.adapter) for r in batch.rows}))
            for row in batch.rows:
                self._fail(row.pending, error)
        finally:
            self._release(batch.rows)
        logger.debug("Batch %d done", self.batches_served)

    def _serving_mode(self) -> contextlib.AbstractContextManager:
        """Eval mode for a batch. A model the trainer shares may be in train mode and have any `requires_grad`:
        every module's mode and flag is saved and restored around the batch (a walk of the model: 0.1-0.2 ms on
        the tiny model, paid by every lone request). A model the engine has to itself (a serving copy, or a
        model nobody trains) stays in eval: the engine put it there, adapters it loads come in eval
        (peft's `load_adapter` leaves a frozen adapter in eval), and only a caller's `train()` on the whole model is undone here."""
        if self.shares_trainer_weights:
            return preserved_training_state(self._model, eval_mode=True)
        if self._model.training:
            self._model.eval()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ adapters
    def _release(self, rows: list[DecodeRow]) -> None:
        for row in rows:
            if row.held:
                self._versions.release(row.adapter)
                row.held = False

    def _leave_mode(self) -> None:
        """Undo `_enter` (merged weights, the switched adapter); the next forward enters what it needs. Called
        before adapters are loaded or unloaded, after a failed batch, and after every batch unless the engine
        decodes its own serving copy, which keeps its mode between batches (module docstring)."""
        mode, self._mode, self._entered = self._mode, None, NOTHING_ENTERED
        if mode is not None:
            mode.close()

    def _enter(self, target: Any) -> None:
        """Make the model run `target` for every row: an adapter name, PEFT_BASE, None (a model without
        adapters), or _MIXED (nothing switched: the forward passes `adapter_names`)."""
        if target is self._entered or (isinstance(target, str) and target == self._entered):
            return
        self._leave_mode()
        mode = contextlib.ExitStack()
        try:
            if target == PEFT_BASE:
                mode.enter_context(self._model.disable_adapter())
            elif isinstance(target, str):
                mode.enter_context(_active_adapter(self._model, target))
                if self._merger is not None:
                    mode.enter_context(self._merger.merged_live_adapter())
        except BaseException:
            mode.close()
            raise
        self._mode, self._entered = mode, target

    def _adapter_names(self, adapters: list[str | None], *, switch: bool) -> list[str] | None:
        """Set the model up for a forward whose rows run `adapters`; returns peft's `adapter_names` for it, or
        None when the model runs one adapter for all (switched to it only when `switch`)."""
        distinct = set(adapters)
        if len(distinct) == 1:
            only = adapters[0]
            if switch or self._entered is NOTHING_ENTERED or only == self._entered:
                self._enter(only)
                return None
        self._enter(_MIXED)
        return [PEFT_BASE if a is None else a for a in adapters]

    def _graph_key(self) -> Any:
        """What a CUDA graph of the current single-adapter mode computes with (see StaticStep.run)."""
        if self._entered is _MIXED or self._entered is NOTHING_ENTERED:
            return None
        return ("adapter", self._entered, self._versions.generation)  # a reloaded name has new tensors

    def _join(self, batch: DecodeBatch, waiting: collections.deque[DecodeRow]) -> None:
        """Prefill the waiting rows that fit, first come first served, and add them to `batch`."""
        if not waiting or self._closed or not batch.can_join:
            return
        newcomers: list[DecodeRow] = []
        static = isinstance(batch, StaticDecodeBatch)
        while waiting and len(batch) + len(newcomers) < self.max_batch_size and \
                (not static or self._fits(waiting[0])):
            row = waiting.popleft()
            if not row.held:  # the request's first row to join: all its rows run what it resolves to now
                self.requests_admitted += 1
                self.admission_waits.append(time.monotonic() - row.pending.queued_at)
                try:
                    adapter, version = self._versions.resolve(row.request.adapter)
                except Exception as error:  # its adapter was unloaded since the request was checked
                    self._fail(row.pending, error)
                    continue
                for sibling in (row, *(r for r in waiting if r.pending is row.pending)):
                    sibling.adapter, sibling.version, sibling.held = adapter, version, True
                    sibling.version_starts = [(0, version, adapter)]
                    self._versions.hold(adapter)
            newcomers.append(row)
        if not newcomers:
            return
        prompts: list[list[int]] = []
        prompt_adapters: list[str | None] = []
        prompt_images: list[list[Any]] = []
        prompt_of: dict[int, int] = {}
        for row in newcomers:  # the n samples of one request share one prefilled prompt (and its adapter)
            if id(row.pending) not in prompt_of:
                prompt_of[id(row.pending)] = len(prompts)
                prompts.append(row.request.prompt_ids)
                prompt_adapters.append(row.adapter)
                prompt_images.append(row.request.images)
        try:
            names = self._adapter_names(prompt_adapters, switch=not batch.rows)
            if self._routing is not None:
                self._routing.clear()
            batch.admit(newcomers, prompts, [prompt_of[id(r.pending)] for r in newcomers],
                        [r.key for r in newcomers], [r.request.temperature for r in newcomers],
                        [r.request.top_p for r in newcomers],
                        {"adapter_names": names} if names is not None else None,
                        images=prompt_images if any(prompt_images) else None)
            if self._routing is not None:
                self._record_prompt_routing(newcomers, [prompt_of[id(r.pending)] for r in newcomers], len(prompts))
        except Exception as error:
            for row in newcomers:  # they never joined: `_run` fails the batch's own rows
                self._fail(row.pending, error)
            self._release(newcomers)
            raise

    def _follow_live(self, batch: DecodeBatch, waiting: collections.deque[DecodeRow]) -> None:
        """In-flight updates: move every row that asked for the live weights to the version live now (module
        docstring). A waiting row that holds the old version just takes the new one; a decoding row leaves the
        batch and joins again with its cache recomputed under the new version."""
        self._live_changed = False
        if not self.in_flight_updates:
            return
        adapter, version = self._versions.resolve(None)

        def follows(row: DecodeRow) -> bool:
            return row.held and row.request.adapter is None and row.adapter != adapter

        def move(row: DecodeRow) -> None:
            self._versions.release(row.adapter)
            row.adapter, row.version = adapter, version
            self._versions.hold(adapter)
            start = len(row.token_ids)
            if row.version_starts and row.version_starts[-1][0] == start:
                row.version_starts[-1] = (start, version, adapter)  # no token sampled by the one it replaces
            else:
                row.version_starts.append((start, version, adapter))

        for row in waiting:
            if follows(row):
                move(row)
        # a row nobody reads any more leaves at the next step (`_step`): no prefill for it
        moving = [i for i, row in enumerate(batch.rows) if follows(row) and not row.pending.over]
        if not moving:
            return
        rows = [batch.rows[i] for i in moving]
        gone = set(moving)
        batch.keep([i for i in range(len(batch.rows)) if i not in gone])
        for row in rows:
            move(row)
        self.rows_updated_in_flight += len(rows)
        try:
            if batch.rows and not batch.can_join:
                raise RuntimeError("an in-flight adapter update cannot recompute the cache of a running row: this "
                                   "model's cache layers cannot be merged into a running batch (a sliding window)")
            names = self._adapter_names([adapter] * len(rows), switch=not batch.rows)
            images = [row.request.images for row in rows]
            batch.admit(rows, [row.request.prompt_ids + row.token_ids for row in rows], list(range(len(rows))),
                        [r.key for r in rows], [r.request.temperature for r in rows], [r.request.top_p for r in rows],
                        {"adapter_names": names} if names is not None else None,
                        images=images if any(images) else None, first_counters=[len(r.token_ids) for r in rows])
        except Exception as error:
            for row in rows:  # out of the batch: `_run` fails the batch's own rows
                self._fail(row.pending, error)
            self._release(rows)
            raise

    def _record_prompt_routing(self, rows: list[DecodeRow], prompt_of_row: list[int], prompts: int) -> None:
        """Each row's `prompt_routing` from the prefill that just ran: the experts of its prompt's last position
        (prompts are left-padded to one width, so that is each prompt's last column)."""
        latest = self._routing.latest  # [moe layers, prompts x width, top_k], or None
        if latest is None or latest.shape[1] % prompts:
            return
        width = latest.shape[1] // prompts
        for row, p in zip(rows, prompt_of_row):
            row.prompt_routing = latest[:, p * width + width - 1, :]

    def _step(self, batch: DecodeBatch) -> None:
        """Sample one token for every row, record it, let finished rows leave, and run the next forward."""
        rows = batch.rows
        constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
        assert batch.logits is not None
        allowed = self._grammar_masked(batch.logits, rows, constrained) if constrained else None  # [batch, vocab]
        k = max(row.request.top_logprobs for row in rows)
        records = batch.sample(allowed, k)
        self.decode_steps += 1
        kept: list[int] = []
        for i, (row, record) in enumerate(zip(rows, records)):
            if row.pending.abandoned:
                self.rows_abandoned += 1  # nobody reads it; stop spending steps on the row
                continue
            if row.pending.future.done():  # its request failed elsewhere
                continue
            token = int(record[0])
            row.token_ids.append(token)
            row.logprobs.append(record[1])
            n_top = row.request.top_logprobs
            if n_top > 0:
                row.top_logprobs.append([(int(t), v) for t, v in zip(record[2:2 + n_top], record[2 + k:2 + k + n_top])])
            if row.pending.on_token is not None:  # a streamed request: hand the token over as it is taken
                row.pending.on_token(row.sample, token, record[1], row.top_logprobs[-1] if n_top > 0 else None)
            if row.grammar is not None and not row.grammar.accept(token):
                # only when the grammar allowed no token of the vocabulary at all
                logger.warning("A structured row sampled a token its grammar forbids (%s); ending it.",
                               row.grammar.error)
                row.finish_reason = "length"
            elif token in row.stop_ids or self._completes_stop_string(row):
                row.finish_reason = "stop"
            elif len(row.token_ids) >= row.request.max_tokens:
                row.finish_reason = "length"
            if row.finish_reason is not None:
                self._finish(row)
            else:
                kept.append(i)
        kept_set = set(kept)
        self._release([row for i, row in enumerate(rows) if i not in kept_set])
        batch.keep(kept)
        if batch.rows:
            names = self._adapter_names([row.adapter for row in batch.rows], switch=True)
            if self._routing is not None:
                self._routing.clear()
            batch.advance(names, self._graph_key())
            if self._routing is not None:  # the experts each row's fed token took, [moe layers, rows, top_k]
                latest = self._routing.latest
                for i, row in enumerate(batch.rows):
                    if row.routing is not None:
                        if latest is None:
                            row.routing = None  # a replayed graph runs no hook: no record for this row
                        else:
                            row.routing.append(latest[:, i, :])

    def _fits(self, row: DecodeRow) -> bool:
        """Whether `row` fits a static cache slot (prompt + max_tokens within its columns; no images)."""
        return not row.request.images and \
            len(row.request.prompt_ids) + row.request.max_tokens <= self.static_cache_len

    def _slot_step(self, device: torch.device) -> StaticStep:
        """The static cache and its decode step (allocated at the first static batch, kept for the engine's life)."""
        if self._static_step is None:
            probe = DynamicCache(config=self._model.config)  # one token through the model: each layer's KV shape
            self._model(input_ids=torch.full((1, 1), self._pad_id, device=device), use_cache=True,
                        **{self._cache_kwarg: probe})
            cache = SlotCache(probe, slots=self.max_batch_size, length=self.static_cache_len)
            self._static_step = StaticStep(self._model, self._cache_kwarg, cache, self._pad_id)
        return self._static_step

    def _grammar_masked(self, logits: torch.Tensor, rows: list[DecodeRow], constrained: list[int]) -> torch.Tensor:
        """`logits` with what each constrained row's grammar forbids set to -inf (other rows unchanged)."""
        bitmask = torch.empty((len(constrained), bitmask_words(self._vocab_size)), dtype=torch.int32)  # [rows, words]
        for k, i in enumerate(constrained):
            grammar = rows[i].grammar
            assert grammar is not None
            grammar.fill_bitmask(bitmask[k])
        index = torch.tensor(constrained, dtype=torch.long, device=logits.device)  # [rows]
        return mask_logits(logits, bitmask, index)

    def _completes_stop_string(self, row: DecodeRow) -> bool:
        stops = row.request.stop_strings
        if not stops:
            return False
        window = _STOP_WINDOW_TOKENS_PER_CHAR * max(len(s) for s in stops) + 1
        tail = self._tokenizer.decode(row.token_ids[-window:], skip_special_tokens=False)
        return any(s and s in tail for s in stops)


def _spans(row: DecodeRow) -> list[tuple[int, int, int | None, str | None]]:
    """`(start, end, version, adapter)` of each run of the row's tokens that one version sampled, in order."""
    starts = [(start, version, adapter) for start, version, adapter in row.version_starts
              if start < len(row.token_ids)]
    ends = [start for start, _, _ in starts[1:]] + [len(row.token_ids)]
    return [(start, end, version, adapter) for (start, version, adapter), end in zip(starts, ends)]


@contextlib.contextmanager
def _active_adapter(model: Any, adapter: str) -> Iterator[None]:
    """`adapter` as the peft model's active adapter inside; the previous one restored on exit."""
    previous = model.active_adapter
    if previous == adapter:
        yield
        return
    model.set_adapter(adapter, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(previous, inference_mode=True)
