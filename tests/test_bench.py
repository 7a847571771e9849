"""The benchmark commands: their JSON says what it claims, and a failed run says why.

Figures (speed) are not checked here; the benchmarks are how speed is measured.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from artrl.cli import main

WORKLOAD = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "workloads" / "seed-like.json")


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow  # two subprocesses, each loading a model and training a call
def test_bench_train_reports_consistent_figures(capsys):
    assert main(["bench", "train", "--workload", WORKLOAD, "--scale", "0.02", "--device", "cpu",
                 "--per-device-train-batch-size", "1"]) == 0
    out = _json(capsys)
    ours, ref = out["ours"], out["reference"]
    assert ours["trainable_tokens"] == ref["trainable_tokens"] > 0  # the same work, two layouts
    assert ref["optimizer_steps"] == ref["forward_passes"] == ref["rows"]  # one row per step
    assert ours["forward_passes"] == ours["rows"] and ours["optimizer_steps"] == 1  # the call's groups, one step
    assert ours["computed_tokens"] == ours["real_tokens"]  # our rows are trimmed to what they hold
    assert ref["computed_tokens"] == ref["rows"] * ref["row_length"]  # the reference pays for its padding
    assert out["computed_tokens_ratio"] == round(ref["computed_tokens"] / ours["computed_tokens"], 3) > 1
    assert out["ratio_tokens_per_s"] == round(ours["trainable_tokens_per_s"] / ref["trainable_tokens_per_s"], 3)
    for r in (ours, ref):
        assert r["model_flops"] < r["model_flops_dense"] and 0 < r["mfu"] < r["mfu_dense_flops"]
        assert r["skipped_nonfinite_steps"] == 0
    assert out["peak"]["peak_tflops"] == out["peak"]["measured_matmul_tflops"] > 0  # CPU: measured peak


def test_bench_train_failure_shows_the_cause(tmp_path):
    missing = str(tmp_path / "no-such-model")  # a local path: nothing is looked up online
    with pytest.raises(SystemExit) as info:
        main(["bench", "train", "--workload", WORKLOAD, "--scale", "0.02", "--device", "cpu", "--model", missing])
    message = str(info.value)
    assert "the reference run failed" in message and "ConfigError" in message and missing in message


def test_bench_pack_scales_the_reference_layout(capsys):
    assert main(["bench", "pack", "--workload", WORKLOAD, "--scale", "0.125"]) == 0
    out = _json(capsys)
    assert out["reference"]["row_length"] == 768  # ART's multiple of 2048, scaled like the lengths
    assert out["reference"]["rows"] == 88  # as at full length (88 x 6144): the layout keeps its shape
    assert out["reference"]["computed_tokens"] == 88 * 768 > out["computed_tokens"]


def test_bench_serve_sends_the_requests_each_run_names(capsys):
    assert main(["bench", "serve", "--model", "artrl/tiny", "--device", "cpu", "--requests", "3",
                 "--concurrency", "3", "--max-tokens", "4", "--sequential-requests", "1", "--lora"]) == 0
    out = _json(capsys)
    assert out["engine"] == "builtin" and out["lora"] is True
    assert out["concurrent"]["requests"] == 3 and out["concurrent"]["concurrency"] == 3
    assert out["sequential"]["requests"] == 1 and out["sequential"]["concurrency"] == 1
    assert 0 < out["sequential"]["completion_tokens"] <= 4 and 0 < out["concurrent"]["completion_tokens"] <= 12
    assert out["ratio_tokens_per_s"] > 0
    for run in ("concurrent", "sequential"):  # the built-in engine's queue waits of the run's own requests
        assert 0 <= out[run]["admission_wait_p99_s"] <= out[run]["oldest_waiter_s"] <= out[run]["latency_max_s"], run
        assert out[run]["latency_p99_s"] <= out[run]["latency_max_s"], run


@pytest.mark.parametrize("lora", [False, True])
def test_bench_serve_latency_reports_requests_next_to_the_bare_forward(capsys, lora):
    assert main(["bench", "serve", "--latency", "--model", "artrl/tiny", "--device", "cpu", "--requests", "3",
                 "--concurrency", "5", *(["--lora"] if lora else [])]) == 0
    out = _json(capsys)
    assert out["lora"] is lora
    assert (out["bench"], out["engine"], out["max_tokens"], out["requests"], out["concurrency"]) == \
        ("serve_latency", "builtin", 1, 3, 5)
    for run in ("sequential", "sequential_httpx_client", "engine_generate", "bare_forward"):
        assert 0 < out[run]["p50_ms"] <= out[run]["p99_ms"], run
    assert set(out["protocols"]) == {"completions", "responses", "messages"}
    for protocol, stats in out["protocols"].items():  # each timed through its own SDK's client
        assert 0 < stats["p50_ms"] <= stats["p99_ms"], protocol
        assert out["protocols_p50_over_chat"][protocol] == round(
            stats["p50_ms"] / out["sequential_httpx_client"]["p50_ms"], 3)
    assert out["client"] == "AiohttpTransport"  # what model.openai_client() gives a rollout on the local server
    assert out["ratio_mean"] == round(out["sequential"]["mean_ms"] / out["bare_forward"]["mean_ms"], 2)
    assert out["ratio_p50"] == round(out["sequential"]["p50_ms"] / out["bare_forward"]["p50_ms"], 2)
    assert out["concurrent_ms_per_request"] > 0 and out["prompt_tokens"] > 0


@pytest.mark.parametrize("four_bit", [True, False])
def test_bench_serve_and_train_load_the_precision_asked_for(capsys, four_bit):
    """`--load-in-4bit` / `--no-load-in-4bit` reach the loader; each JSON says what was loaded, beside its peak."""
    flag = "--load-in-4bit" if four_bit else "--no-load-in-4bit"
    assert main(["bench", "serve", "--model", "artrl/tiny", "--device", "cpu", "--requests", "2", "--concurrency",
                 "2", "--max-tokens", "2", "--sequential-requests", "1", flag]) == 0
    out = _json(capsys)
    assert out["quantization"] == ("4bit" if four_bit else None) and out["peak_rss_mb"] > 0
    assert main(["bench", "train", "--workload", WORKLOAD, "--scale", "0.02", "--device", "cpu", "--only", "ours",
                 flag]) == 0
    ours = _json(capsys)["ours"]
    assert ours["quantization"] == ("4bit" if four_bit else None) and ours["peak_memory_mb"] > 0


def test_bench_serve_refuses_a_sequential_run_longer_than_the_concurrent_one():
    from artrl.commands.bench.serve import run_serve_bench

    with pytest.raises(ValueError, match="sequential_requests"):
        run_serve_bench("artrl/tiny", requests=2, sequential_requests=3, device="cpu")
