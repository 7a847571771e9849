"""The memory plan (models/memory_plan.py): a pure function of a model's shape and a run's settings, checked before
a model loads, refusing with the settings that would fit."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace

import pytest
import torch

import artrl as art
from artrl.models import memory_plan
from artrl.models.memory_plan import GB, MemorySettings, ModelShape, alternatives, plan_memory
from artrl.models.shapes import random_config
from artrl.run import storage

Q14 = ModelShape.of(random_config("random:qwen3-14b"))


def test_the_parts_follow_the_settings():
    fp32 = plan_memory(Q14, MemorySettings(dtype_bytes=4))
    bf16 = plan_memory(Q14, MemorySettings(dtype_bytes=2))
    eight = plan_memory(Q14, MemorySettings(dtype_bytes=2, quantization="8bit"))
    four = plan_memory(Q14, MemorySettings(dtype_bytes=2, quantization="4bit"))
    # 14.77e9 weights, 13.21e9 of them in the decoder projections
    assert Q14.linear_weights() + Q14.other_weights() == pytest.approx(14.77e9, rel=1e-3)
    assert bf16.parts["weights"] == 2 * (Q14.linear_weights() + Q14.other_weights())
    assert four.parts["weights"] == pytest.approx(0.516 * Q14.linear_weights() + 2 * Q14.other_weights(), rel=1e-3)
    assert four.peak < eight.peak < bf16.peak < fp32.peak
    # only the weights and what quantising them takes differ between bf16 and 4-bit
    assert four.parts["adapter"] == bf16.parts["adapter"] and four.parts["loading"] > bf16.parts["loading"]
    adam = plan_memory(Q14, MemorySettings(dtype_bytes=2))
    assert plan_memory(Q14, MemorySettings(dtype_bytes=2, optim_bits=8)).parts["optimizer"] * 4 == adam.parts["optimizer"]
    checkpointed = plan_memory(Q14, MemorySettings(dtype_bytes=2, gradient_checkpointing=True))
    assert checkpointed.parts["activations"] < adam.parts["activations"] / 5
    longer = plan_memory(Q14, MemorySettings(dtype_bytes=2, micro_batch_tokens=2048))
    assert longer.parts["activations"] > adam.parts["activations"] and longer.resident == adam.resident
    # the peak is what stays plus the larger of loading and a step, never both
    assert four.peak == four.resident + max(four.parts["loading"], four.parts["activations"])


def test_lora_targets_and_rank_size_the_adapter():
    full = plan_memory(Q14, MemorySettings(lora_rank=8))
    attention = plan_memory(Q14, MemorySettings(lora_rank=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")))
    double = plan_memory(Q14, MemorySettings(lora_rank=16))
    assert attention.parts["adapter"] < full.parts["adapter"]
    assert double.parts["adapter"] == 2 * full.parts["adapter"]
    # r (in + out) per projection: Qwen3-14B's seven at r=8, 40 layers
    assert memory_plan.lora_weights(Q14, 8, None) == 40 * 8 * (2 * (5120 + 5120) + 2 * (5120 + 1024)
                                                               + 3 * (5120 + 17408))


def test_the_configured_rank_sizes_the_adapter_planned_before_loading(monkeypatch):
    # the plan register checks (check_model_fits on an InternalModelConfig): the adapter, its gradients and its
    # optimizer state grow with lora_rank, as lora_weights says (r (in + out) per projection)
    monkeypatch.setattr(memory_plan, "available_bytes", lambda *a: int(1000 * GB))
    plans = {rank: memory_plan.check_model_fits("random:qwen3-14b", art.InternalModelConfig(lora_rank=rank),
                                                torch.device("cpu")) for rank in (8, 32)}
    assert plans[32].parts["adapter"] == 4 * plans[8].parts["adapter"]
    assert plans[32].parts["optimizer"] == 4 * plans[8].parts["optimizer"]
    for rank, plan in plans.items():
        assert plan.parts["gradients"] == 4 * memory_plan.lora_weights(Q14, rank, None)  # float32, one a weight
        assert plan.settings.lora_rank == rank


def test_what_does_not_fit_is_answered_with_what_would():
    s = MemorySettings(dtype_bytes=2, random_init=True)
    ways = alternatives(Q14, s, int(20 * GB))
    assert ways and ways[0][0].startswith("load_in_4bit=True")
    assert all(plan.fits() and plan.peak <= 20 * GB for _, plan in ways)
    assert not alternatives(ModelShape.of(random_config("random:qwen3-32b")), s, int(5 * GB))


def _register(tmp_path, base_model: str, **config):
    async def main():
        model = art.TrainableModel(name="m", project="p", base_model=base_model,
                                   _internal_config=art.InternalModelConfig(**config))
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        try:
            await model.register(backend)
            return model
        finally:
            backend.close()

    return asyncio.run(main())


def test_a_model_that_does_not_fit_is_refused_before_it_loads_naming_the_settings_that_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_plan, "available_bytes", lambda *a: int(20 * GB))
    with pytest.raises(art.ConfigError) as e:
        _register(tmp_path, "random:qwen3-14b", dtype="bfloat16", device="cpu")
    message = str(e.value)
    assert "random:qwen3-14b does not fit" in message and "20.0 GB is available" in message
    assert "load_in_4bit=True (peak" in message and "check_memory=False" in message
    assert not storage.run_dir(tmp_path, "p", "m").exists()  # nothing was written, nothing loaded


def test_check_memory_false_loads_anyway_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(memory_plan, "available_bytes", lambda *a: 1)
    with pytest.raises(art.ConfigError, match="does not fit"):
        _register(tmp_path / "checked", "artrl/tiny")
    with caplog.at_level(logging.WARNING, logger="artrl.models.memory_plan"):
        _register(tmp_path / "unchecked", "artrl/tiny", check_memory=False)
    assert any("check_memory=False: loading anyway" in r.getMessage() for r in caplog.records)
    assert storage.latest_checkpoint(storage.run_dir(tmp_path / "unchecked", "p", "m")) == 0


def test_the_plan_is_logged_before_loading(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="artrl.models.memory_plan"):
        _register(tmp_path, "artrl/tiny", load_in_4bit=True, dtype="float32")
    lines = [r.getMessage() for r in caplog.records if r.name == "artrl.models.memory_plan"]
    assert lines and "memory plan (4-bit weights, cpu)" in lines[0]


def test_unset_checkpointing_is_planned_as_a_call_would_choose_it(monkeypatch):
    # gradient_checkpointing=None turns checkpointing on for a call that needs it (train/memory.py): the check
    # before loading plans the cheaper of the two, and only an explicit False plans without it
    import torch

    monkeypatch.setattr(memory_plan, "available_bytes", lambda *a: int(18 * GB))
    plan = memory_plan.check_model_fits("random:qwen3-14b", art.InternalModelConfig(load_in_4bit=True),
                                        torch.device("cpu"))
    assert plan.settings.gradient_checkpointing and plan.fits()
    with pytest.raises(art.ConfigError, match="gradient_checkpointing=True"):
        memory_plan.check_model_fits("random:qwen3-14b", art.InternalModelConfig(
            load_in_4bit=True, gradient_checkpointing=False), torch.device("cpu"))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads Linux's peak-RSS counters")
def test_a_prefill_of_several_prompts_never_copies_the_lm_head(tok):
    """On a CPU, torch's linear over a strided [prompts, 1, hidden] view expands the LM head's weight once per prompt;
    the engine's prefill asks for the last position by index, so its peak stays well below one copy of the weight."""
    from artrl.commands.bench.memory import reset_high_water_mark, status_kb
    from artrl.models.random_init import build_random_model
    from artrl.serve.engines.decode_batch import DecodeBatch

    config = random_config("random:qwen3-0.6b", num_hidden_layers=1, hidden_size=512, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = build_random_model(config, device=torch.device("cpu"), dtype=torch.bfloat16,
                               attn_implementation="sdpa", seed=0).requires_grad_(False)  # frozen, as served
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()  # 156 MB
    prompts = [tok(f"<|im_start|>user\nName colour {'x' * i}.<|im_end|>\n<|im_start|>assistant\n").input_ids
               for i in range(4)]
    batch = DecodeBatch(model, "past_key_values", pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        batch._prefill(prompts)  # the first call's one-off work
        assert reset_high_water_mark()
        before = status_kb("VmRSS") * 1024
        *_, logits = batch._prefill(prompts)  # 4 prompts, one forward
        grew = status_kb("VmHWM") * 1024 - before
    assert logits.shape == (4, config.vocab_size)
    assert grew < head / 2, f"the prefill of 4 prompts held {grew / 1e6:.0f} MB more; the LM head is {head / 1e6:.0f} MB"


class _FakeCuda:
    """torch.cuda's memory queries on an imagined 80 GB card: 70 GB free, torch holding 6 GB of which 4 GB in use."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def fraction_of(self, device: int) -> float:
        if not isinstance(device, int):  # torch's wants an index (a torch.device("cuda") without one is refused)
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return self.fraction

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (int(70 * GB), int(80 * GB)))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", self.fraction_of)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: int(6 * GB))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: int(4 * GB))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("fraction, available, unused", [(1.0, 76, 72), (0.3, 24, 20), (0.04, 3.2, 0)])
def test_a_process_capped_on_its_gpu_plans_and_budgets_within_the_cap(monkeypatch, fraction, available, unused):
    """torch.cuda.set_per_process_memory_fraction makes torch's allocator refuse past fraction x the card: the plan
    (available_bytes) and the trainer's budgets (free_bytes) count that cap as the device's size, so a process made
    to run as on a 24 GB card refuses a call too long for 24 GB before it starts instead of failing at the cap."""
    from artrl.train import memory

    _FakeCuda(fraction).install(monkeypatch)
    assert memory_plan.available_bytes("cuda") == pytest.approx(available * GB, rel=1e-9)
    # the trainer's device is torch.device("cuda"), without an index
    assert memory.free_bytes(torch.device("cuda")) == pytest.approx(unused * GB, rel=1e-9)
    assert memory.free_bytes(torch.device("cuda", 0)) == pytest.approx(unused * GB, rel=1e-9)
    budget = memory.budget_for(random_config("random:qwen3-8b"), torch.bfloat16, 1024,
                               memory.free_bytes(torch.device("cuda")), offload=True)
    uncapped = memory.budget_for(random_config("random:qwen3-8b"), torch.bfloat16, 1024, int(72 * GB), offload=True)
    assert (budget.tokens_offloaded < uncapped.tokens_offloaded) == (fraction < 1.0)


def test_bench_memory_caps_only_a_gpu():
    from artrl.commands.bench.memory import cap_gpu_memory

    with pytest.raises(SystemExit, match="caps a CUDA device"):
        cap_gpu_memory(torch.device("cpu"), 24)
