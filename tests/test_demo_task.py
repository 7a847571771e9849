"""The colour quiz task and `artrl demo`: grading, the held-out split, and one quick end-to-end run."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from artrl.commands import demo
from artrl.errors import ConfigError
from artrl.run import storage
from artrl.tasks import colours

REWARDS = {0.0, colours.PARTIAL_REWARD, colours.HEDGED_REWARD, 1.0}


@pytest.mark.parametrize("answer, colour, expected", [
    ("yellow", "yellow", 1.0),
    ("Yellow.", "yellow", 1.0),
    (" yellow\n", "yellow", 1.0),
    ("yellow, I think.", "yellow", colours.HEDGED_REWARD),
    ("yellow yellow", "yellow", colours.HEDGED_REWARD),
    ("red", "yellow", colours.PARTIAL_REWARD),
    ("red, I think.", "yellow", colours.PARTIAL_REWARD),
    ("It is yellow.", "yellow", 0.0),      # the colour must come first
    ("redyellow", "yellow", 0.0),          # one run of letters that is no colour
    ("banana", "yellow", 0.0),
    ("", "yellow", 0.0),
    (None, "yellow", 0.0),
])
def test_reward(answer, colour, expected):
    assert colours.reward(answer, colour) == expected


@given(st.text(max_size=40), st.sampled_from(colours.COLOURS))
def test_reward_takes_only_the_documented_values(answer, colour):
    assert colours.reward(answer, colour) in REWARDS


@given(st.sampled_from(colours.COLOURS), st.lists(st.sampled_from(["I", "think", "so", "maybe"]), max_size=3))
def test_right_colour_first_is_rewarded_and_one_word_pays_most(colour, rest):
    answer = " ".join([colour, *rest])
    assert colours.reward(answer, colour) == (1.0 if not rest else colours.HEDGED_REWARD)


def test_validation_questions_are_held_out():
    train, val = colours.scenarios("train"), colours.scenarios("val")
    assert len(train) == len(colours.OBJECTS) * len(colours.TRAIN_TEMPLATES) == 96
    assert len(val) == len(colours.OBJECTS) * len(colours.VAL_TEMPLATES) == 48
    assert not set(colours.TRAIN_TEMPLATES) & set(colours.VAL_TEMPLATES)
    assert not {s.prompt for s in train} & {s.prompt for s in val}
    assert {s.obj for s in train} == {s.obj for s in val} == set(colours.OBJECTS)
    assert {s.split for s in train} == {"train"} and {s.split for s in val} == {"val"}


def test_objects_are_balanced_over_single_token_colours():
    counts = {c: sum(1 for v in colours.OBJECTS.values() if v == c) for c in colours.COLOURS}
    assert set(counts.values()) == {4}


def test_sft_data_covers_only_train_questions_in_both_styles():
    data = colours.sft_trajectories()
    val_prompts = {s.prompt for s in colours.scenarios("val")}
    train_prompts = {s.prompt for s in colours.scenarios("train")}
    prompts = [t.messages_and_choices[0]["content"] for t in data]
    answers = [t.messages_and_choices[-1]["content"] for t in data]
    assert set(prompts) == train_prompts and not set(prompts) & val_prompts
    hedged = [a for a in answers if colours.words(a)[1:]]
    assert len(hedged) == len(data) // 2
    for obj, colour in colours.OBJECTS.items():  # every object: right colour, both styles
        mine = [a for p, a in zip(prompts, answers) if obj in p]
        assert {colours.words(a)[0] for a in mine} == {colour}
        assert {colours.reward(a, colour) for a in mine} == {1.0, colours.HEDGED_REWARD}


def test_sft_answer_refuses_validation_questions():
    with pytest.raises(ValueError, match="not a train phrasing"):
        colours.sft_answer(colours.scenarios("val")[0])


def test_demo_config_checks():
    with pytest.raises(ConfigError, match="groups_per_step"):
        demo.DemoConfig(groups_per_step=1000).check()
    with pytest.raises(ConfigError, match="val_samples"):
        demo.DemoConfig(val_samples=0).check()


def test_demo_refuses_to_delete_a_directory_that_is_not_a_run(tmp_path):
    run = storage.run_dir(tmp_path, demo.PROJECT, demo.MODEL_NAME)
    run.mkdir(parents=True)
    (run / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not an artrl run directory"):
        asyncio.run(demo.run_demo(tmp_path, quick=True, show_progress=False))
    assert (run / "precious.txt").exists()


def test_cli_parses_demo_options():
    from artrl.cli import _parser

    args = _parser().parse_args(["demo", "--quick", "--path", "/x", "--rl-steps", "3", "--seed", "7"])
    assert (args.command, args.quick, args.path, args.rl_steps, args.seed) == ("demo", True, "/x", 3, 7)


@pytest.fixture(scope="module")
def quick_demo_cli(tmp_path_factory):
    """One `python -m artrl.cli demo --quick --json` run (what the benchmarks run on a CPU), shared by the two
    end-to-end tests below: (its directory, the finished process)."""
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("quick-demo")
    done = subprocess.run([sys.executable, "-m", "artrl.cli", "demo", "--quick", "--json", "--path", str(path),
                           "--device", "cpu"], capture_output=True, timeout=900, check=False)
    # decoded as they are: text=True would turn a carriage return into a newline
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return path, done


def test_quick_demo_end_to_end(quick_demo_cli):
    """The whole demo in --quick mode: history has val/reward at every measured step, the plot is written,
    and a second run (after the command line's, in the same directory) starts from a fresh model."""
    tmp_path, first = quick_demo_cli
    assert first.returncode == 0, first.stderr[-3000:]
    result = asyncio.run(demo.run_demo(tmp_path, quick=True, show_progress=False))
    cfg = demo.DemoConfig.quick()
    run = storage.run_dir(tmp_path, demo.PROJECT, demo.MODEL_NAME)
    assert result.run_dir == run
    assert result.plot_path == run / demo.PLOT_FILE
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    records = [json.loads(line) for line in (run / storage.HISTORY_FILE).read_text().splitlines()]
    val_steps = [r["step"] for r in records if r["split"] == "val" and "val/reward" in r]
    # step 0 untrained, 1 after SFT, then every RL step (val_every=1); once: the second run started afresh
    assert val_steps == list(range(cfg.rl_steps + 2))
    # a train row is written at the step the RL call produced: steps 2.. (step 1 is the SFT call's)
    assert [s for s, _ in result.train_rewards] == list(range(2, cfg.rl_steps + 2))
    assert result.val_before == records[0]["val/reward"]
    assert 0.0 <= result.val_after_rl <= 1.0
    assert max(int(p.name) for p in (run / storage.CHECKPOINTS_DIR).iterdir() if p.name.isdigit()) \
        == cfg.rl_steps + 1
    assert "validation reward, after RL" in demo.summary(result)


def test_cli_parses_the_device_options_and_keeps_the_defaults():
    from artrl.cli import _parser

    plain = _parser().parse_args(["demo"])
    assert (plain.model, plain.device, plain.json) == (demo.BASE_MODEL, None, False)
    args = _parser().parse_args(["demo", "--model", "random:qwen3-0.6b", "--device", "cuda", "--json"])
    assert (args.model, args.device, args.json) == ("random:qwen3-0.6b", "cuda", True)


def test_quick_demo_json_line(quick_demo_cli):
    """`python -m artrl.cli demo --quick --json` (what the benchmarks run on a CPU): its last standard output
    line is one JSON object whose times add up and whose rollouts sampled tokens."""
    _, done = quick_demo_cli
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout  # the readable summary went to standard error
    report = json.loads(lines[0])
    assert report["bench"] == "demo" and report["model"] == demo.BASE_MODEL and report["device"] == "cpu"
    assert report["rollout_completion_tokens"] > 0 and report["rollout_completion_tokens_per_s"] > 0
    assert 0 < report["rollout_s"] and 0 < report["train_s"]
    assert report["rollout_s"] + report["train_s"] <= report["wall_s"]
    assert abs(report["rollout_s"] + report["train_s"] + report["other_s"] - report["wall_s"]) < 0.05
    for key in ("val_reward_before", "val_reward_after_sft", "val_reward_after_rl"):
        assert 0.0 <= report[key] <= 1.0
    assert "validation reward, after RL" in done.stderr


def test_quick_demo_counters_agree_and_its_log_is_plain_lines(quick_demo_cli):
    """stderr a pipe, as a log file: every bar state is a plain line, and the rollouts' bar, the trainer's bar
    and the demo's line of one RL call name the same step (the step the call makes)."""
    import re

    _, done = quick_demo_cli
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stderr and "\x1b" not in done.stderr
    cfg = demo.DemoConfig.quick()
    lines = done.stderr.splitlines()
    demo_line = re.compile(rf"INFO artrl\.commands\.demo: step (\d+) \(RL \d+/{cfg.rl_steps}\): train")
    said = [int(m.group(1)) for x in lines if (m := demo_line.search(x))]
    trained = sorted({int(m.group(1)) for x in lines if (m := re.match(r"rl step (\d+):", x))})
    gathered = sorted({int(m.group(1)) for x in lines if (m := re.match(r"rollouts for step (\d+):", x))})
    assert said == trained == gathered == list(range(2, cfg.rl_steps + 2))
