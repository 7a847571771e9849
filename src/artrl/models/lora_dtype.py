"""LoRA computed in the base model's dtype: no float32 copy of each adapted projection's input.

peft keeps an adapter's weights in float32 under a bf16 or fp16 base (its `autocast_adapter_dtype`), and its
LoRA layer casts the projection's input to the adapter's dtype before the adapter runs. So every adapted
projection of every layer makes a float32 copy of its input (q, k and v each make their own copy of the same
hidden state), twice the size of the bf16 input, and autograd keeps it for the adapter's backward. On the 8B
shape those copies were more than half a layer's activations (docs/performance.md).

`adapters_in_base_dtype` turns that cast off on every LoRA layer whose base computes in bf16 or fp16 and lets the
adapter's two small matrices (r x d) meet the input in its own dtype instead: the float32 weights stay the
master copy the optimizer updates, and each forward casts them to the input's dtype inside the matmul, as
`torch.autocast` does. The input the adapter keeps for backward is then the very tensor the base projection
already keeps, so the adapter adds no activation memory of its size. A float32 base is left as peft makes it.

Layers with a LoRA variant (DoRA and the like) keep peft's cast: their math reads the base weight in the
adapter's dtype. Call it again after loading another adapter into a model (`adapter_switch.load_frozen_adapter`
does): an adapter's layers are made when it loads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HALF_DTYPES = (torch.bfloat16, torch.float16)


class InputDtypeLinear(nn.Linear):
    """An adapter matrix whose matmul runs in its input's dtype (its float32 weight cast inside the autograd graph,
    so the gradient reaches the float32 weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return F.linear(x, weight, bias)


def base_compute_dtype(base: Any) -> torch.dtype | None:
    """The dtype a LoRA layer's base projection computes in: a 4-bit layer's compute dtype, else its weight's when
    floating; None when it cannot be told (an 8-bit weight, which computes in its input's dtype)."""
    compute = getattr(base, "compute_dtype", None)
    if isinstance(compute, torch.dtype):
        return compute
    weight = getattr(base, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    return None


def adapters_in_base_dtype(model: Any) -> int:
    """Run each LoRA adapter of `model` in its base projection's dtype where that is bf16 or fp16 (module doc);
    returns how many LoRA layers run so. Idempotent."""
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer) or getattr(module, "lora_variant", None):
            continue
        if base_compute_dtype(module.get_base_layer()) not in HALF_DTYPES:
            continue
        matrices = [m for adapters in (module.lora_A, module.lora_B) for m in adapters.values()]
        if not matrices or any(type(m) not in (nn.Linear, InputDtypeLinear) for m in matrices):
            continue  # an adapter of another kind (embedding, conv): peft's own cast stays
        for m in matrices:
            m.__class__ = InputDtypeLinear
        module.cast_input_dtype_enabled = False
        changed += 1
    return changed
