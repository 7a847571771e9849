"""ART's own PipelineTrainer programs run on artrl, small, on a local model, and their history rows carry the
pipeline's keys: ART 0.5.18's (examples/art_pipeline/) and ART 0.5.23's (examples/art_pipeline_0523/, which pass
`run_name` and `pipeline=PipelineRuntimeConfig(...)`), each edited only as its docstring lists.

The untrained tiny model answers gibberish, so every group would score the same and the pipeline would set
every group aside (ART's "model collapse" stop) without training. The fixtures first teach the tiny model
the programs' answers (the words; a make_guess call with a short binary guess) with a few SFT calls and save
it as a local model directory (benchmarks/harness/primed_tiny.py), which the programs take through their BASE_MODEL variable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import primed_tiny
from artrl.run import storage

pytest.importorskip("dotenv", reason="ART's programs import python-dotenv (pip install -e '.[art-examples]')")
pytest.importorskip("polars", reason="binary_prefix_tool_pipeline imports polars (pip install -e '.[art-examples]')")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "art_pipeline"
EXAMPLES_0523 = ROOT / "examples" / "art_pipeline_0523"
PIPELINE_KEYS = ("train/steps_off_policy", "train/discarded_stale_groups", "time/step_wall_s",
                 "throughput/step_trainer_idle_s", "time/step_trainer_s", "time/step_actor_s", "train/reward",
                 # ART 0.5.23's names
                 "time/step_rollout_s", "time/step_rollout_idle_s", "time/step_trainer_idle_s",
                 "pipeline_settings/num_rollout_workers")


def example(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def word_model(tmp_path_factory) -> Path:
    return primed_tiny.word_model(tmp_path_factory.mktemp("word_model"), example("yes_no_maybe_pipeline"))


@pytest.fixture(scope="module")
def guess_model(tmp_path_factory) -> Path:
    return primed_tiny.guess_model(tmp_path_factory.mktemp("guess_model"), example("binary_prefix_tool_pipeline"))


def run_program(name: str, tmp_path: Path, examples: Path = EXAMPLES, **env: str) -> list[dict]:
    art_path = tmp_path / ".art"
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
                "ART_PATH": str(art_path), "PYTHONPATH": str(ROOT / "src"), **env}
    proc = subprocess.run([sys.executable, str(examples / name)], cwd=tmp_path, env=full_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (history,) = art_path.glob("*/models/*/" + storage.HISTORY_FILE)
    return [json.loads(line) for line in history.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("examples", [EXAMPLES, EXAMPLES_0523], ids=["art-0.5.18", "art-0.5.23"])
def test_yes_no_maybe_pipeline_runs_on_artrl(tmp_path, word_model, examples):
    rows = run_program("yes_no_maybe_pipeline.py", tmp_path, examples, BASE_MODEL=str(word_model), MAX_STEPS="2",
                       ROLLOUTS_PER_SCENARIO="4", EVAL_TRAJECTORY_COUNT="2")
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for key in PIPELINE_KEYS:
        assert all(key in r for r in train), key
    assert all(r["train/staleness_max"] <= 4 for r in train)  # the program's bound (ART's default, 4)
    assert [r["step"] for r in rows if r.get("split") == "val"] == [2]  # EVAL_EVERY_N_STEPS=2, not at start


@pytest.mark.slow
@pytest.mark.parametrize("examples", [EXAMPLES, EXAMPLES_0523], ids=["art-0.5.18", "art-0.5.23"])
def test_binary_prefix_tool_pipeline_runs_on_artrl(tmp_path, guess_model, examples):
    rows = run_program("binary_prefix_tool_pipeline.py", tmp_path, examples, BASE_MODEL=str(guess_model),
                       MAX_STEPS="2", MIN_BATCH_SIZE="2", NUM_ROLLOUT_WORKERS="4", ROLLOUTS_PER_SCENARIO="4",
                       MAX_STEPS_OFF_POLICY="1", MAX_TOKENS="40", ROLLOUT_TEMPERATURE="0.7", EVAL_AT_START="0",
                       EVAL_EVERY_N_STEPS="2", SCENARIO_COUNT="200")
    train = [r for r in rows if r.get("split") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for key in (*PIPELINE_KEYS, "train/prefix_len", "train/tool_call_found"):
        assert all(key in r for r in train), key
    assert all(r["train/staleness_max"] <= 1 for r in train)
    assert all(r["pipeline_settings/num_rollout_workers"] == 4 for r in train)  # NUM_ROLLOUT_WORKERS reached it
    assert all(r["train/steps_off_policy"] == pytest.approx(r["train/staleness"] + 1) for r in train)
    assert [r["step"] for r in rows if r.get("split") == "val"] == [2]
