"""Checkpoints of a sharded trainer, in exactly the files the in-process trainer writes.

A checkpoint holds FULL tensors, never shards: the LoRA adapter in peft's format
(`adapter_model.safetensors`, `adapter_config.json`) and the AdamW state in
`optimizer.pt` keyed by parameter index, as `torch.optim.Optimizer.state_dict()`
keys it in one process. Nothing in it depends on the world size, so a run
trained by 2 workers resumes on 1 (or in-process) and the other way round.

* Saving (`gather`, every rank; `write`, rank 0): each trainable parameter is
  all-gathered with `DTensor.full_tensor()` (only the adapter: the frozen base
  weights are never gathered), and the optimizer state with
  `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(...,
  full_state_dict=True, cpu_offload=True)`, which lands on rank 0's CPU. Rank 0
  writes through `storage.write_checkpoint` (temporary directory, fsync,
  COMPLETE marker, rename), so a rank killed mid-write leaves no checkpoint.
* Restoring (`read`, `load_adapter` before sharding, `load_optimizer` after):
  every rank reads the files; the adapter goes into the unsharded peft model
  (sharding then distributes it) and the optimizer state through
  `set_optimizer_state_dict(..., full_state_dict=True)`, which keeps each
  rank's shard.

RNG: rank 0's CPU RNG and Python `random` states are saved as in one process
(the CUDA states are not: each rank has its own device). On restore every rank
takes the saved states and ranks > 0 then reseed from them and their rank, so
LoRA dropout differs per rank and is reproducible for a given world size.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..local import storage

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def trainable_names(model: Any) -> list[str]:
    """Names of the trained parameters, in the optimizer's order (index i of optimizer.pt is name i)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def gather(trainer: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(adapter tensors by the model's parameter names, optimizer state keyed by index): full, on CPU, on
    rank 0; empty dicts on the other ranks. A collective: every rank calls it."""
    rank0 = dist.get_rank() == 0
    adapter: dict[str, torch.Tensor] = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if rank0:
                adapter[name] = full.detach().to("cpu", copy=True)
    by_name = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=_FULL)
    if not rank0:
        return {}, {}
    names = trainable_names(trainer.model)
    index = {n: i for i, n in enumerate(names)}
    state = {index[n]: s for n, s in by_name["state"].items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return adapter, {"state": state, "param_groups": groups}


def write(run: Path, step: int, trainer: Any, adapter: dict[str, torch.Tensor], optimizer: dict[str, Any],
          trainer_state: dict[str, Any], marker: dict[str, Any]) -> Path:
    """Rank 0: checkpoint `step` of `run`, atomically, in the in-process layout (local/storage.py)."""

    def files(tmp: Path) -> None:
        trainer.model.save_pretrained(str(tmp), selected_adapters=["default"], state_dict=adapter)
        torch.save({"optimizer": optimizer, "torch_rng": torch.get_rng_state(), "cuda_rng": None,
                    "python_rng": random.getstate()}, tmp / storage.OPTIMIZER_FILE)
        with open(tmp / storage.TRAINER_STATE_FILE, "w") as fh:
            json.dump(trainer_state, fh)

    return storage.write_checkpoint(run, step, files, marker)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(adapter weights as saved by peft, the optimizer.pt dict, trainer_state.json) of a complete checkpoint."""
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path / storage.ADAPTER_WEIGHTS_FILE))
        # weights_only: a checkpoint directory is data, never code
        opt = torch.load(path / storage.OPTIMIZER_FILE, weights_only=True)
        trainer_state = json.loads((path / storage.TRAINER_STATE_FILE).read_text())
        if not isinstance(opt, dict) or not {"optimizer", "torch_rng", "python_rng"} <= set(opt):
            raise ValueError(f"{storage.OPTIMIZER_FILE} lacks the optimizer or RNG state")
        if not isinstance(trainer_state, dict):
            raise ValueError(f"{storage.TRAINER_STATE_FILE} is not a JSON object")
    except Exception as e:  # SafetensorError, UnpicklingError, EOFError, ...: all mean the same here
        raise CheckpointError(
            f"checkpoint {path} is corrupted or incomplete ({type(e).__name__}: {str(e)[:300]}). Delete that "
            "directory to resume from the previous checkpoint.") from e
    return weights, opt, trainer_state


def load_adapter(model: Any, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Put saved adapter weights into an unsharded peft model (raises if they do not fit it)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, weights, adapter_name="default")
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if ".lora_" in k and ".default." in k]
    if unexpected or missing:
        bad = unexpected or missing
        raise CheckpointError(
            f"checkpoint {path} has adapter weights that do not match this model ({len(unexpected)} unexpected, "
            f"{len(missing)} missing, e.g. {bad[0]!r}): was it trained with another LoRA configuration? Delete "
            "that directory to resume from the previous checkpoint.")


def load_optimizer(trainer: Any, saved: dict[str, Any], path: Path) -> None:
    """Every rank: the saved full optimizer state (keyed by index) into this rank's shards."""
    names = trainable_names(trainer.model)
    state = saved.get("state", {})
    if not state:
        return  # checkpoint 0: nothing stepped yet; a fresh AdamW is that state
    try:
        by_name = {"state": {names[int(i)]: s for i, s in state.items()},
                   "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                    for g in saved["param_groups"]]}
        set_optimizer_state_dict(trainer.model, trainer.optimizer, by_name,
                                 options=StateDictOptions(full_state_dict=True))
    except (IndexError, KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path} has optimizer state that does not fit this model ({e}); was it "
                              "trained with another LoRA configuration?") from e


def restore_rng(saved: dict[str, Any], rank: int) -> None:
    """The saved RNG states on rank 0; on other ranks, a seed drawn from them plus the rank."""
    torch.set_rng_state(saved["torch_rng"])
    random.setstate(saved["python_rng"])
    if rank > 0:
        seed = int(torch.randint(0, 2**62, (1,))) + rank
        torch.manual_seed(seed)
        random.seed(seed)
