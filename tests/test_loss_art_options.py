"""ART's policy-loss options (train/loss.py) against values and gradients computed by hand, and their defaults.

Three tokens with new logprobs -1 and sampled logprobs [-1.1, -1.5, -0.5]: log-ratios d = [0.1, 0.5, -0.5],
ratios r = [1.105, 1.649, 0.607]. With ART's CISPO clip bounds (epsilon 1.0, epsilon_high 4.0) nothing is
clipped, so a CISPO token's loss is -r_t * A_t * new_t and its gradient -r_t * A_t.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from artrl.runtime import notices
from artrl.train.loss import RATIO_EDGES, histogram_quantile, policy_loss, ratio_histogram
from artrl.types import TrainConfig

NEW = [-1.0, -1.0, -1.0]
OLD = [-1.1, -1.5, -0.5]
D = [0.1, 0.5, -0.5]
R = [math.exp(d) for d in D]
A = 2.0


def _run(kind: str = "cispo", seq: list[int] | None = None, adv: list[float] | None = None,
         ref: list[float] | None = None, original: list[float] | None = None, **options):
    eps, eps_high = options.pop("clip", (1.0, 4.0))
    n = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    terms = policy_loss(n, t(OLD), t(adv or [A] * 3), t([1.0] * 3), torch.tensor(seq or [0, 1, 2]), t([0.0] * 3),
                        kind=kind, epsilon=eps, epsilon_high=eps_high, ref=t(ref) if ref is not None else None,
                        original=t(original) if original is not None else None, **options)
    terms.loss_sum.backward()
    return terms, n.grad.tolist()


def _cispo(weights: list[float], adv: list[float] | None = None) -> tuple[float, list[float]]:
    """CISPO's loss sum and gradient for detached per-token weights (new = -1 everywhere)."""
    adv = adv or [A] * 3
    return sum(w * a for w, a in zip(weights, adv)), [-w * a for w, a in zip(weights, adv)]


# --------------------------------------------------------------------------- defaults (types.TrainConfig)

@pytest.mark.parametrize(("fields", "bounds"), [
    ({}, (1.0, 4.0)),                                    # ART's CISPO: clip the weight to [0, 5]
    ({"ppo": True}, (0.2, 0.2)),                         # ART's PPO: [0.8, 1.2]
    ({"ppo": True, "epsilon": 0.3}, (0.3, 0.3)),         # PPO: epsilon_high defaults to epsilon
    ({"epsilon": 0.3}, (0.3, 4.0)),                      # CISPO: epsilon_high keeps its own default
    ({"epsilon": 0.3, "epsilon_high": 0.5}, (0.3, 0.5)),
    ({"loss": "gspo"}, (0.2, 0.2)),                      # PPO-shaped
])
def test_clip_defaults_follow_art_and_the_loss(fields, bounds):
    assert TrainConfig(**fields).clip_bounds() == bounds


def test_ppo_flag_picks_the_loss():
    assert TrainConfig().resolved_loss() == "cispo"
    assert TrainConfig(ppo=True).resolved_loss() == "ppo"
    assert TrainConfig(loss="gspo").resolved_loss() == "gspo"


# --------------------------------------------------------------------------- importance sampling level

def test_token_level_cispo_with_art_bounds_is_unclipped():
    terms, grad = _run()
    loss, g = _cispo(R)
    assert terms.loss_sum.item() == pytest.approx(loss) and grad == pytest.approx(g)
    assert terms.clipped_tokens == 0


def test_sequence_level_ppo_ratio_and_its_gradient_through_the_mean():
    # sequences {0, 1} and {2}: s0 = exp((0.1 + 0.5) / 2) = 1.350 > 1.2 (clipped, constant for A > 0),
    # s1 = exp(-0.5) = 0.607 < 0.8 (min picks the unclipped term, gradient A * s1 / 1 token)
    terms, grad = _run("ppo", seq=[0, 0, 1], clip=(0.2, 0.2), importance_sampling_level="sequence")
    s1 = math.exp(-0.5)
    assert terms.loss_sum.item() == pytest.approx(-(1.2 * A * 2 + s1 * A))
    assert grad == pytest.approx([0.0, 0.0, -A * s1])


