"""A back end written against ART's hook protocol (async generators of per-optimizer-step metrics) plugs into
Model.train / train_sft and LocalBackend.train; artrl's protocol (an awaited TrainResult) keeps working."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

import artrl as art
from artrl.run import storage
from artrl.metrics_taxonomy import TRAIN_GRADIENT_STEPS_KEY


def traj(reward: float, text: str = "hi") -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": text},
                                                {"role": "assistant", "content": text.upper()}], reward=reward)


GROUPS = [art.TrajectoryGroup([traj(1.0, "a"), traj(0.0, "b")]), art.TrajectoryGroup([traj(0.5, "c")])]


def rows(model) -> list[dict]:
    path = model._run_dir() / storage.HISTORY_FILE
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


class ArtProtocolBackend(art.Backend):
    """ART's hooks: each yields one metric dict per optimizer step and advances the step at the end."""

    def __init__(self, rl_steps: list[dict], sft_steps: list[dict], gpu_price_per_hour: float | None = None):
        self.step, self.rl_steps, self.sft_steps, self.price = 0, rl_steps, sft_steps, gpu_price_per_hour
        self.seen: list[tuple] = []

    async def register(self, model):
        pass

    async def _get_step(self, model):
        return self.step

    def supports_automatic_train_step_metrics(self) -> bool:
        return self.price is not None

    def automatic_gpu_cost_per_hour_usd(self, model) -> float | None:
        return self.price

    async def _train_model(self, model, groups, config, dev_config, verbose=False):
        self.seen.append(("rl", len(groups), config.learning_rate, dict(dev_config), verbose))
        for metrics in self.rl_steps:
            yield metrics
        self.step += 1

    async def _train_sft(self, model, trajectories, config, dev_config, verbose=False):
        self.seen.append(("sft", len(trajectories)))
        for metrics in self.sft_steps:
            yield metrics
        if self.sft_steps:
            self.step += 1


def model_on(backend, tmp_path) -> art.TrainableModel:
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", base_path=str(tmp_path),
                               report_metrics=[])
    model._backend = backend
    return model


def test_an_art_protocol_rl_hook_gives_one_row_with_arts_aggregation_and_automatic_metrics(tmp_path):
    steps = [{"loss/train": 1.0, "loss/grad_norm": 0.5, TRAIN_GRADIENT_STEPS_KEY: 3.0},
             {"loss/train": 0.8, "loss/grad_norm": 0.3, TRAIN_GRADIENT_STEPS_KEY: 3.0},
             {"loss/train": 0.6, TRAIN_GRADIENT_STEPS_KEY: 3.0}]
    backend = ArtProtocolBackend(steps, [], gpu_price_per_hour=3600.0)  # $1 per second: costs/gpu = wall seconds
    model = model_on(backend, tmp_path)
    result = asyncio.run(model.train(GROUPS, config=art.TrainConfig(learning_rate=1e-5), _config={"ppo": True},
                                     verbose=True))
    assert backend.seen == [("rl", 2, 1e-5, {"ppo": True}, True)]
    (row,) = rows(model)
    assert (row["step"], row["split"], row["kind"]) == (1, "train", "rl") and result.step == 1
    assert row["loss/train"] == pytest.approx(0.8)  # the mean over the three optimizer steps
    assert row["loss/grad_norm"] == pytest.approx(0.4)  # over the steps that report it
    assert row[TRAIN_GRADIENT_STEPS_KEY] == 3.0  # invariant: kept, not summed or averaged
    assert row["time/step_trainer_s"] >= 0 and result.metrics["time/step_trainer_s"] == row["time/step_trainer_s"]
    assert row["costs/gpu"] == pytest.approx(row["time/step_wall_s"])  # ART's automatic metrics, from Model.log
    assert row["costs/all"] == pytest.approx(row["costs/gpu"])
    assert row["train/reward"] == pytest.approx(0.5) and row["data/step_num_groups_trainable"] == 1
    assert (model._run_dir() / "trajectories" / "train" / "0001.parquet").exists()


def test_a_reported_trainer_time_is_kept_for_rl_and_replaced_for_sft_as_in_art(tmp_path):
    backend = ArtProtocolBackend([{"loss/train": 1.0, "time/step_trainer_s": 1234.0}],
                                 [{"loss/train": 2.0, "time/step_trainer_s": 1234.0}])
    model = model_on(backend, tmp_path)
    asyncio.run(model.train(GROUPS))
    sft = asyncio.run(model.train_sft([traj(0.0)] * 3))
    rl_row, sft_row = rows(model)
    assert rl_row["time/step_trainer_s"] == 1234.0
    assert sft_row["time/step_trainer_s"] < 1234.0 and sft.metrics["time/step_trainer_s"] < 1234.0
    assert (sft_row["step"], sft_row["kind"], sft_row["loss/train"]) == (2, "sft", 2.0)
    assert "train/reward" not in sft_row  # SFT logs no groups
    assert "time/step_wall_s" not in rl_row  # this backend offers no automatic metrics


