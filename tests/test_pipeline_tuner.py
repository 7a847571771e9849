"""The pipeline tuner (`PipelineAutotuneConfig(mode="online" | "profile")`): ART's decision rules on synthetic
windows, the overlap / in-turn judge on synthetic steps, the in-turn schedule inside a real PipelineTrainer run
(no rollout runs during a train call), and the saved profile read back by a later run.

Time is a fake clock advanced by the work itself (rollouts and train calls share it, as one CPU does), so every
figure the tuner reads is deterministic; nothing waits on the wall clock.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import sys
from pathlib import Path

import pytest
from art_source import art_package
from test_pipeline_trainer import FakeBackend, group, make_model, run, scenarios, train_rows

from artrl.errors import ConfigError
from artrl.pipeline_trainer import PipelineAutotuneConfig, PipelineRuntimeConfig, PipelineTrainer
from artrl.pipeline_tuner import PipelineAutotuner, PipelineTunerProfileStore, PipelineTuneSettings, StepMeasurement
from artrl.pipeline_tuner.autotune import ScheduleJudge, build_initial_settings, freshness_worker_limit, worker_limit
from artrl.pipeline_tuner.config import TunerWindowStats

# ---------------------------------------------------------------------------------------------- ART's rules


def _tuner(workers=8, min_batch=8, max_batch=8, age=4.0, **knobs) -> PipelineAutotuner:
    settings = PipelineTuneSettings(num_rollout_workers=workers, min_batch_size=min_batch, max_batch_size=max_batch,
                                    queue_maxsize=max_batch, target_groups_per_step=max_batch)
    return PipelineAutotuner(config=PipelineAutotuneConfig(mode="online", **knobs), settings=settings,
                             policy_age_limit_steps=age)


def _stats(underfeed=0.0, pressure=0.0, put_wait=0.0, stale=0.0, collect=1.0) -> TunerWindowStats:
    return TunerWindowStats(start_step=1, end_step=4, trainer_underfeed_score=underfeed, vllm_pressure=pressure,
                            queue_put_wait_frac=put_wait, actual_stale_frac=stale, collect_batch_s=collect)


def _apply(tuner: PipelineAutotuner, stats: TunerWindowStats, **kw):
    d = tuner.decide(stats, **kw)
    tuner.settings = d.updated
    return d


def test_an_underfed_trainer_gets_more_workers_after_sustained_evidence():
    t = _tuner()
    first = _apply(t, _stats(underfeed=0.3, pressure=0.1))
    assert first.state == "inference_under_train_under" and first.action == "hold"
    assert "awaits sustained evidence (1/2)" in first.reason
    second = _apply(t, _stats(underfeed=0.3, pressure=0.1))
    # ART's move: 10% of 8 rounded to worker_step 2 is 0, so one worker_step
    assert second.action == "increase_workers" and t.settings.num_rollout_workers == 10
    # an engine that does not report its queue reads as balanced: the same rule applies
    t = _tuner()
    _apply(t, _stats(underfeed=0.3), pressure_measured=False)
    d = _apply(t, _stats(underfeed=0.3), pressure_measured=False)
    assert d.state == "inference_unmeasured_train_under" and d.updated.num_rollout_workers == 10
    # evidence must be consecutive: a balanced window in between resets it
    t = _tuner()
    _apply(t, _stats(underfeed=0.3, pressure=0.1))
    _apply(t, _stats(underfeed=0.06, pressure=0.6))
    assert _apply(t, _stats(underfeed=0.3, pressure=0.1)).action == "hold"


def test_pressure_with_queue_backpressure_removes_workers_and_backpressure_alone_holds():
    t = _tuner(workers=20, min_batch=8, max_batch=8)
    assert _apply(t, _stats(underfeed=0.0, pressure=2.0, put_wait=0.5)).action == "hold"
    d = _apply(t, _stats(underfeed=0.0, pressure=2.0, put_wait=0.5))
    assert d.state == "inference_over_train_over" and d.action == "decrease_workers"
    assert t.settings.num_rollout_workers == 18
    d = _apply(t, _stats(underfeed=0.12, pressure=0.1, put_wait=0.5))  # underfed, not enough for a trial
    assert d.action == "hold" and d.reason == "completed-group queue backpressure is active"


def test_a_stale_backlog_raises_min_batch_then_removes_workers_with_hysteresis():
    t = _tuner(workers=16, min_batch=7, max_batch=8)
    d = _apply(t, _stats(underfeed=0.06, pressure=0.6, stale=0.25))
    assert d.action == "raise_min_batch_size" and t.settings.min_batch_size == 8
    d = _apply(t, _stats(underfeed=0.06, pressure=0.6, stale=0.15))  # above stale_clear_frac: still a backlog
    assert d.action == "decrease_workers" and t.settings.num_rollout_workers == 14
    d = _apply(t, _stats(underfeed=0.06, pressure=0.6, stale=0.05))
    assert d.action == "hold" and t.settings.num_rollout_workers == 14


def test_the_min_batch_trial_lowers_then_restores_when_collection_does_not_improve():
    t = _tuner(workers=8, min_batch=20, max_batch=20)
    # underfed while inference is over: no worker increase, so ART tries smaller batches (floor 0.85 * 20 = 17)
    d = _apply(t, _stats(underfeed=0.3, pressure=2.0, collect=4.0))
    assert d.action == "lower_min_batch_size" and t.settings.min_batch_size == 17
    # pressure drops and collection did not get faster: after min_batch_trial_windows (2) windows, raised again
    assert _apply(t, _stats(underfeed=0.3, pressure=0.6, collect=3.9)).updated.min_batch_size == 17
    d = _apply(t, _stats(underfeed=0.3, pressure=0.6, collect=3.9))
    assert d.action == "raise_min_batch_size" and t.settings.min_batch_size == 20
    assert "did not reduce collection time" in d.reason


def test_workers_stay_inside_arts_freshness_limit_and_initial_settings_are_arts():
    assert freshness_worker_limit(target_groups_per_step=8, limit_steps_off_policy=4.0,
                                  running_reserve_fraction=0.75, worker_step=2) == 32
    assert freshness_worker_limit(target_groups_per_step=8, limit_steps_off_policy=1.0,
                                  running_reserve_fraction=0.75, worker_step=2) == 1
    t = _tuner(workers=30, age=2.0)  # limit: (16 - 8) / 0.75 = 10 -> 10
    d = _apply(t, _stats(underfeed=0.06, pressure=0.6))
    assert d.action == "decrease_workers" and t.settings.num_rollout_workers == 10
    assert d.reason == "running rollout reserve exceeded the policy-age budget"
    s = build_initial_settings(config=PipelineAutotuneConfig(mode="online"), inference_gpu_count=1,
                               target_packed_sequences=1, policy_age_limit_steps=4.0)
    assert (s.num_rollout_workers, s.min_batch_size, s.max_batch_size, s.queue_maxsize) == (8, 8, 8, 8)


def test_at_a_bound_of_one_step_the_defaults_roll_out_a_whole_step_at_once_not_one_group():
    """ART's freshness limit is one worker at a bound of 1 (a pipeline slower than the loop it replaces); the
    limit here never goes below one step's groups, and above them it is ART's."""
    for age, art_limit, ours in ((1.0, 1, 8), (2.0, 10, 10), (4.0, 32, 32)):
        assert freshness_worker_limit(target_groups_per_step=8, limit_steps_off_policy=age,
                                      running_reserve_fraction=0.75, worker_step=2) == art_limit
        assert worker_limit(target_groups_per_step=8, limit_steps_off_policy=age, running_reserve_fraction=0.75,
                            worker_step=2) == ours
    assert worker_limit(target_groups_per_step=5, limit_steps_off_policy=1.0, running_reserve_fraction=0.75,
                        worker_step=2) == 6  # a whole step's groups, rounded up to the worker step
    assert worker_limit(target_groups_per_step=8, limit_steps_off_policy=1.0, running_reserve_fraction=0.0,
                        worker_step=2) is None  # no reserve: no limit, as in ART
    s = build_initial_settings(config=PipelineAutotuneConfig(mode="online"), inference_gpu_count=1,
                               target_packed_sequences=1, policy_age_limit_steps=1.0)
    assert (s.num_rollout_workers, s.min_batch_size, s.max_batch_size) == (8, 8, 8)
    t = _tuner(workers=8, age=1.0)
    d = _apply(t, _stats(underfeed=0.06, pressure=0.6))  # balanced: the floor does not push workers down
    assert t.settings.num_rollout_workers == 8, d


# ---------------------------------------------------------------------------------------------- the schedule


def _steps(judge: ScheduleJudge, first: int, n: int, s_per_group: float, groups: int = 4):
    out = []
    for step in range(first, first + n):
        m = StepMeasurement(step=step, t_s=float(step), wall_s=s_per_group * groups, collect_s=0.0, train_s=0.0,
                            rollout_s=0.0, groups=groups, schedule=judge.schedule)
        change = judge.observe(m)
        if change is not None:
            out.append((step, change[0]))
    return out


def test_the_judge_keeps_overlap_only_when_it_beats_in_turn():
    # contention (one CPU): overlapped steps take as long per group as in turn -> in turn
    j = ScheduleJudge(window_steps=2, warmup_ignore_steps=1, starting_step=0)
    assert _steps(j, 1, 3, 1.0) == [(3, "probe_in_turn")]  # step 1 is warm-up, 2-3 overlapped
    assert j.schedule == "in_turn" and not j.decided
    assert _steps(j, 4, 3, 1.0) == [(6, "run_in_turn")]  # step 4 settles, 5-6 in turn
    assert j.decided and j.schedule == "in_turn" and j.evidence["overlap_speedup"] == pytest.approx(1.0)
    assert _steps(j, 7, 10, 5.0) == []  # decided in turn: stays
    # overlap 4% faster: not enough (OVERLAP_MIN_GAIN 5%)
    j = ScheduleJudge(window_steps=2, warmup_ignore_steps=0, starting_step=0)
    _steps(j, 1, 2, 0.96)
    assert _steps(j, 3, 3, 1.0)[-1][1] == "run_in_turn"
    # overlap clearly faster: kept, then re-checked each window against the in-turn figure
    j = ScheduleJudge(window_steps=2, warmup_ignore_steps=0, starting_step=0)
    _steps(j, 1, 2, 0.5)
    assert _steps(j, 3, 3, 1.0) == [(5, "run_overlapped")]
    assert j.schedule == "overlap" and j.evidence["overlap_speedup"] == pytest.approx(2.0)
    assert _steps(j, 6, 5, 0.6) == []  # step 6 settles; still faster
    assert _steps(j, 11, 2, 1.1) == [(12, "run_in_turn")] and j.schedule == "in_turn"


def test_worker_and_batch_rules_wait_for_the_schedule_and_hold_in_turn():
    t = _tuner(workers=8, min_batch=8, max_batch=8, window_steps=2, warmup_ignore_steps=0)
    out = []
    for step in range(1, 12):
        m = StepMeasurement(step=step, t_s=float(step), wall_s=4.0, collect_s=2.0, train_s=2.0, rollout_s=4.0,
                            groups=8, schedule=t.schedule)
        out += [(d.step, d.action) for d in t.observe(m)]
    # probe (2 overlapped, 1 settling, 2 in turn), then in turn: only holds though the trainer idles half the time
    assert out[:2] == [(2, "probe_in_turn"), (5, "run_in_turn")]
    assert [a for _, a in out[2:]] == ["hold"] * len(out[2:]) and len(out) >= 4
    assert all("in turn" in d.reason for d in t.decisions[2:])
    assert t.settings.num_rollout_workers == 8


# ---------------------------------------------------------------------------------------------- in a real run


class Work:
    """One CPU: a fake clock that rollouts and train calls advance by their work, in small slices, so that
    running at once only interleaves the same seconds. Counts the rollouts running during each train call."""

    def __init__(self, rollout_slices=6, train_slices=6, slice_s=0.1):
        self.t = 0.0
        self.running = 0
        self.rollout_slices, self.train_slices, self.slice_s = rollout_slices, train_slices, slice_s
        self.during_train: list[int] = []  # the most rollouts seen running during each train call

    def clock(self) -> float:
        return self.t

    async def rollout(self, model, scenario, config):
        self.running += 1
        try:
            for _ in range(self.rollout_slices):
                await asyncio.sleep(0)
                self.t += self.slice_s
        finally:
            self.running -= 1
        return group(scenario)

    async def train(self, step):
        seen = self.running
        for _ in range(self.train_slices):
            await asyncio.sleep(0)
            self.t += self.slice_s
            seen = max(seen, self.running)
        self.during_train.append(seen)


def _online(**knobs) -> PipelineAutotuneConfig:
    base = dict(mode="online", window_steps=2, warmup_ignore_steps=1, initial_min_groups_per_packed_sequence=2,
                initial_max_groups_per_packed_sequence=2, initial_model_calls_per_inference_gpu=4)
    return PipelineAutotuneConfig(**{**base, **knobs})


def test_on_a_shared_cpu_the_tuner_runs_rollouts_and_training_in_turn(tmp_path, caplog):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)
        # rollouts longer than the trainer's turn-around between calls, so the two workers (one step's groups, the
        # worker limit's floor at a bound of 1) are still rolling out the next step when a train call starts
        work = Work(rollout_slices=30)
        backend.during_train = work.train
        trainer = PipelineTrainer(model, backend, work.rollout, scenarios(40), None, autotune=_online(),
                                  max_steps_off_policy=1, eval_fn=None, clock=work.clock, max_steps=14)
        with caplog.at_level(logging.INFO, logger="artrl.pipeline_trainer"):
            await run(trainer)
        return model, work, trainer

    model, work, trainer = asyncio.run(main())
    rows = train_rows(model)
    schedule = [r["train/pipeline_tuner/schedule_in_turn"] for r in rows]
    # warm-up step 1 and the probe's overlapped steps 2-3 overlap; from step 4 on, in turn
    assert schedule[:3] == [0.0, 0.0, 0.0] and set(schedule[3:]) == {1.0}
    assert max(work.during_train[:3]) > 0  # overlapped: rollouts ran during train calls
    assert work.during_train[3:] == [0] * (len(rows) - 3)  # in turn: never
    assert trainer._tuning.schedule == "in_turn" and trainer._tuning.tuner.judge.decided
    assert "run_in_turn" in caplog.text and "rollouts and training contend" in caplog.text
    assert rows[-1]["train/pipeline_tuner/overlap_speedup"] < 1.05
    assert all(r["time/step_in_turn_drain_s"] >= 0 for r in rows[3:])
    assert "tuner online: in turn" in trainer._status.line()
    profile = json.loads((Path(model._get_output_dir()) / "pipeline_tuner" / "latest.json").read_text())
    assert profile["schedule"] == "in_turn" and profile["decisions"][-1]["action"] in ("run_in_turn", "hold")


def test_a_tuner_that_lowers_the_workers_lowers_the_rollouts_running(tmp_path):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)
        work = Work(train_slices=2)
        peak: dict[int, int] = {}

        async def rollout(model, scenario, config):
            step = backend.step
            peak[step] = max(peak.get(step, 0), work.running + 1)
            return await work.rollout(model, scenario, config)

        trainer = PipelineTrainer(model, backend, rollout, scenarios(60), None,
                                  pipeline=PipelineRuntimeConfig(num_rollout_workers=6, min_batch_size=2,
                                                                 max_batch_size=2),
                                  max_steps_off_policy=3, eval_fn=None, clock=work.clock)

        async def shrink(step):
            if step == 3:
                trainer.apply_pipeline_settings(PipelineTuneSettings(
                    num_rollout_workers=1, min_batch_size=2, max_batch_size=2, queue_maxsize=2,
                    target_groups_per_step=2))
            await work.train(step)

        backend.during_train = shrink
        await run(trainer)
        return peak, backend, trainer

    peak, backend, trainer = asyncio.run(main())
    assert peak[0] == 6
    # workers that had already pulled a scenario roll it out, then stop: one at a time once those are done
    assert max(peak[s] for s in peak if s >= 7) == 1
    assert len(backend.trained()) + trainer.state.discarded_stale_groups == 60  # each trained or counted


# ---------------------------------------------------------------------------------------------- profiles


def _art_profile_class():
    """ART 0.5.23's profile schema, loaded from the source `ART_SOURCE` names (tests/art_source.py); None when
    it is unset."""
    package = art_package()
    if package is None:
        return None
    path = package / "pipeline_tuner" / "config.py"
    spec = importlib.util.spec_from_file_location("_art_pipeline_tuner_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.PipelineAutotunerProfile


def test_the_profile_is_written_and_a_later_run_starts_from_it(tmp_path):
    async def first():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)
        work = Work()
        backend.during_train = work.train
        trainer = PipelineTrainer(model, backend, work.rollout, scenarios(24), None,
                                  autotune=_online(output_name="cpu"), max_steps_off_policy=1, eval_fn=None,
                                  clock=work.clock)
        await run(trainer)
        return model

    model = asyncio.run(first())
    store = PipelineTunerProfileStore.for_model(model)
    path = store.resolve("cpu")
    assert path == Path(model._get_output_dir()) / "pipeline_tuner" / "cpu.json"
    saved = store.load("cpu")
    assert saved.schedule == "in_turn" and saved.settings.max_batch_size == 2
    assert [d.action for d in saved.decisions[:2]] == ["probe_in_turn", "run_in_turn"]
    assert saved.schedule_evidence["in_turn_s_per_group"] > 0
    art_profile = _art_profile_class()
    if art_profile is not None:  # ART reads our file (it ignores the schedule fields)
        assert art_profile.model_validate_json(path.read_text()).settings.num_rollout_workers == \
            saved.settings.num_rollout_workers
    # a tuned setting to carry over: the later run must use it, and the saved schedule, from its first step
    store.save("cpu", saved.model_copy(update={"settings": saved.settings.model_copy(
        update={"num_rollout_workers": 2, "min_batch_size": 3, "max_batch_size": 3, "target_groups_per_step": 3})}))

    async def later():
        backend = FakeBackend()
        model2 = await make_model(tmp_path / "later", backend)
        (Path(model2._get_output_dir()) / "pipeline_tuner").mkdir(parents=True)
        work = Work()
        backend.during_train = work.train
        trainer = PipelineTrainer(model2, backend, work.rollout, scenarios(12), None,
                                  autotune=PipelineAutotuneConfig(mode="profile", profile=str(path)),
                                  max_steps_off_policy=4, eval_fn=None, clock=work.clock)
        await run(trainer)
        return model2, work, trainer

    model2, work, trainer = asyncio.run(later())
    rows = train_rows(model2)
    assert [r["pipeline_settings/num_rollout_workers"] for r in rows] == [2.0] * len(rows)
    assert [r["pipeline_settings/min_batch_size"] for r in rows] == [3.0] * len(rows)
    assert {r["train/pipeline_tuner/schedule_in_turn"] for r in rows} == {1.0}
    assert work.during_train == [0] * len(rows)  # in turn from the first step
    assert trainer._tuning.tuner is None  # mode "profile": no online changes, nothing written
    assert not (Path(model2._get_output_dir()) / "pipeline_tuner" / "latest.json").exists()


def test_profile_mode_without_a_profile_and_runtime_config_with_the_tuner_are_refused(tmp_path):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            return group(scenario)

        with pytest.raises(ValueError, match="cannot be provided when pipeline autotuning is enabled"):
            PipelineTrainer(model, backend, rollout, scenarios(4), None, autotune=_online(),
                            pipeline=PipelineRuntimeConfig())
        with pytest.raises(ValueError, match="autotuning is enabled"):
            PipelineTrainer(model, backend, rollout, scenarios(4), None, autotune=_online(), min_batch_size=2)
        trainer = PipelineTrainer(model, backend, rollout, scenarios(4), None,
                                  autotune=PipelineAutotuneConfig(mode="profile"), eval_fn=None)
        with pytest.raises(ConfigError, match=r"no tuner profile at .*pipeline_tuner/latest\.json"):
            await trainer.train(handle_signals=False)

    asyncio.run(main())


def test_in_turn_a_hung_rollout_delays_one_train_call_only(tmp_path, monkeypatch, caplog):
    import artrl.pipeline_trainer.trainer as trainer_module
    from artrl.pipeline_tuner import PipelineAutotunerProfile

    monkeypatch.setattr(trainer_module, "IN_TURN_DRAIN_MIN_S", 0.05)  # real seconds: 4 x 0.05 once

    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)
        PipelineTunerProfileStore.for_model(model).save("latest", PipelineAutotunerProfile(
            settings=PipelineTuneSettings(num_rollout_workers=3, min_batch_size=2, max_batch_size=2,
                                          queue_maxsize=2, target_groups_per_step=2),
            config=PipelineAutotuneConfig(mode="online"), schedule="in_turn"))
        work = Work(slice_s=0.0)
        backend.during_train = work.train
        never = asyncio.Event()

        async def rollout(model, scenario, config):
            if scenario["metadata"]["scenario_id"] == 3:
                await never.wait()
            return await work.rollout(model, scenario, config)

        trainer = PipelineTrainer(model, backend, rollout, scenarios(12), None,
                                  autotune=PipelineAutotuneConfig(mode="profile"), max_steps_off_policy=4,
                                  eval_fn=None, clock=work.clock, max_steps=5)
        with caplog.at_level(logging.WARNING, logger="artrl.pipeline_trainer"):
            await run(trainer)
        return model, backend

    model, backend = asyncio.run(main())
    rows = train_rows(model)
    assert len(rows) == 5 and 3 not in backend.trained()
    assert rows[-1]["train/pipeline_tuner/in_turn_drain_timeouts"] == 1.0
    assert caplog.text.count("still running after") == 1