def test_sequence_level_gradient_is_spread_over_the_sequence():
    # one sequence of 3 tokens, mean d = 0.0333, s = 1.034 inside [0.8, 1.2]:
    # loss = -3 * s * A; d loss / d new_t = -A * 3 * s / 3 = -A * s for every token
    terms, grad = _run("ppo", seq=[0, 0, 0], clip=(0.2, 0.2), importance_sampling_level="sequence")
    s = math.exp(sum(D) / 3)
    assert terms.loss_sum.item() == pytest.approx(-3 * s * A)
    assert grad == pytest.approx([-A * s] * 3)


@pytest.mark.parametrize("level", ["average", "geometric_average"])
def test_mixed_levels_combine_token_and_sequence_ratios(level):
    s = math.exp(sum(D) / 3)
    mix = [(r + s) / 2 if level == "average" else math.sqrt(r * s) for r in R]
    terms, grad = _run(seq=[0, 0, 0], importance_sampling_level=level)
    loss, g = _cispo(mix)
    assert terms.loss_sum.item() == pytest.approx(loss) and grad == pytest.approx(g)


# --------------------------------------------------------------------------- ratio cap and mask

def test_ratio_cap_applies_to_every_token_as_in_art():
    terms, grad = _run(max_ratio=1.2)
    loss, g = _cispo([R[0], 1.2, R[2]])
    assert terms.loss_sum.item() == pytest.approx(loss) and grad == pytest.approx(g)


def test_ratio_cap_of_zero_is_off():
    assert _run(max_ratio=0.0)[1] == pytest.approx(_run()[1])


def test_mask_prob_ratio_zeroes_ratios_outside_the_clip_range_before_clipping():
    # range (0.8, 1.28): r1 = 1.649 and r2 = 0.607 become 0, which CISPO's clip lifts to 1 - 0.2 = 0.8
    terms, grad = _run(clip=(0.2, 0.28), mask_prob_ratio=True)
    loss, g = _cispo([R[0], 0.8, 0.8])
    assert terms.loss_sum.item() == pytest.approx(loss) and grad == pytest.approx(g)
    # with ART's CISPO bounds (0, 5) every ratio is inside: no change
    assert _run(mask_prob_ratio=True)[1] == pytest.approx(_run()[1])


def test_mask_prob_ratio_with_ppo_removes_the_gradient_of_masked_tokens():
    _, grad = _run("ppo", clip=(0.2, 0.28), mask_prob_ratio=True)
    assert grad == pytest.approx([-A * R[0], 0.0, 0.0])


# --------------------------------------------------------------------------- advantages

def test_kimi_k2_tau_subtracts_tau_times_the_log_ratio_from_the_advantage():
    adv = [A - 0.5 * d for d in D]
    terms, grad = _run(kimi_k2_tau=0.5)
    loss, g = _cispo(R, adv)
    assert terms.loss_sum.item() == pytest.approx(loss) and grad == pytest.approx(g)


REF = [-1.2, -1.0, -0.4]  # kl_t = new - ref = [0.2, 0.0, -0.6], mean -0.1333


def test_kl_penalty_adjusts_advantages_by_the_centred_drift():
    kl = [n - r for n, r in zip(NEW, REF)]
    mean = sum(kl) / 3
    adv = [A + 0.5 * (mean - k) for k in kl]
    terms, grad = _run(ref=REF, kl_penalty_coef=0.5)
    loss, g = _cispo(R, adv)
    assert terms.loss_sum.item() == pytest.approx(loss) and grad == pytest.approx(g)
    assert sum(a - A for a in adv) == pytest.approx(0.0)  # zero-mean over the tokens
    assert adv[0] < adv[1] < adv[2]  # more drift from the reference, less advantage
    assert terms.kl_ref_sum == pytest.approx(sum(kl)) and terms.kl_sum == 0.0  # no loss term (that is beta)


def test_kl_penalty_uses_the_optimizer_steps_mean_when_given():
    kl = [n - r for n, r in zip(NEW, REF)]
    terms, grad = _run(ref=REF, kl_penalty_coef=0.5, kl_mean=0.3)
    assert grad == pytest.approx(_cispo(R, [A + 0.5 * (0.3 - k) for k in kl])[1])


