"""Serving the live LoRA adapter from merged weights, without touching the trainer's tensors.

peft applies LoRA in every adapted linear layer's Python forward: the base matmul, then
dropout, A, B and a scaled add, five more kernels per layer per decode step. On a GPU a
decode step of a small model is bound by those launches, not by memory. While a decode
run holds the model lock, `merged_live_adapter` makes each adapted layer a plain linear:

1. **A separate merged copy.** For each adapted `nn.Linear` it keeps one buffer
   `W + scale * B @ A` (peft's own `get_delta_weight`, in the weight's dtype) next to
   the base weight, never in it. Merging into the base weight in place and unmerging
   afterwards (peft's `merge_adapter` / `unmerge_adapter`) would round `W + d - d` in
   bf16 after every run and drift the frozen base weights a trainer relies on.
2. **Swapped in, swapped back.** Inside the context the base layer's weight points at
   the merged buffer and peft's layer reports the adapter as merged (its forward then
   calls the base layer only); on exit both are restored, exceptions included, so the
   trainer, which takes the same lock, only ever sees its own tensors.
3. **Rebuilt when the adapter changed.** The merged buffer is recomputed when the
   adapter's A or B tensors changed since the last build (their storage or their
   autograd version counter, which every optimizer step and state-dict load bumps), or
   always, with `rebuild="always"` (costs one pass over the adapted weights per run).

Only plain LoRA on dense `nn.Linear` base layers is merged (no DoRA or other peft
variants, no `lora_bias`, no quantised or fan-in-fan-out weights); any other layer keeps
peft's own forward, which is correct, only slower. Memory: one extra copy of every
adapted weight. The engine turns this on by default on CUDA only (serve/engines/factory.py):
on a CPU the extra matmuls cost little next to the rest of the step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)


@dataclass
class _Merged:
    weight: torch.Tensor  # the merged copy, same shape/dtype/device as the base weight
    key: tuple[int, ...]  # what it was built from


def _lora_layers(model: Any, adapter: str) -> list[Any]:
    """peft LoRA linear layers of `model` that hold `adapter` and can be merged into a copy."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # peft is a dependency; a model without it has nothing to merge
        return []
    layers = []
    for module in model.modules():
        if not isinstance(module, LoraLinear) or adapter not in module.lora_A:
            continue
        base = module.get_base_layer()
        if (not isinstance(base, torch.nn.Linear) or adapter in getattr(module, "lora_variant", {})
                or getattr(module, "lora_bias", {}).get(adapter, False) or getattr(module, "fan_in_fan_out", False)
                or module.merged or module.disable_adapters):
            continue
        layers.append(module)
    return layers


class LoraMerger:
    """Holds the merged copies of one model's live adapter between decode runs."""

    def __init__(self, model: Any, *, rebuild: Literal["changed", "always"] = "changed") -> None:
        self._model = model
        self._rebuild = rebuild
        self._merged: dict[int, _Merged] = {}
        #: Merged layers of the last run and how many times a layer's copy was (re)built (for tests and logs).
        self.layers_merged = 0
        self.rebuilds = 0

    @contextlib.contextmanager
    def merged_live_adapter(self) -> Iterator[None]:
        """Inside: every mergeable layer of the active adapter computes with its merged copy."""
        model = self._model
        adapter = getattr(model, "active_adapter", None)
        if not isinstance(adapter, str):
            yield
            return
        layers = _lora_layers(model, adapter)
        swapped: list[tuple[Any, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for module in layers:
                    base = module.get_base_layer()
                    merged = self._merged_weight(module, adapter, base.weight)
                    swapped.append((module, base.weight.data))
                    base.weight.data = merged
                    module.merged_adapters.append(adapter)
            self.layers_merged = len(swapped)
            yield
        finally:
            for module, original in reversed(swapped):
                module.get_base_layer().weight.data = original
                module.merged_adapters.remove(adapter)

    def _merged_weight(self, module: Any, adapter: str, weight: torch.Tensor) -> torch.Tensor:
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        key = (weight.data_ptr(), a.data_ptr(), a._version, b.data_ptr(), b._version,
               hash(float(module.scaling[adapter])))
        cached = self._merged.get(id(module))
        if cached is not None and cached.key == key and self._rebuild == "changed":
            return cached.weight
        target = cached.weight if cached is not None and cached.weight.shape == weight.shape else \
            torch.empty_like(weight)
        delta = module.get_delta_weight(adapter)  # [out, in], scale * B @ A
        torch.add(weight, delta.to(weight.dtype), out=target)
        self._merged[id(module)] = _Merged(target, key)
        self.rebuilds += 1
        return target
