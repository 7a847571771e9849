"""Policy-gradient and SFT losses, as sums over tokens (the caller normalises).

Notation, per trainable token t of sequence i: new_t = log pi_theta(token),
old_t = the logprob the server sampled it with, A_i = the sequence's
group-relative advantage, w_t = its loss weight, r_t = exp(new_t - old_t).

* "cispo" (default): clipped, detached importance weight times the
  REINFORCE term, so every token keeps a gradient (clipping never zeroes it):

      l_t = - sg(clip(r_t, 1 - eps, 1 + eps_high)) * A_i * new_t

* "ppo": the clipped surrogate

      l_t = - min(r_t * A_i, clip(r_t, 1 - eps, 1 + eps_high) * A_i)

* "gspo": PPO with a sequence-level ratio s_i = exp(mean_t(new_t - old_t)),
  applied per token as s_it = sg(s_i) * exp(new_t - sg(new_t)) (same value,
  token-level gradient):

      l_t = - min(s_it * A_i, clip(s_it, 1 - eps, 1 + eps_high) * A_i)

* KL penalty (beta > 0) against the reference (the base model, adapter off, or a
  checkpoint), k3 estimator:

      l_t += beta * (exp(ref_t - new_t) - (ref_t - new_t) - 1)

ART's options (types.TrainConfig; applied in ART's order):

* importance_sampling_level: r_t is the token's ratio ("token"), its sequence's
  s_i = exp(mean_t(new_t - old_t)) with the gradient flowing through the mean
  ("sequence"), (r_t + s_i) / 2 ("average") or sqrt(r_t * s_i) ("geometric_average").
* max_ratio (ART's max_negative_advantage_importance_sampling_weight): r_t = min(r_t, max).
* mask_prob_ratio: r_t = 0 outside (1 - eps, 1 + eps_high).
* kimi_k2_tau: A_t = A_i - tau * sg(new_t - old_t).
* kl_penalty_coef (ART's KL-penalised advantage, not a loss term): with
  kl_t = sg(new_t - ref_t) and m = its mean over the optimizer step,
  A_t += coef * (m - kl_t): a token that drifts further from the reference than
  the average gets less advantage, one that drifts less gets more (zero-mean).
* kl_penalty_source="sample" (ART 0.5.23): kl_t = sg(old_t - ref_t) instead, the
  rollout policy's distance from the reference.
* truncated_importance_sampling: l_t *= sg(min(q_t, c)), q_t = exp(old_t - original_t),
  when the old logprobs were recomputed by the trainer (precalculate_logprobs;
  original = the sampled ones). Without them there is no trainer/sampler ratio and, as
  in ART 0.5.23, the option is skipped, with one notice per process. It is the
  correction "token_truncate" with no lower bound and c as the upper one (below).

artrl's off-policy options beyond ART (train/offpolicy.py has the formulas, `Correction`):
importance_sampling_correction weighs l_t by the bounded trainer/sampler ratio of the token,
its sequence or their geometric mean, truncated or masked (the trainer then hands the
trainer's own logprobs as old and the sampled ones as original, as precalculate_logprobs does);
off_policy_mask_threshold drops negative-advantage sequences too far from the sampler;
use_bias_correction_kl weighs the beta term by exp(new_t - sampled_t). Applied after ART's
options, to the policy term only (the KL term is added after, as in TRL).

As ART 0.5.23: tokens without a finite old logprob (none sampled: nan; or -inf, inf)
use old_t = sg(new_t), i.e. ratio 1 (on-policy); the tokenizer lets them through only
when the user allows. Each log-ratio (token and sequence) is clamped to [-20, 20]
([-10, 10] in float16) before exp, so one far-off token cannot overflow the ratio;
outside the clamp its ratio is constant, with no gradient through it.

Off-policy figures (ART 0.5.23's `loss/importance_ratio_{mean,p95,p99}`,
`loss/clipped_token_fraction`): over the tokens of non-zero weight, the ratio after the
importance-sampling level and before max_ratio / mask_prob_ratio; a token counts as
clipped when its ratio is outside [1 - eps, 1 + eps_high] (CISPO), or, for the PPO-shaped
losses, only on the side where the clip binds (A > 0 above, A < 0 below). The
percentiles come from a histogram of RATIO_EDGES (log-spaced 1e-4 .. 1e4), interpolated
within the bucket, as ART reads them; histograms of micro-batches and ranks add up.

What we simplify: no value function, no length normalisation inside a sequence.
The returned values are sums of w_t * l_t; the trainer (train/trainer.py,
`accumulate`) divides them by the optimizer step's total weight, never per
micro-batch, so the gradient does not depend on how the step's rows are split
into forward passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.notices import notice_once
from .offpolicy import Correction, importance_weights, log_ratio_to_sampler, off_policy_keep, sequence_totals

# The importance-ratio histogram (ART 0.5.23's bucket edges): bucket 0 holds r <= 1e-4, bucket k holds
# EDGES[k-1] < r <= EDGES[k], the last one r > 1e4.
RATIO_EDGES = torch.logspace(-4, 4, steps=257, dtype=torch.float64)  # [257]
RATIO_BUCKETS = RATIO_EDGES.numel() + 1
LOG_RATIO_BOUND, LOG_RATIO_BOUND_FP16 = 20.0, 10.0


@dataclass
class LossTerms:
    """A micro-batch's loss and figures. The figures stay 0-d detached tensors on the loss's device, so the
    trainer adds them up without a host sync per micro-batch (it reads them once per optimizer step); the
    float properties read one (for callers outside the training loop)."""

    loss_sum: torch.Tensor  # scalar, sum of w_t * l_t (with grad)
    sums: dict[str, torch.Tensor]  # detached scalars: weight, policy, kl, entropy, clipped, ratio, kl_ref, ...
    ratio_histogram: torch.Tensor | None = field(default=None)  # [RATIO_BUCKETS] token counts (RL losses only)

    def _value(self, key: str) -> float:
        return float(self.sums[key])

    @property
    def weight_sum(self) -> float:
        return self._value("weight")

    @property
    def policy_sum(self) -> float:
        return self._value("policy")

    @property
    def kl_sum(self) -> float:
        return self._value("kl")

    @property
    def entropy_sum(self) -> float:
        return self._value("entropy")

    @property
    def clipped_tokens(self) -> float:
        return self._value("clipped")

    @property
    def ratio_sum(self) -> float:
        return self._value("ratio")

    @property
    def kl_ref_sum(self) -> float:  # sum of w_t * (new_t - ref_t): ART's kl_policy_ref once divided by weight_sum
        return self._value("kl_ref")


def sequence_mean(values: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence mean of `values` ([n] -> [n]); the gradient flows through the mean."""
    sums, counts, inv = sequence_totals(values, sequence_ids)  # [seqs], [seqs], [n]
    return (sums / counts)[inv]  # [n]


