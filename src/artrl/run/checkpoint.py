"""Saving and restoring a trainer's checkpoint in the run directory.

A checkpoint (layout in storage.py) holds the LoRA adapter in peft's format,
the AdamW state and the trainer's own RNG state (`optimizer.pt`), and
`trainer_state.json` (step, optimizer steps, base model, the step's history
line). It is written through `storage.write_checkpoint`, so a reader sees a
whole checkpoint or none.

Restoring tells two kinds of failure apart:

* the files are unreadable or do not fit this model (truncated safetensors,
  garbage pickles, JSON that does not parse, adapter tensors of other shapes):
  a `CheckpointError` that names the directory and says that deleting it
  resumes from the previous checkpoint, with the original error as its cause;
* anything else (e.g. a library API change, a bug) propagates unchanged: it is
  not the checkpoint's fault, and no one should delete data over it.

A checkpoint whose adapter was built with other LoRA settings than the model
now asks for (rank, alpha, dropout, rslora, target modules, layers: peft's
`adapter_config.json` against the trainer's adapter) is a `ConfigError` naming
each difference: a run keeps the adapter it started with (ART 0.5.23's
`lora_config`), so the remedy is that run's settings or a new run.

Older checkpoints that stored the process-wide RNG states (`torch_rng`) are
read too: their CPU state becomes the trainer's.
"""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ConfigError
from . import storage

if TYPE_CHECKING:
    import torch  # imported where a checkpoint is written or read, not with `import artrl`

log = logging.getLogger(__name__)

# keys of optimizer.pt
OPTIMIZER_KEY = "optimizer"
OPTIM_NAME_KEY = "optim"  # the optimizer that wrote OPTIMIZER_KEY (train/optimizers.py); absent: torch's AdamW
TRAINER_RNG_KEY = "trainer_rng"
LEGACY_TORCH_RNG_KEY = "torch_rng"

DELETE_ADVICE = "Delete that directory to resume from the previous checkpoint."

#: keys of peft's adapter_config.json that decide what a saved adapter is, with ART's lora_config names
ADAPTER_SETTINGS = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "use_rslora": "use_rslora",
                    "target_modules": "target_modules", "target_parameters": "target_modules ('experts')",
                    "layers_to_transform": "layers_to_transform", "layers_pattern": "layers_pattern",
                    "bias": "bias"}


@dataclass
class Restored:
    step: int
    optimizer_steps: int
    history_record: dict[str, Any] | None


def save(trainer: Any, run: Path, step: int, base_model: str, history_record: dict[str, Any] | None, *,
         adapter_state: dict[str, torch.Tensor] | None = None, optimizer_state: dict[str, Any] | None = None,
         optimizer_name: str | None = None) -> Path:
    """Write checkpoint `step` of `trainer` (adapter, optimizer, RNG, trainer state) atomically.

    `adapter_state` (the model's parameter names -> tensors) and `optimizer_state` (as
    `Optimizer.state_dict()` keys it) replace what the trainer's model and optimizer hold: a sharded
    trainer passes the full tensors it gathered from every rank (distributed/checkpoint.py), with the name of
    the optimizer whose format they are in (`optimizer_name`; None: the trainer's own).
    """
    import torch

    adapter = {} if adapter_state is None else {"state_dict": adapter_state}

    def write(tmp: Path) -> None:
        trainer.model.save_pretrained(str(tmp), selected_adapters=["default"], **adapter)
        optimizer = trainer.optimizer.state_dict() if optimizer_state is None else optimizer_state
        torch.save({OPTIMIZER_KEY: optimizer, OPTIM_NAME_KEY: optimizer_name or trainer.optim.name,
                    TRAINER_RNG_KEY: trainer.rng_state()}, tmp / storage.OPTIMIZER_FILE)
        with open(tmp / storage.TRAINER_STATE_FILE, "w") as fh:
            json.dump({"step": step, "optimizer_steps": trainer.optimizer_steps, "base_model": base_model,
                       "history_record": history_record}, fh)

    with trainer.model_lock:
        return storage.write_checkpoint(run, step, write, {"base_model": base_model})


def _unreadable(path: Path, what: str, error: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is corrupted or incomplete: {what} cannot be read "
                           f"({type(error).__name__}: {str(error)[:300]}). {DELETE_ADVICE}")


