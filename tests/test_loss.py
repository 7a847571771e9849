"""Each policy loss against values and gradients computed by hand (train/loss.py's formulas)."""

from __future__ import annotations

import math

import pytest
import torch

from artrl.train.loss import policy_loss, sft_loss

EPS, EPS_HIGH = 0.2, 0.28


def _terms(kind: str, new: list[float], old: list[float], adv: list[float], seq: list[int] | None = None,
           weights: list[float] | None = None, beta: float = 0.0, ref: list[float] | None = None):
    n = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    w = torch.tensor(weights or [1.0] * len(new), dtype=torch.float64)
    terms = policy_loss(n, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64), w,
                        torch.tensor(seq or list(range(len(new)))), torch.zeros(len(new), dtype=torch.float64),
                        kind=kind, epsilon=EPS, epsilon_high=EPS_HIGH, beta=beta,
                        ref=torch.tensor(ref, dtype=torch.float64) if ref is not None else None)
    terms.loss_sum.backward()
    return terms, n.grad.tolist()


# ratios: exp(0.1) = 1.105 (inside), exp(0.5) = 1.649 (above 1.28), exp(-0.5) = 0.607 (below 0.8)
NEW = [-1.0, -1.0, -1.0]
OLD = [-1.1, -1.5, -0.5]
R = [math.exp(0.1), math.exp(0.5), math.exp(-0.5)]
CLIP = [R[0], 1 + EPS_HIGH, 1 - EPS]


@pytest.mark.parametrize("a", [2.0, -2.0])
def test_cispo_is_a_clipped_detached_weight_times_reinforce(a):
    terms, grad = _terms("cispo", NEW, OLD, [a] * 3)
    assert terms.loss_sum.item() == pytest.approx(sum(-c * a * n for c, n in zip(CLIP, NEW)))
    # every token keeps a gradient, scaled by its clipped weight; positive advantage pushes logprob up
    assert grad == pytest.approx([-c * a for c in CLIP])
    assert terms.clipped_tokens == 2
    assert terms.ratio_sum == pytest.approx(sum(R))


def test_ppo_clips_the_surrogate_only_where_it_stops_improving():
    # A > 0: min(r A, clip(r) A). Above the range the clipped term wins (no gradient); below it r A wins.
    terms, grad = _terms("ppo", NEW, OLD, [2.0] * 3)
    assert terms.loss_sum.item() == pytest.approx(-(R[0] * 2 + CLIP[1] * 2 + R[2] * 2))
    assert grad == pytest.approx([-R[0] * 2, 0.0, -R[2] * 2])
    # A < 0: above the range r A is smaller (gradient kept); below it the clipped term wins (no gradient)
    terms, grad = _terms("ppo", NEW, OLD, [-2.0] * 3)
    assert terms.loss_sum.item() == pytest.approx(-(R[0] * -2 + R[1] * -2 + CLIP[2] * -2))
    assert grad == pytest.approx([R[0] * 2, R[1] * 2, 0.0])


def test_gspo_uses_the_sequence_mean_log_ratio():
    # one sequence of two tokens: log ratios 0.1 and 0.3 -> s = exp(0.2), inside the range
    terms, grad = _terms("gspo", [-1.0, -2.0], [-1.1, -2.3], [1.5, 1.5], seq=[0, 0])
    s = math.exp(0.2)
    assert terms.loss_sum.item() == pytest.approx(-2 * s * 1.5)
    # per-token gradient of s * exp(new - sg(new)): d/dnew_t = s
    assert grad == pytest.approx([-s * 1.5, -s * 1.5])
    # a sequence above the range: clipped, no gradient (A > 0)
    terms, grad = _terms("gspo", [-1.0, -2.0], [-1.5, -2.5], [1.5, 1.5], seq=[0, 0])
    assert terms.loss_sum.item() == pytest.approx(-2 * (1 + EPS_HIGH) * 1.5)
    assert grad == pytest.approx([0.0, 0.0])


def test_missing_sampled_logprobs_mean_ratio_one():
    terms, grad = _terms("ppo", [-1.0, -2.0], [float("nan"), float("nan")], [1.0, -1.0])
    assert terms.loss_sum.item() == pytest.approx(0.0)  # -(1 * 1) - (1 * -1)
    assert grad == pytest.approx([-1.0, 1.0])
    assert terms.ratio_sum == pytest.approx(2.0) and terms.clipped_tokens == 0


def test_kl_penalty_is_the_k3_estimator_and_pulls_towards_the_reference():
    new, ref = [-1.0, -2.0], [-1.5, -1.0]
    terms, grad = _terms("cispo", new, new, [0.0, 0.0], beta=0.5, ref=ref)
    d = [r - n for r, n in zip(ref, new)]
    assert terms.loss_sum.item() == pytest.approx(0.5 * sum(math.exp(x) - x - 1 for x in d))
    assert terms.kl_sum == pytest.approx(sum(math.exp(x) - x - 1 for x in d))
    # d/dnew [exp(ref - new) - (ref - new) - 1] = 1 - exp(ref - new): towards ref
    assert grad == pytest.approx([0.5 * (1 - math.exp(x)) for x in d])


def test_weights_scale_every_term():
    terms, grad = _terms("cispo", [-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], weights=[0.5, 0.0])
    assert terms.loss_sum.item() == pytest.approx(0.5 * 1.0)
    assert grad == pytest.approx([-0.5, 0.0])
    assert terms.weight_sum == 0.5


def test_sft_loss_is_the_weighted_negative_log_likelihood():
    new = torch.tensor([-0.5, -2.0], requires_grad=True)
    terms = sft_loss(new, torch.tensor([1.0, 2.0]), torch.zeros(2))
    assert terms.loss_sum.item() == pytest.approx(0.5 + 4.0)
    terms.loss_sum.backward()
    assert new.grad.tolist() == pytest.approx([-1.0, -2.0])
