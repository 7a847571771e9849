"""Checkpoints of a sharded trainer, in exactly the files the in-process trainer writes.

A checkpoint holds FULL tensors, never shards: the LoRA adapter in peft's format
and the AdamW state keyed by parameter index, as `Optimizer.state_dict()` keys
it in one process (run/checkpoint.py writes and reads both). Nothing in it
depends on the world size, so a run trained by 2 workers resumes on 1 (or in
one process) and the other way round.

* Saving (`gather` on every rank, then rank 0 calls `local.checkpoint.save`
  with the gathered tensors): each trainable parameter is all-gathered with
  `DTensor.full_tensor()` (the adapter only: the frozen base weights are never
  gathered), and the optimizer state with
  `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(...,
  full_state_dict=True, cpu_offload=True)`, which lands on rank 0's CPU. The
  write is `storage.write_checkpoint`'s (temporary directory, fsync, COMPLETE
  marker, rename), so a rank killed mid-write leaves no checkpoint.
* Restoring: every rank restores the checkpoint into an unsharded trainer with
  `local.checkpoint.restore` (the same checks and errors as in one process),
  then `ShardedTrainer.from_trainer` shards the model and hands the full
  optimizer state to `load_full_optimizer_state`, which keeps each rank's
  shard (`set_optimizer_state_dict(..., full_state_dict=True)`).

RNG: rank 0 keeps the trainer RNG state of the checkpoint and saves its own;
every other rank draws a seed from that state and adds its rank
(`rank_rng_seed`), so LoRA dropout differs per rank and a run is reproducible
for a given world size. A 1-worker group draws exactly what one process does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError

_FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def trainable_names(model: Any) -> list[str]:
    """Names of the trained parameters, in the optimizer's order (index i of a saved state is name i)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def gather(trainer: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    """(adapter tensors by parameter name, optimizer state keyed by index, the name of the optimizer whose format
    that state is in), full and on the CPU, on rank 0; empty dicts on the other ranks. A collective: every rank
    calls it. A bitsandbytes optimizer's moments are gathered in float32, in torch AdamW's format."""
    from ..config.optimizers import DEFAULT_OPTIM
    from .shard_optimizer import ShardOptimizer, torch_adamw_state

    rank0 = dist.get_rank() == 0
    adapter: dict[str, torch.Tensor] = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if rank0:
                adapter[name] = full.detach().to("cpu", copy=True)
    if isinstance(trainer.optimizer, ShardOptimizer):
        moments = trainer.optimizer.full_moments()
        if not rank0:
            return {}, {}, DEFAULT_OPTIM
        cpu = {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in m.items()} for i, m in moments.items()}
        return adapter, torch_adamw_state(cpu, [p.shape for p in trainer.params]), DEFAULT_OPTIM
    by_name = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=_FULL_ON_CPU)
    if not rank0:
        return {}, {}, trainer.optim.name
    index = {n: i for i, n in enumerate(trainable_names(trainer.model))}
    return adapter, {"state": {index[n]: s for n, s in by_name["state"].items()},
                     "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                      for g in by_name["param_groups"]]}, trainer.optim.name


def load_full_optimizer_state(trainer: Any, saved: dict[str, Any], where: str) -> None:
    """Every rank: a full optimizer state (keyed by index, as one process saves it) into this rank's shards."""
    if not saved.get("state"):
        return  # nothing stepped yet: a fresh AdamW is that state
    names = trainable_names(trainer.model)
    try:
        by_name = {"state": {names[int(i)]: s for i, s in saved["state"].items()},
                   "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                    for g in saved["param_groups"]]}
        set_optimizer_state_dict(trainer.model, trainer.optimizer, by_name,
                                 options=StateDictOptions(full_state_dict=True))
    except (IndexError, KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"the optimizer state of {where} does not fit the sharded model ({e}); was it "
                              "trained with another LoRA configuration?") from e


def rank_rng_seed(state: dict[str, Any], rank: int) -> int:
    """A seed for rank > 0, drawn from the (checkpointed) trainer RNG state, plus the rank."""
    g = torch.Generator()
    g.set_state(state["cpu"])
    return int(torch.randint(0, 2**62, (1,), generator=g)) + rank
