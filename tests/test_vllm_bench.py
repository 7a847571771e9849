"""`artrl bench serve --engine vllm` reports what `--engine builtin` does (the same JSON, figure for figure)."""

from __future__ import annotations

from typing import Any

import pytest

from artrl.commands.bench.serve import run_serve_bench

pytestmark = pytest.mark.vllm


def shape(report: Any) -> Any:
    """The report's keys, nested, without the values."""
    return {k: shape(v) for k, v in report.items()} if isinstance(report, dict) else type(report).__name__


def test_bench_serve_reports_the_same_json_for_either_engine() -> None:
    reports = {kind: run_serve_bench("artrl/tiny", requests=2, concurrency=2, max_tokens=4, engine_kind=kind)
               for kind in ("builtin", "vllm")}
    builtin, vllm = reports["builtin"], reports["vllm"]
    assert (builtin["engine"], vllm["engine"]) == ("builtin", "vllm")
    builtin["concurrent"].pop("engine_batches")  # the built-in engine's own count of decode batches
    assert vllm["threads"] is None  # vLLM sets its threads in its own processes
    builtin["threads"] = None
    for switch in ("merge_lora", "attn_implementation", "static_cache", "cuda_graphs"):  # the built-in engine's
        assert vllm[switch] is None
        builtin[switch] = None
    for run in ("concurrent", "sequential"):  # the built-in engine's queue waits; vLLM does not report them
        for wait in ("oldest_waiter_s", "admission_wait_p99_s"):
            assert vllm[run][wait] is None and builtin[run][wait] >= 0
            builtin[run][wait] = None
    assert shape(vllm) == shape(builtin)
    for report in (builtin, vllm):
        assert report["concurrent"]["completion_tokens"] == report["sequential"]["completion_tokens"] > 0