def test_kl_penalty_source_sample_measures_the_rollout_policy_against_the_reference():
    # ART 0.5.23 kl_penalty_source="sample": kl_t = old - ref = [0.1, -0.5, -0.1], the rollout's drift
    kl = [o - r for o, r in zip(OLD, REF)]
    mean = sum(kl) / 3
    terms, grad = _run(ref=REF, kl_penalty_coef=0.5, kl_source="sample")
    assert grad == pytest.approx(_cispo(R, [A + 0.5 * (mean - k) for k in kl])[1])
    assert terms.kl_ref_sum == pytest.approx(sum(kl))  # what loss/kl_policy_ref reports
    assert grad != pytest.approx(_run(ref=REF, kl_penalty_coef=0.5)[1])  # not the current learner's


def test_kl_penalty_without_reference_or_coefficient_changes_nothing():
    assert _run(kl_penalty_coef=0.5)[1] == pytest.approx(_run()[1])
    assert _run(ref=REF)[1] == pytest.approx(_run()[1])


# --------------------------------------------------------------------------- truncated importance sampling

def test_truncated_importance_sampling_without_recomputed_logprobs_is_skipped_with_one_notice(caplog):
    # ART 0.5.23: no trainer/sampler ratio without precalculate_logprobs, so nothing is truncated
    # (0.5.18 multiplied by the capped current ratio instead)
    notices.forget()
    with caplog.at_level(logging.WARNING, logger="artrl.notices"):
        terms, grad = _run(truncated_importance_sampling=1.2)
        _run(truncated_importance_sampling=1.2)
    assert terms.loss_sum.item() == pytest.approx(_run()[0].loss_sum.item()) and grad == pytest.approx(_run()[1])
    said = [r.getMessage() for r in caplog.records if "truncated_importance_sampling=1.2 is skipped" in r.getMessage()]
    assert len(said) == 1


def test_truncated_importance_sampling_with_recomputed_logprobs_uses_trainer_over_sampler():
    # original (sampled) logprobs [-1.0, nan, -0.7]; nan -> new: q = exp(old - original) = exp([-0.1, -0.5, 0.2])
    q = [math.exp(-0.1), math.exp(-0.5), math.exp(0.2)]
    cap = [min(x, 1.2) for x in q]
    _, grad = _run(truncated_importance_sampling=1.2, original=[-1.0, math.nan, -0.7])
    assert grad == pytest.approx([-r * A * c for r, c in zip(R, cap)])


# --------------------------------------------------------------------------- config checks

def test_contradictions_between_our_names_and_arts_are_refused():
    from artrl.errors import ConfigError

    with pytest.raises(ConfigError, match="ppo=True and loss='cispo'"):
        TrainConfig(ppo=True, loss="cispo").check()
    with pytest.raises(ConfigError, match="loss='gspo' already uses a sequence-level ratio"):
        TrainConfig(loss="gspo", importance_sampling_level="sequence").check()
    TrainConfig(beta=0.1, kl_penalty_coef=0.2).check()  # two different knobs now: both allowed


# --------------------------------------------------------------------------- ART 0.5.23's ratio rules and figures

def _one(new: float, old: float, dtype=torch.float64, kind: str = "ppo", **options):
    n = torch.tensor([new], dtype=dtype, requires_grad=True)
    t = lambda v: torch.tensor(v, dtype=dtype)  # noqa: E731
    eps = 6e4 if dtype == torch.float16 else 1e12  # PPO's clip out of the way (6e4: float16's range)
    terms = policy_loss(n, t([old]), t([1.0]), t([1.0]), torch.tensor([0]), t([0.0]), kind=kind, epsilon=eps,
                        epsilon_high=eps, **options)
    terms.loss_sum.backward()
    return terms, n.grad.item()


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 20.0), (torch.float32, 20.0), (torch.float16, 10.0)])
def test_log_ratio_is_clamped_before_exp(dtype, bound):
    # new - old = 30: unclamped exp(30) = 1.1e13 (inf in float16); ART 0.5.23 clamps the log-ratio first
    terms, grad = _one(-1.0, -31.0, dtype)
    assert terms.sums["ratio_raw"].item() == pytest.approx(math.exp(bound), rel=1e-3)
    assert math.isfinite(terms.loss_sum.item()) and grad == 0.0  # past the clamp the ratio is constant
    inside, grad_inside = _one(-1.0, -6.0, dtype)
    assert inside.sums["ratio_raw"].item() == pytest.approx(math.exp(5.0), rel=1e-2) and grad_inside != 0.0


