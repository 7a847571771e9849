"""benchmarks/pipeline_programs_learn.py's synchronous arm (`SyncLoop`, put in a pipeline program's
`PipelineTrainer` place) and its window gain, on fakes: no model, no server; and docs/pipeline.md's tables are
the recorded runs'."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import artrl as art
from artrl.pipeline_trainer import PipelineRuntimeConfig

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_programs_learn.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("pipeline_programs_learn", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[list, dict]] = []

    async def train(self, model, groups, **kwargs):
        self.calls.append((list(groups), kwargs))
        return SimpleNamespace(step=len(self.calls), metrics={"loss/train": 0.5})


class FakeModel:
    def __init__(self) -> None:
        self.rows: list[tuple[str, int, dict]] = []

    async def log(self, groups, split, step, metrics):
        self.rows.append((split, step, metrics))


async def rollout(model, scenario, config) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": str(scenario)},
                                                                     {"role": "assistant", "content": "x"}],
                                               reward=r) for r in (0.0, 1.0)])


def trained_scenarios(backend: FakeBackend) -> list[list[str]]:
    return [[g.trajectories[0].messages_and_choices[0]["content"] for g in groups] for groups, _ in backend.calls]


def test_sync_loop_trains_min_batch_size_scenarios_a_step_in_stream_order(bench):
    async def stream():
        for i in range(100):
            yield i

    backend, model = FakeBackend(), FakeModel()
    loop = bench.SyncLoop(model, backend, rollout, stream(), None, eval_fn=object(),
                          pipeline=PipelineRuntimeConfig(min_batch_size=3), learning_rate=0.02, max_steps=3,
                          max_steps_off_policy=6, eval_at_start=False)
    asyncio.run(loop.train())
    assert trained_scenarios(backend) == [["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8"]]
    assert all(kw["learning_rate"] == 0.02 and kw["loss_fn"] == "cispo" for _, kw in backend.calls)
    assert [(split, step) for split, step, _ in model.rows] == [("train", 1), ("train", 2), ("train", 3)]
    assert all(m["steps_off_policy"] == 1.0 and m["loss/train"] == 0.5 for _, _, m in model.rows)


def test_sync_loop_takes_a_plain_iterable_once_and_stops_when_it_ends(bench):
    backend = FakeBackend()
    asyncio.run(bench.SyncLoop(FakeModel(), backend, rollout, ["a", "b", "c", "d", "e"], None, max_steps=5).train())
    assert trained_scenarios(backend) == [["a", "b", "c", "d"], ["e"]]  # ART's default min_batch_size, 4
    backend = FakeBackend()
    cycled = itertools.cycle(["a", "b", "c"])
    asyncio.run(bench.SyncLoop(FakeModel(), backend, rollout, cycled, None, min_batch_size=2, max_steps=2).train())
    assert trained_scenarios(backend) == [["a", "b"], ["c", "a"]]


def test_sync_loop_refuses_what_it_would_not_honour(bench):
    with pytest.raises(TypeError, match="kl_penalty_coef"):
        bench.SyncLoop(FakeModel(), FakeBackend(), rollout, [], None, max_steps=1, kl_penalty_coef=0.1)
    with pytest.raises(ValueError, match="max_steps"):
        bench.SyncLoop(FakeModel(), FakeBackend(), rollout, [], None)


def test_window_gain(bench):
    assert bench.window_gain([0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert bench.window_gain([0.2, 0.6]) == pytest.approx(0.4)  # one step at each end
    assert bench.window_gain([0.3]) is None


@pytest.mark.parametrize("results", ["pipeline-programs-learn.jsonl", "pipeline-programs-learn-lr5e-3.jsonl"])
def test_docs_table_is_the_results_file(bench, results):
    """docs/pipeline.md's tables are what `--table` prints from the recorded runs."""
    root = PATH.parents[1]
    lines = (root / "benchmarks" / "results" / "2026-12-03-cpu" / results).read_text().splitlines()
    rows = bench.table([json.loads(line) for line in lines if line.strip()]).splitlines()[2:]
    docs = (root / "docs" / "pipeline.md").read_text().splitlines()
    assert rows and all(row in docs for row in rows)


def test_welch_against_a_hand_computed_example(bench):
    # means 2 and 5, sample variances 1 and 10/3, n 3 and 4: se = sqrt(1/3 + (10/3)/4)
    diff, se, t = bench.welch([1.0, 2.0, 3.0], [3.0, 4.0, 6.0, 7.0])
    assert diff == pytest.approx(-3.0)
    assert se == pytest.approx((1 / 3 + 10 / 3 / 4) ** 0.5)
    assert t == pytest.approx(diff / se)
    assert bench.welch([1.0], [2.0, 3.0]) is None


def test_docs_in_flight_binary_prefix_figures_are_the_results_files(bench):
    """docs/pipeline.md's in-flight against step_lora figures on binary prefix are what `--table` prints from
    the recorded runs (12 and 12 replicates over the two days' files)."""
    root = PATH.parents[1]
    files = [root / "benchmarks" / "results" / "2026-12-03-cpu" / "pipeline-programs-learn.jsonl",
             root / "benchmarks" / "results" / "2026-12-04-cpu" / "pipeline-programs-learn-binary-in-flight.jsonl"]
    records = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    line = next(x for x in bench.differences(records).splitlines() if x.startswith("binary_prefix"))
    assert "-0.500, standard error 0.115, Welch t -4.35 (12 and 12 replicates)" in line
    docs = " ".join((root / "docs" / "pipeline.md").read_text().split())
    assert "difference -0.500, standard error 0.115, Welch t -4.35" in docs


def test_age_fit_recovers_a_planted_line(bench):
    """Gains made exactly 0.1 + 0.3 * age - 0.2 for in-flight runs: the fit gives those coefficients back."""
    records = [{"program": "binary_prefix", "arm": arm, "gain": 0.1 + 0.3 * age - (0.2 if arm == "in_flight" else 0),
                "token_policy_age": [0.0, age, age]}
               for arm, age in [("pipeline", 1.0), ("pipeline", 2.0), ("pipeline", 2.5), ("in_flight", 0.5),
                                ("in_flight", 1.0), ("in_flight", 1.5)]]
    assert "gain = +0.100 +0.300 * age -0.200 * [in-flight]" in bench.age_fit(records)
    assert bench.age_fit(records[:3]) == ""  # one arm only: nothing to fit


def test_read_results_takes_the_arms_named(bench, tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps({"arm": arm, "gain": i}) + "\n" for i, arm in enumerate(bench.ARMS)))
    assert [r["arm"] for r in bench.read_results(str(path))] == list(bench.ARMS)
    assert [r["arm"] for r in bench.read_results(f"{path}:in_flight")] == ["in_flight"]
    assert [r["arm"] for r in bench.read_results(f"{path}:sync,in_flight")] == ["sync", "in_flight"]
