"""model.log as ART has it: from the model, before register and for prompted models; one train row per step."""

from __future__ import annotations

import asyncio
import json
import math

import polars as pl
import pytest

import artrl as art
from artrl.errors import ConfigError, TrajectoryError
from artrl.run import storage
from artrl.metrics import MetricsBuilder
from artrl.run.trajectory_logs import read_trajectory_groups_parquet


def traj(reward: float, text: str = "hi", **kw) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": text},
                                                {"role": "assistant", "content": text.upper()}], reward=reward, **kw)


def rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / storage.HISTORY_FILE).read_text().splitlines()]


def test_a_prompted_model_named_like_a_provider_model_logs_without_a_backend(tmp_path):
    model = art.Model(name="openai/gpt-4o", project="evals", base_path=str(tmp_path), report_metrics=[])
    assert asyncio.run(model.get_step()) == 0
    groups = [art.TrajectoryGroup([traj(0.8, "a", metrics={"tokens": 10}), traj(0.6, "b", metrics={"tokens": 20})]),
              art.TrajectoryGroup([traj(1.0, "c", metrics={"tokens": 30})])]
    row = asyncio.run(model.log(groups, split="val"))
    run = tmp_path / "evals" / "models" / "openai" / "gpt-4o"
    assert rows(run) == [json.loads(json.dumps(row))]
    assert row["step"] == row["training_step"] == 0 and row["split"] == "val" and "recorded_at" in row
    assert row["val/reward"] == pytest.approx(0.8) and row["val/tokens"] == pytest.approx(20)
    assert row["val/reward_std_dev"] == pytest.approx(0.1)  # within-group std, averaged over groups of 2+
    assert row["val/exception_rate"] == 0.0 and row["data/step_num_trajectories"] == 3
    logged = read_trajectory_groups_parquet(run / "trajectories" / "val" / "0000.parquet")
    assert [[t.reward for t in g.trajectories] for g in logged] == [[0.8, 0.6], [1.0]]
    assert pl.read_ndjson(run / storage.HISTORY_FILE)["val/reward"].to_list() == [pytest.approx(0.8)]


def test_a_trainable_model_logs_before_register_at_the_runs_latest_checkpoint(tmp_path):
    model = art.TrainableModel(name="agent", project="p", base_model="artrl/tiny", base_path=str(tmp_path),
                               report_metrics=[])
    run = storage.run_dir(tmp_path, "p", "agent")
    asyncio.run(model.log([traj(1.0)], split="val"))
    (run / storage.CHECKPOINTS_DIR / "0007").mkdir(parents=True)
    (run / storage.CHECKPOINTS_DIR / "0007" / storage.COMPLETE_MARKER).write_text("{}")
    asyncio.run(model.log([traj(0.5)], split="val"))
    assert [(r["step"], r["val/reward"]) for r in rows(run)] == [(0, 1.0), (7, 0.5)]
    assert (run / "trajectories" / "val" / "0007.parquet").exists()
    with pytest.raises(ConfigError, match="not registered"):
        asyncio.run(model.get_step())


def test_lists_with_exceptions_are_counted_and_generators_are_read_once(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=[])

    def rollouts():
        yield traj(1.0, metrics={"custom": 1.0})
        yield RuntimeError("the environment crashed")
        yield traj(3.0, metrics={"custom": 3.0})

    row = asyncio.run(model.log(rollouts(), split="val"))
    assert row["val/reward"] == 2.0 and row["val/custom"] == 2.0
    assert row["val/exception_rate"] == pytest.approx(1 / 3) and row["val/exceptions"] == 1
    assert row["data/step_num_trajectories"] == 3  # ART counts failed rollouts too
    (group,) = read_trajectory_groups_parquet(storage.trajectory_log_path(model._run_dir(), "val", 0))
    assert len(group.trajectories) == 2 and len(group.exceptions) == 1
    assert "the environment crashed" in str(group.exceptions[0])