def policy_loss(
    new: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    sequence_ids: torch.Tensor,
    entropy: torch.Tensor,
    *,
    kind: str = "cispo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    max_ratio: float | None = None,
    mask_prob_ratio: bool = False,
    kimi_k2_tau: float | None = None,
    kl_penalty_coef: float = 0.0,
    kl_mean: float | None = None,
    truncated_importance_sampling: float | None = None,
    original: torch.Tensor | None = None,
    kl_source: str = "current_learner",
    correction: Correction | None = None,
) -> LossTerms:
    """All tensors are [n] over the micro-batch's trainable tokens; see the module docstring.

    `kl_mean` is the mean of kl_t over the optimizer step (None: over these tokens), kl_t = sg(new - ref), or
    sg(old - ref) with `kl_source="sample"`;
    `original` holds the sampled logprobs when `old` was recomputed (precalculate_logprobs) or is the trainer's
    own (a `correction` with a mode: then required); `correction`: artrl's off-policy options.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    sampled_record = original if original is not None else old  # [n], the token record's (nan: none)
    old = torch.where(torch.isfinite(old), old, new.detach())  # [n]
    log_ratio = new - old  # [n]
    bound = LOG_RATIO_BOUND_FP16 if log_ratio.dtype == torch.float16 else LOG_RATIO_BOUND
    if kind == "gspo":
        # sequence ratio value, token-level gradient: sg(s_i) * exp(new_t - sg(new_t))
        seq_lr = sequence_mean(log_ratio.detach(), sequence_ids).clamp(-bound, bound)  # [n]
        ratio = torch.exp(seq_lr + new - new.detach())  # [n], value = sequence ratio
    else:
        ratio = torch.exp(log_ratio.clamp(-bound, bound))  # [n]
        if importance_sampling_level != "token":
            seq_ratio = torch.exp(sequence_mean(log_ratio, sequence_ids).clamp(-bound, bound))  # [n]
            if importance_sampling_level == "sequence":
                ratio = seq_ratio
            elif importance_sampling_level == "average":
                ratio = (ratio + seq_ratio) / 2
            elif importance_sampling_level == "geometric_average":
                ratio = ratio.sqrt() * seq_ratio.sqrt()
            else:
                raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; expected "
                                 "'token', 'sequence', 'average' or 'geometric_average'")
    raw_ratio = ratio.detach()  # [n], what the off-policy figures read
    if max_ratio:
        ratio = torch.clamp(ratio, max=max_ratio)
    if mask_prob_ratio:
        inside = (ratio > 1 - epsilon) & (ratio < 1 + eps_high)  # [n]
        ratio = torch.where(inside, ratio, torch.zeros_like(ratio))
    adv = advantages  # [n]
    if kimi_k2_tau:
        adv = adv - kimi_k2_tau * log_ratio.detach()
    kl_ref = torch.zeros_like(new)
    if ref is not None:
        source = old if kl_source == "sample" else new  # [n]
        kl_ref = (source - ref).detach()  # [n]
    if kl_penalty_coef > 0 and ref is not None:
        mean = kl_mean if kl_mean is not None else float(kl_ref[weights > 0].mean()) if bool((weights > 0).any()) \
            else 0.0
        adv = adv + kl_penalty_coef * (mean - kl_ref)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    if kind == "cispo":
        per_token = -clipped.detach() * adv * new
    elif kind in ("ppo", "gspo"):
        per_token = -torch.minimum(ratio * adv, clipped * adv)
    else:
        raise ValueError(f"unknown loss {kind!r}; expected 'cispo', 'ppo' or 'gspo'")
    if truncated_importance_sampling:
        if original is not None:
            sampled = torch.where(torch.isnan(original), new.detach(), original)  # [n]
            per_token = per_token * importance_weights(old - sampled, sequence_ids, "token_truncate", None,
                                                       truncated_importance_sampling)  # trainer / sampler, capped
        else:
            notice_once("loss.truncated_importance_sampling", f"truncated_importance_sampling="
                        f"{truncated_importance_sampling} is skipped: without precalculate_logprobs=True there are "
                        "no trainer-recomputed logprobs to compare with the sampled ones (as in ART 0.5.23).")
    opsm_masked = weights.new_zeros(())
    if correction is not None and correction.mode is not None:
        if original is None:
            raise ValueError(f"importance_sampling_correction={correction.mode!r} needs the trainer's logprobs as "
                             "`old` and the sampled ones as `original` (train/trainer.py hands both)")
        per_token = per_token * importance_weights(log_ratio_to_sampler(old, original), sequence_ids,
                                                   correction.mode, correction.clip_min, correction.clip_max)
    if correction is not None and correction.mask_threshold is not None:
        keep = off_policy_keep(new, sampled_record, advantages, sequence_ids, correction.mask_threshold)  # [n]
        per_token = per_token * keep
        opsm_masked = ((keep == 0) & (weights != 0)).sum().to(weights.dtype)
    kl = torch.zeros_like(new)
    if beta > 0 and ref is not None:
        d = ref - new
        kl = torch.exp(d) - d - 1  # [n], k3 estimator, >= 0
        if correction is not None and correction.bias_correction_kl:
            # drawn from the sampler: weigh by pi / mu (with its gradient) for an unbiased KL(pi || ref)
            to_sampler = new - new.detach() + log_ratio_to_sampler(new, sampled_record)  # [n], value l_t
            kl = kl * torch.exp(to_sampler.clamp(-bound, bound))
    total = per_token + beta * kl
    with torch.no_grad():
        sums = dict(
            weight=weights.sum(),
            policy=(weights * per_token).sum(),
            kl=(weights * kl).sum(),
            entropy=(weights * entropy).sum(),
            clipped=((ratio != clipped) & (weights > 0)).sum().to(weights.dtype),
            ratio=(weights * ratio).sum(),
            kl_ref=(weights * kl_ref).sum(),
            opsm_masked=opsm_masked,
        )
        live = weights != 0  # [n]
        r = raw_ratio[live].to(torch.float64)  # [live]
        if kind == "cispo":
            off = (r < 1 - epsilon) | (r > 1 + eps_high)  # [live]
        else:
            a = adv.detach()[live]  # [live]
            off = ((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 1 - epsilon))
        sums.update(ratio_tokens=live.sum().to(weights.dtype), ratio_raw=r.sum().to(weights.dtype),
                    ratio_clipped=off.sum().to(weights.dtype))
        histogram = ratio_histogram(r)
    return LossTerms(loss_sum=(weights * total).sum(), sums=sums, ratio_histogram=histogram)


def ratio_histogram(ratios: torch.Tensor) -> torch.Tensor:
    """Token counts per bucket of RATIO_EDGES ([n] -> [RATIO_BUCKETS], float64, on `ratios`' device)."""
    edges = RATIO_EDGES.to(ratios.device)
    buckets = torch.bucketize(ratios.to(torch.float64), edges)  # [n], 0 .. 257
    return torch.bincount(buckets, minlength=RATIO_BUCKETS).to(torch.float64)


def histogram_quantile(counts: list[float], q: float) -> float:
    """The q-quantile of a RATIO_EDGES histogram (0 for an empty one), linear within its bucket.

    Bucket 0 spans [0, 1e-4], the last one is read as ending at 1e4 (a ratio beyond it reports 1e4)."""
    total = sum(counts)
    if total <= 0:
        return 0.0
    target, below = total * q, 0.0
    edges = RATIO_EDGES.tolist()
    for k, c in enumerate(counts):
        if below + c >= target or k == len(counts) - 1:
            lo = 0.0 if k == 0 else edges[k - 1]
            hi = edges[min(k, len(edges) - 1)]
            return lo + (hi - lo) * min(max((target - below) / max(c, 1.0), 0.0), 1.0)
        below += c
    raise AssertionError("unreachable")


def sft_loss(new: torch.Tensor, weights: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    """Negative log-likelihood of the assistant tokens: l_t = -new_t."""
    with torch.no_grad():
        zero = weights.new_zeros(())
        sums = dict(weight=weights.sum(), policy=-(weights * new).sum(), kl=zero, entropy=(weights * entropy).sum(),
                    clipped=zero, ratio=weights.sum(), kl_ref=zero)
    return LossTerms(loss_sum=-(weights * new).sum(), sums=sums)
