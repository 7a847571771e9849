"""A pipelined run's train rows and the checks every test that reads a row's `offpolicy/` figures makes
(docs/observability.md), for both engines: tests/test_offpolicy_call.py (built-in) and tests/test_vllm_e2e.py."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from artrl.run import storage

SHARES = ("token_below_min", "token_above_max", "sequence_below_min", "sequence_above_max")


async def pipelined_train_rows(backend: Any, model: Any, train_kwargs: dict[str, Any]) -> list[dict]:
    """The train rows of `PipelineTrainer` on `model` (registered on `backend`, closed after): tests/
    test_pipeline_local.py's tiny run, staleness bound 2, `train_kwargs` on every call."""
    from artrl.pipeline_trainer import PipelineTrainer
    from test_pipeline_local import GROUPS_PER_STEP, TRAIN, make_rollout, scenario_list

    try:
        trainer = PipelineTrainer(model, backend, make_rollout(), scenario_list(), None, num_rollout_workers=4,
                                  min_batch_size=GROUPS_PER_STEP, max_steps_off_policy=2, train_kwargs=train_kwargs,
                                  **TRAIN)
        async with asyncio.timeout(300):
            await trainer.train(handle_signals=False)
        return [r for r in storage.read_jsonl(model._run_dir() / storage.HISTORY_FILE) if r.get("split") == "train"]
    finally:
        await backend.close()


def check_mismatch_row(row: dict, bounds: tuple[float, float], *, fresh: bool, noise: float, moved: float) -> None:
    """A train row's offpolicy/ figures: measured at `bounds` over the call's sampled tokens, shares in [0, 1],
    finite moments. On groups the weights the call starts from sampled (`fresh`) the sampler/trainer mismatch is
    float noise (|KL| < `noise`, no token outside the bounds, a perplexity ratio of 1); on stale ones the weights
    moved since (k3, never negative unlike k1, over `moved`). Where the row splits by policy age, the ages'
    tokens add up to the call's."""
    assert (row["offpolicy/clip_min"], row["offpolicy/clip_max"]) == pytest.approx(bounds)
    assert row["offpolicy/mismatch_tokens"] > 0
    for key in SHARES:
        assert 0.0 <= row[f"offpolicy/{key}"] <= 1.0, key
    for key in ("sampler_kl", "chi2_token", "chi2_sequence", "ppl_ratio"):
        assert math.isfinite(row[f"offpolicy/{key}"]), key
    if fresh:
        assert abs(row["offpolicy/sampler_kl"]) < noise, row
        assert row["offpolicy/token_below_min"] == row["offpolicy/token_above_max"] == 0.0
        assert row["offpolicy/ppl_ratio"] == pytest.approx(1.0, abs=1e-3)
    else:
        assert row["offpolicy/sampler_kl_k3"] > moved, row
    ages = [row[k] for k in row if k.startswith("offpolicy/age") and k.endswith("/tokens")]
    if ages:
        assert sum(ages) == row["offpolicy/mismatch_tokens"]
