"""`artrl.loss.loss_fn` (ART's `art.loss` signature) against artrl's own loss on one small packed row.

ART's `loss_fn` takes [batch, seq] packed inputs, with each input at its token's position and the
new / reference logprobs one position earlier; `artrl.loss` aligns them and calls
`train.loss.policy_loss`. Here one six-token row is written out by hand, aligned by hand, and
the loss and its gradient compared with (1) `policy_loss` on the hand-aligned tokens and (2) ART's
formula written out term by term (CISPO and PPO, KL-penalised advantage from either source, a
zero-weight token, a NaN old logprob and NaN outside the mask). Runs on CPU, and on CUDA when present.
"""

from __future__ import annotations

import pytest
import torch

from artrl.loss import LossInputs, loss_fn, shift_tensor
from artrl.train.loss import policy_loss

NAN = float("nan")

#                 pos:   0      1      2      3      4      5
#              token:    p      p      a1     a2     a3     a4      (p: prompt, a: sampled)
ASSISTANT_MASK = [[False, False, True, True, True, True]]
SAMPLED_LOGPROBS = [[NAN, NAN, -1.6, NAN, -1.9, -0.2]]  # a2 has none: on-policy; a1: ratio e^1.2 = 3.3
ADVANTAGES = [[0.0, 0.0, 1.5, 1.5, 1.5, -0.5]]
WEIGHTS = [[0.0, 0.0, 1.0, 1.0, 0.0, 2.0]]  # a3 has weight 0
GROUP_IDS = [[1, 1, 1, 1, 1, 2]]
# the model's logprob of token t+1 at position t (the last position predicts nothing: NaN)
NEW = [[NAN, -0.4, -1.2, -1.0, -0.9, NAN]]
REF = [[NAN, -0.6, -1.0, -1.4, -0.3, NAN]]
ENTROPY_AT_TOKEN = [[0.0, 0.0, 0.5, 0.25, 1.0, 2.0]]  # ART passes entropies at token positions, unaligned


def devices() -> list:
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def packed(device: str) -> dict[str, torch.Tensor]:
    t = lambda x, dtype=torch.float32: torch.tensor(x, dtype=dtype, device=device)  # noqa: E731
    return {"tokens": t([[0] * 6], torch.long), "assistant_mask": t(ASSISTANT_MASK, torch.bool),
            "logprobs": t(SAMPLED_LOGPROBS), "advantages": t(ADVANTAGES), "weights": t(WEIGHTS),
            "group_ids": t(GROUP_IDS, torch.long), "parent_ids": t([[0] * 6], torch.long)}


def art_formula(new, old, adv, w, ref, *, ppo, coef, source, eps, eps_high):
    """ART 0.5.23's per-token loss, written out ([n] tensors over the aligned assistant tokens)."""
    old = torch.where(torch.isfinite(old), old, new.detach())
    r = torch.exp(new - old)
    if coef > 0:
        kl = ((old if source == "sample" else new).detach() - ref)
        adv = adv + coef * (kl.mean() - kl)
    clipped = torch.clip(r, 1 - eps, 1 + eps_high)
    per_token = -torch.min(r * adv, clipped * adv) if ppo else -(clipped.detach() * adv * new)
    return (per_token * w).sum()


