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
tokens that carry a sampled logprob; they appear on the first step only.

The model is shared with the inference engine: `model_lock` is held for the
whole of a train call so generation and training take turns on one device.

Randomness (e.g. LoRA dropout) comes from the trainer's own generator state,
seeded from the model config and saved in checkpoints: a train call runs inside
`torch.random.fork_rng` with that state, so the caller's process-wide RNGs are
exactly as they were afterwards, and two models never share a stream.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..preprocess.pack import PackedRows
from ..preprocess.plan import BatchPlan
from ..types import InternalModelConfig, OptimizerConfig
from .attention import attention_mask_for
from .logprobs import TokenLogprobModel
from .loss import LossTerms
from .modeling import model_max_length
from .tree_attention import TREE_ATTENTION, TreeLayout

log = logging.getLogger(__name__)


@dataclass
class TokenBatch:
    """A micro-batch's trainable tokens, flattened: every tensor is [n]."""

    logprobs: torch.Tensor  # new logprobs (with grad when training)
    entropy: torch.Tensor
    old_logprobs: torch.Tensor  # sampled logprobs (nan where unknown)
    advantages: torch.Tensor
    weights: torch.Tensor
    sequence_ids: torch.Tensor
    ref_logprobs: torch.Tensor | None = None


LossFn = Callable[[TokenBatch], LossTerms]

SAMPLED_DELTA_KEYS = ("sampled_logprob_delta_mean", "sampled_logprob_delta_max", "sampled_logprob_tokens")


def new_totals() -> dict[str, float]:
    """An optimizer step's running figures (sums, except `delta_max`, a maximum)."""
    return dict(loss=0.0, policy=0.0, kl=0.0, entropy=0.0, clipped=0.0, ratio=0.0, weight=0.0, computed=0.0,
                delta_sum=0.0, delta_max=0.0, delta_tokens=0.0)


def _add_sampled_delta(totals: dict[str, float], tb: TokenBatch) -> None:
    """Add |trainer - sampled| logprob over the micro-batch's tokens that carry a sampled logprob."""
    with torch.no_grad():
        known = ~torch.isnan(tb.old_logprobs)  # [n]
        delta = (tb.logprobs.detach().float() - tb.old_logprobs.float())[known].abs()  # [known]
    if delta.numel():
        totals["delta_sum"] += float(delta.sum())
        totals["delta_max"] = max(totals["delta_max"], float(delta.max()))
        totals["delta_tokens"] += float(delta.numel())


