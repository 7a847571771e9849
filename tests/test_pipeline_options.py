"""Every option of ART 0.5.23's PipelineTrainer, walked: each field of PipelineRuntimeConfig and
PipelineAutotuneConfig and each keyword of PipelineTrainer.__init__ is either honoured (a check below shows its
effect) or refused with a ConfigError naming it and its value. Nothing is accepted and ignored.

The lists of ART's names and defaults are written out from ART 0.5.23's source
(art/pipeline_tuner/config.py, art/pipeline_trainer/trainer.py); `test_the_walk_covers_every_art_name` fails
when a name is neither in HONOURED nor in REFUSED.
"""

from __future__ import annotations

import asyncio
import inspect
import logging

import pydantic
import pytest
from test_pipeline_trainer import FakeBackend, group, make_model, run, scenarios, train_rows

import artrl as art
from artrl.runtime import notices
from artrl.errors import ConfigError
from artrl.pipeline_trainer import PipelineAutotuneConfig, PipelineRuntimeConfig, PipelineTrainer
from artrl.pipeline_trainer.options import DEPRECATED_PIPELINE_KEYWORDS
from artrl.pipeline_tuner.config import UNREAD_AUTOTUNE_KNOBS

UNREAD = {name for names in UNREAD_AUTOTUNE_KNOBS.values() for name in names}

ART_RUNTIME_FIELDS = {"num_rollout_workers": 16, "min_batch_size": 4, "max_batch_size": None, "queue_maxsize": None,
                      "score_reference_groups_per_step": 8.0, "score_reference_rollouts_per_group": None}
ART_AUTOTUNE_FIELDS = {
    "mode": "off", "profile": None, "output_name": "latest", "window_steps": 4, "warmup_ignore_steps": 3,
    "target_spill_probability": 0.03, "worker_step": 2, "worker_move_fraction": 0.10,
    "worker_load_change_windows": 2, "max_worker_move": 16, "max_rollout_workers": 1024,
    "initial_model_calls_per_inference_gpu": 8, "initial_min_groups_per_packed_sequence": 8,
    "initial_max_groups_per_packed_sequence": 8, "packing_trials": 48, "packing_reservoir_multiplier": 2,
    "packing_reservoir_min_groups": 32, "packing_history_steps": 64, "packing_spill_prior_alpha": 1.0,
    "packing_spill_prior_beta": 8.0, "packing_spill_confidence": 0.8, "queue_running_reserve_fraction": 0.75,
    "trainer_load_under_score": 0.08, "trainer_load_severe_under_score": 0.50, "trainer_load_over_score": 0.04,
    "vllm_pressure_over_ratio": 0.80, "vllm_pressure_under_ratio": 0.50, "queue_put_severe_frac": 1.0 / 3.0,
    "stale_high_frac": 0.20, "stale_clear_frac": 0.10, "unused_and_dummy_high_frac": 0.25,
    "trainer_min_batch_lower_score": 0.15, "trainer_min_batch_raise_score": 0.10,
    "min_batch_collect_improvement_ratio": 0.85, "min_batch_trial_windows": 2, "recommendation_min_windows": 5,
    "recommendation_consecutive_holds": 2, "freshness_min_batch_floor_fraction": 0.85,
    "target_group_change_windows": 1, "target_group_increase_fraction": 0.20, "target_group_max_increase": 64,
    "target_group_min_relative_change": 0.10, "target_group_immediate_decrease_fraction": 0.25,
    "vllm_metric_interval_s": 1.0, "vllm_metric_timeout_window_frac": 0.35}
ART_TRAINER_KEYWORDS = {
    "num_rollout_workers": None, "min_batch_size": None, "max_batch_size": None, "queue_maxsize": None,
    "pipeline": None, "autotune": None, "learning_rate": 1e-5, "loss_fn": "cispo", "loss_fn_config": None,
    "normalize_advantages": True, "grad_accumulation_sequences": None, "adam_params": None, "kl_penalty_coef": 0.0,
    "kl_penalty_step_lag": None, "max_steps": None, "discard_queue_multiplier": 100, "max_steps_off_policy": 4,
    "limit_mean_steps_off_policy": None, "score_reference_groups_per_step": None,
    "score_reference_rollouts_per_group": None, "log_interval_seconds": 60.0, "status_ewa_alpha": 0.2,
    "total_scenarios": None, "eval_every_n_steps": 20, "eval_at_start": True, "save_checkpoint": True,
    "optimizer_save_interval": 5, "checkpoint_retention_strategy": None, "checkpoint_retention_interval": 1,
    "resume": True, "rollout_executor": None}