CASES = [  # experimental_config, (ppo, epsilon, epsilon_high) as ART defaults them
    ({}, (False, 1.0, 4.0)),
    ({"kl_penalty_coef": 0.3}, (False, 1.0, 4.0)),
    ({"kl_penalty_coef": 0.3, "kl_penalty_source": "sample"}, (False, 1.0, 4.0)),
    ({"ppo": True, "kl_penalty_coef": 0.3}, (True, 0.2, 0.2)),
    ({"ppo": True, "epsilon": 0.1, "epsilon_high": 0.5}, (True, 0.1, 0.5)),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("config,defaults", CASES)
def test_loss_fn_is_artrl_policy_loss_on_the_aligned_tokens(device, config, defaults):
    inputs = packed(device)
    new = torch.tensor(NEW, device=device, requires_grad=True)  # [1, 6]
    ref = torch.tensor(REF, device=device)
    got = loss_fn(LossInputs(inputs=inputs), new, ref, torch.tensor(ENTROPY_AT_TOKEN, device=device), config)
    got.policy_loss.backward()

    # hand alignment: token t's inputs meet the logprob predicted at t - 1 (positions 1..4 here)
    pos = [1, 2, 3, 4]
    ppo, eps, eps_high = defaults
    coef, source = config.get("kl_penalty_coef", 0.0), config.get("kl_penalty_source", "current_learner")
    new2 = torch.tensor(NEW, device=device, requires_grad=True)
    row = {k: v[0, [p + 1 for p in pos]] for k, v in inputs.items()}  # [4] each
    tok_new, tok_ref = new2[0, pos], ref[0, pos]
    expected = art_formula(tok_new, row["logprobs"], row["advantages"], row["weights"], tok_ref, ppo=ppo,
                           coef=coef, source=source, eps=eps, eps_high=eps_high)
    kl_source = torch.where(torch.isfinite(row["logprobs"]), row["logprobs"], tok_new.detach()) \
        if source == "sample" else tok_new.detach()
    mean = (kl_source - tok_ref).mean()
    ours = policy_loss(tok_new, row["logprobs"], row["advantages"], row["weights"], row["group_ids"],
                       torch.zeros(4, device=device), kind="ppo" if ppo else "cispo", epsilon=eps,
                       epsilon_high=eps_high, ref=tok_ref, kl_penalty_coef=coef, kl_mean=mean, kl_source=source)
    assert torch.allclose(got.policy_loss_sum, ours.loss_sum, atol=1e-6)
    assert torch.allclose(got.policy_loss_sum, expected, atol=1e-6)
    assert torch.allclose(got.policy_loss, expected / 4, atol=1e-6)  # mean over the 4 assistant tokens
    (expected / 4).backward()
    assert torch.allclose(new.grad, new2.grad, atol=1e-6)
    assert new.grad[0, 0] == 0 and new.grad[0, 5] == 0  # outside the mask
    assert new.grad[0, 3] == 0  # a3 (weight 0) is predicted at position 3
    assert (new.grad[0, 4] != 0) == (not ppo)  # a4: A < 0 and r < 1 - eps, so PPO's clip holds it constant
    if coef > 0:
        assert torch.allclose(got.kl_policy_ref, mean, atol=1e-6)
    else:
        assert got.kl_policy_ref is None
    # entropy: aligned as the inputs are, weighted, over the assistant tokens
    assert torch.allclose(got.entropy, torch.tensor((0.5 + 0.25 + 0 * 1.0 + 2 * 2.0) / 4, device=device))


@pytest.mark.parametrize("device", devices())
def test_sum_reduction_probs_corr_and_shift(device):
    inputs = packed(device)
    new = torch.tensor(NEW, device=device)
    mean = loss_fn(LossInputs(inputs=inputs), new, None, None, {})
    total = loss_fn(LossInputs(inputs=inputs), new, None, None, {}, reduction="sum")
    assert total.reduction == "sum" and torch.allclose(total.policy_loss, mean.policy_loss * 4, atol=1e-6)
    assert mean.entropy is None
    # probs_corr: over the aligned tokens with both logprobs finite (a1, a3, a4 at positions 1, 3, 4)
    old = torch.tensor([-1.6, -1.9, -0.2]).exp()
    cur = torch.tensor([-0.4, -1.0, -0.9]).exp()
    assert torch.allclose(mean.probs_corr.cpu(), torch.corrcoef(torch.stack([old, cur]))[0, 1], atol=1e-6)
    assert shift_tensor(torch.tensor([[1, 2, 3]]), 0).tolist() == [[2, 3, 0]]