def _read_files(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(adapter weights, optimizer.pt contents, trainer_state.json) or a CheckpointError naming the file."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    adapter = path / storage.ADAPTER_WEIGHTS_FILE
    try:
        weights = load_file(str(adapter))
    except (OSError, SafetensorError) as e:
        raise _unreadable(path, storage.ADAPTER_WEIGHTS_FILE, e) from e
    try:
        # weights_only: a checkpoint directory is data, never code (no arbitrary unpickling)
        opt = torch.load(path / storage.OPTIMIZER_FILE, weights_only=True)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
        raise _unreadable(path, storage.OPTIMIZER_FILE, e) from e
    if not isinstance(opt, dict) or OPTIMIZER_KEY not in opt or not ({TRAINER_RNG_KEY, LEGACY_TORCH_RNG_KEY} & set(opt)):
        raise _unreadable(path, storage.OPTIMIZER_FILE, ValueError("it lacks the optimizer or RNG state"))
    try:
        state = json.loads((path / storage.TRAINER_STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise _unreadable(path, storage.TRAINER_STATE_FILE, e) from e
    if not isinstance(state, dict):
        raise _unreadable(path, storage.TRAINER_STATE_FILE, ValueError("it is not a JSON object"))
    return weights, opt, state


def _setting(value: Any) -> Any:
    """An adapter setting in one form, on disk (JSON lists) or in peft's config (sets, a bare int layer)."""
    if isinstance(value, (set, frozenset, list, tuple)):
        return sorted(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # alpha 16 on disk, 16.0 in the config
    return value


def check_adapter_settings(trainer: Any, path: Path) -> None:
    """ConfigError when checkpoint `path`'s adapter_config.json differs from the trainer's adapter (see the
    module docstring); nothing to compare in a checkpoint without that file (its weights are checked anyway)."""
    file = path / storage.ADAPTER_CONFIG_FILE
    try:
        saved = json.loads(file.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise _unreadable(path, storage.ADAPTER_CONFIG_FILE, e) from e
    current = trainer.model.peft_config["default"]
    diffs = []
    for key, art_name in ADAPTER_SETTINGS.items():
        if key not in saved:
            continue
        on_disk, now = saved[key], getattr(current, key, None)
        if key == "layers_to_transform" and isinstance(now, int):
            now = [now]
        if _setting(on_disk) != _setting(now):
            diffs.append(f"{art_name} ({key}): {on_disk!r} in the checkpoint, {now!r} now")
    if diffs:
        raise ConfigError(f"checkpoint {path} holds an adapter built with other LoRA settings than this model asks "
                          f"for: {'; '.join(diffs)}. A run keeps the adapter it started with: give the model the "
                          "run's settings (lora_config / _internal_config), or a new run_name to start a new run.")


def restore(trainer: Any, run: Path, step: int, base_model: str) -> Restored:
    """Load checkpoint `step` into `trainer`; see the module docstring for the errors."""
    from peft import set_peft_model_state_dict

    path = storage.checkpoint_dir(run, step)
    marker = storage.read_marker(path)
    if marker.get("base_model") != base_model:
        raise CheckpointError(
            f"checkpoint {path} was trained from base model {marker.get('base_model')!r}, but this run uses "
            f"{base_model!r}. Register with the original base model, or use a new model name.")
    check_adapter_settings(trainer, path)
    weights, opt, state = _read_files(path)
    with trainer.model_lock:
        try:
            result = set_peft_model_state_dict(trainer.model, weights, adapter_name="default")
        except RuntimeError as e:  # torch's "size mismatch for ..." when copying tensors of other shapes
            raise CheckpointError(
                f"checkpoint {path} has adapter weights that do not fit this model ({str(e)[:300]}): was it "
                f"trained with another LoRA configuration, or is its adapter file damaged? {DELETE_ADVICE}") from e
    unexpected = getattr(result, "unexpected_keys", []) or []
    missing = [k for k in getattr(result, "missing_keys", []) or [] if ".lora_" in k and ".default." in k]
    if unexpected or missing:
        bad = unexpected or missing
        raise CheckpointError(
            f"checkpoint {path} has adapter weights that do not match this model ({len(unexpected)} "
            f"unexpected, {len(missing)} missing, e.g. {bad[0]!r}): was it trained with another LoRA "
            f"configuration, or is its adapter file damaged? {DELETE_ADVICE}")
    with trainer.model_lock:
        try:
            trainer.load_optimizer_state(opt[OPTIMIZER_KEY], opt.get(OPTIM_NAME_KEY))
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path} has optimizer state that does not fit this model ({e}); "
                                  f"was it trained with another LoRA configuration? {DELETE_ADVICE}") from e
    rng = opt.get(TRAINER_RNG_KEY) or {"cpu": opt.get(LEGACY_TORCH_RNG_KEY)}
    try:
        trainer.set_rng_state(rng)
    except (ValueError, AttributeError) as e:
        raise _unreadable(path, f"the RNG state in {storage.OPTIMIZER_FILE}", e) from e
    log.info("resumed from checkpoint %s", path)
    return Restored(step=step, optimizer_steps=int(state.get("optimizer_steps", 0)),
                    history_record=state.get("history_record"))
