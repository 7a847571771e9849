"""The data model: ART's fields and defaults, lenient construction, checks where the data is used, copies."""

from __future__ import annotations

import asyncio
import copy
from datetime import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.chat.chat_completion import Choice

import artrl.trajectories as T
from artrl.errors import ArtrlError, TrajectoryError
from artrl.trajectories.tokenization import tokenize_sft

USER = {"role": "user", "content": "hi"}


def traj(**kw):
    kw.setdefault("messages_and_choices", [USER, {"role": "assistant", "content": "hello"}])
    kw.setdefault("reward", 1.0)
    return T.Trajectory(**kw)


# --------------------------------------------------------------------------- ART's fields and defaults


def test_an_art_rollout_builds_the_trajectory_first_and_fills_it_in(make_choice):
    t = T.Trajectory()
    assert t.reward == 0.0 and t.messages_and_choices == [] and t.additional_histories == []
    assert t.initial_policy_version is None and t.final_policy_version is None
    assert isinstance(t.start_time, datetime) and "start_time" not in t.model_dump()
    t.messages_and_choices.append(USER)
    t.messages_and_choices.append(make_choice("blue"))
    t.reward = 0.5
    T.revalidate(t, "trajectories[0]")  # complete now: passes
    assert T.Trajectory().messages_and_choices is not t.messages_and_choices  # defaults are not shared


def test_reward_less_sft_data_trains(tok):
    result = tokenize_sft([T.Trajectory(messages_and_choices=[USER, {"role": "assistant", "content": "hello"}])], tok)
    assert result.stats.sequences == 1


def test_finish_and_track_duration_set_duration_metrics():
    t = T.Trajectory()

    async def main():
        async with t.track_duration("tool"):
            await asyncio.sleep(0)
        async with t.track_duration("tool"):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert t.metrics["tool_duration"] >= 0
    assert t.finish() is t and t.metrics["duration"] >= 0