# name -> the test that shows its effect
HONOURED = {
    **{f"runtime.{k}": "test_runtime_fields_shape_the_run" for k in ART_RUNTIME_FIELDS},
    "autotune.mode": "test_pipeline_tuner.py (the schedule, in a real run, profiles)",
    "autotune.profile": "test_pipeline_tuner.py (profiles)",
    "autotune.output_name": "test_pipeline_tuner.py (profiles)",
    **{f"autotune.{k}": "test_pipeline_tuner.py (ART's rules)" for k in ART_AUTOTUNE_FIELDS
       if k not in UNREAD | {"mode", "profile", "output_name"}},
    **{k: "test_deprecated_aliases_work_with_one_notice_each" for k in DEPRECATED_PIPELINE_KEYWORDS},
    "pipeline": "test_runtime_fields_shape_the_run",
    "autotune": "test_pipeline_tuner.py (the schedule, in a real run, profiles)",
    **{k: "test_train_call_keywords_reach_backend_train" for k in (
        "learning_rate", "loss_fn", "loss_fn_config", "normalize_advantages", "grad_accumulation_sequences",
        "adam_params", "save_checkpoint")},
    "kl_penalty_coef": "test_a_kl_penalty_reaches_every_call_with_its_reference_kept",
    "kl_penalty_step_lag": "test_kl_penalty_step_lag_is_checked_and_read_only_with_a_penalty",
    "max_steps": "test_runtime_fields_shape_the_run",
    "discard_queue_multiplier": "test_status_and_discard_keywords_are_wired",
    "max_steps_off_policy": "test_no_hard_bound_and_the_mean_limit",
    "limit_mean_steps_off_policy": "test_no_hard_bound_and_the_mean_limit",
    "score_reference_groups_per_step": "test_runtime_fields_shape_the_run",
    "score_reference_rollouts_per_group": "test_runtime_fields_shape_the_run",
    "log_interval_seconds": "test_status_and_discard_keywords_are_wired",
    "status_ewa_alpha": "test_status_and_discard_keywords_are_wired",
    "total_scenarios": "test_status_and_discard_keywords_are_wired",
    "eval_every_n_steps": "test_pipeline_trainer.py (eval scheduling)",
    "eval_at_start": "test_pipeline_trainer.py (eval scheduling)",
    "optimizer_save_interval": "test_optimizer_save_interval_is_checked",
    "checkpoint_retention_strategy": "test_pipeline_trainer.py (retention)",
    "checkpoint_retention_interval": "test_pipeline_trainer.py (retention)",
    "resume": "test_pipeline_trainer.py (resume)",
}
REFUSED = {  # name -> a value ART accepts that artrl refuses
    **{f"autotune.{k}": ["a value other than ART's default, with mode 'online' or 'profile'"] for k in UNREAD},
    "rollout_executor": [object()],
}


def test_the_walk_covers_every_art_name():
    names = ({f"runtime.{k}" for k in ART_RUNTIME_FIELDS} | {f"autotune.{k}" for k in ART_AUTOTUNE_FIELDS}
             | set(ART_TRAINER_KEYWORDS))
    assert names - set(HONOURED) - set(REFUSED) == set()
    for where in HONOURED.values():
        if where.startswith("test_") and " " not in where:
            assert callable(globals().get(where)), where


def test_names_and_defaults_are_art_0523s():
    params = inspect.signature(PipelineTrainer.__init__).parameters
    for name, default in ART_TRAINER_KEYWORDS.items():
        assert name in params, name
        assert params[name].default == default, name
    assert {k: f.default for k, f in PipelineRuntimeConfig.model_fields.items()} == ART_RUNTIME_FIELDS
    assert {k: f.default for k, f in PipelineAutotuneConfig.model_fields.items()} == ART_AUTOTUNE_FIELDS
    assert art.PipelineRuntimeConfig is PipelineRuntimeConfig and art.PipelineAutotuneConfig is PipelineAutotuneConfig


def _trainer(tmp_path, **kwargs) -> tuple[PipelineTrainer, FakeBackend]:
    async def build():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            return group(scenario)

        return PipelineTrainer(model, backend, rollout, scenarios(40), None, **kwargs), backend
    return asyncio.run(build())


