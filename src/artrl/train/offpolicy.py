"""Off-policy corrections beyond ART's, and the sampler/trainer mismatch every RL call measures.

Notation, per trainable token t of sequence i: s_t = the token record's sampled logprob (an in-flight reply
carries each token's own, from the version that sampled it), p_t = the trainer's logprob at the weights the
call starts from, l_t = p_t - s_t and rho_t = exp(l_t) the trainer/sampler ratio. One ratio covers every
cause of mismatch: other kernels (vLLM, bf16 or 4-bit compute), a stale policy version, in-flight spans.
A token without a sampled logprob has l_t = 0 (ratio 1: on-policy, as everywhere in artrl).

Three ratios of the same logprobs, each checked against the bounds [lo, hi]:

    token      rho_t
    sequence   rho_i = exp(sum_t l_t)     the product of its tokens' ratios (TRL's sequence_* modes)
    geometric  g_i   = exp(mean_t l_t)    the length-normalised one (ART's / GSPO's sequence ratio)

`importance_sampling_correction` (types.TrainConfig) picks one ratio and what happens outside the bounds:

    <level>_truncate:  loss_t *= sg(clip(ratio, lo, hi))             (lo None: no lower bound)
    <level>_mask:      loss_t *= sg(ratio) if lo <= ratio <= hi else 0

A worked sequence of three tokens, l = [0.1, -0.9, 0.2], bounds [0.5, 2]: token ratios [1.11, 0.41, 1.22]
(token_mask zeroes the second token, token_truncate lifts it to 0.5); sum -0.6, sequence ratio 0.55 (kept
whole by sequence_mask); mean -0.2, geometric ratio 0.82 (kept).

With a correction on, the policy loss's old logprobs are the trainer's p_t, so its ratio new/old is the
proximal one (how far this call moved the weights) and the correction weighs the rest: new/s =
(new/p)(p/s), as ART's precalculate_logprobs + truncated_importance_sampling does (ART's option is
token_truncate with lo None and hi its value, on the same code path). Where p comes from (train/trainer.py):
a one-step call uses its own first pass (detached: the weights have not moved yet), a call of several
steps recomputes p once, without gradient, before the first step (as precalculate_logprobs).

`off_policy_mask_threshold` d (DeepSeek-V3.2's off-policy sequence masking, TRL's name): a sequence with a
negative advantage whose mean sampled-minus-current logprob, mean_t(s_t - sg(new_t)), exceeds d is left
out of the policy loss (every step, with that step's weights). `use_bias_correction_kl`: the beta k3 term
of a token is multiplied by exp(new_t - s_t), with its gradient (DeepSeek-V3.2's unbiased KL estimate:
the tokens were drawn from the sampler, not from the policy the KL is of).

The mismatch (every RL call, whatever is set; `mismatch_sums`, on the first optimizer step's own pass: no
extra forward) over the tokens that carry a sampled logprob, in docs/observability.md's names:
KL(sampler || trainer) as mean(-l_t) (k1) and mean(rho_t - 1 - l_t) (k3, never negative), chi-squared
mean(rho^2) - 1 per token and per sequence, the perplexity ratio mean_i exp(-mean_t l_t) (trainer's over
the sampler's), and the share of tokens / sequences each ratio puts outside the bounds: the correction's,
or, without one, [1 / hi, hi] with hi ART's truncated_importance_sampling or TRL's default 3. Split by the
policy age of each sequence (the call's version minus the one its rollout started on) when the call trains
more than one. Log-ratios are clamped to +-LOG_RATIO_BOUND before exp in these figures only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..types import IMPORTANCE_SAMPLING_CLIP_MAX as DEFAULT_CLIP_MAX
LOG_RATIO_BOUND = 20.0
AGE_BUCKETS = 8  # policy ages 0..6 reported apart, 7 and more together
AGE_FIELDS = ("tokens", "k1", "k3", "r2", "above", "below")
AGE_VECTOR_KEY = "mm_age"
MISMATCH_KEYS = ("mm_tokens", "mm_k1", "mm_k3", "mm_r2", "mm_token_above", "mm_token_below", "mm_sequences",
                 "mm_seq_r2", "mm_seq_above", "mm_seq_below", "mm_geo_above", "mm_geo_below", "mm_ppl",
                 "mm_opsm_sequences")
"""The first step's mismatch sums (StepTotals keys); `opsm_masked` (every step's) is the loss's."""


