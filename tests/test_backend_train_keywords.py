"""`backend.train(model, groups, **kwargs)` and `model.train(..., _config=...)` with ART's keywords.

Every keyword of ART 0.5.17's `LocalBackend.train` is accepted; the ones with a meaning change what the
trainer computes (tests/test_train_call_update.py checks each one's effect on the loss, the gradient and the
update of a call, and tests/test_loss_art_options.py the loss function against hand-computed values); the
ones without log exactly one notice per process.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

import artrl as art
from artrl.runtime import notices
from artrl.errors import ConfigError
from artrl.run import storage
from artrl.types import TrainConfig

# ART 0.5.17 LocalBackend.train's keyword arguments (after model, trajectory_groups)
ART_TRAIN_KEYWORDS = (
    "learning_rate", "kl_penalty_coef", "kl_penalty_reference_step", "kl_ref_adapter_path", "ppo", "epsilon",
    "epsilon_high", "advantage_balance", "scale_rewards", "importance_sampling_level",
    "max_negative_advantage_importance_sampling_weight", "mask_prob_ratio", "kimi_k2_tau", "precalculate_logprobs",
    "allow_training_without_logprobs", "plot_tensors", "truncated_importance_sampling",
    "scale_learning_rate_by_reward_std_dev", "logprob_calculation_chunk_size",
    "num_trajectories_learning_rate_multiplier_power", "save_checkpoint", "verbose",
)
BACKEND_ONLY = {"save_checkpoint", "verbose"}
USER = {"role": "user", "content": "Pick a colour."}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = tmp_path_factory.mktemp("keywords")
    backend = art.LocalBackend(path=str(path), show_progress=False)
    model = art.TrainableModel(name="kw", project="p", base_model="artrl/tiny",
                               _internal_config=art.InternalModelConfig(max_length=128))
    asyncio.run(model.register(backend))
    yield model, backend
    backend.close()


@pytest.fixture()
def groups(make_choice):
    def make() -> list[art.TrajectoryGroup]:
        return [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[USER, make_choice(c)], reward=r)
                                     for c, r in pairs]) for pairs in ((("blue", 1.0), ("red", 0.0)),
                                                                       (("green", 0.5), ("pink", 0.0)))]
    return make


def metric(result, name: str) -> float:
    """A trainer figure under artrl's history name (train/<name>) or ART's (loss/<name>)."""
    for key in (f"train/{name}", f"loss/{name}"):
        if key in result.metrics:
            return result.metrics[key]
    raise KeyError(f"{name} not in {sorted(result.metrics)}")


def has_metric(result, name: str) -> bool:
    return f"train/{name}" in result.metrics or f"loss/{name}" in result.metrics


def train(live, groups, **kwargs) -> art.TrainResult:
    model, backend = live
    return asyncio.run(backend.train(model, groups, **kwargs))


def test_every_art_keyword_is_a_field_or_a_backend_argument():
    missing = [k for k in ART_TRAIN_KEYWORDS if k not in TrainConfig.model_fields and k not in BACKEND_ONLY]
    assert missing == []


def test_all_art_keywords_at_once_train_and_advance(live, groups, caplog, tmp_path):
    model, backend = live
    run = backend._runs["kw"].run
    reference = storage.checkpoint_dir(run, storage.list_checkpoints(run)[0])
    notices.forget()
    values = dict(learning_rate=1e-4, kl_penalty_coef=0.05, kl_penalty_reference_step=0,
                  kl_ref_adapter_path=str(reference), ppo=True, epsilon=0.25, epsilon_high=0.3,
                  advantage_balance=0.3, scale_rewards=False, importance_sampling_level="geometric_average",
                  max_negative_advantage_importance_sampling_weight=3.0, mask_prob_ratio=True, kimi_k2_tau=0.01,
                  precalculate_logprobs=True, allow_training_without_logprobs=True, plot_tensors=True,
                  truncated_importance_sampling=2.0, scale_learning_rate_by_reward_std_dev=True,
                  logprob_calculation_chunk_size=7, num_trajectories_learning_rate_multiplier_power=0.5,
                  save_checkpoint=False, verbose=True)
    assert set(values) == set(ART_TRAIN_KEYWORDS)
    step = asyncio.run(model.get_step())
    with caplog.at_level(logging.INFO):
        first = train(live, groups(), **values)
        second = train(live, groups(), **values)
    assert (first.step, second.step) == (step + 1, step + 2)
    assert first.checkpoint_path is None and storage.is_complete(storage.checkpoint_dir(run, step + 1))
    assert metric(first, "learning_rate") == pytest.approx(1e-4 * 4 ** 0.5)  # 4 sequences, power 0.5
    assert has_metric(first, "kl_policy_ref")
    assert list(run.glob("packed_tensors_plot_*.png"))
    ignored = [r.getMessage() for r in caplog.records if r.name == "artrl.notices"]
    assert sum("scale_learning_rate_by_reward_std_dev" in m for m in ignored) == 1
    assert sum("save_checkpoint=False" in m for m in ignored) == 1
    assert len(ignored) == 2, ignored  # every other keyword has a meaning here
    steps_logged = [r.getMessage() for r in caplog.records if "optimizer step 1/1" in r.getMessage()]
    assert len(steps_logged) == 2  # verbose: one line per optimizer step of each call


def test_precalculated_logprobs_make_the_first_ratio_one(live, groups):
    # the fixture's sampled logprobs are random, so the sampler/trainer ratio is far from 1 ...
    plain = train(live, groups(), learning_rate=1e-6)
    assert abs(metric(plain, "mean_ratio") - 1) > 0.1
    # ... until the trainer recomputes them before the step (ART's precalculate_logprobs)
    pre = train(live, groups(), learning_rate=1e-6, precalculate_logprobs=True)
    assert metric(pre, "mean_ratio") == pytest.approx(1.0, abs=1e-5)


def test_kl_reference_is_the_base_model_or_the_named_checkpoint(live, groups):
    model, _ = live
    train(live, groups(), learning_rate=5e-3)  # move the adapter away from the base model
    here = asyncio.run(model.get_step())
    base = train(live, groups(), learning_rate=1e-7, kl_penalty_coef=0.1)
    same = train(live, groups(), learning_rate=1e-7, kl_penalty_coef=0.1, kl_penalty_reference_step=here + 1)
    assert abs(metric(base, "kl_policy_ref")) > 1e-4  # trained weights vs base
    assert abs(metric(same, "kl_policy_ref")) < 1e-5  # the checkpoint the weights were just saved as
    with pytest.raises(ConfigError, match="kl_penalty_reference_step=999: .* no complete checkpoint"):
        train(live, groups(), kl_penalty_coef=0.1, kl_penalty_reference_step=999)


def test_model_train_accepts_every_art_dev_train_config_key(live, groups):
    model, backend = live
    run = backend._runs["kw"].run
    options = art.dev.TrainConfig(
        advantage_balance=-0.2, allow_training_without_logprobs=True, epsilon=0.3, epsilon_high=0.5,
        importance_sampling_level="average", kimi_k2_tau=0.05, kl_penalty_coef=0.05,
        kl_ref_adapter_path=str(storage.checkpoint_dir(run, 0)), logprob_calculation_chunk_size=64,
        mask_prob_ratio=False, max_negative_advantage_importance_sampling_weight=4.0,
        num_trajectories_learning_rate_multiplier_power=0.0, plot_tensors=False, ppo=False,
        precalculate_logprobs=False, scale_learning_rate_by_reward_std_dev=False, scale_rewards=True,
        truncated_importance_sampling=3.0)
    step = asyncio.run(model.get_step())
    result = asyncio.run(model.train(groups(), config=art.TrainConfig(learning_rate=1e-5), _config=options))
    assert result.step == step + 1 and metric(result, "learning_rate") == pytest.approx(1e-5)


def test_an_unknown_keyword_is_refused_with_the_known_ones(live, groups):
    with pytest.raises(ConfigError, match="unknown TrainConfig fields \\['lerning_rate'\\]"):
        train(live, groups(), lerning_rate=1e-5)


def test_plot_file_is_a_png(live, groups):
    _, backend = live
    train(live, groups(), learning_rate=1e-7, plot_tensors=True)
    newest = max(backend._runs["kw"].run.glob("packed_tensors_plot_*.png"), key=lambda p: p.stat().st_mtime)
    assert Path(newest).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
