"""A bitsandbytes optimizer over each rank's shards of FSDP2's parameters.

bitsandbytes' optimizers take plain tensors, not the DTensors FSDP2 makes of every trained
parameter, so `ShardOptimizer` steps the local shard of each one (`DTensor.to_local()`, the
very storage FSDP2 gathers from): before a step each shard is given its local gradient, and
the moments live per shard. Clipping has already seen the global gradient norm (the trainer
clips the DTensors).

Two things keep a sharded run equal to one process:

* whether a tensor's moments are 8-bit follows the whole tensor's size, as in one process
  (bitsandbytes would look at the shard's, often below its 4096-element minimum);
* where the shards split a tensor at a multiple of bitsandbytes' 256-element block, every
  block of a shard is a block of the one-process tensor, so the 8-bit moments are the same
  bytes (tests/test_distributed.py: the same updates to 1e-4).

A checkpoint holds the full moments in float32 (`full_moments`, all-gathered: nothing in it
depends on the world size; written in torch AdamW's format, train/optimizers.py converts),
and a restored rank quantises its own slice of them again (`load_full_moments`). That detour
is not exact: a block whose largest moment is negative dequantises to 0.993 of its scale (the
8-bit map's most negative code), so quantised again its scale comes out 0.7% smaller. A step
after a sharded checkpoint differs from the uninterrupted run's by about 5e-3 of the update
(measured on the tiny model); a resume in one process restores the optimizer's own bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config.optimizers import OptimSpec
from ..train.optimizers import MIN_8BIT_SIZE, bnb_class, moments, set_moments

_NEVER = 2**62  # a minimum size no shard reaches: float32 moments


def _full_size_rule(base: type) -> type:
    """A subclass of bitsandbytes optimizer `base` that decides 8-bit moments by a given minimum per parameter
    (`min_sizes`, by (group, index)) instead of by the shard's own size."""

    class FullSizeRule(base):  # type: ignore[misc, valid-type]
        min_sizes: dict[tuple[int, int], int] = {}

        def get_config(self, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
            config = super().get_config(gindex, pindex, group)
            config["min_8bit_size"] = self.min_sizes[(gindex, pindex)]
            return config

    return FullSizeRule


class ShardOptimizer:
    """The optimizer a sharded trainer steps (module docstring): the parts of torch's Optimizer the trainer uses."""

    def __init__(self, params: list[torch.nn.Parameter], spec: OptimSpec) -> None:
        self.params = params
        with torch.no_grad():
            self._locals = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        # shards with no rows on this rank take no part in the local optimizer
        self._index = [i for i, t in enumerate(self._locals) if t.numel() > 0]
        from ..types import OptimizerConfig

        on_cuda = any(t.device.type == "cuda" for t in self._locals)
        self.inner = _full_size_rule(bnb_class(spec, paged=spec.paged and on_cuda))([self._locals[i] for i in self._index], lr=1e-5,
                                                      **OptimizerConfig().optimizer_settings())
        self.inner.min_sizes = {(0, k): 0 if params[i].numel() >= MIN_8BIT_SIZE else _NEVER
                                for k, i in enumerate(self._index)}

    # ------------------------------------------------------------------ what the trainer calls
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for t in self._locals:
            t.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, local in zip(self.params, self._locals):
            grad = p.grad
            local.grad = (grad.to_local() if isinstance(grad, DTensor) else grad) if grad is not None else None
        self.inner.step()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    # ------------------------------------------------------------------ checkpoints
    def full_moments(self) -> dict[int, dict[str, Any]]:
        """Every parameter's full float32 moments and step (by index among `params`); a collective: every rank
        calls it, and every rank gets them."""
        local = moments(self.inner)  # by index in `inner`
        step = max((entry["step"] for entry in local.values()), default=0)
        out: dict[int, dict[str, Any]] = {}
        for k, p in enumerate(self.params):
            inner_k = self._index.index(k) if k in self._index else None
            entry = local.get(inner_k) if inner_k is not None else None
            shard = self._locals[k]
            full = {}
            for key in ("exp_avg", "exp_avg_sq"):
                value = entry[key] if entry is not None else torch.zeros(shard.shape, dtype=torch.float32,
                                                                         device=shard.device)
                if isinstance(p, DTensor):
                    value = DTensor.from_local(value.to(shard.device), p.device_mesh, p.placements, shape=p.shape,
                                               stride=p.stride()).full_tensor()
                full[key] = value
            out[k] = {**full, "step": step}
        return out

    def load_full_moments(self, full: dict[int, dict[str, Any]]) -> None:
        """Each rank keeps its slice of full moments (`full_moments`' form, or `train.optimizers.moments` of an
        optimizer over the unsharded parameters) and quantises it as its own optimizer does."""
        mine: dict[int, dict[str, Any]] = {}
        for k, i in enumerate(self._index):
            entry = full.get(i)
            if entry is None:
                continue
            p = self.params[i]
            sliced = {}
            for key in ("exp_avg", "exp_avg_sq"):
                value = entry[key].to(self._locals[i].device)
                if isinstance(p, DTensor):
                    value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
                sliced[key] = value
            mine[k] = {**sliced, "step": entry["step"]}
        set_moments(self.inner, mine)


def torch_adamw_state(full: dict[int, dict[str, Any]], shapes: list[torch.Size]) -> dict[str, Any]:
    """`full` moments as torch AdamW's `state_dict()` (what a checkpoint holds when `ShardOptimizer` wrote it)."""
    stand_ins = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    adamw = torch.optim.AdamW(stand_ins)
    set_moments(adamw, full)
    return adamw.state_dict()
