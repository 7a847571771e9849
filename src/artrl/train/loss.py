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

* KL penalty (beta > 0) against the base model (adapter off), k3 estimator:

      l_t += beta * (exp(ref_t - new_t) - (ref_t - new_t) - 1)

Tokens without a sampled logprob (old_t = nan) use old_t = sg(new_t), i.e.
ratio 1 (on-policy); the tokenizer lets them through only when the user allows.

What we simplify: no value function, no per-token advantages (all tokens of a
sequence share A_i), no length normalisation inside a sequence. The returned
values are sums of w_t * l_t; the trainer (train/trainer.py, `accumulate`)
divides them by the optimizer step's total weight, never per micro-batch, so the gradient does not depend on how the
step's rows are split into forward passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossTerms:
    loss_sum: torch.Tensor  # scalar, sum of w_t * l_t (with grad)
    weight_sum: float
    policy_sum: float
    kl_sum: float
    entropy_sum: float
    clipped_tokens: float
    ratio_sum: float


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
) -> LossTerms:
    """All inputs are [n] over the micro-batch's trainable tokens."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    old = torch.where(torch.isnan(old), new.detach(), old)  # [n]
    log_ratio = new - old  # [n]
    if kind == "gspo":
        # mean log-ratio per sequence, broadcast back to its tokens
        uniq, inv = torch.unique(sequence_ids, return_inverse=True)
        counts = new.new_zeros(len(uniq)).index_add_(0, inv, torch.ones_like(new))  # [seqs]
        seq_lr = new.new_zeros(len(uniq)).index_add_(0, inv, log_ratio.detach()) / counts  # [seqs]
        ratio = torch.exp(seq_lr[inv] + new - new.detach())  # [n], value = sequence ratio
    else:
        ratio = torch.exp(log_ratio)  # [n]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    if kind == "cispo":
        per_token = -clipped.detach() * advantages * new
    elif kind in ("ppo", "gspo"):
        per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    else:
        raise ValueError(f"unknown loss {kind!r}; expected 'cispo', 'ppo' or 'gspo'")
    kl = torch.zeros_like(new)
    if beta > 0 and ref is not None:
        d = ref - new
        kl = torch.exp(d) - d - 1  # [n], k3 estimator, >= 0
    total = per_token + beta * kl
    return LossTerms(
        loss_sum=(weights * total).sum(),
        weight_sum=float(weights.sum()),
        policy_sum=float((weights * per_token).sum().detach()),
        kl_sum=float((weights * kl).sum().detach()),
        entropy_sum=float((weights * entropy).sum().detach()),
        clipped_tokens=float(((ratio.detach() != clipped.detach()) & (weights > 0)).sum()),
        ratio_sum=float((weights * ratio.detach()).sum()),
    )


def sft_loss(new: torch.Tensor, weights: torch.Tensor, entropy: torch.Tensor) -> LossTerms:
    """Negative log-likelihood of the assistant tokens: l_t = -new_t."""
    return LossTerms(
        loss_sum=-(weights * new).sum(),
        weight_sum=float(weights.sum()),
        policy_sum=float(-(weights * new).sum().detach()),
        kl_sum=0.0,
        entropy_sum=float((weights * entropy).sum().detach()),
        clipped_tokens=0.0,
        ratio_sum=float(weights.sum()),
    )
