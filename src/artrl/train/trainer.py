"""The trainer: runs a batch plan on a peft model, one optimizer step at a time.

For each optimizer step of the plan: every micro-batch (rows trimmed to their
longest row) goes through ONE forward and backward pass with the packed
prefix-sharing attention; the micro-batch's loss sum is divided by the whole
step's total token weight before backward, so the accumulated gradient is the
step's token-mean gradient whatever the micro-batch size. Then gradients are
clipped, checked for NaN/inf (a non-finite loss or gradient refuses the step,
which is counted and logged), and AdamW steps with the call's optimizer
settings. Metrics are yielded per step.

The forward passes before a call's first optimizer step run the weights that
sampled the data (when it came from the current policy), so they also measure
the token record (docs/token-record.md): `sampled_logprob_delta_mean` / `_max`
are the mean and max |trainer logprob - sampled logprob| over the trainable
tokens that carry a sampled logprob; they appear on the first step only. The same
pass gives the call's `offpolicy/...` mismatch figures (KL and chi-squared of sampler
against trainer, the share each bound would act on, by policy age; train/offpolicy.py).

What a step computes besides the policy's logprobs is a call's `StepOptions`:
reference logprobs (base model with the adapter off, or a checkpoint loaded as
a frozen adapter) for a KL term or ART's KL-penalised advantages, whose mean KL
is taken over the whole optimizer step in a first no-grad pass; ART's
`precalculate_logprobs` (the old logprobs recomputed once before the first
step, the sampled ones kept for truncated importance sampling), or an
off-policy correction's trainer logprobs (`trainer_old_logprobs`: a one-step
call's own first pass, detached, since its weights have not moved yet; else
the same recompute); the LM-head chunk size.

`model_lock` is held for the whole of a train call. The built-in inference
engine may serve this very model (serve/engines/transformers_engine.py); it is then
built with this lock, so generation and training take turns on one device.
`end_ids` (the ids that close an assistant turn) are given by the session,
which hands the same set to the inference engine.

On a GPU (train/memory.py, train/kernels.py, docs/performance.md): a step's figures are added up on the
device and read once per step (train/totals.py), never per micro-batch; AdamW runs fused; activation
checkpointing follows the free memory unless configured; an out-of-memory error puts the adapter, the
optimizer state, the step count and the RNG state back as they were before the call and raises
`TrainOutOfMemoryError`. The parts of a pass carry `record_function` ranges for `bench train --profile`.

Randomness (e.g. LoRA dropout) comes from the trainer's own generator state,
seeded from the model config and saved in checkpoints: a train call runs inside
`torch.random.fork_rng` with that state, so the caller's process-wide RNGs are
exactly as they were afterwards, and two models never share a stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from ..preprocess.rows import PackedRows
from ..preprocess.plan import BatchPlan
from ..errors import ConfigError
from ..runtime.host_allocator import fix_mmap_threshold, thresholds_for, use_thresholds
from ..runtime.once_per_run import OncePerRun
from ..runtime.progress import ProgressBar, progress_bar
from ..config.model import InternalModelConfig
from ..types import OptimizerConfig
from .attention import attention_mask_for
from .kernels import apply_kernels, fused_adamw
from .logprobs import TokenLogprobModel
from .loss import LossTerms, histogram_quantile
from .offload import HostOffload
from ..config.optimizers import optim_spec
from .optimizers import build_optimizer, load_state
from .routing import TrainerRouting
from . import memory
from .memory import (MemoryBudget, budget_for, checkpointing_on, is_out_of_memory, needs_checkpointing,
                     needs_offload, out_of_memory_error, refuse_too_long, set_checkpointing)
from ..models.loading import model_max_length
from .memory import log as memory_log
from .offpolicy import AGE_VECTOR_KEY, mismatch_metrics, mismatch_sums
from .totals import RATIO_HISTOGRAM_KEY, StepTotals, vector_figure
from ..models.tree_attention import TREE_ATTENTION, TreeLayout

log = logging.getLogger(__name__)

REFERENCE_ADAPTERS = 2  # frozen KL reference adapters kept loaded at once (load_reference_adapter)


@dataclass
class TokenBatch:
    """A micro-batch's trainable tokens, flattened: every tensor is [n]."""

    logprobs: torch.Tensor  # new logprobs (with grad when training)
    entropy: torch.Tensor
    old_logprobs: torch.Tensor  # the behaviour policy's logprobs: sampled ones, or recomputed by the trainer
    # before the first step under precalculate_logprobs (nan where unknown)
    advantages: torch.Tensor
    weights: torch.Tensor
    sequence_ids: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    original_logprobs: torch.Tensor | None = None  # sampled logprobs when old_logprobs were recomputed
    kl_mean: float | None = None  # mean of (new - ref) over the optimizer step, when the loss asks for it


LossFn = Callable[[TokenBatch], LossTerms]


