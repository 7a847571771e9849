"""ART's per-call options that act before the loss: advantage_balance and the trajectory-count learning-rate power."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from artrl.preprocess.advantages import balance_advantages
from artrl.preprocess.build import build_call
from artrl.trajectories.sequences import TokenizedSequence
from artrl.train.rl import learning_rates
from artrl.types import TrainConfig


def seq(advantage: float, n_trainable: int = 2, prompt: int = 3, group: int = 0, index: int = 0) -> TokenizedSequence:
    ids = list(range(10, 10 + prompt)) + [100 + index] * n_trainable
    return TokenizedSequence(token_ids=ids, trainable_mask=[False] * prompt + [True] * n_trainable,
                             logprobs=[float("nan")] * prompt + [-1.0] * n_trainable, advantage=advantage,
                             group_index=group, trajectory_index=index)


def mean_abs(groups) -> float:
    seqs = [s for g in groups for s in g]
    return sum(abs(s.advantage) * s.n_trainable for s in seqs) / sum(s.n_trainable for s in seqs)


def test_balance_worked_example():
    groups = [[seq(1.0), seq(-1.0, index=1)]]
    balance_advantages(groups, 0.5)
    assert [s.advantage for s in groups[0]] == pytest.approx([4 / 3, -2 / 3])


@pytest.mark.parametrize(("balance", "expected"), [(1.0, [2.0, 0.0]), (-1.0, [0.0, -2.0]), (0.0, [1.0, -1.0])])
def test_balance_extremes_train_on_one_sign_only(balance, expected):
    groups = [[seq(1.0), seq(-1.0, index=1)]]
    balance_advantages(groups, balance)
    assert [s.advantage for s in groups[0]] == pytest.approx(expected)


ADVANTAGE = st.floats(-3, 3).filter(lambda a: a == 0 or abs(a) > 1e-6)  # no subnormals: ratios must be exact


@given(st.lists(st.tuples(ADVANTAGE, st.integers(1, 5)), min_size=2, max_size=8), st.floats(-1, 1))
def test_balance_keeps_the_calls_mean_abs_advantage_and_signs(items, balance):
    groups = [[seq(a, n, index=i) for i, (a, n) in enumerate(items)]]
    before = mean_abs(groups)
    signs = [a > 0 for a, _ in items]
    balance_advantages(groups, balance)
    after = [s.advantage for s in groups[0]]
    if mean_abs(groups) > 0:
        assert mean_abs(groups) == pytest.approx(before, rel=1e-9, abs=1e-12)
    for s, positive in zip(after, signs):
        assert (s >= 0) if positive else (s <= 0)
    positives = [s for s, p in zip(after, signs) if p]
    negatives = [s for s, (a, _) in zip(after, items) if a < 0]
    if balance > 0 and positives and negatives and all(a != 0 for a, _ in items):
        # positives are scaled up relative to negatives by 1 / (1 - balance)
        ratio = positives[0] / items[signs.index(True)][0]
        neg_ratio = negatives[0] / next(a for a, _ in items if a < 0)
        assert neg_ratio == pytest.approx(ratio * (1 - balance), rel=1e-9, abs=1e-12)


def test_balance_outside_its_range_is_refused():
    with pytest.raises(ValueError, match="advantage_balance=1.5"):
        balance_advantages([[seq(1.0)]], 1.5)


def _built(groups_per_step: int | None):
    units = [[seq(1.0, group=g, index=i) for i in range(k)] for g, k in enumerate([2, 3, 4])]
    return build_call(units, units_per_step=groups_per_step, max_length=256)


@pytest.mark.parametrize("power", [0.0, 0.5, -1.0])
def test_learning_rate_multiplier_counts_the_sequences_of_each_step(power):
    built = _built(groups_per_step=1)  # steps of 2, 3 and 4 sequences
    config = TrainConfig(learning_rate=1e-3, num_trajectories_learning_rate_multiplier_power=power)
    assert [s.sequences for s in built.plan.steps] == [2, 3, 4]
    assert learning_rates(built, config) == pytest.approx([1e-3 * n ** power for n in (2, 3, 4)])


def test_learning_rate_multiplier_over_one_step():
    built = _built(groups_per_step=None)
    assert learning_rates(built, TrainConfig(learning_rate=1e-3,
                                             num_trajectories_learning_rate_multiplier_power=1.0)) == \
        pytest.approx([9e-3])