def _unwrap(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class Trainer:
    """Owns the peft model's training state: optimizer, step counter, the model lock."""

    def __init__(self, model: Any, tokenizer: Any, cfg: InternalModelConfig | None = None,
                 model_lock: threading.RLock | None = None,
                 wrap: Callable[[TokenLogprobModel], Any] | None = None) -> None:
        """`wrap`, if given, is applied to the forward module before the optimizer takes its parameters
        (distributed/sharding.py shards it with FSDP2 there)."""
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg or InternalModelConfig()
        inner = _unwrap(model)
        self.backbone = getattr(inner, inner.base_model_prefix)  # e.g. Qwen3Model
        self.lm_head = inner.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.dtype = next(p for p in inner.parameters() if not p.requires_grad).dtype
        self.attn_implementation = inner.config._attn_implementation
        self.softcap = getattr(inner.config, "final_logit_softcapping", None)
        self.max_length = model_max_length(inner, self.cfg)
        self.token_model = TokenLogprobModel(self.backbone, self.lm_head, chunk_size=self.cfg.logprob_chunk_size,
                                             softcap=self.softcap)
        if wrap is not None:
            wrap(self.token_model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, **OptimizerConfig().optimizer_settings())
        self.model_lock = model_lock or threading.RLock()
        self.optimizer_steps = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._rng = self._seeded_rng_state(self.cfg.seed)

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

    # ------------------------------------------------------------------ forward
    def forward_tokens(self, mb: PackedRows, *, grad: bool = True, adapter: bool = True) -> TokenBatch:
        """One forward pass over a micro-batch; returns its trainable tokens' logprobs."""
        dev = self.device
        input_ids = mb.input_ids.to(dev)  # [rows, width]
        extra: dict[str, Any] = {}
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
        adapter_ctx = self.model.disable_adapter() if not adapter and hasattr(self.model, "disable_adapter") \
            else contextlib.nullcontext()
        with ctx, adapter_ctx:
            targets = input_ids[b_idx.to(dev), t_idx.to(dev)]  # [n]
            logp, ent = self.token_model(input_ids, mask, mb.position_ids.to(dev), b_idx.to(dev), prev.to(dev),
                                         targets, **extra)
        return TokenBatch(
            logprobs=logp, entropy=ent.detach(),
            old_logprobs=mb.logprobs[b_idx, t_idx].to(dev),
            advantages=mb.advantages[b_idx, t_idx].to(dev),
            weights=mb.weights[b_idx, t_idx].to(dev),
            sequence_ids=mb.sequence_ids[b_idx, t_idx].to(dev),
        )

    # ------------------------------------------------------------------ steps
    def run(self, packed: PackedRows, plan: BatchPlan, loss_fn: LossFn, learning_rates: list[float], *,
            optimizer: OptimizerConfig | None = None, need_ref: bool = False, desc: str = "train",
            show_progress: bool = True) -> Iterator[dict[str, float]]:
        """Run every optimizer step of `plan`; yields one metrics dict per step."""
        if len(learning_rates) != len(plan.steps):
            raise ValueError(f"{len(learning_rates)} learning rates for {len(plan.steps)} steps")
        optimizer = optimizer or OptimizerConfig()
        bar = tqdm(total=plan.num_micro_batches, desc=desc, unit="mb", disable=not show_progress, leave=False)
        try:
            with self.model_lock, self._own_rng():
                self.model.train()
                for index, (step, lr) in enumerate(zip(plan.steps, learning_rates)):
                    metrics = self._step(packed, step, loss_fn, lr, optimizer, need_ref, bar)
                    if index:  # later passes run updated weights: they no longer measure the record
                        for key in SAMPLED_DELTA_KEYS:
                            metrics.pop(key, None)
                    yield metrics
        finally:
            bar.close()
            self.model.eval()

    def accumulate(self, packed: PackedRows, step: Any, loss_fn: LossFn, *, need_ref: bool = False,
                   bar: tqdm | None = None) -> dict[str, float]:
        """Forward/backward every micro-batch of one optimizer step; gradients accumulate in .grad.

        Each micro-batch's loss sum is divided by the step's total weight, so the sum over
        micro-batches is the step's token-mean loss however the rows are split.
        """
        denom = float(packed.weights[step.rows].sum())
        totals = new_totals()
        for mb in step.micro_batches:
            self.micro_step(packed, mb, loss_fn, denom, totals, need_ref=need_ref)
            if bar is not None:
                bar.update(1)
        return totals

    def micro_step(self, packed: PackedRows, mb: Any, loss_fn: LossFn, denom: float, totals: dict[str, float], *,
                   need_ref: bool = False, always_backward: bool = False, scale: float = 1.0) -> None:
        """One forward/backward pass over micro-batch `mb` (rows of `packed`); adds its figures to `totals`.

        The loss sum is divided by `denom`, the whole optimizer step's weight, and multiplied by `scale`.
        A pass with nothing to learn skips backward unless `always_backward` (a sharded model's ranks must
        all run every backward: distributed/sharding.py, which also runs zero-`scale` padding passes).
        """
        sub = packed.select(mb.rows, mb.width)
        totals["computed"] += sub.input_ids.numel()
        tb = self.forward_tokens(sub)
        _add_sampled_delta(totals, tb)
        if need_ref:
            tb.ref_logprobs = self.forward_tokens(sub, grad=False, adapter=False).logprobs
        terms = loss_fn(tb)
        if denom > 0 and terms.weight_sum > 0:
            (terms.loss_sum / denom if scale == 1.0 else terms.loss_sum / denom * scale).backward()
        elif always_backward:
            (terms.loss_sum * 0.0).backward()
        totals["loss"] += float(terms.loss_sum.detach()) / max(denom, 1e-12)
        totals["policy"] += terms.policy_sum
        totals["kl"] += terms.kl_sum
        totals["entropy"] += terms.entropy_sum
        totals["clipped"] += terms.clipped_tokens
        totals["ratio"] += terms.ratio_sum
        totals["weight"] += terms.weight_sum

    def _step(self, packed: PackedRows, step: Any, loss_fn: LossFn, lr: float, optimizer: OptimizerConfig,
              need_ref: bool, bar: tqdm) -> dict[str, float]:
        t0 = time.perf_counter()
        settings = optimizer.optimizer_settings()
        max_grad_norm = optimizer.max_grad_norm
        for g in self.optimizer.param_groups:
            g["lr"] = lr
            g.update(settings)
        self.optimizer.zero_grad(set_to_none=True)
        totals = self.accumulate(packed, step, loss_fn, need_ref=need_ref, bar=bar)
        computed = int(totals["computed"])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm or float("inf"))
        finite = math.isfinite(totals["loss"]) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
            self.optimizer_steps += 1
        else:
            log.error("non-finite loss (%s) or gradient norm (%s): optimizer step refused, gradients dropped",
                      totals["loss"], float(grad_norm))
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
        if need_ref:
            metrics["kl"] = totals["kl"] / w
        if totals["delta_tokens"]:
            metrics["sampled_logprob_delta_mean"] = totals["delta_sum"] / totals["delta_tokens"]
            metrics["sampled_logprob_delta_max"] = totals["delta_max"]
            metrics["sampled_logprob_tokens"] = totals["delta_tokens"]
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
        return metrics
