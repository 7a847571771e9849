"""The pipeline's small rules, without a backend: staleness, admission, leases, retention, saved state."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import pytest

from artrl.errors import ConfigError
from artrl.local.adapter_leases import LeaseRegistry, pin_inference_step, pinned_inference_step
from artrl.pipeline_trainer import CheckpointInfo, CheckpointRetentionContext, keep_recent_and_top
from artrl.pipeline_trainer.checkpoint_retention import steps_to_delete
from artrl.pipeline_trainer.staleness import Admission, StalenessBound
from artrl.pipeline_trainer.state import PIPELINE_STATE_KEY, PipelineState, SavedState


@pytest.mark.parametrize("bound, version, step, stale", [
    (0, 5, 5, False),   # on policy
    (0, 4, 5, True),    # one step old, bound 0
    (1, 4, 5, False),   # at the boundary
    (1, 3, 5, True),    # one past it
    (4, 1, 5, False),
    (4, 0, 5, True),
    (2, 7, 5, False),   # newer than the weights (cannot happen, never stale)
])
def test_staleness_rule(bound, version, step, stale):
    rule = StalenessBound(bound)
    assert rule.is_stale(version, step) is stale
    assert rule.min_fresh_version(step) == step - bound


def test_bound_must_be_non_negative():
    with pytest.raises(ValueError, match="max_steps_off_policy=-1"):
        StalenessBound(-1)


@pytest.mark.parametrize("start", [0, 7])  # a fresh run, and a run resumed at step 7
def test_admission_targets_and_when_they_may_start(start):
    adm = Admission(StalenessBound(1), groups_per_step=2, start_step=start)
    tickets = [adm.admit() for _ in range(6)]
    assert [t.target - start for t in tickets] == [0, 0, 1, 1, 2, 2]
    assert [t.seq for t in tickets] == list(range(6))
    # at the resumed version only (bound + 1) * groups_per_step rollouts may start: no flood after a restart
    assert [adm.may_start(t, start) for t in tickets] == [True, True, True, True, False, False]
    assert all(adm.may_start(t, start + 1) for t in tickets)


def test_bound_zero_admits_one_steps_groups_per_version():
    adm = Admission(StalenessBound(0), groups_per_step=3, start_step=0)
    tickets = [adm.admit() for _ in range(6)]
    assert [adm.may_start(t, 0) for t in tickets] == [True] * 3 + [False] * 3
    assert [adm.may_start(t, 1) for t in tickets] == [True] * 6


def test_a_released_ticket_gives_its_slot_to_the_next_scenario():
    adm = Admission(StalenessBound(0), groups_per_step=2, start_step=0)
    a, b, c = adm.admit(), adm.admit(), adm.admit()
    assert (a.target, b.target, c.target) == (0, 0, 1)
    adm.release(a)  # a's rollout failed
    d = adm.admit()
    assert d.target == 0 and adm.may_start(d, 0)
    assert adm.admit().target == 1
    adm.release(b)
    adm.release(d)
    with pytest.raises(RuntimeError, match="more tickets"):
        adm.release(d)  # step 0 has no live ticket left


def test_lease_registry_counts_and_releases_on_error():
    reg = LeaseRegistry()

    async def main():
        async with reg.hold(3):
            async with reg.hold(3):
                assert reg.active_steps() == {3} and reg.count(3) == 2
            assert reg.count(3) == 1
        with pytest.raises(KeyError):
            async with reg.hold(4):
                raise KeyError("boom")
        assert reg.active_steps() == set()

    asyncio.run(main())


def test_pinned_step_is_per_task_and_restored():
    seen = {}

    async def rollout(name, step, gate):
        async with pin_inference_step("m", step):
            await gate.wait()
            seen[name] = pinned_inference_step("m")
        seen[name + "-after"] = pinned_inference_step("m")

    async def main():
        gate = asyncio.Event()
        tasks = [asyncio.create_task(rollout("a", 1, gate)), asyncio.create_task(rollout("b", 2, gate))]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*tasks)
        assert pinned_inference_step("m") is None

    asyncio.run(main())
    assert seen == {"a": 1, "b": 2, "a-after": None, "b-after": None}


def _info(step, **metrics):
    return CheckpointInfo(step=step, path=f"/x/{step}", created_at=datetime.now(timezone.utc), metrics=metrics)


def test_keep_recent_and_top():
    infos = [_info(1, **{"val/reward": 0.9}), _info(2, **{"val/reward": 0.1}), _info(3), _info(4), _info(5)]
    ctx = CheckpointRetentionContext(current_step=6, checkpoints=infos)
    assert set(keep_recent_and_top(recent=2, top=1)(ctx)) == {1, 4, 5}
    assert steps_to_delete(ctx, keep_recent_and_top(recent=2, top=1)) == {2, 3}
    # a strategy's answer outside the eligible steps is ignored
    assert steps_to_delete(ctx, lambda c: {99}) == {1, 2, 3, 4, 5}
    with pytest.raises(ValueError):
        keep_recent_and_top(recent=-1)


def test_saved_state_round_trip_and_checks():
    state = PipelineState(scenario_offset=12, total_scenarios_consumed=20, last_eval_step=4,
                          completed_eval_steps={0, 4})
    saved = SavedState.from_state_file({PIPELINE_STATE_KEY: state.payload(5)})
    assert (saved.scenario_offset, saved.total_scenarios_consumed, saved.training_step) == (12, 20, 5)
    assert saved.completed_eval_steps == {0, 4} and saved.last_eval_step == 4
    assert SavedState.from_state_file(None) == SavedState()
    with pytest.raises(ConfigError, match="scenario_offset"):
        SavedState.from_state_file({PIPELINE_STATE_KEY: {"scenario_offset": "7"}})
    with pytest.raises(ConfigError, match="completed_eval_steps"):
        SavedState.from_state_file({PIPELINE_STATE_KEY: {"completed_eval_steps": "0,4"}})


def test_may_admit_follows_the_first_open_target():
    adm = Admission(StalenessBound(1), groups_per_step=2, start_step=0)
    tickets = []
    while adm.may_admit(0):
        tickets.append(adm.admit())
    assert [t.target for t in tickets] == [0, 0, 1, 1]  # (bound + 1) * groups_per_step at version 0
    adm.release(tickets[0])  # a dropped group: its slot is open again at version 0
    assert adm.may_admit(0) and adm.admit().target == 0 and not adm.may_admit(0)
    assert adm.may_admit(1)
