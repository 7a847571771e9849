"""artrl's off-policy corrections and mismatch figures (train/offpolicy.py) on small hand-made tensors.

The worked data: two sequences, five tokens, trainer-minus-sampled log-ratios

    sequence   0     0     0     1     1
    l_t        0.1  -0.9   0.2   1.0  -0.2
    rho_t      1.105 0.407 1.221 2.718 0.819

sequence sums -0.6 and 0.8 (product ratios 0.549, 2.226), means -0.2 and 0.4 (geometric ratios 0.819,
1.492). With bounds [0.5, 2]: token ratios 0.407 and 2.718 lie outside, sequence 1's product ratio above,
no geometric ratio outside.
"""

from __future__ import annotations

import math

import pytest
import torch

from artrl.errors import ConfigError
from artrl.train.loss import policy_loss
from artrl.train.offpolicy import (AGE_BUCKETS, AGE_FIELDS, Correction, MISMATCH_KEYS, importance_weights,
                                   mismatch_metrics, mismatch_sums, off_policy_keep)
from artrl.train.trainer import StepOptions
from artrl.types import TrainConfig

L = [0.1, -0.9, 0.2, 1.0, -0.2]
SEQ = [0, 0, 0, 1, 1]
RHO = [math.exp(x) for x in L]
SUMS, MEANS = [-0.6, 0.8], [-0.2, 0.4]
f64 = torch.float64


def t(v):
    return torch.tensor(v, dtype=f64)


# --------------------------------------------------------------------------- the weights


@pytest.mark.parametrize(("mode", "want"), [
    ("token_truncate", [RHO[0], 0.5, RHO[2], 2.0, RHO[4]]),
    ("token_mask", [RHO[0], 0.0, RHO[2], 0.0, RHO[4]]),
    ("sequence_truncate", [math.exp(-0.6)] * 3 + [2.0] * 2),
    ("sequence_mask", [math.exp(-0.6)] * 3 + [0.0] * 2),
    ("geometric_truncate", [math.exp(-0.2)] * 3 + [math.exp(0.4)] * 2),
    ("geometric_mask", [math.exp(-0.2)] * 3 + [math.exp(0.4)] * 2),
])
def test_each_mode_weighs_the_worked_sequences(mode, want):
    w = importance_weights(t(L), torch.tensor(SEQ), mode, 0.5, 2.0)
    assert w.tolist() == pytest.approx(want)


def test_an_unset_lower_bound_leaves_small_ratios_alone():
    assert importance_weights(t(L), torch.tensor(SEQ), "token_mask", None, 2.0).tolist() == \
        pytest.approx([RHO[0], RHO[1], RHO[2], 0.0, RHO[4]])


def test_off_policy_mask_drops_negative_advantage_sequences_far_from_the_sampler():
    # sampled - new per sequence: mean -l = 0.2 (sequence 0), -0.4 (sequence 1)
    new, sampled = t([-1.0] * 5), t([-1.0 - x for x in L])
    keep = off_policy_keep(new, sampled, t([-1.0] * 3 + [1.0] * 2), torch.tensor(SEQ), 0.15)
    assert keep.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert off_policy_keep(new, sampled, t([1.0] * 5), torch.tensor(SEQ), 0.15).tolist() == [1.0] * 5  # A > 0
    assert off_policy_keep(new, sampled, t([-1.0] * 5), torch.tensor(SEQ), 0.25).tolist() == [1.0] * 5  # within


# --------------------------------------------------------------------------- the loss: on, off, and on-policy

NEW = [-1.0, -1.5, -0.7, -2.0, -0.3]
ADV = [-1.0, -1.0, -1.0, 1.0, 1.0]
OPTIONS = {
    **{mode: Correction(mode, 0.5, 2.0) for mode in ("token_truncate", "sequence_truncate", "sequence_mask",
                                                     "geometric_truncate", "geometric_mask")},
    # [0.3, 2]: with [0.5, 2] token_mask would zero exactly the two tokens whose clipped PPO term has no gradient
    "token_mask": Correction("token_mask", 0.3, 2.0),
    "off_policy_mask_threshold": Correction(mask_threshold=0.15),  # drops sequence 0 (A < 0, 0.2 > 0.15)
}