def test_a_gradient_step_count_that_changes_between_steps_is_refused(tmp_path):
    backend = ArtProtocolBackend([{TRAIN_GRADIENT_STEPS_KEY: 2.0}, {TRAIN_GRADIENT_STEPS_KEY: 3.0}], [])
    model = model_on(backend, tmp_path)
    with pytest.raises(ValueError, match="must be invariant across samples"):
        asyncio.run(model.train(GROUPS))
    assert rows(model) == []


def test_an_sft_hook_that_yields_nothing_writes_no_row_and_says_so(tmp_path, caplog):
    model = model_on(ArtProtocolBackend([], []), tmp_path)
    with caplog.at_level(logging.WARNING, logger="artrl.model"):
        assert asyncio.run(model.train_sft([traj(0.0)])) is None
    assert rows(model) == [] and "yielded no metrics" in caplog.text


def test_a_hook_yielding_something_else_than_a_dict_is_named(tmp_path):
    model = model_on(ArtProtocolBackend([{"loss/train": 1.0}, 0.5], []), tmp_path)
    with pytest.raises(TypeError, match=r"ArtProtocolBackend\._train_model yielded a float \(item 1\)"):
        asyncio.run(model.train(GROUPS))


def test_artrls_protocol_reads_the_step_before_the_hook_runs(tmp_path):
    class Awaited(art.Backend):
        step = 4

        async def _get_step(self, model):
            return self.step

        async def _train_sft(self, model, trajectories, config, dev_config, verbose=False):
            self.step += 1
            return art.TrainResult(step=self.step, metrics={"loss/train": 0.5})

    model = model_on(Awaited(), tmp_path)
    result = asyncio.run(model.train_sft([traj(0.0)]))
    assert result.step == 5 and [(r["step"], r["loss/train"]) for r in rows(model)] == [(5, 0.5)]


def test_local_backend_train_iterates_an_art_protocol_hook(tmp_path):
    class Subclassed(art.LocalBackend):
        async def _train_model(self, model, groups, config, dev_config, verbose=False):
            self.seen = (config.learning_rate, dev_config)
            for loss in (1.0, 0.5):
                yield {"loss/train": loss, TRAIN_GRADIENT_STEPS_KEY: 2.0}

        async def _get_step(self, model):
            return 3

    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", base_path=str(tmp_path))
    backend = Subclassed(path=str(tmp_path), show_progress=False)
    result = asyncio.run(backend.train(model, GROUPS, learning_rate=2e-5, ppo=True))
    assert backend.seen == (2e-5, {"learning_rate": 2e-5, "ppo": True})
    assert result.step == 3 and result.metrics["loss/train"] == pytest.approx(0.75)
    assert result.metrics[TRAIN_GRADIENT_STEPS_KEY] == 2.0 and result.metrics["time/step_trainer_s"] >= 0
    assert result.metrics["data/step_num_groups_submitted"] == 2 and result.metrics["data/step_num_trajectories"] == 3
    assert result.checkpoint_path is None  # no checkpoint directory for step 3
    checkpoint = storage.checkpoint_dir(storage.run_dir(tmp_path, "p", "m"), 3)
    checkpoint.mkdir(parents=True)
    assert asyncio.run(backend.train(model, GROUPS)).checkpoint_path == str(checkpoint)
    assert asyncio.run(backend.train(model, GROUPS, save_checkpoint=False)).checkpoint_path is None
    assert rows(model) == []  # backend.train logs nothing, as in ART


def test_log_metrics_routes_known_sections_and_prefixes_the_rest(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=[])
    row = model._log_metrics({"reward/mean": 0.9, "custom": 1.0, "rewardish/value": 2.0}, split="train", step=7)
    (written,) = rows(model)
    assert written == json.loads(json.dumps(row))
    assert (row["reward/mean"], row["train/custom"], row["train/rewardish/value"]) == (0.9, 1.0, 2.0)
    assert row["training_step"] == 7 and row["time/wall_clock_sec"] >= 0
    assert model._log_metrics({"loss/x": 1.0}, split="eval", step=8)["eval/loss/x"] == 1.0  # not a split of ART's
