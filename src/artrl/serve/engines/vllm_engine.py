"""The vLLM inference engine: artrl's engine interface over vLLM's `AsyncLLM`.

Chosen with `InternalModelConfig(inference_engine="vllm")` (docs/engines.md). The server, the
token record and the trainer do not know it from the built-in engine. What it does:

1. **Where things run.** vLLM's `AsyncLLM` is an asyncio object: its output handler is a task
   on the loop that created it, and its model runs in an engine-core process that vLLM
   spawns (AsyncLLM always does; its in-process mode exists only for the synchronous
   engine). artrl calls an engine from two threads at once: the server's uvicorn loop
   (`generate`) and the trainer's thread (`set_live_weights`, `training`). So the engine
   owns one thread running one event loop, where `AsyncLLM` is built and lives; every call
   is handed to that loop with `asyncio.run_coroutine_threadsafe`, and all of the engine's
   own state (adapters, live weights, the batch gate) is touched only there, without locks.

       uvicorn loop / trainer thread --run_coroutine_threadsafe--> engine loop thread (AsyncLLM)
                                                           --ZMQ--> vLLM engine-core process(es)

2. **The caller's process is left as it was** (DESIGN.md 5). vLLM seeds the RNGs of the
   process that runs its model; here that is the engine-core process, never the caller's
   (the torch, `random` and numpy states are unchanged, tests/test_vllm_engine.py). Importing
   vLLM and starting its engine set environment variables in the calling process (the CPU
   build sets `LD_PRELOAD`, `LD_LIBRARY_PATH`, `VLLM_WORKER_MULTIPROC_METHOD=spawn` and
   others, which every later subprocess of the program would inherit); they are restored as
   soon as the engine-core process has started with them (vLLM's processes set their own
   again when they import it), and so is torch's thread count.
3. **Raw logprobs, tokens in and out.** vLLM runs with `logprobs_mode="raw_logprobs"` (the
   log-softmax of the logits before temperature and top-p, serve/engines/base.py) and is given
   token ids (`TokensPrompt`); every result carries the sampled ids, a final end-of-turn
   id included, and their logprobs. Sampling stops on exactly the engine's
   `end_of_turn_ids` plus the request's stop ids (`ignore_eos`, so vLLM adds none of its
   own), and on stop strings with artrl's rule: vLLM keeps the token that completes the
   string as the last one and drops any after it (`include_stop_str_in_output`, special
   tokens decoded as text, as chat_format does).
4. **Weights as LoRA adapters.** vLLM holds the base model; the trained weights are peft
   adapters loaded with `LoRARequest`. `set_live_weights(path, step)` loads a checkpoint as a
   new adapter and makes it what `adapter=None` serves; requests already running keep the
   adapter they started with, and a superseded live adapter is removed from vLLM once its
   last request ends. `load_adapter(name, path)` adds a named one (`name@step`).
5. **Base rows never share a batch with LoRA rows.** In vLLM 0.32's LoRA kernels for CPU
   (`lora/ops/torch_ops`), "no adapter" is index -1, which selects the last adapter slot: a
   base-model row batched with LoRA rows comes back with that adapter applied. A gate on the
   engine loop admits requests of one kind (base weights, or any adapter) at a time; the
   other kind waits for the running ones to finish, in arrival order, so neither starves.
   Traffic of one kind (the usual RL loop: live weights and `name@step`) is not slowed.
6. **A caller that stops waiting aborts its request** (vLLM frees its sequence and KV cache).
7. **Training on one GPU.** With vLLM's sleep mode (`enable_sleep_mode`, on by default on a
   GPU, as in ART), `training()` puts vLLM to sleep for a whole train call (level 1: weights
   offloaded to CPU memory, KV cache freed; running requests are kept and resume after) and
   wakes it afterwards. On CPU vLLM has no sleep mode and keeps its own copy of the weights,
   so rollouts go on while the trainer works.
8. **Closing** fails every request in flight with `EngineClosedError`, shuts vLLM's processes
   down, stops the loop and joins its thread (also at interpreter exit, artrl/runtime/shutdown.py).
9. **Structured outputs by artrl's grammar in vLLM's sampler.** A request with `structured` is
   compiled here first (`GrammarCompiler`: the llguidance grammar, checks, cache and 400 of the
   built-in engine; what cannot be compiled never reaches vLLM), then handed to vLLM with its
   grammar in `SamplingParams.extra_args`, where artrl's logits processor masks the row's logits
   after vLLM's sampler took the raw logprobs (serve/engines/vllm_grammar.py says why vLLM's own
   structured outputs, which mask before, are not used).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from ...runtime import shutdown
from ...errors import ArtrlError, ConfigError
from ...runtime.once_per_run import OncePerRun
from .base import BASE_WEIGHTS, GenerationRequest, GenerationResult, InferenceEngine
from ..errors import EngineClosedError, InvalidRequestError
from ..structured import GrammarCompiler
from .vllm_grammar import GRAMMAR_ARG
from .vllm_args import GRAMMAR_PROCESSOR

logger = logging.getLogger(__name__)

#: Seconds vLLM's processes get to exit on close before vLLM kills them (they need a few on a busy CPU).
SHUTDOWN_TIMEOUT_S = 60.0
BASE, ADAPTER = "base weights", "adapter"  # the two kinds of request the gate keeps apart (point 5)


class EngineStartError(ArtrlError, RuntimeError):
    """vLLM's engine did not start (its own log above says why)."""