def _grad(correction: Correction | None, sampled: list[float], **kw):
    new = torch.tensor(NEW, dtype=f64, requires_grad=True)
    # with a correction mode the trainer hands its own logprobs as old and the record as original
    old, original = (new.detach(), t(sampled)) if correction is not None and correction.mode else (t(sampled), None)
    terms = policy_loss(new, old, t(ADV), t([1.0] * 5), torch.tensor(SEQ), t([0.0] * 5), original=original,
                        correction=correction, **kw)
    terms.loss_sum.backward()
    return terms, new.grad


@pytest.mark.parametrize("loss", ["cispo", "ppo"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_moves_an_off_policy_update_and_not_an_on_policy_one(option, loss):
    bounds = dict(epsilon=1.0, epsilon_high=4.0) if loss == "cispo" else dict(epsilon=0.2, epsilon_high=0.2)
    off_policy = [n - x for n, x in zip(NEW, L)]  # sampled = new - l: the worked ratios
    _, on = _grad(OPTIONS[option], off_policy, kind=loss, **bounds)
    _, off = _grad(None, off_policy, kind=loss, **bounds)
    assert (on - off).abs().max() > 1e-3
    _, on = _grad(OPTIONS[option], NEW, kind=loss, **bounds)  # exactly on policy: every ratio 1
    _, off = _grad(None, NEW, kind=loss, **bounds)
    assert torch.equal(on, off)


def test_a_correction_needs_the_record_beside_the_trainers_logprobs():
    new = torch.tensor(NEW, dtype=f64, requires_grad=True)
    with pytest.raises(ValueError, match="needs the trainer's logprobs"):
        policy_loss(new, new.detach(), t(ADV), t([1.0] * 5), torch.tensor(SEQ), t([0.0] * 5),
                    correction=Correction("token_mask", 0.5, 2.0))


def test_a_token_without_a_sampled_logprob_weighs_one():
    sampled = [n - x for n, x in zip(NEW, L)]
    sampled[1] = math.nan  # token 1 (ratio 0.407, masked above) has no record: on-policy, kept
    terms, grad = _grad(Correction("token_mask", 0.5, 2.0), sampled)
    assert grad[1].item() == pytest.approx(-ADV[1])  # CISPO: - 1 * A
    assert grad[3].item() == 0.0  # ratio 2.718: masked


def test_bias_corrected_kl_weighs_the_k3_term_by_the_ratio_to_the_sampler():
    """DeepSeek-V3.2's estimate: beta * exp(new - sampled) * k3, the gradient through both factors. On on-policy
    data its value is the plain term's and its gradient adds beta * k3 per token (the score-function part that the
    plain k3 term leaves out): the one option that moves an on-policy update, by design."""
    ref = t([-1.2, -1.2, -1.2, -1.2, -1.2])
    k3 = [math.exp(r - n) - (r - n) - 1 for r, n in zip(ref.tolist(), NEW)]
    dk3 = [-math.exp(r - n) + 1 for r, n in zip(ref.tolist(), NEW)]  # d k3 / d new
    common = dict(ref=ref, beta=0.5, kind="cispo", epsilon=1.0, epsilon_high=4.0)
    sampled = [n - x for n, x in zip(NEW, L)]
    plain, g_plain = _grad(None, sampled, **common)
    biased, g_biased = _grad(Correction(bias_correction_kl=True), sampled, **common)
    assert biased.kl_sum == pytest.approx(sum(r * k for r, k in zip(RHO, k3)))
    assert plain.kl_sum == pytest.approx(sum(k3))
    assert (g_biased - g_plain).tolist() == pytest.approx([0.5 * r * (k + d) - 0.5 * d
                                                           for r, k, d in zip(RHO, k3, dk3)])
    on, g_on = _grad(Correction(bias_correction_kl=True), NEW, **common)
    off, g_off = _grad(None, NEW, **common)
    assert on.kl_sum == pytest.approx(off.kl_sum)
    assert (g_on - g_off).tolist() == pytest.approx([0.5 * k for k in k3])


# --------------------------------------------------------------------------- the figures


class Totals(dict):
    """StepTotals' two adders over a plain dict (the sums, read at once)."""

    def add(self, key, value):
        self[key] = self.get(key, 0.0) + float(value)

    def add_vector(self, key, value):
        self[key] = value.tolist()


def test_mismatch_figures_of_the_worked_tokens():
    totals = Totals(dict.fromkeys(MISMATCH_KEYS, 0.0))
    trainer, sampled = t([-1.0] * 5), t([-1.0 - x for x in L])
    mismatch_sums(totals, trainer, sampled, t(ADV), t([1.0] * 5), torch.tensor(SEQ), bounds=(0.5, 2.0),
                  threshold=0.15, sequence_ages=torch.tensor([0, 2]))
    got = mismatch_metrics(totals, totals["mm_age"], bounds=(0.5, 2.0), threshold=0.15)
    want = {
        "offpolicy/sampler_kl": -sum(L) / 5,
        "offpolicy/sampler_kl_k3": sum(r - 1 - x for r, x in zip(RHO, L)) / 5,
        "offpolicy/chi2_token": sum(r * r for r in RHO) / 5 - 1,
        "offpolicy/chi2_sequence": (math.exp(2 * SUMS[0]) + math.exp(2 * SUMS[1])) / 2 - 1,
        "offpolicy/ppl_ratio": (math.exp(-MEANS[0]) + math.exp(-MEANS[1])) / 2,
        "offpolicy/token_above_max": 1 / 5, "offpolicy/token_below_min": 1 / 5,
        "offpolicy/sequence_above_max": 1 / 2, "offpolicy/sequence_below_min": 0.0,
        "offpolicy/geometric_above_max": 0.0, "offpolicy/geometric_below_min": 0.0,
        "offpolicy/clip_min": 0.5, "offpolicy/clip_max": 2.0, "offpolicy/mismatch_tokens": 5.0,
        # sequence 0 has a negative advantage and sampled - trainer averages 0.2 > 0.15: masked; sequence 1 A > 0
        "offpolicy/off_policy_masked_sequences": 0.5,
        # by age: sequence 0 is 0 versions old, sequence 1 two
        "offpolicy/age0/tokens": 3.0, "offpolicy/age0/sampler_kl": 0.2,
        "offpolicy/age0/sampler_kl_k3": sum(r - 1 - x for r, x in zip(RHO[:3], L[:3])) / 3,
        "offpolicy/age0/chi2_token": sum(r * r for r in RHO[:3]) / 3 - 1,
        "offpolicy/age0/token_above_max": 0.0, "offpolicy/age0/token_below_min": 1 / 3,
        "offpolicy/age2/tokens": 2.0, "offpolicy/age2/sampler_kl": -0.4,
        "offpolicy/age2/sampler_kl_k3": sum(r - 1 - x for r, x in zip(RHO[3:], L[3:])) / 2,
        "offpolicy/age2/chi2_token": sum(r * r for r in RHO[3:]) / 2 - 1,
        "offpolicy/age2/token_above_max": 1 / 2, "offpolicy/age2/token_below_min": 0.0,
    }
    assert got == pytest.approx(want)


def test_figures_count_only_tokens_with_a_record_and_split_by_age_only_for_several_ages():
    totals = Totals(dict.fromkeys(MISMATCH_KEYS, 0.0))
    sampled = t([-1.0 - x for x in L])
    sampled[0] = math.nan
    mismatch_sums(totals, t([-1.0] * 5), sampled, t(ADV), t([1.0] * 5), torch.tensor(SEQ), bounds=(0.5, 2.0),
                  sequence_ages=torch.tensor([1, 1]))
    got = mismatch_metrics(totals, totals["mm_age"], bounds=(0.5, 2.0))
    assert got["offpolicy/mismatch_tokens"] == 4.0
    assert got["offpolicy/sampler_kl"] == pytest.approx(-sum(L[1:]) / 4)
    assert not any("/age" in k for k in got) and "offpolicy/off_policy_masked_sequences" not in got
    assert len(totals["mm_age"]) == AGE_BUCKETS * len(AGE_FIELDS)
    assert mismatch_metrics(Totals(dict.fromkeys(MISMATCH_KEYS, 0.0)), [0.0] * 48, bounds=(0.5, 2.0)) == {}


# --------------------------------------------------------------------------- the config


def test_bounds_the_figures_measure_at():
    assert Correction.from_config(TrainConfig()).bounds == pytest.approx((1 / 3, 3.0))  # TRL's default max
    assert Correction.from_config(TrainConfig(truncated_importance_sampling=2.0)).bounds == (0.5, 2.0)
    cfg = TrainConfig(importance_sampling_correction="token_mask", importance_sampling_clip_min=0.2,
                      importance_sampling_clip_max=5.0)
    assert Correction.from_config(cfg) == Correction("token_mask", 0.2, 5.0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"importance_sampling_clip_max": 2.0}, r"importance_sampling_clip_max=2.0 bounds the weights of "
                                            r"importance_sampling_correction, which is None"),
    ({"importance_sampling_clip_min": 0.5}, r"importance_sampling_clip_min=0.5 bounds the weights"),
    ({"importance_sampling_correction": "token_mask", "truncated_importance_sampling": 2.0},
     r"importance_sampling_correction='token_mask' and truncated_importance_sampling=2.0 both weigh"),
    ({"importance_sampling_correction": "token_mask", "importance_sampling_clip_min": 2.0,
      "importance_sampling_clip_max": 1.5}, r"importance_sampling_clip_min=2.0 is not below "
                                            r"importance_sampling_clip_max=1.5"),
    ({"importance_sampling_correction": "token_truncate", "importance_sampling_clip_min": 3.0},
     r"importance_sampling_clip_min=3.0 is not below importance_sampling_clip_max=3.0 \(its default\)"),
    ({"importance_sampling_correction": "sequence_mask", "importance_sampling_level": "sequence"},
     r"importance_sampling_correction='sequence_mask' contradicts importance_sampling_level='sequence'.*"
     r"'geometric_mask'"),
    ({"importance_sampling_correction": "token_truncate", "loss": "gspo"},
     r"importance_sampling_correction='token_truncate' contradicts loss='gspo'.*'geometric_truncate'"),
    ({"use_bias_correction_kl": True}, r"use_bias_correction_kl=True weighs the beta KL loss term, and beta=0"),
])
def test_each_option_is_refused_where_it_cannot_apply(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**fields).check()