@pytest.mark.parametrize("name,value", [(k, v) for k, vs in REFUSED.items() for v in vs if "." not in k])
def test_refused_keywords_name_themselves(tmp_path, name, value):
    with pytest.raises(ConfigError, match=name) as info:
        _trainer(tmp_path, **{name: value})
    assert "not supported" in str(info.value)


def test_tuner_knobs_of_unbuilt_parts_are_refused_by_name_when_the_tuner_runs(tmp_path):
    assert _trainer(tmp_path, autotune=PipelineAutotuneConfig())[0].autotune.mode == "off"
    assert _trainer(tmp_path, autotune=PipelineAutotuneConfig(mode="online"))[0].autotune.mode == "online"
    # with mode "off" no part of ART's tuner runs, in ART either: the knobs are only checked
    assert _trainer(tmp_path, autotune=PipelineAutotuneConfig(packing_trials=64))[0].autotune.packing_trials == 64
    for name in sorted(UNREAD):
        value = PipelineAutotuneConfig.model_fields[name].default
        changed = value + 1 if isinstance(value, int) else value / 2
        for mode in ("online", "profile"):
            with pytest.raises(ConfigError, match=rf"{name}=.*mode='{mode}' is not supported"):
                _trainer(tmp_path, autotune=PipelineAutotuneConfig(mode=mode, **{name: changed}))


def test_in_flight_lora_is_refused_by_name_where_it_cannot_run():
    for mode in ("step_lora", "in_flight_lora"):  # ART's default, and the built-in engine's in-flight updates
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny",
                                   _internal_config=art.dev.InternalModelConfig(rollout_weight_update_mode=mode))
        assert model.name == "m"
    with pytest.raises(ConfigError, match="rollout_weight_update_mode='in_flight_lora' is not supported with "
                                          "inference_engine='vllm'"):
        art.TrainableModel(name="m", project="p", base_model="artrl/tiny",
                           _internal_config=art.dev.InternalModelConfig(rollout_weight_update_mode="in_flight_lora",
                                                                        inference_engine="vllm"))


def test_autotune_knobs_are_checked_as_art_checks_them():
    """A bad value fails here where it fails in ART."""
    bad = {"window_steps": 0, "max_worker_move": 3, "packing_trials": 15, "packing_reservoir_multiplier": 1,
           "target_spill_probability": 1.5, "packing_spill_confidence": 1.0, "worker_move_fraction": 0.0,
           "vllm_metric_interval_s": 0.0, "mode": "fast"}
    for field, value in bad.items():
        with pytest.raises(pydantic.ValidationError, match=field):
            PipelineAutotuneConfig(**{field: value})
    with pytest.raises(pydantic.ValidationError, match="stale_clear_frac"):
        PipelineAutotuneConfig(stale_clear_frac=0.3, stale_high_frac=0.2)
    with pytest.raises(pydantic.ValidationError, match="trainer_min_batch_raise_score"):
        PipelineAutotuneConfig(trainer_min_batch_raise_score=0.2, trainer_min_batch_lower_score=0.1)


def test_runtime_config_is_checked_as_art_checks_it():
    for field, value in {"num_rollout_workers": 0, "min_batch_size": 0, "max_batch_size": 0, "queue_maxsize": 0,
                         "score_reference_groups_per_step": 0.0, "score_reference_rollouts_per_group": -1.0,
                         "packed_sequence_length": 64}.items():
        with pytest.raises(pydantic.ValidationError, match=field):
            PipelineRuntimeConfig(**{field: value})
    with pytest.raises(pydantic.ValidationError, match="max_batch_size=2 must be >= min_batch_size=3"):
        PipelineRuntimeConfig(min_batch_size=3, max_batch_size=2)


