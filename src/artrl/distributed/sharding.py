"""FSDP2-sharded training on one rank of a data-parallel group: the model wrap and the train step.

The wrap (`shard`): `torch.distributed.fsdp.fully_shard` on every decoder layer
(the classes transformers lists in `_no_split_modules`), then on the trainer's
`TokenLogprobModel` (embeddings, final norm, LM head; a tied LM head stays one
parameter) as the root. Each rank holds 1/world of every weight, LoRA adapter
and AdamW moments included; a layer's full weights exist only while it runs.
Two settings differ from FSDP2's defaults:

* gradients are SUMMED across ranks (`set_gradient_divide_factor(1.0)` with
  `set_force_sum_reduction_for_comms(True)`: a plain SUM, which gloo supports,
  where the default averages). Each rank divides its micro-batches' loss sums by the
  whole step's trainable weight, so the sum over ranks is the step's gradient,
  the same as in one process;
* a parameter that a pass did not reach is reduce-scattered as zeros
  (`set_reduce_scatter_unused_params(True)`), so the collectives of all ranks
  line up whatever their data.

The step (`ShardedTrainer.accumulate`): this rank's share of the step's rows
(balance.py), then zero-weight padding passes until every rank has run the
same number, then the loss figures summed over ranks, so every rank takes the
same decision about a non-finite step. Clipping sees the global gradient norm
(the gradients are DTensors); AdamW steps each rank's shard (a bitsandbytes optimizer through
shard_optimizer.py). Quantised base weights are not sharded: each rank holds them whole.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..preprocess.rows import PackedRows
from ..preprocess.plan import BatchPlan
from ..runtime.progress import ProgressBar
from ..config.model import InternalModelConfig
from ..types import OptimizerConfig
from ..models.structure import decoder_layers
from ..train.optimizers import moments
from ..train.logprobs import TokenLogprobModel
from ..train.trainer import LossFn, StepOptions, Trainer, new_totals
from .balance import padding_batch, split_step
from .shard_optimizer import ShardOptimizer

log = logging.getLogger(__name__)


def _combine(totals: dict[str, float], device: torch.device) -> dict[str, float]:
    """A step's figures over all ranks: sums, and maxima for the `*_max` keys; every rank gets the same."""
    keys = sorted(totals)
    on = device if device.type == "cuda" else torch.device("cpu")  # NCCL wants the GPU, gloo the CPU
    sums = torch.tensor([0.0 if k.endswith("_max") else totals[k] for k in keys], dtype=torch.float64, device=on)
    maxima = torch.tensor([totals[k] if k.endswith("_max") else 0.0 for k in keys], dtype=torch.float64, device=on)
    dist.all_reduce(sums)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return {k: (m if k.endswith("_max") else v) for k, v, m in zip(keys, sums.tolist(), maxima.tolist())}


def shard(token_model: TokenLogprobModel) -> None:
    """fully_shard every decoder layer, then the forward module as the root (in place). Quantised weights
    (bitsandbytes) stay whole on every rank, as accelerate leaves them: FSDP2 ignores them."""
    from ..models.quantization import quantized_params

    for layer in decoder_layers(token_model.backbone):
        fully_shard(layer, ignored_params=set(quantized_params(layer)) or None)
    fully_shard(token_model, ignored_params=set(quantized_params(token_model)) or None)
    root: Any = token_model
    assert isinstance(root, FSDPModule)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not mean: the loss is already normalised by the whole step
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM), nothing to divide
    root.set_reduce_scatter_unused_params(True, recurse=True)


