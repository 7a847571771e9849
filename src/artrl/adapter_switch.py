"""Switching peft LoRA adapters on a model that a trainer and an inference engine share.

The shared model is usually the trainer's own `PeftModel`: its active adapter
("default") holds the live trained weights, its parameters are in an optimizer,
and the trainer may have left it in train mode. Using another adapter (a
checkpoint served as `name@step`, or a checkpoint as the KL reference of a train
call) means switching to it for a while; using the base model (`BASE_WEIGHTS`)
switches every adapter off with peft's `disable_adapter`. peft's `load_adapter`
and `set_adapter` also flip `requires_grad` flags (`set_adapter(name)` makes
`name` trainable and freezes the others), so every switch here snapshots each
module's train/eval mode and each parameter's `requires_grad` and restores them
afterwards. Callers hold the model lock, so nobody sees the model mid-switch.

Used by the inference engine (serve/) and the trainer (train/); it imports neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: The adapter name that means "the base model, every adapter off".
BASE_WEIGHTS = "artrl:base-weights"


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
