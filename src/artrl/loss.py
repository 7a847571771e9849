"""ART's `art.loss`: `loss_fn` over ART's packed tensors, computed by artrl's own loss (train/loss.py).

ART's trainer calls `loss_fn(LossInputs(inputs=packed), new_logprobs, ref_logprobs, entropies,
experimental_config, reduction)` on `[batch, seq]` tensors: `inputs` holds the packed rows
(`assistant_mask`, `logprobs`, `advantages`, `weights`, `group_ids`, optionally `original_logprobs`),
each at the position of its token, while `new_logprobs` / `ref_logprobs` hold at position t the
logprob of token t + 1 (the model's prediction from t). `align_inputs` therefore shifts the
inputs one position left (`shift_tensor`), which is all this module adds; the math is
`artrl.train.loss.policy_loss`, run on the aligned assistant tokens:

* `experimental_config` (ART's `dev.TrainConfig` keys) maps onto its arguments: `ppo` -> the
  PPO surrogate (else CISPO), `epsilon` / `epsilon_high` with ART's defaults (PPO: 0.2, and
  epsilon; CISPO: 1.0 and 4.0), `importance_sampling_level`, `max_negative_advantage_importance_sampling_weight`,
  `mask_prob_ratio`, `kimi_k2_tau`, `kl_penalty_coef`, `kl_penalty_source`, `truncated_importance_sampling`.
* As in ART's `loss_fn`, the KL mean is over this call's assistant tokens (artrl's trainer takes it over
  the whole optimizer step), and `reduction="mean"` divides by the number of assistant tokens ("sum":
  by 1); `kl_policy_ref` is that mean, present only when the penalty is on and a reference is given.
* Tokens outside the assistant mask never enter the arithmetic, so a NaN there has no effect on the
  loss or its gradient.

`probs_corr` (the correlation of sampled and new token probabilities) and `offpolicy_diagnostics` (the
importance-ratio sums and histogram, `train/loss.RATIO_EDGES`) are reported as in ART.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from .train.loss import policy_loss

__all__ = ["AlignedLossInputs", "Loss", "LossInputs", "LossOffPolicyDiagnostics", "compute_probs_corr", "loss_fn",
           "shift_tensor"]


def shift_tensor(tensor: torch.Tensor, pad: int | float | bool) -> torch.Tensor:
    """`tensor` ([batch, seq]) moved one position left, `pad` in the last column."""
    tail = torch.full_like(tensor[:, :1], pad)  # [batch, 1]
    return torch.cat([tensor[:, 1:], tail], dim=1)  # [batch, seq]


class LossOffPolicyDiagnostics(BaseModel):
    """Importance-ratio figures of the call's trainable tokens (ART's names)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    ratio_sum: torch.Tensor
    clipped_count: torch.Tensor
    token_count: torch.Tensor
    ratio_histogram: torch.Tensor