@dataclass(frozen=True)
class BuildContext:
    """What preparing a call needs to know of the trainer that will run it (`Trainer.build_context()`)."""

    tokenizer: Any
    end_ids: frozenset[int]  # ids that close an assistant turn (the inference engine stops on the same)
    max_length: int  # the longest row the model takes
    pad_id: int
    device_type: str  # "cpu" or "cuda": the default per_device_train_batch_size depends on it
    optimizer_steps: int  # optimizer steps taken so far (the SFT shuffle's seed mixes it in)
    # token budgets the free device memory allows (train/memory.py; None off CUDA): a call that sets neither
    # per_device_train_batch_size nor max_tokens_per_microbatch cuts its micro-batches by it
    memory_budget: MemoryBudget | None = None
    gradient_checkpointing: bool | None = None  # the model config's setting (None: as memory requires)
    # says the token budget the free memory gave a call: INFO once per run, then DEBUG (None: INFO every call)
    memory_notes: OncePerRun | None = None
    vision: Any = None  # a vision-language model's models.vision.VisionInputs (None: the model reads text only)
    policy_version: int | None = None  # the version the call trains (the run's step; None: unknown), for policy ages

SAMPLED_DELTA_KEYS = ("sampled_logprob_delta_mean", "sampled_logprob_delta_max", "sampled_logprob_tokens",
                      # an MoE model's (train/routing.py): measured with the weights that sampled, like the delta
                      "routing_record_tokens", "routing_mismatch_tokens", "sampled_logprob_delta_max_without_replay")


def new_totals() -> StepTotals:
    """An optimizer step's running figures (sums, except `delta_max`, a maximum), added up on the device."""
    return StepTotals()


def _add_sampled_delta(totals: StepTotals, tb: TokenBatch) -> None:
    """Add |trainer - sampled| logprob over the micro-batch's tokens that carry a sampled logprob.

    With precalculate_logprobs the old logprobs were recomputed by the trainer itself; the sampled ones are
    then `original_logprobs`, and the record is measured against those. Nothing is read on the host here.
    """
    sampled = tb.original_logprobs if tb.original_logprobs is not None else tb.old_logprobs  # [n]
    if not sampled.numel():
        return
    with torch.no_grad():
        known = ~torch.isnan(sampled)  # [n]
        delta = torch.where(known, (tb.logprobs.detach().float() - sampled.float()).abs(), 0.0)  # [n], 0: unknown
        totals.add("delta_sum", delta.sum())
        totals.add("delta_max", delta.max())  # >= 0 everywhere, so the zeros of unknown slots change nothing
        totals.add("delta_tokens", known.sum())


@dataclass
class StepOptions:
    """What a call's optimizer steps compute besides the policy's own logprobs.

    need_ref: reference logprobs per token (a KL term or KL-penalised advantages); from the base model
        (adapter off) or, when `ref_adapter` names a loaded peft adapter, from that adapter.
    kl_step_mean: first pass over each step without gradients for the mean of (new - ref) over the whole
        optimizer step (ART's kl_penalty_coef), so the result does not depend on the micro-batch layout.
    kl_source: "current_learner" (new - ref) or "sample" (old - ref; ART's kl_penalty_source).
    offpolicy_figures: the step's metrics include ART 0.5.23's importance-ratio figures (RL calls).
    chunk_size: tokens per LM-head chunk (None: the model config's logprob_chunk_size).
    precalculate_logprobs: before the first step, recompute the old logprobs of every trainable token with
        the current weights; the sampled ones reach the loss as `original_logprobs`.
    routing_replay: a mixture-of-experts model's tokens with a routing record take the recorded experts
        (train/routing.py).
    trainer_old_logprobs: the loss's old logprobs are the trainer's at the call's start, the sampled ones reach
        it as `original_logprobs` (an off-policy correction, train/offpolicy.py): the first pass's own (detached)
        in a call of one step, else recomputed as precalculate_logprobs does.
    mismatch_bounds / mask_threshold: what the first step's `offpolicy/...` figures measure against (RL calls).
    sequence_ages: the policy age of each of the call's sequences, by global sequence id (-1: unknown), for
        those figures by age.
    """

    need_ref: bool = False
    ref_adapter: str | None = None
    kl_step_mean: bool = False
    kl_source: str = "current_learner"
    offpolicy_figures: bool = False  # report the loss's importance-ratio figures (RL losses compute them)
    chunk_size: int | None = None
    precalculate_logprobs: bool = False
    routing_replay: bool = True  # an MoE model replays the routing record (train/routing.py)
    trainer_old_logprobs: bool = False
    mismatch_bounds: tuple[float, float] = (1.0 / 3.0, 3.0)
    mask_threshold: float | None = None
    sequence_ages: tuple[int, ...] | None = None

    def recomputes(self, steps: int) -> bool:
        """Whether a call of `steps` optimizer steps recomputes its old logprobs before the first step (else a
        correction's trainer logprobs are the first pass's own)."""
        return self.precalculate_logprobs or (self.trainer_old_logprobs and (
            steps > 1 or (self.kl_step_mean and self.kl_source == "sample")))  # the KL pass reads old too


