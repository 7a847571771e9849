"""Switching peft LoRA adapters for inference without disturbing a trainer.

The served model is usually the trainer's own `PeftModel`: its active adapter
("default") holds the live trained weights, its parameters are in an optimizer,
and the trainer may have left it in train mode. Serving a checkpoint means
loading that checkpoint as another named adapter and switching to it for a
batch; serving the base model (`BASE_WEIGHTS`) switches every adapter off with
peft's `disable_adapter` for the batch. peft's `load_adapter` and `set_adapter` also flip `requires_grad` flags
(`set_adapter(name)` makes `name` trainable and freezes the others), so every
switch here snapshots each module's train/eval mode and each parameter's
`requires_grad` and restores them afterwards. Callers hold the engine's
`model_lock`, so the trainer never sees the model mid-switch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from artrl.serve.engine import BASE_WEIGHTS, InvalidRequestError


@contextlib.contextmanager
def preserved_training_state(model: Any) -> Iterator[None]:
    """Restore every module's train/eval mode and every parameter's requires_grad on exit."""
    modes = {module: module.training for module in model.modules()}
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training
        for name, p in model.named_parameters():
            if name in grads and p.requires_grad != grads[name]:
                p.requires_grad_(grads[name])


@contextlib.contextmanager
def serving(model: Any, adapter: str | None) -> Iterator[None]:
    """Eval mode, with `adapter` active (None: keep the active one; BASE_WEIGHTS: every adapter off);
    all restored on exit."""
    with preserved_training_state(model):
        model.eval()
        if adapter is None:
            yield
            return
        if adapter == BASE_WEIGHTS:
            # peft's own switch; a model without adapters already is its base
            with model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext():
                yield
            return
        previous = model.active_adapter
        model.set_adapter(adapter, inference_mode=True)
        try:
            yield
        finally:
            model.set_adapter(previous)


def load_frozen_adapter(model: Any, name: str, path: str) -> None:
    """Load the peft adapter saved in `path` into `model` as `name`, frozen; the active adapter stays."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise InvalidRequestError(
            f"Cannot load adapter {name!r} from {path}: the served model is a "
            f"{type(model).__name__}, not a peft PeftModel. Wrap it first, e.g. "
            "`peft.PeftModel.from_pretrained(model, path)` or `peft.get_peft_model(model, config)`."
        )
    with preserved_training_state(model):
        try:
            model.load_adapter(str(path), adapter_name=name, is_trainable=False)
        except Exception:
            if name in model.peft_config:  # peft may have injected the adapter before its weights failed
                model.delete_adapter(name)
            raise
