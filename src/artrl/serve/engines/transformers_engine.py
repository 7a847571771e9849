"""The default inference engine: a hand-written decode loop over a transformers model.

Runs wherever the model is (CPU or GPU) with no extra install. What it does, and
what it leaves out compared with vLLM:

1. **Continuous batching.** `generate` calls are queued; one background thread
   decodes a running batch (serve/engines/decode_batch.py) of at most `max_batch_size`
   sequences, a request of `n` counting as n rows. At every step boundary, waiting
   rows join it (prefilled, then merged into its KV cache) in arrival order while there
   is room, whatever their adapter: rows of different adapters and of the base weights
   share one forward (peft's mixed-adapter batches, serve/engines/decode_loop.py). Rows that
   finished leave at once, their request answered as soon as its last row is done:
   nobody waits for the longest row. No paged KV cache.
2. **Own decode loop, not `model.generate`,** (serve/engines/decode_loop.py) because rows of
   one batch differ in temperature, top-p, seed, stop tokens, max_tokens and adapter,
   and because we report the raw log-softmax of the logits (before temperature/top-p).
3. **Left padding that does not change the math.** Prompts are left-padded; a 2-D
   attention mask hides the padding and explicit `position_ids` (counted from each
   row's first real token) give every row the positions it would have alone, so a
   row's logprobs match an unbatched forward to float tolerance, whenever it joined.
   Sampling runs on the device with counter-based draws (serve/engines/sampling.py): a
   seeded request samples the same tokens alone or in any batch, and each step
   brings back only the sampled ids and logprobs in one transfer.
4. **Policy versions, and serving while a trainer trains** (docs/engines.md). Each
   `set_live_weights(path, step)` loads that checkpoint as a frozen adapter of its own,
   a *version* (serve/engines/adapter_versions.py); `adapter=None` resolves to the newest
   version when a row joins a batch, and the row keeps it to its end, so no sequence
   sees weights change and each result records its `policy_version`, unless built with
   `in_flight_updates=True` (ART's `rollout_weight_update_mode="in_flight_lora"`): then a
   running `adapter=None` row moves to each new version at the next step boundary, its
   cache recomputed, and records where (`policy_token_spans`; serve/engines/decode_loop.py). Old versions stay
   until `prune_versions` (never one a row uses). Adapter loads and unloads run on the
   decode worker at a step boundary (`_on_worker`), so a running batch waits one step,
   never a batch. Built with `serve_copy=True` (what a training session does), the
   engine decodes a copy of the trainer's peft model that shares its frozen base
   tensors (adapter_switch.serving_copy): the trainer's modules, adapters and hooks are
   never touched by the decode thread, `training()` holds nothing and no request waits
   for a train call. Built with `shares_trainer_weights=True` and the trainer's lock
   (a caller that steps the served model itself, without checkpoints), `training()`
   holds `model_lock`, which each batch holds from its first row to its last, and
   `adapter=None` with no version loaded serves whatever adapter is active. Two
   switches for a GPU, each on by default on CUDA only: `merge_lora` serves a batch
   whose rows all run one adapter from merged copies of the adapted weights
   (serve/engines/merged_lora.py: the copy's own parameters point at them, the shared storage
   is never written; never for quantised base weights, which would need a full-precision
   copy of each adapted weight), `attn_implementation` decodes with 'sdpa' instead of the
   trainer's attention (serve/engines/attention_switch.py).
5. **A caller that stops waiting frees its rows.** Cancelling `generate` (the server
   does when the HTTP client disconnects) cancels a queued request outright; a
   request already decoding stops taking tokens at the next step, and the batch
   ends as soon as every row is finished or abandoned.
6. **Closing stops the thread before the interpreter does.** `close()` (also run
   at interpreter exit, artrl/runtime/shutdown.py) fails the batch in flight at its next
   decode step and every queued request with `EngineClosedError`, then joins the
   worker, so no daemon thread is inside torch when Python finalises.
7. **Structured outputs by a grammar.** A request with `structured` (a JSON schema or
   tool calls, serve/structured.py) is compiled into an llguidance grammar when it
   arrives (once per distinct schema; a schema that does not compile is an
   `InvalidRequestError` before anything is queued). Each of its rows gets its own
   matcher: before every step the matcher's token bitmask sets the forbidden logits
   of that row to -inf, *then* temperature and top-p apply, and the sampled token
   advances the matcher. Rows without a grammar are not touched, and a batch with no
   grammar row does no grammar work at all. Logprobs stay the raw, unmasked ones
   (serve/engines/base.py, point 1), so the token record trains as it does unconstrained.
8. **Images.** A vision-language model's engine holds its `vision` (models/vision.py). A request's
   images (processed by the server with it) go through the vision tower when the request's prompt is
   prefilled, its image tokens take the features and the prompt gets the model's 3-D rotary positions;
   its rows then decode like any other, from the position after the prompt's last. Image rows never use
   the static cache.
9. **Tokens as they are sampled.** `generate(request, on_token=f)` hands each token to
   `f` on the caller's event loop (`loop.call_soon_threadsafe`) from the step where its
   row takes it (serve/engines/base.py, point 9); the server streams from it. A request
   without `on_token` pays one attribute check per row per step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import logging
import queue
import threading
from typing import Any

import torch

from ...runtime import shutdown
from ...models.adapter_switch import NotPeftModelError, serving_copy
from ...chat.format import end_of_turn_ids
from ...errors import ConfigError
from ...models.moe import RoutingRecorder, is_moe
from ...models.structure import config_max_length
from ...models.quantization import quantization_of
from ...runtime.once_per_run import OncePerRun
from .base import BASE_WEIGHTS, GenerationRequest, GenerationResult, InferenceEngine, TokenSink
from ..errors import EngineClosedError, InvalidRequestError
from .adapter_versions import AdapterVersions
from .attention_switch import current_attention
from .decode_loop import NOTHING_ENTERED, DecodeLoop, DecodeRow, EngineTask, Pending
from .merged_lora import LoraMerger
from .sampling import row_key
from ..structured import GrammarCompiler
from ...runtime.threads import training_threads

logger = logging.getLogger(__name__)

ADMISSION_WAITS_KEPT = 100_000
"""Admission waits the engine keeps (the newest; 800 KB at most)."""


class TransformersEngine(DecodeLoop, InferenceEngine):
    """Serve a transformers causal LM (optionally a peft `PeftModel`); see the module docstring.

    `end_ids`: the end-of-turn ids (None: `chat_format.end_of_turn_ids(tokenizer, model)`, what a
    session passes). `serve_copy`: decode a copy of peft model `model` sharing its frozen tensors, so a trainer
    may train `model` meanwhile (module docstring, point 4). `shares_trainer_weights`: the model is stepped by
    its owner in place; `model_lock` is then the owner's lock (None: a lock of the engine's own), held by
    `training()`. `merge_lora`: serve single-adapter batches from merged
    weights (serve/engines/merged_lora.py); None: on when the model is on a CUDA device. `attn_implementation`: the
    attention decode batches run with (serve/engines/attention_switch.py); None: 'sdpa' on a CUDA device, else the model's.
    `static_cache`: decode rows that fit in `static_cache_len` columns (None: min(max_model_len, 2048)) in fixed
    slots of a static KV cache (serve/engines/static_batch.py), their step replayed from a CUDA graph when `cuda_graphs`
    (None: on CUDA). `vision`: a vision-language model's image processing (models/vision.py; module docstring,
    point 8). `in_flight_updates`: a new live version replaces the old one under running `adapter=None` rows
    (module docstring, point 4; not for an MoE model).
    """

    structured_outputs = True
    streams_tokens = True

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        end_ids: frozenset[int] | None = None,
        shares_trainer_weights: bool = False,
        model_lock: Any = None,
        serve_copy: bool = False,
        merge_lora: bool | None = None,
        attn_implementation: str | None = None,
        static_cache: bool = False,
        static_cache_len: int | None = None,
        cuda_graphs: bool | None = None,
        vision: Any = None,
        in_flight_updates: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if serve_copy and shares_trainer_weights:
            raise ValueError("serve_copy=True decodes a copy of the model, shares_trainer_weights=True the model "
                             "itself; choose one")
        if serve_copy:
            model = serving_copy(model)
        elif not shares_trainer_weights:
            model.eval()  # the engine's to serve: it stays in eval (decode_loop._serving_mode)
        #: Whether the engine decodes its own copy of the given model (sharing its frozen tensors).
        self.serve_copy = serve_copy
        #: A vision-language model's image processing (models/vision.py), None for a text-only model.
        self.vision = vision
        self._model = model
        self._tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        #: CPU threads of the decode worker (torch's setting is per thread); None keeps torch's default.
        self.num_threads = num_threads
        #: Held for each batch, by `load_adapter` / `set_live_weights`, and (sharing) by the trainer.
        self.model_lock = model_lock if model_lock is not None else threading.RLock()
        self.shares_trainer_weights = shares_trainer_weights
        config = model.config
        if max_model_len is None:
            max_model_len = config_max_length(config) or 2048
        self._max_model_len = int(max_model_len)
        self._vocab_size = model.get_input_embeddings().num_embeddings
        # what ends a turn is chat_format's: the same ids the trainer closes a turn on
        self._eos_ids = frozenset(end_ids) if end_ids is not None else end_of_turn_ids(tokenizer, model)
        pad = tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._eos_ids, default=0)
        self._cache_kwarg = _cache_kwarg_name(model)
        self._versions = AdapterVersions(model)
        # an MoE model's routing record (models/moe.py): hooks on the routers of the model this engine decodes
        self._routing = RoutingRecorder(model) if is_moe(model.config) else None
        if in_flight_updates and self._routing is not None:
            raise ConfigError("rollout_weight_update_mode='in_flight_lora' is not supported for a mixture-of-experts "
                              "model: a row moved to a new version mid-sequence would carry a routing record of two "
                              "versions, which training cannot replay. Use rollout_weight_update_mode='step_lora'.")
        #: Whether a new live version replaces the old one under running rows (serve/engines/decode_loop.py).
        self.in_flight_updates = in_flight_updates
        #: Rows moved to a new version mid-sequence (in-flight updates), and whether one is waiting to move them.
        self.rows_updated_in_flight = 0
        self._live_changed = False
        self._say = OncePerRun(logger)  # a new version or adapter every step: INFO once, then DEBUG
        self._entered: Any = NOTHING_ENTERED  # the adapter mode of the batch in flight (decode_loop._enter)
        self._mode: contextlib.ExitStack | None = None
        #: The checkpoint `set_live_weights` last made the live weights: (path, step), or None.
        self.live_weights: tuple[str, int] | None = None
        self._grammars = GrammarCompiler(tokenizer, self._vocab_size, self._eos_ids)
        device = next(model.parameters()).device
        quantized = quantization_of(model)
        if merge_lora and quantized:
            raise ConfigError(f"inference_merge_lora=True: the base weights are {quantized}, and a LoRA adapter "
                              "cannot be merged into them without a full-precision copy of every adapted weight; "
                              "leave inference_merge_lora None (off for quantised weights).")
        if merge_lora is None:
            merge_lora = device.type == "cuda" and not quantized
        #: Whether the live adapter is served from merged weights (serve/engines/merged_lora.py).
        self.merge_lora = merge_lora
        # sharing the trainer's model: its optimizer may change the adapter in any way between batches
        self._merger = LoraMerger(model, rebuild="always" if shares_trainer_weights else "changed") \
            if merge_lora else None
        if self._vocab_size >= 1 << 24:  # sampled ids come back from the device as float32 (decode_batch.py)
            raise ValueError(f"vocabulary of {self._vocab_size} ids: the built-in engine serves fewer than 2**24")
        if attn_implementation is None and device.type == "cuda" and current_attention(model) != "sdpa":
            attn_implementation = "sdpa"
        #: The attention implementation decode batches switch to (None: the model's own).
        self.attn_implementation = self._attn_implementation = attn_implementation
        #: Static KV cache slots (serve/engines/static_batch.py) and CUDA graph replay of their step.
        self.static_cache = static_cache
        self.static_cache_len = min(self._max_model_len, static_cache_len or 2048)
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a model on a CUDA device; this one is on {device}")
        self.cuda_graphs = bool(static_cache and (device.type == "cuda" if cuda_graphs is None else cuda_graphs))
        self._static_step = None

        #: Batches started (counted when they start; requests joining a running batch add none) and sequences
        #: sampled so far (for logs, metrics and tests).
        self.batches_served = 0
        self.rows_served = 0
        #: Requests whose caller stopped waiting, rows cut short because of it, decode steps run.
        self.requests_abandoned = 0
        self.rows_abandoned = 0
        self.decode_steps = 0
        #: Requests whose first row joined a batch, and the seconds each of the last `ADMISSION_WAITS_KEPT` waited
        #: for that from `generate` (queued, in arrival order: decode_loop.py, point 1).
        self.requests_admitted = 0
        self.admission_waits: collections.deque[float] = collections.deque(maxlen=ADMISSION_WAITS_KEPT)
        self._pending = 0
        self._counter_lock = threading.Lock()
        self._queue: queue.Queue[Pending | EngineTask | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._worker_start_lock = threading.Lock()
        self._closed = False
        self._stopping = False  # the worker took the close sentinel

    # ------------------------------------------------------------------ interface

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model(self) -> Any:
        return self._model

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        """The ids sampling stops on (tokenizer eos, the model's generation-config eos, chat end tokens)."""
        return self._eos_ids

    @property
    def pending_requests(self) -> int:
        """Requests queued and not yet taken into a batch."""
        return self._pending

    def has_adapter(self, name: str) -> bool:
        return name in self._versions.named or name == BASE_WEIGHTS

    @property
    def live_step(self) -> int | None:
        """The policy version `adapter=None` resolves to now (None: no `set_live_weights` yet)."""
        return self._versions.live_step

    @property
    def live_adapter(self) -> str | None:
        """The peft adapter of `model` that `adapter=None` runs now (the live version's, or the adapter active
        when the engine was built; None for a model without adapters)."""
        return self._versions.resolve(None)[0]

    @property
    def loaded_versions(self) -> list[int]:
        """Steps of the policy versions loaded."""
        return sorted(self._versions.versions)

    def load_adapter(self, name: str, path: str) -> None:
        """Load a saved peft adapter under `name` (frozen; a checkpoint already loaded as a version is shared)."""
        def load() -> None:
            try:
                self._versions.load_named(name, str(path))
            except NotPeftModelError as error:
                raise InvalidRequestError(f"Cannot serve adapter {name!r}: {error}") from error

        self._on_worker(load)
        self._say("loaded", "Loaded adapter %r from %s", name, path)

    def unload_adapter(self, name: str) -> bool:
        """Unload the adapter `load_adapter` loaded as `name`; False (nothing changes) while a row uses it."""
        return bool(self._on_worker(lambda: self._versions.unload_named(name)))

    def set_live_weights(self, path: str, step: int) -> None:
        """Serve checkpoint `path` as policy version `step`: loaded as an adapter of its own (at the next step
        boundary of a running batch), the version `adapter=None` resolves to for every row that joins a batch
        from now on; rows already decoding keep theirs, unless `in_flight_updates`: then they move to it before
        their next token."""
        def add() -> None:
            self._versions.add_version(str(path), step)
            self._live_changed = self.in_flight_updates

        self._on_worker(add)
        self._say("serving", "Serving policy version %d from %s", step, path)
        self.live_weights = (str(path), step)

    def prune_versions(self, retain_steps: Any = ()) -> list[int]:
        """Unload the policy versions not in `retain_steps`, except the live one and any a row uses; returns the
        steps unloaded."""
        return list(self._on_worker(lambda: self._versions.prune(retain_steps)))

    def training(self) -> Any:
        """Sharing the trainer's model in place: its lock, so no batch runs while the weights change; else
        nothing (a serving copy, or no trainer)."""
        return self.model_lock if self.shares_trainer_weights else contextlib.nullcontext()

    def _on_worker(self, fn: Any) -> Any:
        """Run `fn` (work on the model's adapters) where no forward runs: here, when no batch is in flight (or
        on the worker itself), else on the decode worker at its next step boundary; returns its result."""
        if self._closed:
            raise EngineClosedError("the inference engine was closed")
        if self.model_lock.acquire(blocking=False):
            try:
                return self._run_task(fn)
            finally:
                self.model_lock.release()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._ensure_worker()
        self._queue.put(EngineTask(fn, future))
        if self._closed:  # closed meanwhile: the worker may have left before taking it
            self._fail_queued()
        return future.result()

    def _run_task(self, fn: Any) -> Any:
        self._leave_mode()  # no adapter switched in, nothing merged, while adapters come and go
        with torch.inference_mode(False):
            return fn()

    async def generate(self, request: GenerationRequest, on_token: TokenSink | None = None
                       ) -> list[GenerationResult]:
        """Sample `request` (serve/engines/base.py); `on_token` gets each token on this event loop as its row takes it."""
        if self._closed:
            raise EngineClosedError("TransformersEngine.generate called after close()")
        self.check(request)
        grammar = None
        if request.structured is not None:  # compiling a new schema is CPU work: off the event loop
            grammar = self._grammars.cached(request.structured) or await asyncio.to_thread(
                self._grammars.compile, request.structured)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._ensure_worker()
        with self._counter_lock:
            self._pending += 1
        pending = Pending(request, future, grammar=grammar)
        if on_token is not None:
            pending.on_token = _on_loop(asyncio.get_running_loop(), on_token, pending)
        self._queue.put(pending)
        try:
            # cancelling this await cancels `future` too while it is still queued
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            pending.abandoned = True  # already decoding: its rows stop at the next step
            with self._counter_lock:
                self.requests_abandoned += 1
            raise

    def close(self, timeout: float = 60.0) -> None:
        """Fail generation in flight and queued, stop and join the decode worker (idempotent)."""
        self._closed = True
        worker = self._worker
        if worker is not None:
            self._queue.put(None)
            worker.join(timeout=timeout)
            if worker.is_alive():
                logger.warning("the decode worker did not stop within %.0fs", timeout)
            else:
                self._worker = None
        self._fail_queued()
        shutdown.untrack(self, shutdown.ENGINES)

    def shutdown_at_exit(self) -> None:
        self.close(timeout=30.0)

    def _fail_queued(self) -> None:
        """Requests that reached the queue after the worker left get an error instead of waiting forever."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineClosedError("the inference engine was closed"))

    # ------------------------------------------------------------------ batching

    def _ensure_worker(self) -> None:
        with self._worker_start_lock:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._worker_loop, name="artrl-transformers-engine", daemon=True
                )
                self._worker.start()
                shutdown.track(self, shutdown.ENGINES)

    def _worker_loop(self) -> None:
        if self.num_threads:
            # Set from this worker thread: OpenMP keeps the count per thread, so the trainer's thread keeps
            # its own (checked by test_decode_threads_leave_the_caller_alone). Threads started later take this
            # count at their first parallel op, so the process's own is read first, for train calls to set
            # in theirs (artrl/runtime/threads.py).
            training_threads()
            torch.set_num_threads(self.num_threads)
        waiting: collections.deque[DecodeRow] = collections.deque()  # rows taken from the queue, not decoding
        try:
            while not self._stopping:
                if not waiting:
                    first = self._queue.get()
                    if first is None:
                        return
                else:
                    first = None
                # Take the lock before draining the queue: whatever queued up while a
                # trainer held the device joins this batch instead of waiting for the next.
                with self.model_lock:
                    if first is not None:
                        self._take(first, waiting)
                    self._drain(waiting)
                    self._skip_over(waiting)
                    if waiting and not self._stopping:
                        self._run(waiting)
        finally:
            error = EngineClosedError("the inference engine was closed")
            for row in waiting:
                self._fail(row.pending, error)

    def _take(self, item: Pending | EngineTask | None, waiting: collections.deque[DecodeRow]) -> None:
        """A queued request becomes waiting rows; a task runs now; the close sentinel stops the worker."""
        if item is None:
            self._stopping = True
            return
        if isinstance(item, EngineTask):
            if item.future.set_running_or_notify_cancel():
                try:
                    item.future.set_result(self._run_task(item.fn))
                except BaseException as error:  # the caller of _on_worker gets it
                    item.future.set_exception(error)
            return
        with self._counter_lock:
            self._pending -= 1
        if not item.future.set_running_or_notify_cancel():  # its caller left while it was queued
            return
        request = item.request
        item.results, item.remaining = [None] * request.n, request.n
        stop_ids = frozenset(request.stop_token_ids) | self._eos_ids
        for sample in range(request.n):
            grammar = item.grammar.row() if item.grammar is not None else None
            waiting.append(DecodeRow(item, sample, row_key(request.seed, sample), stop_ids, grammar=grammar))

    def _drain(self, waiting: collections.deque[DecodeRow]) -> None:
        while not self._stopping:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._take(item, waiting)


def _on_loop(loop: asyncio.AbstractEventLoop, on_token: TokenSink, pending: Pending) -> TokenSink:
    """`on_token` as the decode worker calls it: scheduled on the caller's `loop` (before the request's answer,
    which the worker sets later); a loop that is gone abandons the request."""

    def hand_over(sample: int, token: int, logprob: float, top: list[tuple[int, float]] | None) -> None:
        try:
            loop.call_soon_threadsafe(on_token, sample, token, logprob, top)
        except RuntimeError:  # the caller's loop closed: nobody reads the rest
            pending.abandoned = True

    return hand_over


def _cache_kwarg_name(model: Any) -> str:
    """transformers 5 renamed the forward's `past_key_values` to `cache`; use what the model takes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
