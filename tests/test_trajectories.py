"""The data model refuses bad input with a TrajectoryError that names the field."""

from __future__ import annotations

import asyncio
import math

import pytest

import artrl.trajectories as T
from artrl.errors import ArtrlError, TrajectoryError
from artrl.gather import GatherError, gather_trajectory_groups

USER = {"role": "user", "content": "hi"}


def traj(**kw):
    kw.setdefault("messages_and_choices", [USER, {"role": "assistant", "content": "hello"}])
    kw.setdefault("reward", 1.0)
    return T.Trajectory(**kw)


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused(reward):
    with pytest.raises(TrajectoryError, match=r"reward is (nan|inf|-inf)"):
        traj(reward=reward)


def test_unknown_role_names_the_index():
    with pytest.raises(TrajectoryError, match=r"messages_and_choices\[1\]\.role is 'robot'"):
        traj(messages_and_choices=[USER, {"role": "robot", "content": "beep"}])


def test_non_string_content():
    with pytest.raises(TrajectoryError, match=r"messages_and_choices\[0\]\.content has type int"):
        traj(messages_and_choices=[{"role": "user", "content": 42}])


def test_tool_call_with_invalid_json_arguments():
    bad = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}
    with pytest.raises(TrajectoryError, match=r"tool_calls\[0\]\.function\.arguments is not valid JSON"):
        traj(messages_and_choices=[USER, bad])


def test_tool_call_without_name():
    bad = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}
    with pytest.raises(TrajectoryError, match="function.name"):
        traj(messages_and_choices=[USER, bad])


def test_valid_tool_call_and_choice_dict_are_accepted(make_choice):
    good = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    choice = make_choice("ok").model_dump()
    t = traj(messages_and_choices=[USER, good, {"role": "tool", "tool_call_id": "c1", "content": "1"}, choice])
    assert type(t.messages_and_choices[-1]).__name__ == "Choice"  # dict-shaped choice became a Choice
    assert t.messages()[-1]["role"] == "assistant"


def test_empty_group_is_refused():
    with pytest.raises(TrajectoryError, match="TrajectoryGroup.trajectories is empty"):
        T.TrajectoryGroup([])


def test_group_keeps_exceptions_and_names_bad_member():
    g = T.TrajectoryGroup([traj(), ValueError("boom")])
    assert len(g.trajectories) == 1 and g.exceptions == ["ValueError: boom"]
    with pytest.raises(TrajectoryError, match=r"trajectories\[1\]"):
        T.TrajectoryGroup([traj(), {"messages_and_choices": [USER], "reward": math.nan}])


def test_errors_are_artrl_errors():
    with pytest.raises(ArtrlError):
        traj(reward="not a number")


def test_awaitable_group_and_gather_collect_exceptions():
    async def ok(r):
        return traj(reward=r)

    async def fails():
        raise RuntimeError("rollout broke")

    async def main():
        groups = await gather_trajectory_groups(
            (T.TrajectoryGroup([ok(1.0), ok(0.0), fails()]) for _ in range(3)), pbar_desc=None, max_exceptions=3)
        assert [len(g.trajectories) for g in groups] == [2, 2, 2]
        assert all(g.exceptions == ["RuntimeError: rollout broke"] for g in groups)
        with pytest.raises(GatherError, match="3 of 9 rollouts raised"):
            await gather_trajectory_groups((T.TrajectoryGroup([ok(1.0), ok(0.0), fails()]) for _ in range(3)),
                                           pbar_desc=None, max_exceptions=2)

    asyncio.run(main())


def test_gather_respects_concurrency_limit():
    running = 0
    peak = 0

    async def rollout():
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return traj()

    async def main():
        await gather_trajectory_groups((T.TrajectoryGroup(rollout() for _ in range(4)) for _ in range(4)),
                                       pbar_desc=None, max_concurrency=3)

    asyncio.run(main())
    assert peak == 3
