"""What ART 0.5.23 added to its public surface, here: top-level names, train and SFT keys, and what they do.

Loss-level rules (the log-ratio clamp, kl_penalty_source's arithmetic, the ratio figures) are checked against hand
values in tests/test_loss_art_options.py, and each RL key's effect on a real update in
tests/test_train_call_update.py; this file checks the names, the SFT keys and the refusals, through the calls
that take them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

import pytest

import artrl as art
from artrl.runtime import notices
from artrl.errors import ConfigError, TrajectoryError
from artrl.trajectories.tokenization import tokenize_sft
from artrl.run import storage
from artrl.config.model import InternalModelConfig
from artrl.types import TrainConfig, TrainSFTConfig

USER = {"role": "user", "content": "Name a colour."}


# --------------------------------------------------------------------------- top-level names

def test_art_0523_top_level_names_are_exported():
    for name in ("get_tokenizer", "LocalServingUnavailableError", "MetricDefinition",
                 "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS", "PIPELINE_RL_METRIC_DEFINITIONS", "PIPELINE_RL_SCORE_METRICS"):
        assert name in art.__all__ and hasattr(art, name), name
    from artrl.local import LocalBackend  # ART 0.5.23's home of LocalBackend; the top-level name stays

    assert LocalBackend is art.LocalBackend
    assert issubclass(art.LocalServingUnavailableError, RuntimeError)


def test_arts_megatron_names_say_there_is_no_megatron_back_end():
    for name in ("MegatronRuntimeConfig", "MegatronTopologyConfig", "get_megatron_runtime_config",
                 "init_megatron_runtime_config"):
        with pytest.raises(AttributeError, match=f"artrl has no {name}: .*Megatron back end"):
            getattr(art, name)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        art.not_a_name  # noqa: B018
    assert not hasattr(art, "MegatronRuntimeConfig")


def test_get_tokenizer_loads_a_models_tokenizer_and_passes_options_on(tiny_path, monkeypatch):
    tok = art.get_tokenizer("artrl/tiny")
    assert tok.encode("blue") and tok.chat_template
    calls = []
    import transformers

    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        calls.append(kwargs)
        return real(path, **{k: v for k, v in kwargs.items() if k != "revision"})

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    art.get_tokenizer(str(tiny_path), revision="abc", use_fast=True)
    art.get_tokenizer(str(tiny_path), trust_remote_code=False)
    # ART: a local directory trusts its code unless told otherwise; revision and other keywords pass through
    assert calls[0] == {"trust_remote_code": True, "revision": "abc", "use_fast": True}
    assert calls[1] == {"trust_remote_code": False}
    with pytest.raises(ConfigError, match="looks like a local path, but nothing is there"):
        art.get_tokenizer(str(tiny_path / "no-such-dir"))


def test_get_tokenizer_of_a_directory_without_one_names_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"get_tokenizer\('.*empty'\): could not load its tokenizer"):
        art.get_tokenizer(str(tmp_path / "empty"))


def test_metric_catalogue_is_arts():
    defs = art.PIPELINE_RL_METRIC_DEFINITIONS
    assert len(defs) == 40 and len({d.key for d in defs}) == 40
    assert all(isinstance(d, art.MetricDefinition) for d in defs)
    assert art.PIPELINE_RL_DASHBOARD_DEFAULT_METRICS[:2] == ("objective/score", "throughput/accepted_train_tok_per_s")
    assert len(art.PIPELINE_RL_DASHBOARD_DEFAULT_METRICS) == 11
    assert art.PIPELINE_RL_SCORE_METRICS == (
        "objective/score", "sample_efficiency/freshness_discount", "sample_efficiency/batch_factor",
        "offpolicy/token_weighted_policy_age_steps", "throughput/accepted_train_tok_per_s",
        "data/step_trainable_assistant_tokens")
    by_key = {d.key: d for d in defs}
    assert by_key["queue/put_wait_s"].kind == "duration" and by_key["queue/put_wait_s"].unit == "seconds"
    with pytest.raises(Exception):
        art.MetricDefinition(key="x", title="x", description="x", kind="speed")


# --------------------------------------------------------------------------- TrainConfig keys

def test_new_train_config_keys_are_checked():
    assert TrainConfig().kl_penalty_source == "current_learner" and TrainConfig().optimizer_save_interval == 5
    for bad in (dict(kl_penalty_source="learner"), dict(optimizer_save_interval=0), dict(final_training_step=0),
                dict(kl_penalty_step_lag=0)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            TrainConfig(**bad)
    with pytest.raises(ConfigError, match="kl_penalty_step_lag=2 names a moving KL reference"):
        TrainConfig(kl_penalty_step_lag=2, kl_penalty_reference_step=0).check()


def test_optimizer_save_keys_are_noticed_once_when_they_ask_for_less_than_every_checkpoint(caplog):
    notices.forget()
    with caplog.at_level(logging.INFO, logger="artrl.notices"):
        TrainConfig().notice_ignored()
        TrainConfig(optimizer_save_interval=5).notice_ignored()  # ART's default: nothing to say
        for _ in range(2):
            TrainConfig(optimizer_save_interval=10, final_training_step=100).notice_ignored()
    said = [r.getMessage() for r in caplog.records]
    assert sum("optimizer_save_interval=10" in m for m in said) == 1
    assert sum("final_training_step=100" in m for m in said) == 1
    assert len(said) == 2 and all("every checkpoint" in m for m in said)


# --------------------------------------------------------------------------- SFT: assistant_turns

def _conversation() -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[
        USER, {"role": "assistant", "content": "Blue, a long answer that has quite a few tokens in it."},
        {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red."}], reward=0.0)


def test_assistant_turns_last_trains_only_the_final_reply(tok):
    traj = _conversation()
    every = tokenize_sft([traj], tok).sequences
    last = tokenize_sft([traj], tok, assistant_turns="last").sequences
    (seq,) = last
    trained = tok.decode([t for t, m in zip(seq.token_ids, seq.trainable_mask) if m])
    assert "Red." in trained and "Blue" not in trained
    assert sum(s.n_trainable for s in every) > seq.n_trainable > 0
    # the same tokens as the final reply's in the all-turns rendering: only the mask differs
    (full,) = every
    assert full.token_ids == seq.token_ids
    assert [m for m in seq.trainable_mask if m] and all(f for f, m in zip(full.trainable_mask, seq.trainable_mask) if m)


def test_assistant_turns_last_refuses_a_trajectory_that_ends_otherwise(tok):
    ends_with_user = art.Trajectory(messages_and_choices=[*_conversation().messages_and_choices, USER], reward=0.0)
    with pytest.raises(TrajectoryError, match=r"trajectories\[1\]: assistant_turns='last' .* ends with 'user'"):
        tokenize_sft([_conversation(), ends_with_user], tok, assistant_turns="last")
    tokenize_sft([ends_with_user], tok)  # 'all' trains its assistant turns
    with pytest.raises(ConfigError, match="assistant_turns"):
        TrainSFTConfig(assistant_turns="first")


# --------------------------------------------------------------------------- SFT through the model

@pytest.fixture(scope="module")
def live(tmp_path_factory):
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("sft0523")), show_progress=False)
    model = art.TrainableModel(name="sft", project="p", base_model="artrl/tiny",
                               _internal_config=art.InternalModelConfig(max_length=128))
    asyncio.run(model.register(backend))
    yield model, backend
    backend.close()


def _train_rows(model) -> list[dict]:
    path = model._run_dir() / storage.HISTORY_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("split") == "train"]


def test_train_sft_log_metrics_and_assistant_turns(live):
    model, _ = live
    before = len(_train_rows(model))
    last = asyncio.run(model.train_sft([_conversation()], TrainSFTConfig(assistant_turns="last", learning_rate=1e-4)))
    every = asyncio.run(model.train_sft([_conversation()], TrainSFTConfig(learning_rate=1e-4)))
    assert 0 < last.metrics["data/step_trainer_tokens"] < every.metrics["data/step_trainer_tokens"]
    assert len(_train_rows(model)) == before + 2
    step = asyncio.run(model.get_step())
    quiet = asyncio.run(model.train_sft([_conversation()], TrainSFTConfig(learning_rate=1e-4), log_metrics=False))
    assert quiet.step == step + 1  # trained and checkpointed ...
    assert len(_train_rows(model)) == before + 2  # ... but no train row, as ART's log_metrics=False
    with pytest.raises(ConfigError, match="contradicts train_sft\\(log_metrics=True\\)"):
        asyncio.run(model.train_sft([_conversation()], _config=art.dev.TrainSFTConfig(metric_logging={"enabled": False})))
    with pytest.raises(ConfigError, match="target_training_step"):
        asyncio.run(model.train_sft([_conversation()], _config={"metric_logging": {"target_training_step": 3}}))
    with pytest.raises(ConfigError, match="metric_logging\\['enabld'\\]"):
        art.dev.TrainSFTConfig(metric_logging={"enabld": True})


def test_train_sft_from_file_takes_assistant_turns_and_log_metrics(live, tmp_path):
    from artrl.utils.sft import train_sft_from_file

    model, _ = live
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"messages": _conversation().messages_and_choices}) for _ in range(2)))
    before, step = len(_train_rows(model)), asyncio.run(model.get_step())
    asyncio.run(train_sft_from_file(model, str(path), batch_size=2, assistant_turns="last", log_metrics=False))
    assert asyncio.run(model.get_step()) == step + 1 and len(_train_rows(model)) == before
    asyncio.run(train_sft_from_file(model, str(path), batch_size=2, assistant_turns="last"))
    (row,) = _train_rows(model)[before:]
    with_all = asyncio.run(model.train_sft([_conversation()] * 2, TrainSFTConfig(batch_size=2, learning_rate=1e-4),
                                           log_metrics=False))
    assert 0 < row["data/step_trainer_tokens"] < with_all.metrics["data/step_trainer_tokens"]


# --------------------------------------------------------------------------- metric names

def test_metrics_builder_writes_0523_names_beside_0518s():
    from artrl.metrics import MetricsBuilder

    builder = MetricsBuilder("train")
    builder.add_data(step_rollout_tokens=100)
    builder.add_user_timing(step_wall_s=5.0, step_rollout_s=4.0)
    builder.add_idle_times(step_trainer_idle_s=1.0, step_rollout_idle_s=0.5)
    first = asyncio.run(builder.flush())
    assert first["data/step_rollout_tokens"] == first["data/step_actor_tokens"] == 100
    assert first["time/step_rollout_s"] == first["time/step_actor_s"] == 4.0
    assert first["time/step_trainer_idle_s"] == first["throughput/step_trainer_idle_s"] == 1.0
    assert first["time/step_rollout_idle_s"] == first["throughput/step_actor_idle_s"] == 0.5
    assert first["throughput/avg_rollout_tok_per_s"] == first["throughput/avg_actor_tok_per_s"] == 25.0
    builder.add_data(step_actor_tokens=60)  # ART 0.5.18's keywords keep working
    builder.add_user_timing(step_actor_s=1.0)
    builder.add_idle_times(step_actor_idle_s=0.25)
    second = asyncio.run(builder.flush())
    assert second["data/cum/rollout_tokens"] == second["data/cum/actor_tokens"] == 160
    assert second["time/cum/rollout_idle_s"] == 0.75 and second["throughput/cum/actor_idle_s"] == 0.75
    assert second["throughput/avg_rollout_tok_per_s"] == pytest.approx(160 / 5.0)
    with pytest.raises(ValueError, match="given twice"):
        builder.add_user_timing(step_rollout_s=1.0, step_actor_s=1.0)


def test_trainer_throughput_is_trainable_tokens_over_backend_train_time():
    from artrl.metrics import MetricsBuilder

    builder = MetricsBuilder("train")
    for tokens, seconds in ((300, 2.0), (100, 2.0)):
        builder.add_metric("data/step_trainable_assistant_tokens", tokens)
        builder.add_metric("time/step_backend_train_s", seconds)
        out = asyncio.run(builder.flush())
    assert out["throughput/avg_trainer_tok_per_s"] == pytest.approx(400 / 4.0)


def test_completion_tokens_is_the_sum_over_every_choice(make_choice):
    from artrl.trajectories.gather_context import GatherContext, record_metrics

    a, b = make_choice("red green"), make_choice("blue")
    n = len(a.logprobs.content) + len(b.logprobs.content)
    traj = art.Trajectory(messages_and_choices=[USER, a], reward=1.0,
                          additional_histories=[art.History(messages_and_choices=[USER, b])])
    record_metrics(GatherContext(), traj)
    assert traj.metrics["completion_tokens"] == n  # ART 0.5.23: a sum (0.5.18: the mean per turn)
    silent = make_choice("pink", logprobs=False, token_ids=False)
    partial = art.Trajectory(messages_and_choices=[USER, a, {"role": "user", "content": "more"}, silent], reward=0.0)
    record_metrics(GatherContext(), partial)
    assert "completion_tokens" not in partial.metrics  # a Choice that does not say: no figure, as in ART


def test_an_rl_train_row_has_arts_0523_figures(live, make_choice):
    model, _ = live
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[USER, make_choice(c)], reward=r)
                                 for c, r in (("blue", 1.0), ("red", 0.0))])
    result = asyncio.run(model.train([group], config=TrainConfig(learning_rate=1e-5, epsilon=0.2,
                                                                 epsilon_high=0.2)))
    m = result.metrics
    for key in ("loss/importance_ratio_mean", "loss/importance_ratio_p95", "loss/importance_ratio_p99",
                "loss/clipped_token_fraction", "time/step_backend_train_s", "data/step_trainable_assistant_tokens"):
        assert key in m, key
    assert m["data/step_trainable_assistant_tokens"] == m["data/step_trainer_tokens"] > 0
    # the fixture's sampled logprobs are random: ratios spread, and some fall outside [0.8, 1.2]
    assert 0 < m["loss/clipped_token_fraction"] <= 1 and m["loss/importance_ratio_p99"] >= m["loss/importance_ratio_p95"]
    assert m["loss/importance_ratio_mean"] == pytest.approx(m["train/mean_ratio"], rel=1e-6)  # unit weights here
    (row,) = [r for r in _train_rows(model) if r["step"] == result.step]
    assert row["loss/importance_ratio_mean"] == pytest.approx(m["loss/importance_ratio_mean"])
    from artrl.metrics import ARTRL_LOGS

    assert ARTRL_LOGS <= set(m)


# --------------------------------------------------------------------------- keys older than 0.5.23, through backend.train

def _groups(make_choice) -> list[art.TrajectoryGroup]:
    return [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[USER, make_choice(c)], reward=r)
                                 for c, r in pairs]) for pairs in ((("blue", 1.0), ("red", 0.0)),
                                                                   (("green", 0.5), ("pink", 0.0)))]


def test_grad_accumulation_sequences_makes_a_step_of_that_many_rows(live, make_choice):
    model, backend = live
    # short rows without prompt sharing: several rows; by default the call is one optimizer step, with
    # grad_accumulation_sequences=1 (ART: packed sequences per step) one step per row
    layout = dict(row_length=32, share_prompts=False, learning_rate=1e-6)
    whole = asyncio.run(backend.train(model, _groups(make_choice), **layout))
    per_row = asyncio.run(backend.train(model, _groups(make_choice), grad_accumulation_sequences=1, **layout))
    rows = whole.metrics["train/rows"]
    assert rows >= 2 and per_row.metrics["train/rows"] == rows
    assert whole.metrics["data/step_num_gradient_steps"] == 1
    assert per_row.metrics["data/step_num_gradient_steps"] == rows


def test_logprob_calculation_chunk_size_reaches_the_logprob_computation(live, make_choice, monkeypatch):
    from artrl.train.trainer import Trainer

    model, backend = live
    seen = []
    real = Trainer.forward_tokens

    def spy(self, sub, *args, **kwargs):
        seen.append(kwargs.get("chunk_size"))
        return real(self, sub, *args, **kwargs)

    monkeypatch.setattr(Trainer, "forward_tokens", spy)
    small = asyncio.run(backend.train(model, _groups(make_choice), logprob_calculation_chunk_size=3, learning_rate=1e-6))
    assert seen and set(seen) == {3}
    seen.clear()
    asyncio.run(backend.train(model, _groups(make_choice), learning_rate=1e-6))
    assert set(seen) == {None}  # the model's logprob_chunk_size
    assert math.isfinite(small.metrics["loss/train"])


def test_dev_train_configs_packed_sequence_length_is_the_row_length(live, make_choice):
    model, _ = live
    options = art.dev.TrainConfig(packed_sequence_length=32, share_prompts=False, learning_rate=1e-6)
    narrow = asyncio.run(model.train(_groups(make_choice), _config=options))
    wide = asyncio.run(model.train(_groups(make_choice), _config={**options, "packed_sequence_length": 128}))
    assert narrow.metrics["train/rows"] > wide.metrics["train/rows"]
    with pytest.raises(ConfigError, match="packed_sequence_length=8"):
        asyncio.run(model.train(_groups(make_choice), _config={"packed_sequence_length": 8}))
    with pytest.raises(ConfigError, match="exceeds the model's max_length"):
        asyncio.run(model.train(_groups(make_choice), _config={"packed_sequence_length": 4096}))


def test_max_length_comes_from_the_models_config_as_art_reads_it():
    from types import SimpleNamespace

    from artrl.models.loading import model_max_length

    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert model_max_length(model(max_position_embeddings=4096)) == 4096
    assert model_max_length(model(n_positions=1024)) == 1024  # GPT-2's name, which 0.5.18's rule missed
    assert model_max_length(model(seq_length=2048), InternalModelConfig(max_length=512)) == 512
    nested = model(text_config=SimpleNamespace(max_position_embeddings=8192), max_position_embeddings=None)
    assert model_max_length(nested) == 8192
    assert model_max_length(model(), InternalModelConfig(max_length=300)) == 300
    with pytest.raises(ConfigError, match="gives no maximum sequence length .* set InternalModelConfig\\(max_length"):
        model_max_length(model(hidden_size=8))