def test_messages_and_for_logging_as_art_gives_them(make_choice):
    choice = make_choice("blue")
    t = traj(messages_and_choices=[USER, {"role": "assistant", "content": None,
                                          "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "{}"}}]},
                                   {"role": "tool", "tool_call_id": "c", "content": "1"}, choice],
             metadata={"task": "colours"}, initial_policy_version=3)
    messages = t.messages()
    assert messages[1]["content"] == "" and messages[-1] == {"role": "assistant", "content": "blue"}
    logged = t.for_logging()
    assert [m["trainable"] for m in logged["messages"]] == [False, False, False, True]
    assert logged["initial_policy_version"] == 3 and logged["metadata"] == {"task": "colours"}
    assert str(t) == f"Trajectory(reward=1.0, metrics={{}}, metadata={{'task': 'colours'}})"


def test_unknown_fields_are_ignored_with_a_notice(caplog):
    with caplog.at_level("WARNING"):
        t = T.Trajectory(reward=1.0, rewrad=2.0)
        T.Trajectory(rewrad=3.0)
    assert t.reward == 1.0
    assert sum("no field 'rewrad'" in r.message for r in caplog.records) == 1


def test_what_pydantic_cannot_read_is_refused_at_construction():
    with pytest.raises(TrajectoryError, match=r"fields: reward") as info:
        traj(reward="not a number")
    assert isinstance(info.value, ArtrlError) and isinstance(info.value, ValueError)
    with pytest.raises(TrajectoryError, match="metadata"):
        traj(metadata="not a dict")


def test_metadata_values_may_nest_as_in_art_0523(tmp_path):
    # ART 0.5.23: MetadataValue = Any (0.5.18 allowed scalars only); the Parquet log keeps the nesting
    from artrl.run.trajectory_logs import read_trajectory_groups_parquet, write_trajectory_groups_parquet

    nested = {"task": {"id": 7, "tags": ["a", "b"], "score": None}}
    group = T.TrajectoryGroup([traj(metadata=nested)], metadata={"split": {"seed": 1}})
    path = tmp_path / "g.parquet"
    write_trajectory_groups_parquet([group], path)
    (back,) = read_trajectory_groups_parquet(path)
    assert back.trajectories[0].metadata == nested and back.metadata == {"split": {"seed": 1}}


# --------------------------------------------------------------------------- checks where the data is used
# (each refusal is tested end to end in test_hostile_input.py; test_chat_format.py has the rules)


def test_valid_tool_call_and_choice_dict_are_accepted(make_choice):
    good = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    choice = make_choice("ok").model_dump()
    t = traj(messages_and_choices=[USER, good, {"role": "tool", "tool_call_id": "c1", "content": "1"}, choice])
    T.revalidate(t, "trajectories[0]")
    assert isinstance(t.messages_and_choices[-1], Choice)  # a dict-shaped choice became a Choice
    assert t.messages()[-1]["role"] == "assistant"


# --------------------------------------------------------------------------- groups


def test_group_keeps_exceptions_with_arts_shape_and_its_own_fields():
    g = T.TrajectoryGroup([traj(), ValueError("boom")], exceptions=[KeyError("k")], metadata={"scenario": 7},
                          metrics={"judge_calls": 2}, logs=["started"])
    assert len(g) == 1 and [t.reward for t in g] == [1.0]
    assert [(e.type, e.message) for e in g.exceptions] == [("<class 'ValueError'>", "boom"),
                                                           ("<class 'KeyError'>", "'k'")]
    assert "ValueError: boom" in g.exceptions[0].traceback
    assert g.metadata == {"scenario": 7} and g.metrics == {"judge_calls": 2}
    g.log("done")
    assert g.logs == ["started", "done"]
    assert T.TrajectoryGroup.model_validate(g.model_dump()).exceptions == g.exceptions  # round trip


def test_empty_group_is_allowed():
    assert len(T.TrajectoryGroup([])) == 0 and len(T.TrajectoryGroup(trajectories=[], exceptions=[])) == 0


def test_a_group_member_that_is_not_a_trajectory_is_named():
    with pytest.raises(TrajectoryError, match=r"trajectories\[1\] has type str"):
        T.TrajectoryGroup([traj(), "not a trajectory"])
    with pytest.raises(TrajectoryError, match=r"trajectories\[1\]: Trajectory is malformed"):
        T.TrajectoryGroup([traj(), {"messages_and_choices": [USER], "reward": "high"}])


def test_a_generator_of_trajectories_is_read_once():
    g = T.TrajectoryGroup(traj(reward=float(i)) for i in range(3))
    assert [t.reward for t in g] == [0.0, 1.0, 2.0]


def test_shallow_copy_copies_the_containers_not_the_trajectories():
    g = T.TrajectoryGroup([traj(), RuntimeError("x")], metadata={"a": 1}, metrics={"m": 1.0}, logs=["l"])
    c = copy.copy(g)
    assert c is not g and c.trajectories is not g.trajectories and c.trajectories[0] is g.trajectories[0]
    assert c.exceptions is not g.exceptions and c.exceptions == g.exceptions
    c.metadata["a"] = 2
    c.logs.append("more")
    c.trajectories.append(traj())
    assert g.metadata == {"a": 1} and g.logs == ["l"] and len(g) == 1


def test_deep_copy_copies_everything_and_honours_the_memo():
    g = T.TrajectoryGroup([traj(metrics={"m": 1.0})], exceptions=[ValueError("v")])
    memo: dict = {}
    d = copy.deepcopy(g, memo)
    assert d.trajectories[0] is not g.trajectories[0] and d.trajectories[0].metrics is not g.trajectories[0].metrics
    assert d.exceptions[0] is not g.exceptions[0] and d.exceptions[0].message == "v"
    assert memo[id(g)] is d and copy.deepcopy(g, memo) is d


@given(st.lists(st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5)), max_size=6))
def test_a_group_keeps_every_trajectory_and_every_exception_in_order(items):
    members = [traj(reward=x) if isinstance(x, float) else ValueError(x) for x in items]
    g = T.TrajectoryGroup(members)
    assert [t.reward for t in g] == [x for x in items if isinstance(x, float)]
    assert [e.message for e in g.exceptions] == [x for x in items if isinstance(x, str)]
    for clone in (copy.copy(g), copy.deepcopy(g)):
        assert [t.reward for t in clone] == [t.reward for t in g] and clone.exceptions == g.exceptions


def test_awaiting_a_group_outside_a_gather_raises_the_first_failure_as_art_does():
    cancelled = []

    async def ok(r):
        return traj(reward=r)

    async def fails():
        raise RuntimeError("rollout broke")

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main():
        g = await T.TrajectoryGroup(ok(float(i)) for i in range(3))
        assert [t.reward for t in g] == [0.0, 1.0, 2.0]  # the order given, not the order finished
        with pytest.raises(RuntimeError, match="rollout broke") as info:
            await T.TrajectoryGroup([ok(1.0), fails(), slow()])
        assert "max_exceptions" in "\n".join(info.value.__notes__)

    asyncio.run(main())
    assert cancelled == [True]  # the rollout still running was cancelled, not left behind
