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

Loading a saved adapter onto the shared model is here too: a checkpoint as a
frozen adapter of its own (`load_frozen_adapter`: a `name@step` the engine
serves, a KL reference the trainer reads), or a checkpoint's tensors into the
active adapter (`load_adapter_weights`: an engine that does not share the
trainer's model taking the live weights).

Used by the inference engine (serve/) and the trainer (train/); it imports neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from artrl.errors import ArtrlError

#: The adapter name that means "the base model, every adapter off".
BASE_WEIGHTS = "artrl:base-weights"


@contextlib.contextmanager
def preserved_training_state(model: Any) -> Iterator[None]:
    """Restore every module's train/eval mode and every parameter's requires_grad on exit.

    Entered around every decode batch, so a lone request pays for it: only what changed is written back
    (`Module.__setattr__` costs microseconds a module), and the parameters are walked once, not by name twice.
    """
    modes = [(module, module.training) for module in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for module, training in modes:
            if module.training != training:
                module.training = training
        for p, requires_grad in grads:
            if p.requires_grad != requires_grad:
                p.requires_grad_(requires_grad)


@contextlib.contextmanager
def serving(model: Any, adapter: str | None) -> Iterator[None]:
    """Eval mode, with `adapter` active (None: keep the active one; BASE_WEIGHTS: every adapter off);
    all restored on exit."""
    with preserved_training_state(model):
        if any(module.training for module in model.modules()):  # eval() itself walks and writes every module
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


class NotPeftModelError(ArtrlError, TypeError):
    """An adapter was to be loaded into a model that is not a peft `PeftModel`."""


def _peft_model(model: Any, what: str) -> Any:
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise NotPeftModelError(
            f"Cannot load {what}: the model is a {type(model).__name__}, not a peft PeftModel. Wrap it first, "
            "e.g. `peft.PeftModel.from_pretrained(model, path)` or `peft.get_peft_model(model, config)`."
        )
    return model


def load_frozen_adapter(model: Any, name: str, path: str | Path) -> None:
    """Load the peft adapter saved in `path` into `model` as `name`, frozen; the active adapter stays.

    Callers hold the model lock. A failed load leaves no half-injected adapter behind.
    """
    _peft_model(model, f"adapter {name!r} from {path}")
    with preserved_training_state(model):
        try:
            model.load_adapter(str(path), adapter_name=name, is_trainable=False)
        except Exception:
            if name in model.peft_config:  # peft may have injected the adapter before its weights failed
                model.delete_adapter(name)
            raise


def load_adapter_weights(model: Any, path: str | Path) -> None:
    """Copy the adapter tensors saved in `path` into `model`'s active adapter (callers hold the model lock).

    Raises ValueError when the saved tensors do not match the active adapter's (another LoRA configuration).
    """
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    _peft_model(model, f"the adapter weights in {path}")
    weights = load_peft_weights(str(path), device=str(next(model.parameters()).device))
    active = model.active_adapter
    result = set_peft_model_state_dict(model, weights, adapter_name=active)
    unexpected = list(getattr(result, "unexpected_keys", None) or [])
    missing = [k for k in getattr(result, "missing_keys", None) or [] if ".lora_" in k and f".{active}." in k]
    if unexpected or missing:
        raise ValueError(f"the adapter in {path} does not match the model's adapter {active!r} "
                         f"({len(unexpected)} unexpected, {len(missing)} missing tensors, e.g. "
                         f"{(unexpected or missing)[0]!r}); was it trained with another LoRA configuration?")
