"""The trainer's GPU-facing parts that a CPU can check: kernel switches, the profile table, the LM head.

The kernels themselves (Liger, fused AdamW) are CUDA-only and measured by benchmarks/gpu.sh; here: the
CPU path stays as it was, a switch that cannot work says so, and `bench train --profile`'s table holds
the trainer's ranges.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import artrl as art
from artrl.errors import ConfigError
from artrl.train.logprobs import token_logprobs
from artrl.models.loading import load_model
from artrl.train.memory import checkpointing_on
from artrl.train.trainer import Trainer
from artrl.config.model import InternalModelConfig
from bench_scripts import load_script

WORKLOAD = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "workloads" / "seed-like.json")


def test_the_cpu_path_keeps_its_defaults(tiny_path):
    model, tok = load_model(str(tiny_path))
    trainer = Trainer(model, tok)
    assert trainer.kernels == {"liger_kernel": False, "compile_layers": False, "fused_optimizer": False}
    assert not trainer.optimizer.defaults.get("fused")
    assert trainer.build_context().memory_budget is None  # no memory-aware budget off CUDA
    assert not checkpointing_on(model.get_base_model())


@pytest.mark.parametrize("field", ["liger_kernel", "fused_optimizer"])
def test_a_cuda_only_switch_on_a_cpu_is_refused(tiny_path, field):
    cfg = InternalModelConfig(**{field: True})
    model, tok = load_model(str(tiny_path), cfg)
    with pytest.raises(ConfigError, match=f"{field}=True needs a CUDA device"):
        Trainer(model, tok, cfg)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_the_chunked_head_equals_the_plain_computation_with_gradients(softcap):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 300, bias=False)
    h = torch.randn(257, 32, requires_grad=True)
    t = torch.randint(0, 300, (257,))
    w = torch.randn(257)  # per-token upstream weights, as an RL loss gives them

    logp, ent = token_logprobs(h, head, t, chunk_size=64, softcap=softcap)
    ((logp * w).sum() + ent.sum()).backward()
    chunked = (logp.detach(), ent.detach(), h.grad.clone(), head.weight.grad.clone())
    h.grad, head.weight.grad = None, None

    logits = head(h).float()  # [n, vocab], all at once
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    full = torch.log_softmax(logits, -1)
    plain_logp = full.gather(-1, t[:, None]).squeeze(-1)
    plain_ent = -(full.exp() * full).sum(-1)
    ((plain_logp * w).sum() + plain_ent.sum()).backward()
    for a, b in zip(chunked, (plain_logp.detach(), plain_ent.detach(), h.grad, head.weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bench_train_profile_table_holds_the_trainer_ranges():
    from artrl.commands.bench.train import run_mode

    cfg = art.TrainConfig(learning_rate=1e-5)
    out = run_mode("ours", WORKLOAD, 0.02, "artrl/tiny", cfg, InternalModelConfig(device="cpu"),
                   profile_micro_batches=2)
    table = out["profile"]
    assert table["time_basis"] == "host CPU" and table["micro_batches"] == min(2, out["forward_passes"])
    assert table["lora_modules"] > 0
    groups = table["groups"]
    for part in ("attention_mask", "forward", "logprobs", "loss", "backward", "optimizer", "lora"):
        assert groups[part]["ms"] > 0, part
    assert groups["lora"]["ms"] <= groups["forward"]["ms"]  # LoRA's forward lies within the forward
    ops = table["top_ops"]
    assert 0 < len(ops) <= 15 and all(not op["name"].startswith("artrl/") for op in ops)
    assert [op["self_ms"] for op in ops] == sorted((op["self_ms"] for op in ops), reverse=True)
    assert 0 < sum(op["share"] for op in ops) <= 1.0001
    assert "host_gaps" not in table  # a device figure


def _peer():
    return load_script("trl_peer")


def test_the_trl_peer_says_when_trl_is_missing(monkeypatch, capsys):
    import importlib.util

    peer = _peer()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert peer.main(["--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and "trl" in err and "nothing measured" in err


@pytest.mark.slow  # four processes, each loading the tiny model; needs trl (not a test dependency)
def test_the_trl_peer_measures_both_sides_on_the_same_work(capsys):
    pytest.importorskip("trl")
    peer = _peer()
    assert peer.main(["--model", "artrl/tiny", "--device", "cpu", "--trajectories", "8", "--batch-size", "4",
                      "--prompt-words", "12", "--completion-words", "12"]) == 0
    import json

    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ours, trl = out["artrl"], out["trl"]
    assert ours["optimizer_steps"] == trl["optimizer_steps"] == 1  # 2 steps, the first a warm-up
    # the same assistant tokens on both sides (chat templates may differ by an end-of-turn token per reply)
    assert abs(ours["trainable_tokens"] - trl["trainable_tokens"]) <= 4
    assert out["ratio_tokens_per_s"] == round(ours["trainable_tokens_per_s"] / trl["trainable_tokens_per_s"], 3)


@pytest.mark.parametrize("installed", [True, False])
def test_the_plan_counts_liger_exactly_where_the_trainer_applies_it(monkeypatch, installed):
    """One rule (models/liger.py) for the trainer, which applies the kernels, and the memory plan, which counts
    their smaller activations: on CUDA when asked for, or by default when installed; never on a CPU."""
    from artrl.models import liger, memory_plan

    monkeypatch.setattr(liger, "liger_available", lambda: installed)
    for choice in (None, True, False):
        cfg = art.InternalModelConfig(liger_kernel=choice)
        for device_type in ("cuda", "cpu"):
            expected = device_type == "cuda" and (choice is True or (choice is None and installed))
            assert liger.liger_applies(cfg, device_type) is expected
            assert memory_plan.settings_for(cfg, "artrl/tiny", device_type).fused_kernels is expected
