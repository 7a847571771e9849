"""LoRA in the base dtype (models/lora_dtype.py): under a bf16 base no adapter keeps a float32 copy of its input
for backward, the adapter's weights stay float32, the gradient matches peft's own cast path to the precision of
bf16, a loaded adapter runs the same way, and a float32 base is left as peft makes it."""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

import artrl as art
from artrl.models.adapter_switch import load_frozen_adapter
from artrl.models.loading import load_model
from artrl.models.lora_dtype import InputDtypeLinear, adapters_in_base_dtype


def _model(tiny_path, dtype: str):
    model, tok = load_model(str(tiny_path), art.InternalModelConfig(seed=0, dtype=dtype, device="cpu"))
    with torch.no_grad():  # lora_B starts at zero, which leaves every lora_A gradient zero
        gen = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _peft_cast(model) -> None:
    """Back to peft's own path: the input cast to the adapter's float32, plain Linear adapters."""
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.cast_input_dtype_enabled = True
            for d in (m.lora_A, m.lora_B):
                for lin in d.values():
                    lin.__class__ = nn.Linear


def _step(model, ids):
    """Float32 tensors of at least a hidden state's size that autograd keeps for backward, and the gradients."""
    model.zero_grad(set_to_none=True)
    hidden = model.config.hidden_size
    kept: list[tuple] = []

    def pack(t):
        if t.dtype == torch.float32 and t.numel() >= ids.shape[1] * hidden:
            kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits
    loss = -logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return kept, grads


def test_a_bf16_base_keeps_no_float32_copy_of_an_adapters_input(tiny_path):
    model = _model(tiny_path, "bfloat16")
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert layers and all(not m.cast_input_dtype_enabled for m in layers)
    assert all(type(lin) is InputDtypeLinear for m in layers for d in (m.lora_A, m.lora_B) for lin in d.values())
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # the master weights
    ids = torch.randint(3, 2000, (1, 96), generator=torch.Generator().manual_seed(1))

    kept, ours = _step(model, ids)
    _peft_cast(model)
    kept_peft, peft = _step(model, ids)
    # peft's path keeps a float32 copy of every adapted projection's input (q, k and v each their own); ours none
    # of activation size: what float32 remains is the RMSNorm's and the loss's own
    assert len(kept_peft) - len(kept) >= len(layers)
    assert {g.dtype for g in ours.values()} == {torch.float32}
    model.float()
    _, reference = _step(model, ids)  # the same weights in float32 throughout
    for name, g in ours.items():
        ours_error = float((g - reference[name]).norm() / reference[name].norm())
        peft_error = float((peft[name] - reference[name]).norm() / reference[name].norm())
        # bf16's rounding, about the same for both paths: the base model's bf16 dominates either
        assert ours_error < max(2 * peft_error, 0.02), (name, ours_error, peft_error)


def test_a_float32_base_is_left_as_peft_makes_it(tiny_path):
    model = _model(tiny_path, "float32")
    assert adapters_in_base_dtype(model) == 0
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert all(m.cast_input_dtype_enabled for m in layers)
    assert all(type(lin) is nn.Linear for m in layers for lin in m.lora_A.values())


def test_an_adapter_loaded_later_runs_in_the_base_dtype_too(tiny_path, tmp_path):
    model = _model(tiny_path, "bfloat16")
    model.save_pretrained(str(tmp_path / "v1"))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    load_frozen_adapter(model, "v1", tmp_path / "v1")
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert all(type(m.lora_A["v1"]) is InputDtypeLinear for m in layers)
    model.set_adapter("v1")
    with torch.no_grad():
        got = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.equal(got, expected)  # the saved adapter, loaded, computes what it computed when saved
    assert adapters_in_base_dtype(model) == len(layers)  # idempotent
