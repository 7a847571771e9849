"""The speed guard's comparison (benchmarks/speed_guard.py): what passes and what fails against a baseline.

The guard itself runs benchmarks (a timing, so not a test: .ci/run runs it as a step of its own); here only its
rule is held: a figure below FLOOR of the baseline's median fails, one at or above passes, and the committed
baseline has every figure the guard measures.
"""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_script


@pytest.fixture(scope="module")
def guard():
    return load_script("speed_guard")


def _measured(ratio: float, mfu: float, per_group: float) -> dict:
    return {"medians": {"train": {"ratio_tokens_per_s": ratio, "mfu": mfu},
                        "pipeline": {"ratio_per_trained_group": per_group}}}


def test_the_same_figures_pass_and_the_allocator_regression_fails(guard):
    base = _measured(1.55, 0.346, 1.8)
    assert guard.compare(base, base) == []
    # the 1 MiB allocator rule for every call, measured (docs/performance.md): ratio 0.95, MFU 0.19
    problems = guard.compare(_measured(0.95, 0.19, 1.8), base)
    assert len(problems) == 2 and all("below 80% of the baseline's" in p for p in problems)
    assert any(p.startswith("train ratio_tokens_per_s 0.95") for p in problems)
    # ART's tuner defaults before the worker floor: a pipeline slower than the loop
    [problem] = guard.compare(_measured(1.55, 0.346, 0.37), base)
    assert problem.startswith("pipeline ratio_per_trained_group 0.37")


def test_the_floor_is_where_it_says(guard):
    base = _measured(1.5, 0.3, 2.0)
    at = _measured(1.5 * guard.FLOOR, 0.3 * guard.FLOOR, 2.0 * guard.FLOOR)
    assert guard.compare(at, base) == []
    below = _measured(1.5 * guard.FLOOR - 1e-3, 0.3, 2.0)
    assert len(guard.compare(below, base)) == 1


def test_a_figure_the_baseline_lacks_is_an_error_not_a_pass(guard):
    with pytest.raises(SystemExit, match="no train.mfu"):
        guard.compare(_measured(1.5, 0.3, 2.0), {"medians": {"train": {"ratio_tokens_per_s": 1.5},
                                                             "pipeline": {"ratio_per_trained_group": 2.0}}})


def test_the_committed_baseline_holds_every_figure_the_guard_measures(guard):
    baseline = json.loads(guard.BASELINE.read_text())
    for bench, names in guard.FIGURES.items():
        for name in names:
            assert baseline["medians"][bench][name] > 0, (bench, name)
        assert len(baseline["runs"][bench]) == baseline["rounds"]