class Loss(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    reduction: Literal["mean", "sum"]
    policy_loss: torch.Tensor
    entropy: torch.Tensor | None
    policy_loss_sum: torch.Tensor
    probs_corr: torch.Tensor
    kl_policy_ref: torch.Tensor | None = None
    offpolicy_diagnostics: LossOffPolicyDiagnostics | None = None


class AlignedLossInputs(BaseModel):
    """Inputs already at the positions of `new_logprobs` ([batch, seq] each)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    assistant_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    group_ids: torch.Tensor
    original_logprobs: torch.Tensor | None = None
    entropies_are_aligned: bool = False

    def align_inputs(self) -> "AlignedLossInputs":
        return self

    def aligned_entropies(self, entropies: torch.Tensor | None) -> torch.Tensor | None:
        if entropies is None or self.entropies_are_aligned:
            return entropies
        return shift_tensor(entropies, 0.0)


class LossInputs(BaseModel):
    """ART's packed rows (a mapping of [batch, seq] tensors), each value at its own token's position."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inputs: Any

    def align_inputs(self) -> AlignedLossInputs:
        x = self.inputs
        return AlignedLossInputs(
            assistant_mask=shift_tensor(x["assistant_mask"], False),
            old_logprobs=shift_tensor(x["logprobs"], float("nan")),
            advantages=shift_tensor(x["advantages"], 0.0),
            weights=shift_tensor(x["weights"], 0.0),
            group_ids=shift_tensor(x["group_ids"], 0),
            original_logprobs=shift_tensor(x["original_logprobs"], 0.0) if "original_logprobs" in x else None,
        )


def compute_probs_corr(old_logprobs: torch.Tensor, new_logprobs: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of exp(old) and exp(new) over the tokens where both are finite; 0 when fewer than two
    or either side is constant."""
    both = torch.isfinite(old_logprobs) & torch.isfinite(new_logprobs)
    old_p, new_p = old_logprobs[both].exp(), new_logprobs[both].exp()  # [k]
    zero = new_logprobs.new_zeros(())
    if old_p.numel() < 2:
        return zero
    old_sd, new_sd = old_p.std(unbiased=False), new_p.std(unbiased=False)
    if not (bool(torch.isfinite(old_sd)) and bool(torch.isfinite(new_sd))) or old_sd.item() == 0 or new_sd.item() == 0:
        return zero
    return torch.corrcoef(torch.stack([old_p, new_p]))[0, 1]


def loss_fn(inputs: LossInputs | AlignedLossInputs, new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
            entropies: torch.Tensor | None, experimental_config: Mapping[str, Any],
            reduction: Literal["mean", "sum"] = "mean") -> Loss:
    """ART's loss over [batch, seq] tensors (module docstring), computed by `train.loss.policy_loss`."""
    cfg = experimental_config
    a = inputs.align_inputs()
    mask = a.assistant_mask.to(torch.bool)  # [batch, seq]
    new = new_logprobs[mask]  # [n], only the assistant tokens (NaN elsewhere never enters)
    old = a.old_logprobs[mask].to(new.dtype)  # [n]
    ref = ref_logprobs[mask].to(new.dtype) if ref_logprobs is not None else None  # [n]
    weights = a.weights[mask].to(new.dtype)  # [n]
    ent_all = a.aligned_entropies(entropies)
    entropy = ent_all[mask].to(new.dtype) if ent_all is not None else torch.zeros_like(new)  # [n]
    original = a.original_logprobs[mask].to(new.dtype) if a.original_logprobs is not None else None  # [n]

    ppo = bool(cfg.get("ppo", False))
    epsilon = cfg.get("epsilon", 0.2 if ppo else 1.0)
    epsilon_high = cfg.get("epsilon_high", None if ppo else 4.0)
    coef = float(cfg.get("kl_penalty_coef", 0.0) or 0.0)
    source = cfg.get("kl_penalty_source", "current_learner")
    if source not in ("current_learner", "sample"):
        raise ValueError(f"kl_penalty_source={source!r}; expected 'current_learner' or 'sample'")
    kl_mean = None
    if coef > 0 and ref is not None:  # ART: the mean over this call's assistant tokens, whatever their weight
        filled_old = torch.where(torch.isfinite(old), old, new.detach())  # [n]
        kl_mean = ((filled_old if source == "sample" else new).detach() - ref).sum() / (new.numel() + 1e-18)
    terms = policy_loss(
        new, old, a.advantages[mask].to(new.dtype), weights, a.group_ids[mask], entropy,
        kind="ppo" if ppo else "cispo", epsilon=epsilon, epsilon_high=epsilon_high, ref=ref,
        importance_sampling_level=cfg.get("importance_sampling_level", "token"),
        max_ratio=cfg.get("max_negative_advantage_importance_sampling_weight"),
        mask_prob_ratio=bool(cfg.get("mask_prob_ratio", False)), kimi_k2_tau=cfg.get("kimi_k2_tau"),
        kl_penalty_coef=coef, kl_mean=kl_mean,
        truncated_importance_sampling=cfg.get("truncated_importance_sampling"), original=original,
        kl_source=source)
    denominator = 1.0 if reduction == "sum" else new.numel() + 1e-18
    old_for_corr = torch.where(mask, a.old_logprobs.to(new_logprobs.dtype), float("nan"))  # [batch, seq]
    s = terms.sums
    return Loss(
        reduction=reduction,
        policy_loss=terms.loss_sum / denominator,
        entropy=(entropy * weights).sum() / denominator if ent_all is not None else None,
        policy_loss_sum=terms.loss_sum,
        probs_corr=compute_probs_corr(old_for_corr, torch.where(mask, new_logprobs, 0.0)),
        kl_policy_ref=kl_mean,
        offpolicy_diagnostics=LossOffPolicyDiagnostics(
            ratio_sum=s["ratio_raw"], clipped_count=s["ratio_clipped"], token_count=s["ratio_tokens"],
            ratio_histogram=terms.ratio_histogram.to(torch.float32)),
    )
