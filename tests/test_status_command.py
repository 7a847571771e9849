"""`artrl status`: the devices, engines and optional libraries of this machine, and a named model's memory plan
(the plan `LocalBackend.register` checks), offline: only artrl's random-shape names, whose configs are built."""

from __future__ import annotations

import importlib.util
import json

import pytest

from artrl import cli
from artrl.commands import status
from artrl.config.model import InternalModelConfig
from artrl.models import memory_plan

MODEL = "random:qwen3-0.6b"


def test_what_it_reports_is_what_a_run_here_would_find():
    report = status.gather(MODEL, "cpu")
    cpu = report["devices"]["cpu"]
    assert cpu["cores"] >= 1 and cpu["available_gb"] > 0
    import torch

    assert len(report["devices"]["cuda"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report["engines"]["builtin"]["installed"] is True
    assert report["engines"]["vllm"]["installed"] == (importlib.util.find_spec("vllm") is not None)
    for name, module in (("bitsandbytes", "bitsandbytes"), ("liger-kernel", "liger_kernel"),
                         ("flash-attn", "flash_attn"), ("vllm", "vllm"), ("litellm", "litellm")):
        assert report["extras"][name]["installed"] == (importlib.util.find_spec(module) is not None), name
    plan = report["plan"]
    # the plan register checks, for the default config on this device: the same figures
    expected = memory_plan.plan_for(MODEL, InternalModelConfig(device="cpu"), torch.device("cpu"))
    assert plan["parts_gb"] == expected.as_json()["parts_gb"] and plan["device"] == "cpu"
    assert plan["engine"] == "builtin"  # a model built in memory is served by the built-in engine (no path)
    assert plan["fits"] == (expected.peak <= expected.available)


def test_a_model_that_does_not_fit_is_shown_with_the_settings_that_would(monkeypatch, capsys):
    monkeypatch.setattr(memory_plan, "available_bytes", lambda *a, **k: int(4.5e9))  # a 4.5 GB machine
    assert cli.main(["status", "--model", MODEL, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for line in ("devices:", "  cpu: ", "inference engines:", "  builtin (transformers): available",
                 "  vllm: ", "optional libraries:", "  bitsandbytes", f"model {MODEL}:",
                 "inference_engine='auto' serves it with: builtin", "memory plan (32-bit weights, cpu)",
                 "of 4.5 GB available", "fits: NO; settings that fit (peak GB): load_in_4bit=True"):
        assert line in out, line
    report = status.gather(MODEL, "cpu", load_in_4bit=True)
    assert report["plan"]["fits"] and "4-bit weights" in report["plan"]["line"]


def test_json_and_an_unknown_builtin_name_which_is_never_looked_up(capsys):
    assert cli.main(["status", "--model", "artrl/no-such-model", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert "is not a built-in model" in report["plan"]["error"] and report["devices"]["cpu"]["cores"] >= 1
    assert status.format_status(report).endswith(f"no memory plan: {report['plan']['error']}")


def test_each_cuda_device_is_listed_with_its_free_memory(monkeypatch):
    """A fake CUDA device (none here): what a GPU machine's status lists for it."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (int(70e9), int(80e9)))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0))
    devices = status.devices()
    assert devices["cuda"] == [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "free_gb": 70.0, "total_gb": 80.0,
                                "capability": "9.0"}]
    report = {**status.gather(MODEL, "cpu"), "devices": devices}
    assert "  cuda:0: NVIDIA H100 80GB HBM3 (compute capability 9.0), 70.0 GB free of 80.0 GB" in \
        status.format_status(report)
