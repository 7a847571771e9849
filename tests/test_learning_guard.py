"""RL keeps learning what it learned: `python benchmarks/bench.py learn --baseline` against the committed baseline.

The slow test reruns the baseline's command (colours at lr 2e-3, 4 seeds, both arms; sampling one request at a
time, so a commit that changes nothing in the math reproduces the baseline up to float noise) and fails when
artrl's mean gain falls below GAIN_FLOOR of the baseline's, or its gain minus the yardstick's falls more than
PAIRED_MARGIN below the baseline's. The fast tests hold the comparison itself to its rule.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from benchmarks.harness.learn_results import GAIN_FLOOR, PAIRED_MARGIN, aggregate, compare_to_baseline
from benchmarks.bench import main
from artrl.errors import ConfigError

BASELINE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "learning-baseline.json"
GUARD_ARGS = ["--tasks", "colours", "--lrs", "2e-3", "--seeds", "4"]
"""The baseline's command: `python benchmarks/bench.py learn` + GUARD_ARGS (docs/testing.md, docs/performance.md)."""


def _doc(gains: dict[str, list[float]], settings: dict | None = None) -> dict:
    runs = [{"task": "colours", "lr": 2e-3, "arm": arm, "seed": seed, "gain": g, "first": 0.3, "last": 0.3 + g,
             "failed": None} for arm, values in gains.items() for seed, g in enumerate(values)]
    table, paired = aggregate(runs)
    return {"bench": "learn", "settings": settings or {"steps": 20}, "runs": runs, "table": table, "paired": paired}


BASE = {"artrl": [0.40, 0.38, 0.39, 0.41], "yardstick": [0.40, 0.38, 0.39, 0.41]}


def test_the_same_figures_pass_and_a_halved_gain_fails():
    base = _doc(BASE)
    assert compare_to_baseline(copy.deepcopy(base), base) == []
    halved = _doc({"artrl": [g / 2 for g in BASE["artrl"]], "yardstick": BASE["yardstick"]})
    problems = compare_to_baseline(halved, base)
    assert any("mean gain +0.198" in p and "below 75% of the baseline's +0.395" in p for p in problems)
    assert any("gain minus the yardstick's -0.198" in p for p in problems)


def test_the_floor_and_the_margin_are_where_they_say():
    base = _doc(BASE)
    mean = sum(BASE["artrl"]) / 4
    # both arms lower together (the sampler changed, say): only the floor speaks
    just_above = _doc({arm: [g * (GAIN_FLOOR + 0.01) for g in BASE["artrl"]] for arm in BASE})
    just_below = _doc({arm: [g * (GAIN_FLOOR - 0.01) for g in BASE["artrl"]] for arm in BASE})
    assert compare_to_baseline(just_above, base) == []
    assert len(compare_to_baseline(just_below, base)) == 1
    # artrl alone lower, by less than the floor: the paired margin speaks
    behind = _doc({"artrl": [g - PAIRED_MARGIN - 0.01 for g in BASE["artrl"]], "yardstick": BASE["yardstick"]})
    assert (sum(BASE["artrl"]) / 4 - PAIRED_MARGIN - 0.01) > GAIN_FLOOR * mean
    [problem] = compare_to_baseline(behind, base)
    assert "gain minus the yardstick's" in problem
    within = _doc({"artrl": [g - PAIRED_MARGIN + 0.01 for g in BASE["artrl"]], "yardstick": BASE["yardstick"]})
    assert compare_to_baseline(within, base) == []


def test_diverged_runs_other_settings_and_missing_pairs_are_not_compared_away():
    base = _doc(BASE)
    diverged = _doc(BASE)
    diverged["runs"][0]["failed"] = "non-finite update"
    diverged["table"], diverged["paired"] = aggregate(diverged["runs"])
    assert any("1 runs diverged" in p for p in compare_to_baseline(diverged, base))
    with pytest.raises(ConfigError, match="other settings .*steps"):
        compare_to_baseline(_doc(BASE, {"steps": 10}), base)
    with pytest.raises(ConfigError, match="lack the baseline's"):
        compare_to_baseline(_doc({"yardstick": BASE["yardstick"]}), base)


def test_a_baseline_that_is_not_a_results_file_is_refused_before_running(tmp_path, capsys):
    bad = tmp_path / "baseline.json"
    bad.write_text(json.dumps({"bench": "serve"}))
    out = tmp_path / "learn.json"
    assert main(["learn", *GUARD_ARGS, "--baseline", str(bad), "--out", str(out)]) == 2
    assert "not a `bench.py learn` results file" in capsys.readouterr().err
    assert not out.exists()


def test_the_committed_baseline_is_the_guards_command_and_learns():
    doc = json.loads(BASELINE.read_text())
    runs = doc["runs"]
    assert {(r["task"], r["lr"]) for r in runs} == {("colours", 2e-3)}
    assert sorted((r["arm"], r["seed"]) for r in runs) == [(arm, s) for arm in ("artrl", "yardstick") for s in range(4)]
    assert doc["settings"]["steps"] == 20 and all(r["failed"] is None for r in runs)
    artrl = next(r for r in doc["table"] if r["arm"] == "artrl")
    assert artrl["mean"] > 0.2  # what the guard holds RL to is real learning


@pytest.mark.slow
def test_rl_learns_as_much_as_the_committed_baseline(tmp_path, capsys):
    out = tmp_path / "learn.json"
    code = main(["learn", *GUARD_ARGS, "--baseline", str(BASELINE), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "learns as the baseline" in printed