def test_what_cannot_be_logged_is_refused_before_anything_is_written(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=[])
    bad = traj(1.0)
    bad.reward = math.nan  # set after construction, as rollouts do
    with pytest.raises(TrajectoryError, match="group 0, trajectory 1"):
        asyncio.run(model.log([traj(1.0), bad]))
    with pytest.raises(ConfigError, match="must be numbers"):
        asyncio.run(model.log(metrics={"note": "text"}))
    with pytest.raises(TypeError, match="item 1 is a str"):
        asyncio.run(model.log([traj(1.0), "not a trajectory"]))
    with pytest.raises(TypeError, match="mix"):
        asyncio.run(model.log([art.TrajectoryGroup([traj(1.0)]), traj(1.0)]))
    assert not model._run_dir().exists()


def test_metrics_follow_arts_routing_costs_roll_up_and_totals_survive_a_new_model(tmp_path):
    def make():
        return art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=[])

    first = asyncio.run(make().log(split="train", step=1, metrics={
        "costs/train/prefill": 0.2, "costs/train/sample": 0.3, "loss/train": 1.5, "custom": 2.0}))
    assert first["loss/train"] == 1.5 and first["train/custom"] == 2.0  # known section kept, others prefixed
    assert first["costs/train"] == pytest.approx(0.5) and first["costs/all"] == pytest.approx(0.5)
    second = asyncio.run(make().log(split="train", step=2, metrics={"costs/train/prefill": 0.1,
                                                                     "time/step_actor_s": 2.0}))
    assert second["costs/cum/train/prefill"] == pytest.approx(0.3)  # running totals come back from state.json
    assert second["costs/cum/all"] == pytest.approx(0.6) and second["time/cum/actor_s"] == 2.0
    assert "_metrics_builder_state" in make().read_state()


def test_logging_one_split_twice_at_a_step_keeps_both_calls_groups(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=[])
    asyncio.run(model.log([traj(0.1)], split="val", step=3))
    asyncio.run(model.log([art.TrajectoryGroup([traj(0.2), traj(0.3)])], split="val", step=3))
    groups = read_trajectory_groups_parquet(storage.trajectory_log_path(model._run_dir(), "val", 3))
    assert [[t.reward for t in g.trajectories] for g in groups] == [[0.1], [0.2, 0.3]]


class FakeBackend:
    """Stands in for LocalBackend's train call: advances the step and returns its metrics."""

    def __init__(self, advance: bool = True) -> None:
        self.step, self.advance = 0, advance

    async def register(self, model) -> None:
        pass

    async def _get_step(self, model) -> int:
        return self.step

    async def _train_model(self, model, groups, config, dev, verbose=False):
        self.step += self.advance
        return art.TrainResult(step=self.step, metrics={"loss/train": 0.25, "data/step_num_gradient_steps": 2.0,
                                                         "data/step_trainer_tokens": 40.0,
                                                         "time/step_trainer_s": 4.0, "train/clip_fraction": 0.1})


def test_one_rl_train_call_writes_one_train_row_at_the_step_it_produced(tmp_path):
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", report_metrics=[])
    backend = FakeBackend()
    backend.path = tmp_path
    asyncio.run(model.register(backend))
    assert model.base_path == str(tmp_path)
    groups = [art.TrajectoryGroup([traj(1.0, "a"), traj(0.0, "b")], ), art.TrajectoryGroup([traj(0.5, "c")])]
    for _ in range(2):
        asyncio.run(model.train(groups, config=art.TrainConfig()))
    history = rows(model._run_dir())
    assert [(r["step"], r["split"], r["kind"]) for r in history] == [(1, "train", "rl"), (2, "train", "rl")]
    r = history[0]
    assert r["train/reward"] == pytest.approx(0.5) and r["loss/train"] == 0.25 and r["train/clip_fraction"] == 0.1
    assert r["data/step_num_groups_submitted"] == 2 and r["data/step_num_groups_trainable"] == 1
    assert r["data/step_num_gradient_steps"] == 2 and r["data/cum/num_gradient_steps"] == 2
    assert history[1]["data/cum/trainer_tokens"] == 80 and history[1]["time/cum/trainer_s"] == 8
    assert history[1]["throughput/avg_trainer_tok_per_s"] == pytest.approx(10.0)
    assert (model._run_dir() / "trajectories" / "train" / "0002.parquet").exists()


def test_a_train_call_that_did_not_advance_the_step_writes_no_row(tmp_path, caplog):
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", base_path=str(tmp_path),
                               report_metrics=[])
    model._backend = FakeBackend(advance=False)
    with caplog.at_level("WARNING", logger="artrl.model"):
        asyncio.run(model.train([art.TrajectoryGroup([traj(1.0), traj(1.0)])]))
    assert "writes no train row" in caplog.text and not (model._run_dir() / storage.HISTORY_FILE).exists()