def _unwrap(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _to_host(value: Any) -> Any:
    """A copy of `value` (tensors, nested in dicts/lists) on the host, apart from the live one."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


@dataclass
class CallState:
    """What a train call changes in a trainer, copied to the host at its start (adapter-sized: LoRA weights and
    their AdamW moments), to be put back when the call fails half-way."""

    params: list[torch.Tensor]
    optimizer: dict[str, Any]
    optimizer_steps: int
    rng: dict[str, torch.Tensor | None]

    @classmethod
    def take(cls, trainer: Trainer) -> CallState:
        with torch.no_grad():
            return cls(params=[p.detach().to("cpu", copy=True) for p in trainer.params],
                       optimizer=_to_host(trainer.optimizer.state_dict()),
                       optimizer_steps=trainer.optimizer_steps, rng=trainer.rng_state())

    def restore(self, trainer: Trainer) -> None:
        trainer.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, saved in zip(trainer.params, self.params):
                p.copy_(saved)
        # load_state_dict moves the moments back to each parameter's device (and drops state the call created)
        trainer.optimizer.state.clear()
        trainer.optimizer.load_state_dict(self.optimizer)
        trainer.optimizer_steps = self.optimizer_steps
        trainer._rng = {k: v.clone() if v is not None else None for k, v in self.rng.items()}
        if trainer.device.type == "cuda":
            torch.cuda.empty_cache()


class Trainer:
    """Owns the peft model's training state: optimizer, step counter, the model lock."""

    def __init__(self, model: Any, tokenizer: Any, cfg: InternalModelConfig | None = None,
                 model_lock: threading.RLock | None = None,
                 wrap: Callable[[TokenLogprobModel], Any] | None = None,
                 end_ids: frozenset[int] | None = None, vision: Any = None) -> None:
        """`wrap`, if given, is applied to the forward module before the optimizer takes its parameters
        (distributed/sharding.py shards it with FSDP2 there). `end_ids`: the ids that end an assistant turn
        (None: `chat_format.end_of_turn_ids(tokenizer, model)`, what a session computes and passes). `vision`: a
        vision-language model's image processing (models/vision.py; `models.loading.load_vision`), which
        tokenizing its calls needs."""
        from ..chat.format import end_of_turn_ids

        self.model = model
        self.tokenizer = tokenizer
        self.vision = vision
        self.cfg = cfg or InternalModelConfig()
        self.end_ids = frozenset(end_ids) if end_ids is not None else end_of_turn_ids(tokenizer, model)
        inner = _unwrap(model)
        self.backbone = getattr(inner, inner.base_model_prefix)  # e.g. Qwen3Model
        self.lm_head = inner.get_output_embeddings()
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            fix_mmap_threshold()  # freed activations go back to the system, not to a growing heap (host_allocator.py)
            if self.cfg.offload_activations:
                raise ConfigError("offload_activations=True moves checkpointed activations to host memory, and on "
                                  "a CPU they are there already: leave it None (or False) when training on a CPU.")
        # the call in progress offloads its checkpointed layer inputs to host memory (train/memory.py decides);
        # `force_offload` runs that path on a CPU too (a copy within host memory), for the tests of its math
        self.offload_activations = False
        self.force_offload = False
        self.offload = HostOffload(model, pin_memory=self.device.type == "cuda")
        self._references: list[str] = []  # frozen KL reference adapters loaded, oldest first
        # the dtype activations run in: the frozen floating weights' (a quantised model's packed weights are not)
        self.dtype = next(p for p in inner.parameters() if not p.requires_grad and p.is_floating_point()).dtype
        self.model_config = inner.config
        self.attn_implementation = inner.config._attn_implementation
        self.softcap = getattr(inner.config, "final_logit_softcapping", None)
        self.max_length = model_max_length(inner, self.cfg)
        self.token_model = TokenLogprobModel(self.backbone, self.lm_head, chunk_size=self.cfg.logprob_chunk_size,
                                             softcap=self.softcap)
        # an MoE model: routing replay and router health (its hooks on this model's routers, not a serving copy's)
        self.routing = TrainerRouting.for_model(inner)
        self.kernels = apply_kernels(inner, self.cfg, self.device) if wrap is None else {}
        if wrap is not None:
            wrap(self.token_model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # ART's trainer_args.optim (train/optimizers.py); torch's AdamW runs one fused kernel for the whole step on
        # CUDA (the sharded model keeps torch's default)
        self.optim = optim_spec(self.cfg.optim)
        fused = fused_adamw(self.cfg, self.device) and wrap is None
        # `_adamw_impl`: param-group entries that pick torch AdamW's implementation; set again each step, since
        # loading a checkpoint (maybe written on another device) brings its param groups along
        self.optimizer, self._adamw_impl = self._build_optimizer(fused)
        self.sharded = wrap is not None
        self.model_lock = model_lock or threading.RLock()
        self.optimizer_steps = 0
        self._first_step = False  # inside run(): whether the step in progress is the call's first
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._rng = self._seeded_rng_state(self.cfg.seed)
        # what memory made of each call (token budget, activation checkpointing): INFO once, then DEBUG
        self.memory_notes = OncePerRun(memory_log)

    def _build_optimizer(self, fused: bool) -> tuple[Any, dict[str, Any]]:
        """The adapter's optimizer (a sharded trainer steps each rank's shards: distributed/sharding.py)."""
        return build_optimizer(self.params, self.optim, fused=fused, settings=OptimizerConfig().optimizer_settings())

    def load_optimizer_state(self, saved: dict[str, Any], saved_optim: str | None) -> None:
        """A checkpoint's optimizer state (written by the optimizer named `saved_optim`; None: torch's AdamW) into
        this trainer's optimizer, whichever kind it is (train/optimizers.py)."""
        load_state(self.optimizer, saved, saved_optim, self.optim)

    def build_context(self) -> "BuildContext":
        """What preparing a call for this trainer needs to know of it."""
        return BuildContext(tokenizer=self.tokenizer, end_ids=self.end_ids, max_length=self.max_length,
                            pad_id=self.pad_id, device_type=self.device.type, optimizer_steps=self.optimizer_steps,
                            memory_budget=self.memory_budget(), gradient_checkpointing=self.cfg.gradient_checkpointing,
                            memory_notes=self.memory_notes, vision=self.vision)

    # ------------------------------------------------------------------ memory of a call
    def memory_budget(self, host: bool = False) -> MemoryBudget | None:
        """This trainer's token budgets now (train/memory.py; None off CUDA unless `host`: a CPU's host memory;
        None when workers elsewhere train)."""
        if self.device.type not in (("cuda", "cpu") if host else ("cuda",)) or self.sharded:
            return None
        cfg = self.cfg
        if cfg.num_workers != 1 or cfg.trainer_gpu_ids is not None or cfg.num_nodes != 1:
            return None
        return budget_for(self.model_config, self.dtype, cfg.logprob_chunk_size, memory.free_bytes(self.device),
                          offload=self.device.type == "cuda" and cfg.offload_activations is not False,
                          fused=bool(getattr(self, "kernels", {}).get("liger_kernel")))

    @contextlib.contextmanager
    def call_memory(self, model: Any, plan: BatchPlan) -> Iterator[None]:
        """Activation checkpointing of `model` (the transformers model) for one call: as configured, or
        (`gradient_checkpointing=None`) on only when the plan's largest micro-batch would not fit the free memory
        without it; on CUDA, offloading of the checkpointed inputs to host memory likewise (`offload_activations`).
        A micro-batch no setting fits is refused here, before anything trains (`refuse_too_long`). Put back as it
        was afterwards."""
        cfg = self.cfg
        # the free memory, read once for the call's three decisions (None: a sharded trainer's workers decide)
        budget = None if self.sharded else self.memory_budget(host=True)
        refuse_too_long(plan, budget, cfg, self.device.type)
        want = cfg.gradient_checkpointing
        if want is None and not self.sharded:
            want = needs_checkpointing(plan, budget, self.device.type, self.memory_notes)
        offload = bool(cfg.offload_activations)
        if cfg.offload_activations is None and want is not False:
            offload = needs_offload(plan, budget, self.memory_notes)
        if offload and want is None:
            want = True  # offloading is of the checkpointed inputs
        self.offload_activations = offload and self.device.type == "cuda" or self.force_offload
        before = checkpointing_on(model)
        try:
            if want is None or want == before or not (hasattr(model, "activation_checkpointing_enable")
                                                      or hasattr(model, "gradient_checkpointing_enable")):
                yield
                return
            set_checkpointing(model, want)
            try:
                yield
            finally:
                set_checkpointing(model, before)
        finally:
            self.offload_activations = False

    # ------------------------------------------------------------------ randomness
    def _seeded_rng_state(self, seed: int) -> dict[str, torch.Tensor | None]:
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = None
        if self.device.type == "cuda":
            cuda = torch.Generator(device=self.device).manual_seed(seed).get_state()
        return {"cpu": cpu, "cuda": cuda}

    def rng_state(self) -> dict[str, torch.Tensor | None]:
        """The trainer's own generator states (what a checkpoint saves)."""
        return {k: v.clone() if v is not None else None for k, v in self._rng.items()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore `rng_state()` output; a CUDA state is kept only when training on CUDA."""
        cpu = state.get("cpu")
        if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
            raise ValueError("the saved trainer RNG state has no CPU generator state")
        cuda = state.get("cuda") if self.device.type == "cuda" else None
        self._rng = {"cpu": cpu.clone(), "cuda": cuda.clone() if isinstance(cuda, torch.Tensor) else None}

    @contextlib.contextmanager
    def _own_rng(self) -> Iterator[None]:
        """Run with the trainer's generator states; the caller's are restored on exit."""
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            torch.set_rng_state(self._rng["cpu"])
            if cuda and self._rng["cuda"] is not None:
                torch.cuda.set_rng_state(self._rng["cuda"], self.device)
            try:
                yield
            finally:
                self._rng = {"cpu": torch.get_rng_state(),
                             "cuda": torch.cuda.get_rng_state(self.device) if cuda else None}

    # ------------------------------------------------------------------ reference weights
    def load_reference_adapter(self, name: str, path: str) -> None:
        """Load the peft adapter saved in `path` onto the model as `name`, frozen, for `StepOptions.ref_adapter`
        (a KL reference); loading a name already there does nothing. The active (trained) adapter stays. At most
        `REFERENCE_ADAPTERS` stay loaded: a moving reference (kl_penalty_step_lag, ART's pipeline) names a new
        checkpoint each step, and the oldest one loaded is dropped for it, so a long run holds a bounded number."""
        from ..models.adapter_switch import load_frozen_adapter

        with self.model_lock:
            loaded = getattr(self.model, "peft_config", {})
            if name in loaded:
                self._references = [n for n in self._references if n != name] + [name]
                return
            load_frozen_adapter(self.model, name, path)
            self._references = [n for n in self._references if n in loaded] + [name]
            while len(self._references) > REFERENCE_ADAPTERS:
                self.model.delete_adapter(self._references.pop(0))

    # ------------------------------------------------------------------ forward
    @contextlib.contextmanager
    def _reference(self, adapter: str | None) -> Iterator[None]:
        """The reference weights: the base model (adapter None: LoRA off) or the loaded peft adapter `adapter`."""
        if adapter is None:
            with self.model.disable_adapter() if hasattr(self.model, "disable_adapter") else contextlib.nullcontext():
                yield
            return
        from ..models.adapter_switch import serving

        with serving(self.model, adapter):  # eval mode, adapter switched; modes and requires_grad restored
            yield

    def routed(self, mb: PackedRows, *, replay: bool = True, count: bool = False,
               stats: bool = False) -> contextlib.AbstractContextManager:
        """The routing of an MoE model's passes over `mb` (train/routing.py); nothing for a dense model."""
        if self.routing is None:
            return contextlib.nullcontext()
        return self.routing.replaying(mb.routing, mb.segment_ids >= 0, replay=replay, count=count, stats=stats)

    def forward_tokens(self, mb: PackedRows, *, grad: bool = True, adapter: bool = True,
                       ref_adapter: str | None = None, chunk_size: int | None = None) -> TokenBatch:
        """One forward pass over a micro-batch; returns its trainable tokens' logprobs.

        `adapter=False` computes reference logprobs: the base model, or the adapter `ref_adapter`. An MoE model
        routes as the caller's `routed` context says (none: freely).
        """
        dev = self.device
        input_ids = mb.input_ids.to(dev)  # [rows, width]
        extra: dict[str, Any] = {}
        positions = mb.position_ids.to(dev)  # [rows, width]
        if mb.rope_position_ids is not None:  # a vision-language model's 3-D positions (models/vision.py)
            positions = mb.rope_position_ids.to(dev).permute(2, 0, 1)  # [3, rows, width]
        if mb.images:
            extra["images"] = mb.row_images()
        with record_function("artrl/attention_mask"):
            if self.attn_implementation == TREE_ATTENTION:
                # a 4-D placeholder makes transformers skip building a seq x seq mask; the layout rules instead
                mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev)
                extra[TREE_ATTENTION] = TreeLayout(mb.nodes)
            else:
                mask = attention_mask_for(self.attn_implementation, mb.segment_ids.to(dev), mb.parent_ids.to(dev),
                                          self.dtype)
        sel = mb.trainable_mask  # [rows, width]
        b_idx, t_idx = sel.nonzero(as_tuple=True)  # [n], [n]
        prev = mb.prev_index[b_idx, t_idx]  # [n]
        ctx = torch.enable_grad() if grad else torch.no_grad()
        adapter_ctx = self._reference(ref_adapter) if not adapter else contextlib.nullcontext()
        offload = contextlib.nullcontext()
        if grad and self.offload_activations:
            offload = self.offload.saving()
        with ctx, adapter_ctx, offload:
            targets = input_ids[b_idx.to(dev), t_idx.to(dev)]  # [n]
            logp, ent = self.token_model(input_ids, mask, positions, b_idx.to(dev), prev.to(dev),
                                         targets, chunk_size=chunk_size or self.cfg.logprob_chunk_size, **extra)
        return TokenBatch(
            logprobs=logp, entropy=ent.detach(),
            old_logprobs=mb.logprobs[b_idx, t_idx].to(dev),
            advantages=mb.advantages[b_idx, t_idx].to(dev),
            weights=mb.weights[b_idx, t_idx].to(dev),
            sequence_ids=mb.sequence_ids[b_idx, t_idx].to(dev),
        )

    # ------------------------------------------------------------------ steps
    def run(self, packed: PackedRows, plan: BatchPlan, loss_fn: LossFn, learning_rates: list[float], *,
            optimizer: OptimizerConfig | None = None, need_ref: bool = False, options: StepOptions | None = None,
            desc: str = "train", show_progress: bool = True) -> Iterator[dict[str, float]]:
        """Run every optimizer step of `plan`; yields one metrics dict per step."""
        if len(learning_rates) != len(plan.steps):
            raise ValueError(f"{len(learning_rates)} learning rates for {len(plan.steps)} steps")
        optimizer = optimizer or OptimizerConfig()
        opts = options or StepOptions(need_ref=need_ref)
        bar = progress_bar(total=plan.num_micro_batches, desc=desc, unit="mb", disable=not show_progress, leave=False)
        state: CallState | None = None
        if self.device.type == "cpu":
            self._set_allocator(plan)
        try:
            with self.model_lock, self._own_rng(), self.call_memory(_unwrap(self.model), plan):
                # what the call may change, kept to put back if it runs out of device memory half-way (a
                # sharded trainer's workers restart from the last checkpoint instead: distributed/)
                state = None if self.sharded else CallState.take(self)
                self.model.train()
                original = None
                if opts.recomputes(len(plan.steps)):
                    original = packed.logprobs
                    packed = self.recompute_logprobs(packed, plan, chunk_size=opts.chunk_size,
                                                     replay=opts.routing_replay)
                for index, (step, lr) in enumerate(zip(plan.steps, learning_rates)):
                    self._first_step = index == 0  # its passes run the weights that sampled the data
                    metrics = self._step(packed, step, loss_fn, lr, optimizer, opts, bar, original)
                    if index:  # later passes run updated weights: they no longer measure the record
                        for key in SAMPLED_DELTA_KEYS:
                            metrics.pop(key, None)
                    yield metrics
        except Exception as e:
            if state is None or not is_out_of_memory(e):
                raise
            with self.model_lock:
                state.restore(self)
            raise out_of_memory_error(plan, e, self.model, self.device, self.cfg.logprob_chunk_size) from e
        finally:
            bar.close()
            self.model.eval()


    def _set_allocator(self, plan: BatchPlan) -> None:
        """glibc's thresholds for this call, by its largest micro-batch's kept hidden state (host_allocator.py)."""
        tokens = max((mb.tokens for st in plan.steps for mb in st.micro_batches), default=0)
        cfg = self.model_config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg  # a vision-language model's decoder
        use_thresholds(thresholds_for(tokens, getattr(cfg, "hidden_size", 0) or 0, self.dtype.itemsize,
                                      getattr(cfg, "num_hidden_layers", 1) or 1))

    def recompute_logprobs(self, packed: PackedRows, plan: BatchPlan, *, chunk_size: int | None = None,
                           replay: bool = True) -> PackedRows:
        """`packed` with the logprobs of its trainable tokens recomputed by the current weights (no gradient)."""
        logprobs = packed.logprobs.clone()  # [rows, row_length]
        for step in plan.steps:
            for mb in step.micro_batches:
                sub = packed.select(mb.rows, mb.width)
                with self.routed(sub, replay=replay):
                    new = self.forward_tokens(sub, grad=False, chunk_size=chunk_size).logprobs
                new = new.to(logprobs.dtype).cpu()
                block = logprobs[mb.rows, :mb.width]  # [mb rows, width] (a copy)
                block[sub.trainable_mask] = new
                logprobs[mb.rows, :mb.width] = block
        return dataclasses.replace(packed, logprobs=logprobs)

    def accumulate(self, packed: PackedRows, step: Any, loss_fn: LossFn, *, need_ref: bool = False,
                   bar: ProgressBar | None = None, options: StepOptions | None = None,
                   original_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """Forward/backward every micro-batch of one optimizer step; gradients accumulate in .grad.

        Each micro-batch's loss sum is divided by the step's total weight, so the sum over
        micro-batches is the step's token-mean loss however the rows are split.
        `original_logprobs` ([rows, row_length]) are the sampled logprobs when `packed.logprobs` were recomputed.
        """
        opts = options or StepOptions(need_ref=need_ref)
        denom = float(packed.weights[step.rows].sum())  # host tensors: no device read
        totals = new_totals()
        refs: dict[int, torch.Tensor] = {}
        kl_mean = None
        if opts.need_ref and opts.kl_step_mean:
            total, count = self.kl_sums(packed, step.micro_batches, opts, refs)
            kl_mean = total / count if count else 0.0
        for i, mb in enumerate(step.micro_batches):
            self.micro_step(packed, mb, loss_fn, denom, totals, opts=opts, ref=refs.pop(i, None), kl_mean=kl_mean,
                            original_logprobs=original_logprobs)
            if bar is not None:
                bar.update(1)
        return totals

    def kl_sums(self, packed: PackedRows, micro_batches: list[Any], opts: StepOptions,
                refs: dict[int, torch.Tensor] | None = None) -> tuple[float, int]:
        """Sum and count of (new - ref), or (old - ref) with `opts.kl_source="sample"`, over the micro-batches'
        trainable tokens, without gradients.

        The reference logprobs are kept in `refs` (by micro-batch index) for the passes that follow.
        """
        total, count = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for i, mb in enumerate(micro_batches):
            sub = packed.select(mb.rows, mb.width)
            with self.routed(sub, replay=opts.routing_replay):
                cur = self.forward_tokens(sub, grad=False, chunk_size=opts.chunk_size)
                ref = self.forward_tokens(sub, grad=False, adapter=False, ref_adapter=opts.ref_adapter,
                                          chunk_size=opts.chunk_size).logprobs
            if refs is not None:
                refs[i] = ref
            source = cur.logprobs  # [n]
            if opts.kl_source == "sample":  # the rollout's logprobs; a token without one counts as on-policy
                source = torch.where(torch.isfinite(cur.old_logprobs), cur.old_logprobs, cur.logprobs)
            live = cur.weights > 0  # [n]
            total += torch.where(live, source - ref, 0.0).sum()  # added up on the device
            count += int((sub.weights[sub.trainable_mask] > 0).sum())  # host tensors
        return float(total), count

    def micro_step(self, packed: PackedRows, mb: Any, loss_fn: LossFn, denom: float, totals: dict[str, float], *,
                   opts: StepOptions | None = None, need_ref: bool = False, ref: torch.Tensor | None = None,
                   kl_mean: float | None = None, original_logprobs: torch.Tensor | None = None,
                   always_backward: bool = False, scale: float = 1.0) -> None:
        """One forward/backward pass over micro-batch `mb` (rows of `packed`); adds its figures to `totals`.

        The loss sum is divided by `denom`, the whole optimizer step's weight, and multiplied by `scale`.
        `ref`: the pass's reference logprobs when a KL first pass already computed them (else computed here);
        `kl_mean`: the step's mean (new - ref) for ART's KL-penalised advantages; `original_logprobs`
        ([rows, row_length]): the sampled logprobs when `packed.logprobs` were recomputed.
        A pass with nothing to learn skips backward unless `always_backward` (a sharded model's ranks must
        all run every backward: distributed/sharding.py, which also runs zero-`scale` padding passes).
        """
        opts = opts or StepOptions(need_ref=need_ref)
        sub = packed.select(mb.rows, mb.width)
        totals.add("computed", sub.input_ids.numel())
        weight = float(sub.weights[sub.trainable_mask].sum())  # host tensors: whether there is anything to learn
        measure = self._first_step and scale != 0.0  # a padding pass (scale 0) measures nothing
        counts = self.routing.counts() if self.routing is not None else None
        # an MoE model's routing (train/routing.py) holds for the forward and for its recomputation in backward
        with self.routed(sub, replay=opts.routing_replay, count=measure, stats=scale != 0.0):
            tb = self.forward_tokens(sub, chunk_size=opts.chunk_size)
            if opts.need_ref:
                tb.ref_logprobs = ref if ref is not None else self.forward_tokens(
                    sub, grad=False, adapter=False, ref_adapter=opts.ref_adapter, chunk_size=opts.chunk_size).logprobs
            tb.kl_mean = kl_mean
            if original_logprobs is not None:
                rows = torch.as_tensor(mb.rows, dtype=torch.long)
                tb.original_logprobs = original_logprobs[rows, :mb.width][sub.trainable_mask].to(tb.logprobs.device)
            elif opts.trainer_old_logprobs:  # a one-step call: its weights are still the call's first
                tb.original_logprobs, tb.old_logprobs = tb.old_logprobs, tb.logprobs.detach()
            _add_sampled_delta(totals, tb)
            if measure and opts.offpolicy_figures:
                self._measure_mismatch(totals, tb, opts)
            with record_function("artrl/loss"):
                terms = loss_fn(tb)
            with record_function("artrl/backward"):
                if denom > 0 and weight > 0:
                    (terms.loss_sum / denom if scale == 1.0 else terms.loss_sum / denom * scale).backward()
                elif always_backward:
                    (terms.loss_sum * 0.0).backward()
        if counts is not None and measure:
            self._measure_routing(sub, tb, totals, counts, opts)
        totals.add("loss", terms.loss_sum.detach() / max(denom, 1e-12))
        for key, value in terms.sums.items():
            totals.add(key, value)
        if terms.ratio_histogram is not None:
            totals.add_vector(RATIO_HISTOGRAM_KEY, terms.ratio_histogram)

    def _measure_mismatch(self, totals: StepTotals, tb: TokenBatch, opts: StepOptions) -> None:
        """The first step's sampler/trainer mismatch sums of a micro-batch (train/offpolicy.py)."""
        sampled = tb.original_logprobs if tb.original_logprobs is not None else tb.old_logprobs  # [n]
        ages = torch.tensor(opts.sequence_ages, dtype=torch.long) if opts.sequence_ages is not None else None
        mismatch_sums(totals, tb.logprobs, sampled, tb.advantages, tb.weights, tb.sequence_ids,
                      bounds=opts.mismatch_bounds, threshold=opts.mask_threshold, sequence_ages=ages)

    def _measure_routing(self, sub: PackedRows, tb: TokenBatch, totals: StepTotals, before: dict[str, float],
                         opts: StepOptions) -> None:
        """An MoE micro-batch of the first step: the replay counts it added, and (when it replayed a record) the
        sampled-logprob delta of one more forward that routes freely, without gradient (train/routing.py)."""
        assert self.routing is not None
        after = self.routing.counts()
        replayed = after["routing_record_tokens"] - before["routing_record_tokens"]
        totals.add("routing_record", replayed)
        totals.add("routing_mismatch", after["routing_mismatch_tokens"] - before["routing_mismatch_tokens"])
        if not replayed or not opts.routing_replay:
            return  # without replay the pass itself routed freely: its delta is the sampled one
        with self.routed(sub, replay=False):
            free = self.forward_tokens(sub, grad=False, chunk_size=opts.chunk_size)
        sampled = tb.original_logprobs if tb.original_logprobs is not None else tb.old_logprobs  # [n]
        with torch.no_grad():
            known = ~torch.isnan(sampled)
            delta = torch.where(known, (free.logprobs.float() - sampled.float()).abs(), 0.0)  # [n]
            totals.add("delta_free_max", delta.max() if delta.numel() else 0.0)

    def _step(self, packed: PackedRows, step: Any, loss_fn: LossFn, lr: float, optimizer: OptimizerConfig,
              opts: StepOptions, bar: ProgressBar, original: torch.Tensor | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        settings = optimizer.optimizer_settings()
        max_grad_norm = optimizer.max_grad_norm
        for g in self.optimizer.param_groups:
            g["lr"] = lr
            g.update(settings, **self._adamw_impl)
        self.optimizer.zero_grad(set_to_none=True)
        totals = self.accumulate(packed, step, loss_fn, bar=bar, options=opts, original_logprobs=original)
        with record_function("artrl/optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm or float("inf"))
            finite = math.isfinite(totals["loss"]) and bool(torch.isfinite(grad_norm))  # the step's one host read
            if finite:
                self.optimizer.step()
                self.optimizer_steps += 1
        if not finite:
            log.error("non-finite loss (%s) or gradient norm (%s): optimizer step refused, gradients dropped",
                      totals["loss"], float(grad_norm))
        computed = int(totals["computed"])
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        w = max(totals["weight"], 1e-12)
        metrics = {
            "loss": totals["loss"],
            "policy_loss": totals["policy"] / w,
            "grad_norm": float(grad_norm),
            "learning_rate": lr,
            "entropy": totals["entropy"] / w,
            "clip_fraction": totals["clipped"] / w,
            "mean_ratio": totals["ratio"] / w,
            "trainable_tokens": float(step.trainable_tokens),
            "computed_tokens": float(computed),
            "micro_batches": float(len(step.micro_batches)),
            "rows": float(len(step.rows)),
            "tokens_per_second": step.trainable_tokens / seconds if seconds > 0 else 0.0,
            "step_seconds": seconds,
            "skipped_nonfinite_steps": 0.0 if finite else 1.0,
        }
        if opts.offpolicy_figures:  # an RL loss's (ART 0.5.23)
            n = max(totals["ratio_tokens"], 1.0)
            counts = vector_figure(totals, RATIO_HISTOGRAM_KEY)
            metrics.update(importance_ratio_mean=totals["ratio_raw"] / n,
                           importance_ratio_p95=histogram_quantile(counts, 0.95),
                           importance_ratio_p99=histogram_quantile(counts, 0.99),
                           clipped_token_fraction=totals["ratio_clipped"] / n)
            metrics.update(mismatch_metrics(totals, vector_figure(totals, AGE_VECTOR_KEY),
                                            bounds=opts.mismatch_bounds, threshold=opts.mask_threshold))
            if opts.mask_threshold is not None:
                metrics["offpolicy/off_policy_masked_tokens"] = totals["opsm_masked"] / w
        if opts.need_ref:
            metrics["kl"] = totals["kl"] / w
            metrics["kl_policy_ref"] = totals["kl_ref"] / w
        if totals["delta_tokens"]:
            metrics["sampled_logprob_delta_mean"] = totals["delta_sum"] / totals["delta_tokens"]
            metrics["sampled_logprob_delta_max"] = totals["delta_max"]
            metrics["sampled_logprob_tokens"] = totals["delta_tokens"]
        if self.routing is not None:
            metrics["routing_record_tokens"] = totals["routing_record"]
            metrics["routing_mismatch_tokens"] = totals["routing_mismatch"]
            if totals["routing_record"] and opts.routing_replay:
                metrics["sampled_logprob_delta_max_without_replay"] = totals["delta_free_max"]
            metrics.update(self.routing.health())
            self.routing.reset_health()
        shown = {"loss": f"{metrics['loss']:.4f}"}
        if "offpolicy/sampler_kl" in metrics:  # the first step's mismatch, as the train row has it
            shown["sampler_kl"] = f"{metrics['offpolicy/sampler_kl']:.2e}"
        bar.set_postfix(shown, refresh=False)
        return metrics
