"""`artrl runs show` on a real small run: the table's steps, rewards and losses, and the PNG."""

from __future__ import annotations

import asyncio
import json

import pytest

import artrl as art
from artrl.cli import main as cli
from artrl.errors import ConfigError
from artrl.run import storage
from artrl.commands.runs import show, step_table


def test_runs_show_on_a_real_small_run(tmp_path, make_choice, capsys):
    def val(reward: float) -> art.Trajectory:
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": "Say red."},
                                                    {"role": "assistant", "content": "red"}], reward=reward)

    async def main():
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny")
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        await model.register(backend)
        try:
            await model.log([val(0.25), val(0.75)], split="val")
            await model.train_sft([val(0.0)] * 4, config=art.TrainSFTConfig(learning_rate=1e-3))
            prompt = [{"role": "user", "content": "Pick a colour."}]
            groups = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=prompt + [make_choice(w)], reward=r)
                                           for w, r in (("red", 1.0), ("blue", 0.0))])]
            rl = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
            await model.log([val(1.0)], split="val")
            return rl
        finally:
            backend.close()

    rl = asyncio.run(main())
    run = storage.run_dir(tmp_path, "p", "m")
    table = step_table([json.loads(x) for x in (run / storage.HISTORY_FILE).read_text().splitlines()])
    assert [(r.step, r.kind, r.train_reward, r.val_reward) for r in table] == [
        (0, None, None, 0.5), (1, "sft", None, None), (2, "rl", 0.5, 1.0)]
    assert table[2].loss == rl.metrics["loss/train"] and table[1].loss is not None

    assert cli(["runs", "show", str(run), "--plot", str(tmp_path / "run.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["step", "kind", "train", "reward", "val", "reward", "loss", "val", "trajectories"]
    assert out[1].split() == ["0", "-", "-", "0.500", "-", "2"]
    assert out[3].split()[:4] == ["2", "rl", "0.500", "1.000"] and out[3].split()[4] == f"{rl.metrics['loss/train']:.4f}"
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text, png = show(run)
    assert png == run / "history.png" and png.read_bytes()[:4] == b"\x89PNG" and text.splitlines()[1:] == out[1:4]


def test_runs_show_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    with pytest.raises(ConfigError, match="has no history.jsonl"):
        show(tmp_path)
    assert cli(["runs", "show", str(tmp_path)]) == 2
    assert "pass a run directory" in capsys.readouterr().err


def test_the_plot_gives_sft_and_rl_losses_an_axis_each(tmp_path, monkeypatch):
    """Cross-entropy (~2 nats) and the policy loss (~0) on one axis flattened the RL curve into a line."""
    import matplotlib.pyplot as plt

    from artrl.commands.runs import StepRow, plot_run

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    table = [StepRow(1, "sft", loss=2.1), StepRow(2, "sft", loss=1.4),
             StepRow(3, "rl", train_reward=0.4, loss=-0.02), StepRow(4, "rl", train_reward=0.6, loss=0.01)]
    plot_run(table, tmp_path / "run.png")
    (fig,) = figures
    loss_axes = {ax.get_ylabel(): [tuple(line.get_xdata()) for line in ax.get_lines()] for ax in fig.axes[1:]}
    assert loss_axes == {"SFT loss": [(1, 2)], "RL loss": [(3, 4)]}


def test_every_train_row_names_its_kind_pipeline_and_backend_rows_as_rl():
    """PipelineTrainer's and backend.train's rows carry no `kind` (ART's do not): they are RL, never `-`."""
    rows = [{"step": 1, "split": "train", "kind": "sft", "loss/train": 1.0},
            {"step": 2, "split": "train", "train/reward": 0.5, "loss/train": 0.1},
            {"step": 2, "split": "val", "val/reward": 0.4},
            {"step": 3, "split": "val", "val/reward": 0.4}]
    assert [r.kind for r in step_table(rows)] == ["sft", "rl", None]