class ShardedTrainer(Trainer):
    """A Trainer whose model is FSDP2-sharded over the default process group; one per rank.

    `rank_tokens` / `rank_padding` count every rank's computed tokens and padding passes since
    `reset_balance()` (the split is deterministic, so each rank knows all of them): the balance
    that train calls and `artrl bench train --workers N` report.
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: InternalModelConfig | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ShardedTrainer needs torch.distributed initialised (init_process_group) first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        super().__init__(model, tokenizer, cfg, wrap=shard)
        self._plan: BatchPlan | None = None
        self.rank_tokens = [0] * self.world_size
        self.rank_padding = [0] * self.world_size

    @classmethod
    def from_trainer(cls, plain: Trainer, where: str = "the restored checkpoint") -> "ShardedTrainer":
        """Shard the model of an unsharded trainer (restored from a checkpoint, run/checkpoint.py); its
        optimizer state, optimizer step count and RNG state carry over (distributed/checkpoint.py)."""
        from .checkpoint import load_full_optimizer_state, rank_rng_seed

        rng = plain.rng_state()
        if plain.optim.bnb:  # bitsandbytes' moments: each rank quantises its slice of the full ones
            full = moments(plain.optimizer)
            sharded = cls(plain.model, plain.tokenizer, plain.cfg)
            sharded.optimizer.load_full_moments(full)
        else:
            full = plain.optimizer.state_dict()
            sharded = cls(plain.model, plain.tokenizer, plain.cfg)
            load_full_optimizer_state(sharded, full, where)
        sharded.optimizer_steps = plain.optimizer_steps
        if sharded.rank == 0:
            sharded.set_rng_state(rng)
        else:
            sharded.set_rng_state(sharded._seeded_rng_state(rank_rng_seed(rng, sharded.rank)))
        return sharded

    def _build_optimizer(self, fused: bool) -> tuple[Any, dict[str, Any]]:
        """torch's AdamW takes the DTensors; a bitsandbytes optimizer steps this rank's shards (shard_optimizer.py)."""
        if self.optim.bnb:
            return ShardOptimizer(self.params, self.optim), {}
        return super()._build_optimizer(fused)

    def run(self, packed: PackedRows, plan: BatchPlan, loss_fn: LossFn, learning_rates: list[float], *,
            optimizer: OptimizerConfig | None = None, need_ref: bool = False, options: StepOptions | None = None,
            desc: str = "train", show_progress: bool = True) -> Iterator[dict[str, float]]:
        self._plan = plan
        show = show_progress and self.rank == 0
        try:
            yield from super().run(packed, plan, loss_fn, learning_rates, optimizer=optimizer, need_ref=need_ref,
                                   options=options, desc=desc, show_progress=show)
        finally:
            self._plan = None

    def accumulate(self, packed: PackedRows, step: Any, loss_fn: LossFn, *, need_ref: bool = False,
                   bar: ProgressBar | None = None, options: StepOptions | None = None,
                   original_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """This rank's passes of one optimizer step, then the step's figures combined over all ranks."""
        if self._plan is None:
            raise RuntimeError("ShardedTrainer.accumulate runs inside run(), which knows the plan")
        opts = options or StepOptions(need_ref=need_ref)
        shares = split_step(packed, self._plan, step, self.world_size)
        mine = shares[self.rank]
        denom = float(packed.weights[step.rows].sum())  # the WHOLE step's weight, the same on every rank
        pad = padding_batch(packed, self._plan, step) if mine.padding else None
        refs: dict[int, torch.Tensor] = {}
        pad_ref: dict[int, torch.Tensor] = {}  # the padding batch's reference logprobs, once the KL pass has them
        kl_mean = None
        if opts.need_ref and opts.kl_step_mean:
            # ART's KL-penalised advantages use the mean over the WHOLE step: sum over every rank's share
            total, count = self.kl_sums(packed, mine.micro_batches, opts, refs)
            for _ in range(mine.padding):  # the same number of (collective) forwards on every rank
                self.kl_sums(packed, [pad], opts, pad_ref)
            sums = torch.tensor([total, float(count)], dtype=torch.float64, device=self._collective_device())
            dist.all_reduce(sums)
            kl_mean = float(sums[0] / sums[1]) if float(sums[1]) else 0.0
        totals = new_totals()
        for i, mb in enumerate(mine.micro_batches):
            # every backward runs, even with nothing to learn in it: a skipped backward skips a reduce-scatter
            self.micro_step(packed, mb, loss_fn, denom, totals, opts=opts, ref=refs.pop(i, None), kl_mean=kl_mean,
                            original_logprobs=original_logprobs, always_backward=True)
        for _ in range(mine.padding):  # zero-weight passes (the reference forward too): every collective runs
            # a real pass reuses its reference from the KL pass, so a padding pass must too: a reference forward
            # here only on the ranks that pad would leave the other ranks waiting in a collective
            self.micro_step(packed, pad, loss_fn, denom, new_totals(), opts=opts, ref=pad_ref.get(0),
                            kl_mean=kl_mean, original_logprobs=original_logprobs, always_backward=True, scale=0.0)
        if bar is not None:
            bar.update(len(step.micro_batches))
        for k, s in enumerate(shares):
            self.rank_tokens[k] += s.computed_tokens
            self.rank_padding[k] += s.padding
        if self.routing is not None:  # an MoE model's router health: every rank's share of the step's tokens
            self.routing.reduce(self._all_reduce_on_device)
        return _combine(totals, self.device)

    def _all_reduce_on_device(self, t: torch.Tensor) -> None:
        """Sum a host tensor over ranks, in place (NCCL reduces on the GPU)."""
        on = t.to(self._collective_device())
        dist.all_reduce(on)
        t.copy_(on.cpu())

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def reset_balance(self) -> None:
        self.rank_tokens = [0] * self.world_size
        self.rank_padding = [0] * self.world_size
