"""Next-token sampling for a batch whose rows asked for different settings, in one pass on the device.

`model.generate` applies one temperature and one top-p to the whole batch; a server
batches requests that each chose their own, so this module does it row by row, in
one vectorised pass:

1. temperature 0 means greedy (argmax of the raw logits), any other value divides
   the logits before the softmax;
2. top-p keeps the smallest set of most likely tokens whose probability reaches
   `top_p` (the most likely token is always kept);
3. the draw is inverse-CDF sampling over the (top-p masked) probabilities, which
   picks token i with probability `p_i` and needs no renormalisation after top-p.

**Counter-based draws, not generators.** Each row draws one uniform `u` per step and
takes the token where the cumulative distribution (in vocabulary order, after
temperature and top-p) first reaches `u` (inverse-CDF sampling: token i with
probability p_i). `u` is a hash (splitmix64) of the row's 64-bit key and the index
of the token it is sampling; a row's uniforms for all its steps are computed on the
host when it joins (`row_uniforms`, vectorised) and copied to the device once, so a
step costs one gather and a few passes over the logits, with no host work per row and
no host sync. A row's key comes from its request's `seed` and its sample index
(`row_key`), so a seeded request samples the same tokens whatever else shares its
batch and whenever it joined it.

A grammar (structured outputs) acts before all of this: `mask_logits` sets the logits
of the tokens it forbids to -inf in the rows that have one, so temperature, top-p and
the draw only ever see allowed tokens; rows without a grammar are left as they are.

Logprobs reported to callers are NOT computed here: they are the raw log-softmax of
the unscaled, unmasked logits (see `serve/engines/base.py`).
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_key(seed: int | None, sample: int) -> int:
    """The 64-bit key of sample `sample` of a request: from `(seed, sample)`, or fresh entropy."""
    if seed is None:
        return secrets.randbits(64)
    # Mix the sample index in so the n samples of one seeded request differ.
    return (seed * 0x9E3779B97F4A7C15 + sample * 0xBF58476D1CE4E5B9 + 1) & _MASK64


def row_uniforms(keys: list[int], steps: int) -> torch.Tensor:
    """[len(keys), steps] float32 uniforms in (0, 1): entry (r, s) a pure function of keys[r] and s."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.array(keys, dtype=np.uint64))[:, None]  # [rows, 1]
        step = _splitmix64(np.arange(1, steps + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))  # [steps]
        bits = _splitmix64(key ^ step[None, :]) >> np.uint64(40)  # [rows, steps], 24 random bits
    return torch.from_numpy(((bits.astype(np.float64) + 0.5) / float(1 << 24)).astype(np.float32))


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor | None,
    *,
    all_greedy: bool,
    any_top_p: bool,
    any_greedy: bool = True,
    any_scaled: bool = True,
) -> torch.Tensor:
    """Sample one token per row, without a host sync.

    logits: [batch, vocab] float32; temperature, top_p, uniform: [batch] float32 on the same device
    (uniform: each row's draw for this step, None when `all_greedy`). The flags say what the host knows of
    the rows, so that the device is never asked and no work is done for nothing: every temperature is 0
    (`all_greedy`), some top_p < 1 (`any_top_p`), some temperature is 0 (`any_greedy`), some is not 1
    (`any_scaled`). Returns [batch] long.
    """
    if all_greedy:
        return logits.argmax(dim=-1)  # [batch]
    assert uniform is not None
    if any_scaled:
        greedy = temperature <= 0  # [batch]
        safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)  # [batch]
        logits = logits / safe_temperature[:, None]  # [batch, vocab]
    probs = torch.softmax(logits, dim=-1)  # [batch, vocab]

    if any_top_p:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)  # [batch, vocab] each
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [batch, vocab]
        drop_sorted = mass_before >= top_p[:, None]  # [batch, vocab]; never drops the first
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)  # [batch, vocab]
        probs = probs.masked_fill(drop, 0.0)

    cdf = probs.cumsum(dim=-1)  # [batch, vocab], in vocabulary order, non-decreasing
    target = uniform[:, None] * cdf[:, -1:]  # [batch, 1], in (0, total mass]
    sampled = torch.searchsorted(cdf, target).squeeze(-1)  # [batch]: the first token whose cdf reaches it
    if any_greedy:
        sampled = torch.where(temperature <= 0, logits.argmax(dim=-1), sampled)  # argmax of the raw logits
    return sampled


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`logits` with the tokens each grammar forbids set to -inf, in the rows that have a grammar.

    logits: [batch, vocab] float; bitmask: [len(rows), words] int32, bit j of word w
    allowing token 32w+j (a vocab past 32*words is forbidden); rows: [len(rows)] long,
    the batch rows the bitmask's rows belong to. Returns a new tensor; other rows are
    copied unchanged.
    """
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)  # [rows, words * 32]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]  # [rows, vocab]
    masked = logits.clone()  # [batch, vocab]
    masked[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return masked