@pytest.mark.parametrize("fields", [
    {"importance_sampling_correction": "geometric_mask", "importance_sampling_level": "sequence"},
    {"importance_sampling_correction": "geometric_truncate", "loss": "gspo"},
    {"importance_sampling_correction": "sequence_mask"},  # TRL's default mode with a token-level policy ratio
    {"importance_sampling_correction": "token_mask", "importance_sampling_level": "average"},
    {"off_policy_mask_threshold": 0.5, "truncated_importance_sampling": 2.0, "precalculate_logprobs": True},
    {"use_bias_correction_kl": True, "beta": 0.1},
])
def test_combinations_that_apply_are_accepted(fields):
    TrainConfig(**fields).check()


@pytest.mark.parametrize(("options", "steps", "recomputes"), [
    (StepOptions(), 1, False), (StepOptions(), 3, False),
    (StepOptions(precalculate_logprobs=True), 1, True),  # ART's option: always
    (StepOptions(trainer_old_logprobs=True), 1, False),  # one step: the first pass's own logprobs
    (StepOptions(trainer_old_logprobs=True), 2, True),  # later steps run moved weights: recomputed first
    (StepOptions(trainer_old_logprobs=True, kl_step_mean=True, kl_source="sample"), 1, True),  # the KL pass reads old
    (StepOptions(trainer_old_logprobs=True, kl_step_mean=True), 1, False),
])
def test_when_a_call_recomputes_its_old_logprobs(options, steps, recomputes):
    assert options.recomputes(steps) is recomputes