@pytest.mark.parametrize(("options", "slope"), [
    ({"kind": "gspo"}, -1.0),  # GSPO: the sequence ratio's value, each token's gradient (ratio * A, A = 1)
    ({"importance_sampling_level": "sequence"}, 0.0),
    ({"importance_sampling_level": "average"}, 0.0),
    ({"importance_sampling_level": "geometric_average"}, 0.0),
], ids=["gspo", "sequence", "average", "geometric_average"])
@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 20.0), (torch.float16, 10.0)], ids=["float64", "float16"])
def test_sequence_log_ratio_is_clamped_before_exp(options, slope, dtype, bound):
    # a one-token sequence 30 above its sampled logprob: its token and sequence log-ratios both stop at the bound,
    # so every level's ratio is exactly exp(bound); an unclamped sequence ratio would show exp(30) (1.1e13,
    # finite in float64: only the value can tell) or, mixed with the token's, exp(25) or (exp(20) + exp(30)) / 2
    terms, grad = _one(-1.0, -31.0, dtype, **options)
    ratio = math.exp(bound)
    assert terms.sums["ratio_raw"].item() == pytest.approx(ratio, rel=1e-3)
    assert grad == pytest.approx(slope * ratio, rel=1e-3)


@pytest.mark.parametrize("bad", [math.nan, -math.inf, math.inf])
def test_non_finite_old_logprobs_count_as_on_policy(bad):
    terms, grad = _one(-1.0, bad)
    assert terms.sums["ratio_raw"].item() == pytest.approx(1.0) and grad == pytest.approx(-1.0)


def test_offpolicy_figures_of_a_micro_batch():
    # ratios R = [1.105, 1.649, 0.607]: with CISPO bounds [0.8, 1.28] two are outside; with PPO and A > 0 only the
    # one above 1.28 binds
    terms, _ = _run(clip=(0.2, 0.28))
    assert terms.sums["ratio_tokens"].item() == 3 and terms.sums["ratio_raw"].item() == pytest.approx(sum(R))
    assert terms.sums["ratio_clipped"].item() == 2
    assert _run("ppo", clip=(0.2, 0.28))[0].sums["ratio_clipped"].item() == 1
    assert _run("ppo", clip=(0.2, 0.28), adv=[-A] * 3)[0].sums["ratio_clipped"].item() == 1  # r = 0.607 < 0.8
    assert terms.ratio_histogram.sum().item() == 3
    # the figures read the ratio before the cap and the mask (ART's raw ratio)
    capped, _ = _run(clip=(0.2, 0.28), max_ratio=1.0, mask_prob_ratio=True)
    assert capped.sums["ratio_raw"].item() == pytest.approx(sum(R)) and capped.sums["ratio_clipped"].item() == 2


def test_histogram_quantiles_interpolate_within_the_bucket():
    edges = RATIO_EDGES.tolist()
    assert histogram_quantile([0.0] * (len(edges) + 1), 0.95) == 0.0
    # 100 ratios of exactly 1.0 fall in the bucket that ends at 1.0 (edge 128): p95 is 95% of the way into it
    counts = ratio_histogram(torch.ones(100)).tolist()
    assert counts[128] == 100 and edges[128] == pytest.approx(1.0)
    assert histogram_quantile(counts, 0.95) == pytest.approx(edges[127] + 0.95 * (edges[128] - edges[127]))
    # a spread: 90 tokens at 1.0 and 10 at 3.0; p95 lies in 3.0's bucket, p50 in 1.0's
    spread = ratio_histogram(torch.tensor([1.0] * 90 + [3.0] * 10)).tolist()
    assert 2.9 < histogram_quantile(spread, 0.95) <= 3.0 + 0.1 and 0.9 < histogram_quantile(spread, 0.5) <= 1.0
    # beyond the last edge reads as 1e4
    assert histogram_quantile(ratio_histogram(torch.tensor([1e6])).tolist(), 0.99) == pytest.approx(1e4)
