"""gather_trajectory_groups, gather_trajectories and trajectory_group_batches behave as ART's."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import artrl as art
from artrl.gather import GatherError
from artrl.trajectories.gather_context import GatherContext

USER = {"role": "user", "content": "hi"}


async def ok(reward: float = 1.0, delay: float = 0.0, **metrics: float) -> art.Trajectory:
    await asyncio.sleep(delay)
    return art.Trajectory(messages_and_choices=[USER, {"role": "assistant", "content": "x"}], reward=reward,
                          metrics=metrics)


async def fails(message: str = "rollout broke", delay: float = 0.0) -> art.Trajectory:
    await asyncio.sleep(delay)
    raise RuntimeError(message)


def slow_rollout(cancelled: list[int]):
    """A rollout that takes 30 s unless cancelled; each cancellation is recorded in `cancelled`."""

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(1)
            raise

    return slow


def run(coro):
    return asyncio.run(coro)


def group(*rollouts, **kw):
    return art.TrajectoryGroup(list(rollouts), **kw)


# --------------------------------------------------------------------------- exceptions


def test_failures_within_max_exceptions_are_kept_in_their_groups():
    groups = run(art.gather_trajectory_groups([group(ok(1.0), ok(0.0), fails()) for _ in range(3)],
                                              max_exceptions=3))
    assert [len(g) for g in groups] == [2, 2, 2]
    assert all([e.message for e in g.exceptions] == ["rollout broke"] for g in groups)


def test_one_failure_past_max_exceptions_raises_it_and_cancels_the_rest():
    cancelled: list[int] = []
    slow = slow_rollout(cancelled)

    async def main():
        with pytest.raises(RuntimeError, match="rollout broke") as info:
            await art.gather_trajectory_groups([group(fails(), fails(delay=0.01), slow()), group(slow(), ok())],
                                               max_exceptions=1)
        notes = "\n".join(info.value.__notes__)
        assert "2 of 5 rollouts raised, more than max_exceptions=1" in notes

    run(main())
    assert len(cancelled) == 2


@pytest.mark.parametrize("fraction, raises", [(0.25, False), (0.2, True)])
def test_a_fractional_max_exceptions_is_a_share_of_all_rollouts(fraction, raises):
    groups = [group(ok(), ok(), ok(), fails()) for _ in range(2)]  # 2 failures of 8 rollouts = 0.25
    if raises:
        with pytest.raises(RuntimeError):
            run(art.gather_trajectory_groups(groups, max_exceptions=fraction))
    else:
        assert len(run(art.gather_trajectory_groups(groups, max_exceptions=fraction))) == 2


def test_a_failing_custom_group_coroutine_counts_against_max_exceptions(caplog):
    async def custom(fail: bool) -> art.TrajectoryGroup:
        if fail:
            raise ValueError("custom group broke")
        return art.TrajectoryGroup([await ok()])

    with pytest.raises(ValueError, match="custom group broke"):
        run(art.gather_trajectory_groups([custom(False), custom(True)]))
    with caplog.at_level(logging.WARNING):
        groups = run(art.gather_trajectory_groups([custom(False), custom(True), custom(False)], max_exceptions=1))
    assert len(groups) == 2  # the failed group is left out, and said so
    assert any("custom group broke" in r.message for r in caplog.records)


def test_a_rollout_that_returns_no_trajectory_is_a_counted_failure():
    async def wrong():
        return "not a trajectory"

    g, = run(art.gather_trajectory_groups([group(ok(), wrong())], max_exceptions=1))
    assert len(g) == 1 and "returned str" in g.exceptions[0].message


# --------------------------------------------------------------------------- after_each, order, metrics


def test_after_each_replaces_drops_and_expands_groups():
    async def after_each(g: art.TrajectoryGroup):
        tag = g.metadata["i"]
        if tag == 0:
            return None  # dropped
        if tag == 1:
            return [g, art.TrajectoryGroup(list(g), metadata={"i": 10})]  # expanded
        return art.TrajectoryGroup([t for t in g if t.reward > 0], metadata={"i": 20})  # replaced

    groups = run(art.gather_trajectory_groups(
        [group(ok(1.0), ok(0.0), metadata={"i": i}) for i in range(3)], after_each=after_each))
    assert [g.metadata["i"] for g in groups] == [1, 10, 20]
    assert [len(g) for g in groups] == [2, 2, 1]


def test_a_plain_function_as_after_each_and_a_wrong_return_type():
    kept = run(art.gather_trajectory_groups([group(ok())], after_each=lambda g: g))
    assert len(kept) == 1
    with pytest.raises(GatherError, match="group 0 came back as a str"):
        run(art.gather_trajectory_groups([group(ok())], after_each=lambda g: "oops"))


def test_groups_keep_the_order_given_and_rollouts_the_order_given():
    groups = run(art.gather_trajectory_groups(
        [group(*(ok(reward=10 * i + j, delay=0.001 * (5 - j)) for j in range(4))) for i in range(3)]))
    assert [[t.reward for t in g] for g in groups] == [[10 * i + j for j in range(4)] for i in range(3)]


def test_ready_groups_may_be_passed_as_they_are():
    ready = run(art.gather_trajectory_groups([group(ok())]))[0]
    assert run(art.gather_trajectory_groups([ready, group(ok(0.5))]))[0] is ready


def test_the_progress_bar_shows_running_means_and_at_most_max_metrics(monkeypatch):
    shown: list[dict] = []
    monkeypatch.setattr(GatherContext, "update_pbar", _spy(GatherContext.update_pbar, shown))
    run(art.gather_trajectory_groups([group(ok(1.0, a=1.0, b=2.0), ok(0.0, a=3.0, b=4.0))], max_metrics=2))
    assert shown[-1] == {"reward": 0.5, "a": 2.0}


def _spy(update, shown):
    def spy(self, n):
        update(self, n)
        names = list(self.metric_sums)[: self.max_metrics] if self.max_metrics else list(self.metric_sums)
        shown.append({k: self.metric_sums[k] / max(1, self.metric_divisors[k]) for k in names})
    return spy


def test_completion_tokens_are_recorded_for_sampled_turns(make_choice):
    async def sampled():
        return art.Trajectory(messages_and_choices=[USER, make_choice("red green")], reward=1.0)

    g, = run(art.gather_trajectory_groups([group(sampled())]))
    assert g.trajectories[0].metrics["completion_tokens"] == len(make_choice("red green").logprobs.content)


def test_max_concurrency_limits_the_rollouts_running_at_once():
    running = peak = 0

    async def rollout():
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        for _ in range(3):  # give the loop's other ready rollouts their turn (no timer: load cannot change it)
            await asyncio.sleep(0)
        running -= 1
        return await ok()

    run(art.gather_trajectory_groups([art.TrajectoryGroup(rollout() for _ in range(4)) for _ in range(4)],
                                     max_concurrency=3))
    assert peak == 3


@settings(max_examples=25)
@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=4), min_size=1, max_size=4), st.integers(0, 6))
def test_every_rollout_is_a_trajectory_or_an_exception_or_the_gather_raised(shape, max_exceptions):
    failures = sum(not good for g in shape for good in g)

    async def main():
        return await art.gather_trajectory_groups(
            [group(*(ok(float(j)) if good else fails(f"{i}.{j}") for j, good in enumerate(g)))
             for i, g in enumerate(shape)], max_exceptions=max_exceptions)

    if failures > max_exceptions:
        with pytest.raises(RuntimeError):
            run(main())
        return
    groups = run(main())
    for g, want in zip(groups, shape, strict=True):
        assert [t.reward for t in g] == [float(j) for j, good in enumerate(want) if good]
        assert len(g.exceptions) == want.count(False)


# --------------------------------------------------------------------------- gather_trajectories, batches


def test_gather_trajectories_returns_results_in_place():
    async def pair():
        return [await ok(2.0), await ok(3.0)]

    results = run(art.gather_trajectories([ok(1.0), pair(), fails()], max_exceptions=1))
    assert results[0].reward == 1.0 and [t.reward for t in results[1]] == [2.0, 3.0]
    assert isinstance(results[2], RuntimeError)
    with pytest.raises(RuntimeError):
        run(art.gather_trajectories([ok(), fails()]))


def test_trajectory_group_batches_yields_finished_groups_while_others_run():
    finished: list[int] = []

    async def rollout(i: int):
        await asyncio.sleep(0.001 * (i % 3))
        finished.append(i)
        return await ok(float(i))

    async def main():
        batches = []
        groups = [group(rollout(i), metadata={"i": i}) for i in range(7)]
        async for batch in art.trajectory_group_batches(groups, batch_size=3, max_concurrent_batches=1):
            ids = [g.metadata["i"] for g in batch]
            assert set(ids) <= set(finished)  # only finished groups are handed out
            batches.append((ids, len(finished)))
        return batches

    batches = run(main())
    assert [len(ids) for ids, _ in batches] == [3, 3, 1]
    assert sorted(i for ids, _ in batches for i in ids) == list(range(7))
    assert batches[0][1] < 7  # the first batch came while later groups had not finished (at most 3 run at once)


def test_trajectory_group_batches_skips_batches_and_keeps_its_budget_for_every_batch():
    async def main():
        seen = []
        groups = [group(ok(), fails(), metadata={"i": i}) for i in range(6)]
        async for batch in art.trajectory_group_batches(groups, batch_size=2, skip_batches=1,
                                                        max_batch_exceptions=2, max_concurrent_batches=1):
            seen.append(sorted(g.metadata["i"] for g in batch))
        return seen

    assert run(main()) == [[2, 3], [4, 5]]


def test_stopping_a_batch_iteration_early_cancels_the_groups_still_running():
    cancelled: list[int] = []
    slow = slow_rollout(cancelled)

    async def main():
        batches = art.trajectory_group_batches([group(ok()), group(slow()), group(slow())], batch_size=1)
        async for _ in batches:
            break
        await batches.aclose()

    run(main())
    assert len(cancelled) == 2


def test_the_gather_building_blocks_serve_scripts_that_gather_their_own_way():
    """ART's tic_tac_toe_self_play example gathers tuples of trajectories with these (art.gather names)."""
    from artrl.gather import GatherContext, set_gather_context, wrap_group_awaitable

    async def pair():
        return await ok(1.0), await ok(0.0)

    async def main():
        context = GatherContext(pbar=None, max_exceptions=0)
        with set_gather_context(context):
            tuples = await asyncio.gather(*(wrap_group_awaitable(pair()) for _ in range(3)))
        return context, tuples

    context, tuples = run(main())
    assert [[t.reward for t in pair_] for pair_ in tuples] == [[1.0, 0.0]] * 3
    assert context.metric_sums["reward"] == 3.0 and context.metric_divisors["reward"] == 6
