"""benchmarks/server_soak.py's phases for unknown fields and the Responses store, at a tiny scale: each runs against
a server (a scripted engine, no model) and reports the fields its figures are read from, and what they show
holds at this scale too (the refusals, the bounds). Timing is not asserted: the figures are the benchmark's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from artrl.models.tiny import build_tiny_tokenizer
from artrl.serve import ServedModels, create_app, start_server
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.serve.http.body_policy import REMEMBERED_NAMES
from bench_scripts import load_script

soak = load_script("server_soak")


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine.from_text(build_tiny_tokenizer(), "ok", max_model_len=8192)


@pytest.mark.parametrize("policy", ["refuse", "warn"])
def test_the_unknown_names_phase_samples_memory_log_and_remembered_names(engine: Any, policy: str) -> None:
    app = create_app(ServedModels("m", engine), unknown_fields=policy)
    requests, every = 40, 4  # 8 new names a warning line at most: 32 lines fill the remembered names
    with start_server(app) as handle:
        out = asyncio.run(soak._unknown_names(handle.base_url, app, requests, 20, every, list(soak.ROUTES)))
    assert out["requests"] == requests and out["names_per_request"] == 20
    assert [s["requests"] for s in out["samples"]] == list(range(every, requests + 1, every))
    assert all(isinstance(s["rss_mib"], float) for s in out["samples"])
    assert isinstance(out["rss_growth_after_first_sample_mib"], float)
    last = out["samples"][-1]
    if policy == "refuse":
        assert out["statuses"] == {400: requests} and out["log_bytes_total"] == 0 and last["names_remembered"] == 0
    else:  # served, and once the remembered names are full, no more lines
        assert out["statuses"] == {200: requests} and last["names_remembered"] == REMEMBERED_NAMES
        full = next(s for s in out["samples"] if s["names_remembered"] == REMEMBERED_NAMES)
        assert full["requests"] < requests and full["log_bytes"] == last["log_bytes"] > 0
        assert last["log_records"] == REMEMBERED_NAMES // 8


def test_the_store_phase_fills_the_store_past_its_limit(engine: Any) -> None:
    app = create_app(ServedModels("m", engine), responses_store_bytes=64 * 1024)
    with start_server(app) as handle:
        out = asyncio.run(soak._store_fill(handle.base_url, app, 40, 20, 5))
    assert out["store_max_bytes"] == 64 * 1024 and out["messages_per_response"] == 20
    samples = out["samples"]
    assert len(samples) == 8 and all(s["store_held_bytes"] <= 64 * 1024 for s in samples)
    assert out["requests_to_fill"] is not None and out["requests_to_fill"] < 40  # then past the limit
    kept = [s["store_responses"] for s in samples if s["requests"] >= out["requests_to_fill"]]
    assert len(set(kept)) == 1 and kept[0] < 40  # full: the oldest go as new ones come
    assert isinstance(out["rss_growth_once_full_mib"], float)


def test_the_big_unknown_phase_times_others_alone_and_beside_big_bodies(engine: Any) -> None:
    with start_server(create_app(ServedModels("m", engine))) as handle:
        out = soak._big_unknown_latency(handle.host, handle.port, handle.base_url, 1, 0.5, 1, ["chat", "messages"])
    (window,) = out["windows"]
    assert window["alone_ms"]["count"] > 0 and window["during_ms"]["count"] > 0
    (hostile,) = window["hostile"]
    assert hostile["sent"] > 0 and hostile["statuses"] == {"400": hostile["sent"]}  # refused, by name
    assert hostile["bytes"] > 4_000_000
    assert set(out["alone_p50_ms"]) == set(out["during_p50_ms"]) == {"min", "median"}
    assert out["ratio_of_median_p50"] > 0