@dataclass(frozen=True)
class Correction:
    """A call's off-policy options (types.TrainConfig), resolved: see the module docstring."""

    mode: str | None = None  # importance_sampling_correction
    clip_min: float | None = None
    clip_max: float = DEFAULT_CLIP_MAX
    mask_threshold: float | None = None  # off_policy_mask_threshold
    bias_correction_kl: bool = False

    @classmethod
    def from_config(cls, config: Any) -> "Correction":
        hi = config.importance_sampling_clip_max
        if hi is None:
            hi = config.truncated_importance_sampling or DEFAULT_CLIP_MAX
        return cls(config.importance_sampling_correction, config.importance_sampling_clip_min, hi,
                   config.off_policy_mask_threshold, config.use_bias_correction_kl)

    @property
    def bounds(self) -> tuple[float, float]:
        """What the mismatch figures measure against: [clip_min, clip_max], clip_min 1 / clip_max when unset."""
        return (self.clip_min if self.clip_min is not None else 1.0 / self.clip_max), self.clip_max


def sequence_totals(values: torch.Tensor, sequence_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """Per-sequence sums and token counts of `values` ([n] -> [seqs], [seqs]) and each token's sequence ([n])."""
    uniq, inv = torch.unique(sequence_ids, return_inverse=True)  # [seqs], [n]
    seqs = len(uniq)
    counts = values.new_zeros(seqs).index_add_(0, inv, torch.ones_like(values))  # [seqs]
    sums = values.new_zeros(seqs).index_add(0, inv, values)  # [seqs]
    return sums, counts, inv


def log_ratio_to_sampler(trainer: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """l_t = trainer - sampled logprob, 0 where the token has no (finite) sampled logprob ([n], detached)."""
    known = torch.isfinite(sampled)
    return torch.where(known, trainer.detach() - torch.where(known, sampled, 0.0), 0.0)


def importance_weights(log_ratio: torch.Tensor, sequence_ids: torch.Tensor, mode: str, lo: float | None,
                       hi: float | None) -> torch.Tensor:
    """The detached per-token weight of correction `mode` ([n]): the token's, its sequence's or the geometric
    ratio of `log_ratio`, truncated to or masked outside [lo, hi] (None: unbounded on that side)."""
    level, _, action = mode.partition("_")
    lr = log_ratio.detach()
    if level == "token":
        ratio = torch.exp(lr)  # [n]
    else:
        sums, counts, inv = sequence_totals(lr, sequence_ids)
        ratio = torch.exp(sums if level == "sequence" else sums / counts)[inv]  # [n]
    if action == "truncate":
        return torch.clamp(ratio, min=lo, max=hi)
    inside = torch.ones_like(ratio, dtype=torch.bool)
    if lo is not None:
        inside &= ratio >= lo
    if hi is not None:
        inside &= ratio <= hi
    return torch.where(inside, ratio, torch.zeros_like(ratio))


def off_policy_keep(new: torch.Tensor, sampled: torch.Tensor, advantages: torch.Tensor,
                    sequence_ids: torch.Tensor, threshold: float) -> torch.Tensor:
    """1 for the tokens DeepSeek-V3.2's off-policy sequence mask keeps, 0 for those of a sequence with a negative
    advantage and mean(sampled - new) > threshold ([n], detached)."""
    sums, counts, inv = sequence_totals(-log_ratio_to_sampler(new, sampled), sequence_ids)
    drop = (advantages.detach() < 0) & ((sums / counts)[inv] > threshold)  # [n]
    return (~drop).to(new.dtype)


def mismatch_sums(totals: Any, trainer: torch.Tensor, sampled: torch.Tensor, advantages: torch.Tensor,
                  weights: torch.Tensor, sequence_ids: torch.Tensor, *, bounds: tuple[float, float],
                  threshold: float | None = None, sequence_ages: torch.Tensor | None = None) -> None:
    """Add one micro-batch's mismatch sums (MISMATCH_KEYS, and the AGE_VECTOR_KEY vector) to `totals`.

    All tensors are [n] over its trainable tokens; `trainer` are the logprobs at the call's starting weights,
    `sampled` the record's (nan where none), `sequence_ages` the policy age of every sequence of the call by its
    global id (-1: unknown). Nothing is read on the host."""
    lo, hi = bounds
    with torch.no_grad():
        f64 = torch.float64
        lr = log_ratio_to_sampler(trainer.to(f64), sampled.to(f64))  # [n]
        known = torch.isfinite(sampled) & (weights != 0)  # [n]
        lc = lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        r = torch.exp(lc)  # [n]
        zero = torch.zeros_like(lr)
        per_token = {"tokens": known.to(f64), "k1": torch.where(known, -lr, zero),
                     "k3": torch.where(known, r - 1 - lc, zero), "r2": torch.where(known, r * r, zero),
                     "above": (known & (r > hi)).to(f64), "below": (known & (r < lo)).to(f64)}
        for field, key in zip(AGE_FIELDS, ("mm_tokens", "mm_k1", "mm_k3", "mm_r2", "mm_token_above",
                                           "mm_token_below")):
            totals.add(key, per_token[field].sum())
        sums, counts, inv = sequence_totals(lr, sequence_ids)  # [seqs], [seqs], [n]
        has = sums.new_zeros(sums.shape).index_add_(0, inv, known.to(f64)) > 0  # [seqs]: measured sequences
        seq = torch.exp(sums.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # [seqs]
        mean = sums / counts  # [seqs]
        geo = torch.exp(mean.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # [seqs]
        totals.add("mm_sequences", has.sum())
        totals.add("mm_seq_r2", torch.where(has, seq * seq, 0.0).sum())
        totals.add("mm_seq_above", (has & (seq > hi)).sum())
        totals.add("mm_seq_below", (has & (seq < lo)).sum())
        totals.add("mm_geo_above", (has & (geo > hi)).sum())
        totals.add("mm_geo_below", (has & (geo < lo)).sum())
        totals.add("mm_ppl", torch.where(has, torch.exp((-mean).clamp(max=LOG_RATIO_BOUND)), 0.0).sum())
        if threshold is not None:
            negative = sums.new_zeros(sums.shape).index_add_(0, inv, (advantages.detach() < 0).to(f64)) > 0
            totals.add("mm_opsm_sequences", (has & negative & (-mean > threshold)).sum())
        if sequence_ages is not None:
            age = sequence_ages.to(sequence_ids.device)[sequence_ids.clamp(min=0)]  # [n]
            ok = (age >= 0) & (sequence_ids >= 0)
            bucket = age.clamp(0, AGE_BUCKETS - 1)  # [n]
            table = lr.new_zeros(AGE_BUCKETS, len(AGE_FIELDS))  # [buckets, fields]
            values = torch.stack([torch.where(ok, per_token[f], zero) for f in AGE_FIELDS], -1)  # [n, fields]
            totals.add_vector(AGE_VECTOR_KEY, table.index_add_(0, bucket, values).flatten())


def mismatch_metrics(totals: dict[str, float], ages: list[float], *, bounds: tuple[float, float],
                     threshold: float | None = None) -> dict[str, float]:
    """The first step's `offpolicy/...` figures from its sums (module docstring; docs/observability.md).
    `ages`: the AGE_VECTOR_KEY vector ([AGE_BUCKETS x AGE_FIELDS], flat). Empty when no token was measured."""
    n = totals["mm_tokens"]
    if not n:
        return {}
    seqs = max(totals["mm_sequences"], 1.0)
    out = {"offpolicy/sampler_kl": totals["mm_k1"] / n, "offpolicy/sampler_kl_k3": totals["mm_k3"] / n,
           "offpolicy/chi2_token": totals["mm_r2"] / n - 1.0, "offpolicy/chi2_sequence": totals["mm_seq_r2"] / seqs - 1,
           "offpolicy/ppl_ratio": totals["mm_ppl"] / seqs,
           "offpolicy/token_above_max": totals["mm_token_above"] / n,
           "offpolicy/token_below_min": totals["mm_token_below"] / n,
           "offpolicy/sequence_above_max": totals["mm_seq_above"] / seqs,
           "offpolicy/sequence_below_min": totals["mm_seq_below"] / seqs,
           "offpolicy/geometric_above_max": totals["mm_geo_above"] / seqs,
           "offpolicy/geometric_below_min": totals["mm_geo_below"] / seqs,
           "offpolicy/clip_min": bounds[0], "offpolicy/clip_max": bounds[1], "offpolicy/mismatch_tokens": n}
    if threshold is not None:
        out["offpolicy/off_policy_masked_sequences"] = totals["mm_opsm_sequences"] / seqs
    k = len(AGE_FIELDS)
    rows = {a: dict(zip(AGE_FIELDS, ages[a * k:(a + 1) * k])) for a in range(AGE_BUCKETS)}
    present = [a for a, row in rows.items() if row["tokens"] > 0]
    if len(present) > 1:  # the call trains more than one policy version: each age apart
        for a in present:
            row, m = rows[a], rows[a]["tokens"]
            out.update({f"offpolicy/age{a}/tokens": m, f"offpolicy/age{a}/sampler_kl": row["k1"] / m,
                        f"offpolicy/age{a}/sampler_kl_k3": row["k3"] / m,
                        f"offpolicy/age{a}/chi2_token": row["r2"] / m - 1.0,
                        f"offpolicy/age{a}/token_above_max": row["above"] / m,
                        f"offpolicy/age{a}/token_below_min": row["below"] / m})
    return out
