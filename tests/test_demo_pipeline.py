"""`artrl demo --pipeline`: the options reach the run, the default demo is untouched, and (slow) the three
arms run end to end from one warm-up, each measured the same way."""

from __future__ import annotations

import asyncio
import json

import pytest

from artrl.commands import demo, demo_pipeline
from artrl.cli import _parser, main
from artrl.commands.demo_pipeline import ArmResult
from artrl.errors import ConfigError
from artrl.run import storage


def _capture_run(monkeypatch):
    """Replace the two runners by recorders: which one ran, and with what."""
    calls: dict[str, tuple] = {}

    async def fake_pipeline(path, **kwargs):
        calls["pipeline"] = (path, kwargs)
        arm = ArmResult("sync", None, step_times=[(2, 1.0)], val_rewards=[(1, 0.5), (2, 0.6)])
        return demo_pipeline.PipelineDemoResult(root=tmp_root, plot_path=tmp_root / "p.png", val_after_sft=0.5,
                                                arms=[arm], seconds=1.0)

    async def fake_demo(path, **kwargs):
        calls["demo"] = (path, kwargs)
        raise SystemExit(0)

    tmp_root = storage.run_dir("/nowhere", demo_pipeline.PROJECT, "x")
    monkeypatch.setattr(demo_pipeline, "run_pipeline_demo", fake_pipeline)
    monkeypatch.setattr(demo, "run_demo", fake_demo)
    return calls


def test_pipeline_options_reach_the_run(monkeypatch, capsys):
    calls = _capture_run(monkeypatch)
    assert main(["demo", "--pipeline", "--quick", "--bounds", "0,2", "--learning-rate", "0.02", "--seed", "3",
                 "--rl-steps", "5", "--path", "/p", "--device", "cpu", "--json"]) == 0
    assert "demo" not in calls
    path, kwargs = calls["pipeline"]
    assert path == "/p" and kwargs["bounds"] == (0, 2) and kwargs["learning_rate"] == 0.02
    assert kwargs["device"] == "cpu" and kwargs["base_model"] == demo.BASE_MODEL
    assert kwargs["train_in_worker"] is None  # --trainer auto: a worker on a CPU (run_pipeline_demo decides)
    cfg = kwargs["config"]
    assert (cfg.rl_steps, cfg.seed, cfg.groups_per_step) == (5, 3, demo.DemoConfig.quick().groups_per_step)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "demo-pipeline" and report["arms"]["sync"]["val_reward_final"] == 0.6
    assert report["command"].startswith("artrl demo --pipeline --bounds 0,2 --learning-rate 0.02 --seed 3")
    assert "--rl-steps 5" in report["command"] and "--quick" in report["command"]
    assert main(["demo", "--pipeline", "--quick", "--trainer", "here", "--path", "/p"]) == 0
    assert calls["pipeline"][1]["train_in_worker"] is False


def test_the_default_demo_does_not_run_the_pipeline_comparison(monkeypatch):
    calls = _capture_run(monkeypatch)
    with pytest.raises(SystemExit):
        main(["demo", "--quick", "--path", "/p"])
    assert "pipeline" not in calls and calls["demo"][0] == "/p"
    plain = _parser().parse_args(["demo"])
    assert (plain.pipeline, plain.bounds) == (False, "1,4")


def test_bounds_are_checked():
    assert demo_pipeline.parse_bounds("1,4") == (1, 4)
    with pytest.raises(ConfigError, match="comma-separated"):
        demo_pipeline.parse_bounds("one")
    for bad in [(-1,), (2, 2)]:
        with pytest.raises(ConfigError, match="bounds"):
            asyncio.run(demo_pipeline.run_pipeline_demo("/nowhere", config=demo.DemoConfig.quick(), bounds=bad))


def test_rollout_workers_run_one_step_ahead_whatever_the_bound():
    assert demo_pipeline.rollout_workers(32, 0) == 32  # the synchronous loop's
    assert demo_pipeline.rollout_workers(32, 1) == demo_pipeline.rollout_workers(32, 4) == 64


def test_curve_puts_the_warm_up_at_zero_seconds_and_each_step_at_its_time():
    arm = ArmResult("pipeline-1", 1, step_times=[(2, 3.0), (3, 5.5), (4, 8.0)],
                    val_rewards=[(1, 0.2), (3, 0.5), (4, 0.7)], staleness=[0, 1, 1, 0])
    assert arm.curve() == [(0.0, 0.2), (5.5, 0.5), (8.0, 0.7)]
    report = arm.report()
    assert report["wall_s"] == 8.0 and report["steps"] == 3 and report["mean_staleness"] == 0.5
    assert report["val_reward_final"] == 0.7


def test_plot_is_a_png(tmp_path):
    arms = [ArmResult("sync", None, step_times=[(2, 2.0)], val_rewards=[(1, 0.1), (2, 0.3)]),
            ArmResult("pipeline-1", 1, step_times=[(2, 1.0)], val_rewards=[(1, 0.1), (2, 0.25)])]
    path = demo_pipeline.plot_curves(arms, tmp_path / "r.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # an SFT warm-up and three short RL runs on the tiny model (about a minute)
def test_pipeline_demo_end_to_end(tmp_path):
    cfg = demo.DemoConfig.quick()

    async def run():
        async with asyncio.timeout(600):  # a stuck pipeline fails here instead of hanging the suite
            return await demo_pipeline.run_pipeline_demo(tmp_path, config=cfg, bounds=(1, 2), device="cpu")

    result = asyncio.run(run())
    assert [a.name for a in result.arms] == ["sync", "pipeline-1", "pipeline-2"]
    for arm in result.arms:
        steps = [s for s, _ in arm.step_times]
        assert steps == list(range(2, cfg.rl_steps + 2))  # step 1 is the warm-up every arm starts from
        times = [t for _, t in arm.step_times]
        assert times == sorted(times) and times[0] > 0
        assert arm.val_rewards[0] == (1, result.val_after_sft)
        assert [s for s, _ in arm.val_rewards] == list(range(1, cfg.rl_steps + 2))  # val_every=1
        assert all(0.0 <= r <= 1.0 for _, r in arm.val_rewards)
        assert arm.groups_trained >= 1 and max(arm.staleness) <= (arm.max_steps_off_policy or 0)
        run = storage.run_dir(tmp_path, demo_pipeline.PROJECT, arm.name)
        rows = [json.loads(line) for line in (run / storage.HISTORY_FILE).read_text().splitlines()]
        # the warm-up's validation at step 1 (copied with its history), then each step's
        assert sorted(r["step"] for r in rows if r["split"] == "val" and "val/reward" in r) == [1] + steps
    assert result.arms[0].staleness == [0] * result.arms[0].groups_trained  # the synchronous loop is on-policy
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "pipeline-2" in demo_pipeline.summary(result)