def test_runtime_fields_shape_the_run(tmp_path):
    """num_rollout_workers bounds concurrent rollouts, min/max_batch_size the groups of each call,
    queue_maxsize the queue, max_steps the calls, score_reference_* the batch factor."""
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)
        running = peak = 0

        async def rollout(model, scenario, config):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            for _ in range(3):
                await asyncio.sleep(0)
            running -= 1
            return group(scenario, rewards=(0.0, 1.0, 1.0))

        pipeline = PipelineRuntimeConfig(num_rollout_workers=3, min_batch_size=2, max_batch_size=3, queue_maxsize=5,
                                         score_reference_groups_per_step=6.0, score_reference_rollouts_per_group=2.0)
        trainer = PipelineTrainer(model, backend, rollout, scenarios(40), None, pipeline=pipeline, max_steps=3)
        await run(trainer)
        return trainer, backend, model, peak

    trainer, backend, model, peak = asyncio.run(main())
    assert peak == 3
    assert len(backend.calls) == 3
    assert all(2 <= len(groups) <= 3 for _, groups in backend.calls)
    rows = train_rows(model)
    for row, (_, groups) in zip(rows, backend.calls):
        assert row["pipeline_settings/queue_maxsize"] == 5 and row["pipeline_settings/num_rollout_workers"] == 3
        n = len(groups)
        assert row["sample_efficiency/batch_factor"] == pytest.approx((6.0 + 300 / 2.0) / (n + 300 / 3.0))
        for key in ("time/step_rollout_s", "time/step_rollout_idle_s", "time/step_trainer_idle_s",
                    "offpolicy/token_weighted_policy_age_steps", "sample_efficiency/freshness_discount"):
            assert key in row, key


def test_deprecated_aliases_work_with_one_notice_each(tmp_path, caplog):
    keys = [f"pipeline_trainer.deprecated.{k}" for k in DEPRECATED_PIPELINE_KEYWORDS]
    notices.forget(*keys)
    aliases = {"num_rollout_workers": 3, "min_batch_size": 2, "max_batch_size": 5, "queue_maxsize": 7}
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            trainer, _ = _trainer(tmp_path, **aliases)
    assert trainer.pipeline == PipelineRuntimeConfig(**aliases)
    assert (trainer.num_rollout_workers, trainer.min_batch_size, trainer.max_batch_size,
            trainer.queue_maxsize) == (3, 2, 5, 7)
    for key in DEPRECATED_PIPELINE_KEYWORDS:
        assert sum(f"PipelineTrainer({key}=" in r.message and "deprecated" in r.message
                   for r in caplog.records) == 1, key
    with pytest.raises(ValueError, match="not both"):
        _trainer(tmp_path, pipeline=PipelineRuntimeConfig(), min_batch_size=2)


def test_train_call_keywords_reach_backend_train(tmp_path):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            return group(scenario)

        trainer = PipelineTrainer(model, backend, rollout, scenarios(8), None,
                                  pipeline=PipelineRuntimeConfig(min_batch_size=2, max_batch_size=2),
                                  learning_rate=3e-4, loss_fn="ppo", loss_fn_config={"x": 1},
                                  normalize_advantages=False, grad_accumulation_sequences=3, adam_params={"b": 2},
                                  save_checkpoint=False, max_steps=1)
        await run(trainer)
        return backend

    (kwargs,) = asyncio.run(main()).kwargs
    assert kwargs == {"learning_rate": 3e-4, "loss_fn": "ppo", "loss_fn_config": {"x": 1},
                      "normalize_advantages": False, "grad_accumulation_sequences": 3, "adam_params": {"b": 2},
                      "save_checkpoint": False}


@pytest.mark.parametrize("lag", [None, 2])
def test_a_kl_penalty_reaches_every_call_with_its_reference_kept(tmp_path, lag):
    """kl_penalty_coef > 0, as ART's pipeline: every call gets the coefficient, kl_penalty_source="sample" and the
    reference step (0, or `lag` steps before the step it trains from), and retention keeps those checkpoints."""
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            return group(scenario)

        trainer = PipelineTrainer(model, backend, rollout, scenarios(8), None, kl_penalty_coef=0.3,
                                  kl_penalty_step_lag=lag,
                                  pipeline=PipelineRuntimeConfig(min_batch_size=2, max_batch_size=2), max_steps=4)
        await run(trainer)
        return trainer, backend

    trainer, backend = asyncio.run(main())
    assert len(backend.kwargs) == 4
    for start, kwargs in zip(range(4), backend.kwargs):
        reference = 0 if lag is None else max(0, start - lag)
        assert (kwargs["kl_penalty_coef"], kwargs["kl_penalty_source"], kwargs["kl_penalty_reference_step"]) == \
            (0.3, "sample", reference), (start, kwargs)
    protected = trainer.protected_steps(10)
    assert ({0} <= protected and 5 not in protected) if lag is None else ({8, 9, 10} <= protected and 7 not in protected)
    with pytest.raises(ValueError, match="kl_penalty_source"):
        _trainer(tmp_path, kl_penalty_coef=0.3, train_kwargs={"kl_penalty_source": "current_learner"})


