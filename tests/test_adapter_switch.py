"""`adapter_switch.serving`: a batch runs in eval mode with its adapter, and leaves the trainer's state as it was."""

from __future__ import annotations

import pathlib

import torch
from peft import LoraConfig, get_peft_model

from artrl.models.adapter_switch import serving
from artrl.models.tiny import load_tiny

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)


def test_serving_switches_and_restores_modes_adapters_and_requires_grad(tmp_path: pathlib.Path) -> None:
    model = get_peft_model(load_tiny(tmp_path / "cache")[0], LORA)
    model.add_adapter("other", LORA)  # frozen, inactive
    model.train()
    model.base_model.model.lm_head.eval()  # a trainer's mix of modes: each is kept as it was
    modes = {name: m.training for name, m in model.named_modules()}
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    assert any(grads.values()) and not all(grads.values())
    with serving(model, "other"):
        assert not any(m.training for m in model.modules())
        assert model.active_adapter == "other"
        for p in model.parameters():
            p.requires_grad_(False)  # what peft's inference-mode switch may do to the adapters
        model.get_input_embeddings().weight.requires_grad_(True)  # and a frozen weight turned trainable
        with torch.inference_mode():
            model(input_ids=torch.tensor([[1, 2, 3]]))
    assert model.active_adapter == "default"
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert {name: p.requires_grad for name, p in model.named_parameters()} == grads
    with serving(model, None):  # the active adapter, already in eval mode: nothing to switch
        assert not any(m.training for m in model.modules())
    assert {name: m.training for name, m in model.named_modules()} == modes