def test_model_fields_and_litellm_params_are_arts(tmp_path):
    prompted = art.Model(name="openai/gpt-4o", project="p", inference_base_url="https://api.openai.com/v1",
                         inference_api_key="sk-x")
    assert (prompted.base_path, prompted.report_metrics, prompted.run_id) == (".art", None, None)
    assert prompted.litellm_completion_params() == {"model": "openai/gpt-4o", "base_url": "https://api.openai.com/v1",
                                                    "api_key": "sk-x", "temperature": 1}
    trainable = art.TrainableModel(name="agent", project="p", base_model="artrl/tiny")
    assert trainable.litellm_completion_params(3)["model"] == "hosted_vllm/agent@3"
    assert trainable.get_inference_name() == "agent" and trainable.get_inference_name(2) == "agent@2"
    for bad in ("", "a//b", "../x", "a/./b"):
        with pytest.raises(ValueError, match="not valid"):
            art.Model(name=bad, project="p")
    with pytest.raises(ValueError, match="may not contain '/'"):
        art.TrainableModel(name="org/agent", project="p", base_model="artrl/tiny")


def test_openai_client_has_arts_timeout_and_is_shared_only_with_the_defaults():
    model = art.Model(name="openai/gpt-4o", project="p", inference_base_url="http://127.0.0.1:9/v1",
                      inference_api_key="sk-x")
    client = model.openai_client()
    assert model.openai_client() is client  # rollouts may call it per request
    assert (client.timeout.read, client.timeout.connect) == (1200.0, 5.0)
    short = model.openai_client(timeout=5.0)
    assert short is not client and short.timeout == 5.0
    assert model.openai_client() is client  # a client made with the caller's options is not the shared one