def test_kl_penalty_step_lag_is_checked_and_read_only_with_a_penalty(tmp_path):
    with pytest.raises(ValueError, match="kl_penalty_step_lag must be >= 1"):
        _trainer(tmp_path, kl_penalty_step_lag=0)
    trainer, _ = _trainer(tmp_path, kl_penalty_step_lag=2)  # ART reads it only when kl_penalty_coef > 0
    assert trainer.kl_penalty_step_lag == 2


def test_optimizer_save_interval_is_checked(tmp_path):
    """ART's LocalBackend writes no separate optimizer snapshots (the interval thins Megatron's); artrl writes the
    optimizer state with every checkpoint, as a snapshot every step. The value is checked as in ART."""
    with pytest.raises(ValueError, match="optimizer_save_interval must be > 0"):
        _trainer(tmp_path, optimizer_save_interval=0)
    assert _trainer(tmp_path, optimizer_save_interval=3)[0].optimizer_save_interval == 3


def test_status_and_discard_keywords_are_wired(tmp_path):
    trainer, _ = _trainer(tmp_path, log_interval_seconds=7.0, status_ewa_alpha=0.5, total_scenarios=40,
                          discard_queue_multiplier=3, pipeline=PipelineRuntimeConfig(min_batch_size=2))
    status = trainer._status
    assert (status._interval, status._alpha, status._total) == (7.0, 0.5, 40)
    assert trainer._discard_queue_limit == 6


@pytest.mark.parametrize("limit", [None, 0.5])
def test_no_hard_bound_and_the_mean_limit(tmp_path, limit):
    """max_steps_off_policy=None: no hard bound (groups run ahead; the run still trains every group);
    limit_mean_steps_off_policy=0.5 keeps every trained group's mean age at 0 (floor of the limit)."""
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            return group(scenario)

        async def slow_trainer(step):
            for _ in range(50):
                await asyncio.sleep(0)

        backend.during_train = slow_trainer
        trainer = PipelineTrainer(model, backend, rollout, scenarios(24), None, max_steps_off_policy=None,
                                  limit_mean_steps_off_policy=limit,
                                  pipeline=PipelineRuntimeConfig(num_rollout_workers=8, min_batch_size=2,
                                                                 max_batch_size=2))
        await run(trainer)
        return backend, trainer

    backend, trainer = asyncio.run(main())
    ages = [from_step - version for from_step, groups in backend.calls for _, version in groups]
    if limit is None:
        assert max(ages) > 0 and trainer.state.discarded_stale_groups == 0
        assert len(ages) == 24
    else:
        assert max(ages) == 0
    with pytest.raises(ValueError, match="limit_mean_steps_off_policy must be >= 0"):
        _trainer(tmp_path, limit_mean_steps_off_policy=-1.0)


@pytest.mark.parametrize("old_weight,new_weight,kept", [(3, 1, False), (1, 3, True)])
def test_the_mean_limit_weighs_trajectories_by_completion_tokens(tmp_path, old_weight, new_weight, kept):
    """A group whose trajectories carry their own versions: one from version 0, one from the lease's version.
    Trained from step 1, their ages are 1 and 0; the mean, weighted by completion_tokens, decides (limit 0.5)."""
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            old = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0.0,
                                 metrics={"completion_tokens": old_weight}, initial_policy_version=0)
            new = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=1.0,
                                 metrics={"completion_tokens": new_weight})
            return art.TrajectoryGroup([old, new])

        trainer = PipelineTrainer(model, backend, rollout, scenarios(4), None, max_steps_off_policy=None,
                                  limit_mean_steps_off_policy=0.5,
                                  pipeline=PipelineRuntimeConfig(num_rollout_workers=2, min_batch_size=2,
                                                                 max_batch_size=2))
        await run(trainer)
        return backend, trainer

    backend, trainer = asyncio.run(main())
    assert len(backend.calls[0][1]) == 2  # step 0: both trajectories on policy
    assert trainer.state.discarded_stale_groups == (0 if kept else 2)
    assert len(backend.calls) == (2 if kept else 1)
