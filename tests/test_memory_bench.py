"""`artrl bench memory` reports the train call's trained tokens and seconds beside its peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from artrl.commands.bench.memory import train_figures
from artrl.runtime.threads import training_threads


def test_a_call_that_trained_nothing_says_so():
    tied = train_figures({"data/step_trainer_tokens": 0.0, "data/step_num_gradient_steps": 0.0}, 0.4, 1.2)
    assert tied["trained_tokens"] == 0 and tied["optimizer_steps"] == 0 and "nothing was trained" in tied["note"]
    trained = train_figures({"data/step_trainer_tokens": 40.0, "data/step_num_gradient_steps": 1.0}, 8.0, 1.5)
    assert trained["trained_tokens"] == 40 and trained["optimizer_steps"] == 1 and "note" not in trained
    assert trained["trained_tokens_per_second"] == 5.0 and trained["peak_gb"] == 1.5
    assert trained["torch_threads"] == training_threads() and "cpu_seconds" not in trained
    busy = train_figures({"data/step_trainer_tokens": 40.0}, 8.0, 1.5, cpu_seconds=15.2)
    assert busy["cpu_seconds"] == 15.2 and busy["cores_busy"] == 1.9


def test_bench_memory_prints_the_trained_tokens_of_its_call(tmp_path):
    out = subprocess.run([sys.executable, "-m", "artrl.cli", "bench", "memory", "--model", "artrl/tiny",
                          "--max-tokens", "4", "--path", str(tmp_path)], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    train = result["train"]
    assert train["trained_tokens"] > 0 and train["optimizer_steps"] >= 1  # distinct rewards: the call trained
    assert train["seconds"] == result["seconds"]["train"] and train["peak_gb"] == result["measured_gb"]["train_peak"]
    assert train["cpu_seconds"] > 0 and train["cores_busy"] == round(train["cpu_seconds"] / train["seconds"], 2)


@pytest.mark.parametrize("layout", ["prompt", "completion"])
def test_bench_memory_context_trains_a_pair_of_that_length(tmp_path, layout):
    out = subprocess.run([sys.executable, "-m", "artrl.cli", "bench", "memory", "--model", "artrl/tiny",
                          "--context", "600", "--layout", layout, "--path", str(tmp_path)], capture_output=True,
                         text=True, env=os.environ.copy(), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    context = result["context"]
    # one row holding the pair: a shared prompt of ~600 tokens, or two answers of ~600 tokens each
    assert 600 <= context["row_tokens"] <= (700 if layout == "prompt" else 1400), context
    if layout == "prompt":
        assert 0 < context["trained_tokens"] < 50  # two short answers
    else:
        assert context["trained_tokens"] > 1000  # every token of both answers
    assert result["train"]["optimizer_steps"] == 1
    assert context["train_above_registered_gb"] == round(result["measured_gb"]["train_peak"]
                                                         - result["measured_gb"]["registered"], 3)
