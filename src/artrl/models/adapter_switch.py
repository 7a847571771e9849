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

Loading a saved adapter is here too: a checkpoint as a frozen adapter of its
own (`load_frozen_adapter`: a policy version or a `name@step` the engine
serves, a KL reference the trainer reads). And the copy an inference engine
decodes while a trainer trains (`serving_copy`: its own modules, adapters and
hooks over the trainer's frozen tensors, docs/engines.md).

Used by the inference engine (serve/) and the trainer (train/); it imports neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ArtrlError

#: The adapter name that means "the base model, every adapter off".
BASE_WEIGHTS = "artrl:base-weights"


def _submodules(model: Any) -> list[Any]:
    """`model` and every module under it, each once: what `model.modules()` yields, without building the
    dotted names `named_modules` makes (half the cost of a walk on a small model)."""
    found: list[Any] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        stack.extend(child for child in module._modules.values() if child is not None)
    return found


@contextlib.contextmanager
def preserved_training_state(model: Any, *, eval_mode: bool = False) -> Iterator[None]:
    """Restore every module's train/eval mode and every parameter's requires_grad on exit; with `eval_mode`,
    the model is in eval mode inside.

    Entered around every decode batch, so a lone request pays for it: the modules are walked once (their
    parameters read from the same walk), `eval()` runs only when some module is in train mode, and only what
    changed is written back (`Module.__setattr__` costs microseconds a module).
    """
    modules = _submodules(model)
    modes = [(module, module.training) for module in modules]
    grads = [(p, p.requires_grad) for module in modules for p in module._parameters.values() if p is not None]
    try:
        if eval_mode and any(training for _, training in modes):
            model.eval()  # the model's own eval(): a transformers model also re-applies its kernels
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
    with preserved_training_state(model, eval_mode=True):
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

    Callers hold the model lock. A failed load leaves no half-injected adapter behind. The process's random
    streams are left as they were (peft initialises the new layers randomly before it loads their tensors).
    """
    import torch

    from .lora_dtype import adapters_in_base_dtype

    _peft_model(model, f"adapter {name!r} from {path}")
    device = next(model.parameters()).device
    with preserved_training_state(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            model.load_adapter(str(path), adapter_name=name, is_trainable=False)
            adapters_in_base_dtype(model)  # the new adapter's layers too (models/lora_dtype.py)
        except Exception:
            if name in model.peft_config:  # peft may have injected the adapter before its weights failed
                model.delete_adapter(name)
            raise


def serving_copy(model: Any) -> Any:
    """A copy of peft model `model` for an inference engine, sharing every frozen tensor with it.

    The trainer keeps training `model` while the engine decodes with the copy: the copy's modules,
    its adapter registry, active adapter and forward hooks are its own, so a decode thread and a
    training thread never touch the same module. Every frozen parameter (the base weights, frozen
    adapters) becomes a new `Parameter` over the *same storage* (no memory for the base; a quantised weight is
    shared as the same object), every buffer is the same tensor, and only the trainable tensors (the LoRA adapter being trained) are copied. So
    rebinding a copied parameter's `.data` (serve/engines/merged_lora.py) leaves the trainer's parameter alone.
    Make the copy before the trainer applies anything to its modules (kernels, compiled layers).
    """
    import copy

    import torch

    _peft_model(model, "a serving copy")
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if not p.requires_grad:
            # a quantised weight (bitsandbytes' Params4bit / Int8Params) carries its quantisation state beside its
            # data: the copy holds the very same parameter (nothing rebinds one: no merged LoRA on quantised weights)
            memo[id(p)] = p if type(p) is not torch.nn.Parameter else torch.nn.Parameter(p.data, requires_grad=False)
    for b in model.buffers():
        memo[id(b)] = b
    served = copy.deepcopy(model, memo)
    for p in served.parameters():
        p.requires_grad_(False)
    return served.eval()