class VLLMEngine(InferenceEngine):
    """Serve a model with vLLM; see the module docstring.

    tokenizer, end_ids: the trainer's (the session computes `end_ids` once); cfg: the model's
    `InternalModelConfig` (device, dtype, context length, LoRA rank, seed, `engine_args`); base_model_path:
    the directory of the base model's weights, which vLLM loads itself. `engine_args` replaces the vLLM engine
    arguments built from `cfg` (serve/engines/vllm_args.py) altogether.
    """

    def __init__(self, *, tokenizer: Any, end_ids: frozenset[int], cfg: Any = None, base_model_path: str,
                 engine_args: dict[str, Any] | None = None) -> None:
        if cfg is not None and getattr(cfg, "in_flight_lora", False):
            raise ConfigError("rollout_weight_update_mode='in_flight_lora' is not supported by the vLLM engine: it "
                              "serves each policy step as an adapter of its own and cannot replace one under running "
                              "sequences or record which version sampled each token. Use inference_engine='builtin', "
                              "or rollout_weight_update_mode='step_lora'.")
        self._tokenizer = tokenizer
        self._end_ids = frozenset(int(t) for t in end_ids)
        with _process_state_kept():  # importing vLLM sets environment variables too
            if engine_args is None:
                engine_args = vllm_engine_arguments(cfg, base_model_path)
        self._sleep_mode = bool(engine_args.get("enable_sleep_mode"))
        # a mixture-of-experts model (serve/engines/vllm_args.py): adapters on its fused experts, and its routing record
        self._lora_format = {"is_3d_lora_weight": True} if engine_args.get("enable_mixed_moe_lora_format") else {}
        self._routing = bool(engine_args.get("enable_return_routed_experts"))
        # structured outputs need artrl's grammar processor in vLLM (point 9); the server refuses them without it
        self.structured_outputs = GRAMMAR_PROCESSOR in (engine_args.get("logits_processors") or [])
        self._closed = False
        self._lora_ids = itertools.count(1)
        self._named: dict[str, Any] = {}  # adapter name -> LoRARequest
        self._live: Any = None  # the LoRARequest `adapter=None` serves; None: the base weights
        self._live_steps: dict[int, int] = {}  # lora id of a live adapter -> its step (policy version)
        self._users: collections.Counter[int] = collections.Counter()  # lora id -> requests running with it
        self._retired: set[int] = set()  # superseded live adapters to remove once unused
        self._say = OncePerRun(logger)  # a new adapter every step: INFO once, then DEBUG
        self._tasks: set[asyncio.Task] = set()
        self._idle = threading.Condition()
        #: Requests served, requests whose caller stopped waiting (aborted in vLLM), sequences sampled.
        self.requests_served = 0
        self.requests_aborted = 0
        self.rows_served = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="artrl-vllm-engine", daemon=True)
        self._thread.start()
        self._gate = _KindGate()
        try:
            with _process_state_kept():
                self._llm = self._call(_start_llm(engine_args))
        except BaseException as error:
            self._stop_loop()
            raise EngineStartError(_start_failure(error)) from error
        config = self._llm.model_config
        self._max_model_len = int(config.max_model_len)
        self._vocab_size = int(config.get_vocab_size())
        self._grammars = GrammarCompiler(tokenizer, self._vocab_size, self._end_ids)
        shutdown.track(self, shutdown.ENGINES)
        logger.info("vLLM engine ready (%s, max_model_len %d, sleep mode %s)", engine_args.get("model"),
                    self._max_model_len, "on" if self._sleep_mode else "off")

    # ------------------------------------------------------------------ interface

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        return self._end_ids

    def has_adapter(self, name: str) -> bool:
        return name == BASE_WEIGHTS or name in self._named

    def load_adapter(self, name: str, path: str) -> None:
        """Load the peft adapter saved in `path` under `name` (served to requests with `adapter=name`)."""
        self._call(self._load_named(name, str(path)))

    def unload_adapter(self, name: str) -> bool:
        """Remove the adapter `load_adapter` loaded as `name`; False (nothing changes) while a request uses it."""
        return bool(self._call(self._unload_named(name)))

    def set_live_weights(self, path: str, step: int) -> None:
        """Serve the adapter saved in `path` for `adapter=None` from now on (loaded before this returns)."""
        self._call(self._set_live(str(path), int(step)))

    @property
    def live_step(self) -> int | None:
        """The policy version `adapter=None` serves now (None: the base weights)."""
        return None if self._live is None else self._live_steps.get(self._live.lora_int_id)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Held around a whole train call: with sleep mode (GPU), vLLM sleeps and gives the card to the trainer."""
        if not self._sleep_mode:
            yield
            return
        self._call(self._llm.sleep(level=1, mode="keep"))
        try:
            yield
        finally:
            self._call(self._llm.wake_up())

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        self._check(request)
        grammar = None
        if request.structured is not None:  # compiling a new schema is CPU work: off the event loop
            compiled = self._grammars.cached(request.structured) or await asyncio.to_thread(
                self._grammars.compile, request.structured)
            grammar = compiled.lark
        coroutine = self._generate(request, grammar)
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError as error:  # the loop closed since the check
            coroutine.close()
            raise EngineClosedError("VLLMEngine used after close()") from error
        # cancelling this await cancels `future`, which cancels the task on the engine loop: vLLM aborts it
        return await asyncio.wrap_future(future)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is running in this engine (True), or `timeout` seconds passed (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._tasks, timeout)

    def close(self) -> None:
        """Fail requests in flight with EngineClosedError, shut vLLM down, stop the loop thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            try:
                self._call(self._shutdown())
            finally:
                self._stop_loop()
        shutdown.untrack(self, shutdown.ENGINES)

    def shutdown_at_exit(self) -> None:
        self.close()

    # ------------------------------------------------------------------ on the engine loop

    async def _generate(self, request: GenerationRequest, grammar: str | None = None) -> list[GenerationResult]:
        """Sample `request` in vLLM; `grammar`: `request.structured` compiled (point 9)."""
        from vllm.inputs import TokensPrompt

        self._refuse_if_closed()  # handed over while the engine closed
        task = asyncio.current_task()
        assert task is not None
        lora = self._lora_for(request.adapter)  # resolved here, so a later set_live_weights does not change it
        if lora is not None:
            self._users[lora.lora_int_id] += 1
        with self._idle:
            self._tasks.add(task)
        try:
            async with self._gate.admitted(BASE if lora is None else ADAPTER):
                final = None
                prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
                params = _sampling_params(request, self._end_ids, grammar,
                                          routing_from=len(request.prompt_ids) if self._routing else None)
                async for output in self._llm.generate(prompt, params, uuid.uuid4().hex, lora_request=lora):
                    final = output
            assert final is not None and final.finished
            results = [_result(o, request.top_logprobs, self._closed, self._routing)
                       for o in sorted(final.outputs, key=lambda o: o.index)]
            if lora is not None and request.adapter is None:  # the policy version it was resolved to
                for result in results:
                    result.policy_version = self._live_steps.get(lora.lora_int_id)
            self.requests_served += 1
            self.rows_served += len(results)
            return results
        except asyncio.CancelledError:
            if self._closed:
                raise EngineClosedError("the inference engine was closed while the request ran") from None
            self.requests_aborted += 1
            raise
        finally:
            if lora is not None:
                self._release(lora)
            with self._idle:
                self._tasks.discard(task)
                self._idle.notify_all()

    def _lora_for(self, adapter: str | None) -> Any:
        if adapter is None:
            return self._live
        if adapter == BASE_WEIGHTS:
            return None
        try:
            return self._named[adapter]
        except KeyError:
            raise InvalidRequestError(f"adapter {adapter!r} is not loaded (loaded: {sorted(self._named)})") from None

    def _release(self, lora: Any) -> None:
        self._users[lora.lora_int_id] -= 1
        if self._users[lora.lora_int_id] <= 0:
            del self._users[lora.lora_int_id]
            if lora.lora_int_id in self._retired:
                self._retire(lora.lora_int_id)

    def _retire(self, lora_id: int) -> None:
        """Remove a superseded live adapter from vLLM now, or when its last request ends."""
        self._retired.add(lora_id)
        if self._users[lora_id] == 0 and not self._closed:
            self._retired.discard(lora_id)
            task = self._loop.create_task(self._llm.remove_lora(lora_id))
            task.add_done_callback(_log_failure)

    async def _load_named(self, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        self._refuse_if_closed()
        if name in self._named:
            if self._named[name].lora_path == path:
                return
            raise InvalidRequestError(f"Adapter name {name!r} is already loaded from {self._named[name].lora_path}; "
                                      f"cannot load it again from {path}. Use another name.")
        lora = LoRARequest(name, next(self._lora_ids), path, **self._lora_format)
        await self._llm.add_lora(lora)
        self._named[name] = lora
        self._say("loaded", "Loaded adapter %r from %s", name, path)

    async def _unload_named(self, name: str) -> bool:
        self._refuse_if_closed()
        lora = self._named.get(name)
        if lora is None:
            return True
        if self._users[lora.lora_int_id] > 0:
            return False
        del self._named[name]
        if self._live is None or self._live.lora_int_id != lora.lora_int_id:
            await self._llm.remove_lora(lora.lora_int_id)
        return True

    async def _set_live(self, path: str, step: int) -> None:
        from vllm.lora.request import LoRARequest

        self._refuse_if_closed()
        # a checkpoint already loaded by name (a replica loads `name@step` before it makes it live) is not loaded
        # a second time
        lora = next((named for named in self._named.values() if named.lora_path == path), None)
        if lora is None:
            lora = LoRARequest(f"artrl-live-step-{step}", next(self._lora_ids), path, **self._lora_format)
            await self._llm.add_lora(lora)
        self._live_steps[lora.lora_int_id] = step
        previous, self._live = self._live, lora
        if previous is not None and previous.lora_int_id != lora.lora_int_id \
                and all(previous.lora_int_id != named.lora_int_id for named in self._named.values()):
            self._retire(previous.lora_int_id)
        self._say("live", "live weights: step %d (%s)", step, path)

    async def _shutdown(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        llm, self._llm = self._llm, None
        llm.shutdown(timeout=SHUTDOWN_TIMEOUT_S)  # its processes exit; dropped here, not at interpreter exit

    # ------------------------------------------------------------------ helpers

    def _call(self, coroutine: Any) -> Any:
        """Run `coroutine` on the engine loop and wait for its result (from any thread but that loop's)."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("VLLMEngine's blocking methods cannot be called from its own event loop")
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError as error:  # the loop is closed
            coroutine.close()
            raise EngineClosedError("VLLMEngine used after close()") from error
        return future.result()

    def _run_loop(self) -> None:
        """The engine thread: the loop, until `_stop_loop`; then calls handed over while it stopped run (they
        find the engine closed and fail, so no caller waits for ever), anything still pending is cancelled,
        and the loop closes."""
        loop = self._loop
        loop.run_forever()
        loop.run_until_complete(asyncio.sleep(0))
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise EngineClosedError("VLLMEngine used after close()")

    def _check(self, request: GenerationRequest) -> None:
        self._refuse_if_closed()
        self.check(request)


class _KindGate:
    """Admits requests of one kind at a time (point 5 of the module docstring), first come first served.

    A request of the kind already running enters at once unless one of the other kind is waiting; then it
    queues behind it. When the last running request leaves, the request at the head of the queue and every
    request of its kind queued right after it are let in. Used on the engine loop only."""

    def __init__(self) -> None:
        self._kind: str | None = None
        self._running = 0
        #: Requests that had to wait for the other kind's to finish.
        self.waited = 0
        self._queue: collections.deque[tuple[str, asyncio.Future]] = collections.deque()

    @contextlib.asynccontextmanager
    async def admitted(self, kind: str) -> Any:
        await self._enter(kind)
        try:
            yield
        finally:
            self._running -= 1
            self._admit()

    async def _enter(self, kind: str) -> None:
        if not self._queue and (self._running == 0 or self._kind == kind):
            self._kind, self._running = kind, self._running + 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append((kind, waiter))
        self.waited += 1
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # admitted just before the cancel arrived
                self._running -= 1
            elif (kind, waiter) in self._queue:
                self._queue.remove((kind, waiter))
            self._admit()
            raise

    def _admit(self) -> None:
        if self._running:
            return
        while self._queue and (self._running == 0 or self._queue[0][0] == self._kind):
            kind, waiter = self._queue.popleft()
            if waiter.done():  # cancelled while it waited; its request leaves on its own
                continue
            self._kind, self._running = kind, self._running + 1
            waiter.set_result(None)


def vllm_engine_arguments(cfg: Any, base_model_path: str) -> dict[str, Any]:
    """`vllm.AsyncEngineArgs` keywords for a model config (serve/engines/vllm_args.py)."""
    import dataclasses

    from vllm import AsyncEngineArgs

    from ...models.quantization import resolve_quantization
    from .vllm_args import device_and_dtype, engine_arguments

    from transformers import AutoConfig

    from ...models.moe import is_moe

    device_type = device_and_dtype(cfg.device, cfg.dtype, torch.cuda.is_available())[0]
    quantization = resolve_quantization(cfg, str(base_model_path), device_type)
    moe = is_moe(AutoConfig.from_pretrained(str(base_model_path), trust_remote_code=cfg.trust_remote_code))
    device_type, dtype = device_and_dtype(cfg.device, cfg.dtype, torch.cuda.is_available(), quantization is not None)
    explicit = "inference_max_batch_size" in cfg.model_fields_set
    return engine_arguments(model_path=str(base_model_path), device_type=device_type, dtype=dtype,
                            quantization=quantization, moe=moe,
                            max_model_len=cfg.inference_max_length or cfg.max_length, lora_rank=cfg.lora_rank,
                            seed=cfg.seed, trust_remote_code=cfg.trust_remote_code,
                            max_num_seqs=cfg.inference_max_batch_size if explicit else None,
                            engine_args=cfg.engine_args, known=[f.name for f in dataclasses.fields(AsyncEngineArgs)])


async def _start_llm(engine_args: dict[str, Any]) -> Any:
    """Build vLLM's AsyncLLM on the engine loop (its output handler is a task of the loop it starts on)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))


def _sampling_params(request: GenerationRequest, end_ids: frozenset[int], grammar: str | None = None,
                     routing_from: int | None = None) -> Any:
    """vLLM's sampling parameters of a request; `routing_from`: an MoE model's routing is returned from this
    position on (the prompt's length: the sampled tokens' only)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    routing = {} if routing_from is None else {"routed_experts_prompt_start": routing_from}
    return SamplingParams(
        **routing,
        n=request.n,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=_spread(request.seed),
        stop_token_ids=sorted(end_ids | set(request.stop_token_ids)),
        ignore_eos=True,  # stop on exactly the ids above
        stop=list(request.stop_strings) or None,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        detokenize=bool(request.stop_strings),  # text is only needed to find stop strings
        logprobs=request.top_logprobs,  # the sampled token's logprob always; the top k when k > 0
        output_kind=RequestOutputKind.FINAL_ONLY,
        # constrained decoding: artrl's grammar processor in vLLM's sampler (serve/engines/vllm_grammar.py)
        extra_args=None if grammar is None else {GRAMMAR_ARG: {"grammar": grammar, "end_ids": sorted(end_ids)}},
    )


def _spread(seed: int | None) -> int | None:
    """The seed handed to vLLM, which seeds sample i of a request with `seed + i`: spread out, so that sample 1
    of seed s is not sample 0 of seed s + 1 (a request's n samples and nearby seeds stay independent)."""
    return None if seed is None else (seed * 0x9E3779B97F4A7C15) % (2**62)


def _result(output: Any, top_k: int, closed: bool, routing: bool = False) -> GenerationResult:
    """One of vLLM's CompletionOutputs as artrl's GenerationResult (`routing`: with an MoE model's routing
    record, `_routing_record`)."""
    reason = output.finish_reason
    if reason not in ("stop", "length"):
        if closed:
            raise EngineClosedError("the inference engine was closed while the request ran")
        raise RuntimeError(f"vLLM ended a sequence with finish_reason={reason!r} (stop_reason={output.stop_reason!r})")
    token_ids = [int(t) for t in output.token_ids]
    steps = output.logprobs or []
    if len(steps) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(steps)} logprob entries for {len(token_ids)} sampled tokens")
    logprobs = [float(step[t].logprob) for t, step in zip(token_ids, steps)]
    top = None
    if top_k > 0:
        top = [[(int(t), float(lp.logprob)) for t, lp in sorted(step.items(), key=lambda item: item[1].rank)
                if lp.rank is not None and lp.rank <= top_k] for step in steps]
    return GenerationResult(token_ids=token_ids, logprobs=logprobs, top_logprobs=top, finish_reason=reason,
                            routed_experts=_routing_record(output, len(token_ids)) if routing else None)


def _routing_record(output: Any, n_tokens: int) -> torch.Tensor | None:
    """vLLM's routed experts of the sampled tokens (computed as each was fed in, from the prompt's end on:
    [fed tokens, layers, top_k]) as artrl's record (models/moe.record_of_fed_tokens, tested there without vLLM).
    None when vLLM returned nothing."""
    from ...models.moe import record_of_fed_tokens

    routed = getattr(output, "routed_experts", None)
    return None if routed is None else record_of_fed_tokens(routed, n_tokens)


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Restore the environment variables and torch's thread count that starting vLLM changes (point 2)."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    try:
        yield
    finally:
        changed = {k for k in set(os.environ) | set(environ) if os.environ.get(k) != environ.get(k)}
        for key in changed:
            if key in environ:
                os.environ[key] = environ[key]
            else:
                del os.environ[key]
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if changed:
            logger.debug("restored environment variables vLLM set while starting: %s", sorted(changed))


def _start_failure(error: BaseException) -> str:
    message = f"vLLM's engine did not start ({type(error).__name__}: {str(error)[:500]}); vLLM's log above says why."
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None):
        message += (f" vLLM starts its engine process with multiprocessing's 'spawn' method, which imports the "
                    f"main script ({main.__file__}) again: a script that starts training at import time needs "
                    "`if __name__ == \"__main__\":` around its entry point.")
    return message


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("removing a superseded LoRA adapter from vLLM failed: %s", task.exception())


__all__ = ["EngineStartError", "VLLMEngine"]