def test_state_is_kept_in_the_run_directory_and_merged(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    assert model.read_state() is None
    model.overwrite_state({"dataset": {"offset": 3, "epoch": 1}})
    assert model.merge_state({"dataset": {"offset": 5}, "best": 0.9}) == {"dataset": {"offset": 5, "epoch": 1},
                                                                          "best": 0.9}
    assert json.loads((model._run_dir() / storage.STATE_FILE).read_text())["dataset"]["offset"] == 5


def test_an_active_model_builder_receives_metrics_for_the_next_row(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=[])
    token = model.activate_metrics_context("eval")
    try:
        MetricsBuilder.get_active().add_cost("eval/judge/ruler", 0.01)
    finally:
        token.var.reset(token)
    row = asyncio.run(model.log([traj(1.0)], split="val"))
    assert row["costs/eval/judge/ruler"] == 0.01 and row["costs/cum/all"] == 0.01


def test_response_costs_are_priced_from_openai_or_anthropic_usage_as_art_prices_them():
    builder = MetricsBuilder(cost_context="eval")
    builder.register_model_pricing("anthropic/judge", prompt_per_million=5.0, completion_per_million=7.0,
                                   cache_creation_per_million=6.0, cache_read_per_million=0.5)
    builder.register_model_pricing("openai/judge", prompt_per_million=2.0, completion_per_million=8.0,
                                   cached_prompt_per_million=0.5)
    anthropic = {"usage": {"input_tokens": 40, "output_tokens": 60, "cache_creation_input_tokens": 100,
                           "cache_read_input_tokens": 1000}}
    cost = builder.add_response_cost("judge/a", anthropic, provider="anthropic", model_name="anthropic/judge")
    assert cost == pytest.approx((40 * 5 + 100 * 6 + 1000 * 0.5 + 60 * 7) / 1e6)
    openai_usage = {"usage": {"prompt_tokens": 300, "completion_tokens": 20,
                              "prompt_tokens_details": {"cached_tokens": 100}}}
    cost = builder.add_response_cost("judge/o", openai_usage, provider="openai", model_name="openai/judge")
    assert cost == pytest.approx((200 * 2 + 100 * 0.5 + 20 * 8) / 1e6)
    # a price passed with the call overrides the registered one; unset cache prices are the prompt price
    cost = builder.add_response_cost("judge/o", openai_usage, provider="openai", model_name="openai/judge",
                                     completion_price_per_million=10.0)
    assert cost == pytest.approx((200 * 2 + 100 * 0.5 + 20 * 10) / 1e6)
    builder.register_model_pricing("plain", prompt_per_million=1.0, completion_per_million=1.0)
    assert builder.add_response_cost("j", anthropic, provider="anthropic", model_name="plain") == \
        pytest.approx((40 + 100 + 1000 + 60) / 1e6)
    with pytest.raises(ValueError, match="register_model_pricing"):
        builder.add_response_cost("j", openai_usage, provider="openai", model_name="unpriced")


def test_a_litellm_proxys_cost_header_is_the_cost_and_litellms_usage_is_read_for_anthropic_judges():
    from types import SimpleNamespace

    builder = MetricsBuilder(cost_context="eval")
    proxied = SimpleNamespace(usage={"prompt_tokens": 10}, _hidden_params={
        "additional_headers": {"llm_provider-x-litellm-response-cost": 0.0042}})
    assert builder.add_response_cost("judge", proxied, provider="openai", model_name="unpriced") == 0.0042
    # litellm reports an Anthropic call in OpenAI's fields, with zero Anthropic cache counts beside them
    builder.register_model_pricing("anthropic/claude", prompt_per_million=3.0, completion_per_million=15.0)
    litellm_usage = {"usage": {"prompt_tokens": 100, "completion_tokens": 10, "cache_creation_input_tokens": 0,
                               "cache_read_input_tokens": 0}}
    assert builder.add_response_cost("judge", litellm_usage, provider="anthropic", model_name="anthropic/claude") \
        == pytest.approx((100 * 3 + 10 * 15) / 1e6)


def test_averaging_train_samples_refuses_a_changing_gradient_step_count_in_arts_words():
    from artrl.metrics_taxonomy import TRAIN_GRADIENT_STEPS_KEY, average_metric_samples

    avg = average_metric_samples([{"loss/train": 1.0, TRAIN_GRADIENT_STEPS_KEY: 2.0},
                                  {"loss/train": 0.5, TRAIN_GRADIENT_STEPS_KEY: 2.0}])
    assert avg == {"loss/train": 0.75, TRAIN_GRADIENT_STEPS_KEY: 2.0}
    with pytest.raises(ValueError, match="must be invariant across samples"):
        average_metric_samples([{TRAIN_GRADIENT_STEPS_KEY: 2.0}, {TRAIN_GRADIENT_STEPS_KEY: 3.0}])


def test_the_builder_takes_art_0523s_rollout_spellings_and_0518s_actor_ones():
    """Either version's keyword writes the figure under both versions' names; both at once is refused."""
    for timing, idle, data in (({"step_rollout_s": 2.0}, {"step_rollout_idle_s": 0.75}, {"step_rollout_tokens": 20}),
                               ({"step_actor_s": 2.0}, {"step_actor_idle_s": 0.75}, {"step_actor_tokens": 20})):
        builder = MetricsBuilder(cost_context="train")
        builder.add_user_timing(step_wall_s=3.0, **timing)
        builder.add_idle_times(step_trainer_idle_s=0.5, **idle)
        builder.add_data(**data)
        out = asyncio.run(builder.flush())
        assert {k: out[k] for k in ("time/step_actor_s", "time/step_rollout_s", "throughput/step_trainer_idle_s",
                                    "time/step_trainer_idle_s", "throughput/step_actor_idle_s",
                                    "time/step_rollout_idle_s", "data/step_actor_tokens", "data/step_rollout_tokens",
                                    "time/cum/rollout_s", "time/cum/trainer_idle_s")} == {
            "time/step_actor_s": 2.0, "time/step_rollout_s": 2.0, "throughput/step_trainer_idle_s": 0.5,
            "time/step_trainer_idle_s": 0.5, "throughput/step_actor_idle_s": 0.75, "time/step_rollout_idle_s": 0.75,
            "data/step_actor_tokens": 20.0, "data/step_rollout_tokens": 20.0, "time/cum/rollout_s": 2.0,
            "time/cum/trainer_idle_s": 0.5}, timing
    with pytest.raises(ValueError, match="given twice"):
        MetricsBuilder(cost_context="train").add_user_timing(step_actor_s=1.0, step_rollout_s=2.0)
