"""Next-token sampling for a batch whose rows asked for different settings, in one pass on the device.

`model.generate` applies one temperature and one top-p to the whole batch; a server
batches requests that each chose their own, so this module does it row by row, in
one vectorised pass:

1. temperature 0 means greedy (argmax of the raw logits), any other value divides
   the logits before the softmax;
2. top-p keeps the smallest set of most likely tokens whose probability reaches
   `top_p` (the most likely token is always kept);
3. the draw is the exponential-race form of sampling, `argmax(p_i / E_i)` with
   `E_i ~ Exp(1)`, which picks token i with probability `p_i` and needs no
   renormalisation after top-p.

**Counter-based noise, not generators.** `E_i = -log(U_i)` where `U_i` is a hash of
(the row's 64-bit key, the row's step counter, token i), computed with integer torch
ops on the device: one batched draw per step whatever the rows' seeds, no host work
per row, and the same numbers on CPU and GPU. A row's key comes from its request's
`seed` and its sample index (`row_key`), its counter is the index of the token it is
sampling, so a seeded request samples the same tokens whatever else shares its batch
and whenever it joined it. The hash keeps every intermediate below 2**63 (32-bit
words times 27-bit constants), so no integer overflow is involved.

A grammar (structured outputs) acts before all of this: `mask_logits` sets the logits
of the tokens it forbids to -inf in the rows that have one, so temperature, top-p and
the draw only ever see allowed tokens; rows without a grammar are left as they are.

Logprobs reported to callers are NOT computed here: they are the raw log-softmax of
the unscaled, unmasked logits (see `serve/engine.py`).
"""

from __future__ import annotations

import secrets

import torch

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 27-bit odd multiplier: (2**32 - 1) * _MIX < 2**63
_STEP_SALT = 0x2545F491


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash, element-wise: int64 in [0, 2**32) -> int64 in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def row_key(seed: int | None, sample: int) -> int:
    """The 64-bit noise key of sample `sample` of a request: from `(seed, sample)`, or fresh entropy."""
    if seed is None:
        return secrets.randbits(64)
    # Mix the sample index in so the n samples of one seeded request differ.
    return (seed * 0x9E3779B97F4A7C15 + sample * 0xBF58476D1CE4E5B9 + 1) % (2**64)


def split_keys(keys: list[int], device: torch.device) -> torch.Tensor:
    """Row keys as a [batch, 2] int64 tensor of their (high, low) 32-bit words."""
    return torch.tensor([[k >> 32, k & _MASK32] for k in keys], dtype=torch.int64, device=device)


def token_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] int64: the per-token word the row noise is combined with (computed once per engine)."""
    return _mix32(torch.arange(vocab, dtype=torch.int64, device=device) * 0x9E3779B1 & _MASK32)


def exponential_noise(keys: torch.Tensor, counters: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise for every (row, token): a pure function of the row's key, its counter and the token.

    keys: [batch, 2] int64 (`split_keys`); counters: [batch] int64; tokens: [vocab] int64 (`token_hashes`).
    Returns [batch, vocab] float32, strictly positive and finite.
    """
    row = _mix32(keys[:, 0] ^ _mix32((counters * _STEP_SALT + 1) & _MASK32))  # [batch]
    row = _mix32(row ^ keys[:, 1])  # [batch]
    bits = _mix32(row[:, None] ^ tokens[None, :])  # [batch, vocab]
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # [batch, vocab], in (0, 1)
    return -torch.log(uniform)


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    noise: torch.Tensor | None,
    *,
    all_greedy: bool,
    any_top_p: bool,
) -> torch.Tensor:
    """Sample one token per row, without a host sync.

    logits: [batch, vocab] float32; temperature, top_p: [batch] float32 on the same device;
    noise: [batch, vocab] Exp(1) draws (`exponential_noise`), None when `all_greedy`.
    all_greedy / any_top_p: what the host knows of the rows (every temperature 0; some top_p < 1),
    so that the device is never asked. Returns [batch] long.
    """
    greedy_tokens = logits.argmax(dim=-1)  # [batch]
    if all_greedy:
        return greedy_tokens
    assert noise is not None
    greedy = temperature <= 0  # [batch]
    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)  # [batch]
    probs = torch.softmax(logits / safe_temperature[:, None], dim=-1)  # [batch, vocab]

    if any_top_p:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)  # [batch, vocab] each
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [batch, vocab]
        drop_sorted = mass_before >= top_p[:, None]  # [batch, vocab]; never drops the first
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)  # [batch, vocab]
        probs = probs.masked_fill(drop, 0.0)

    sampled = (probs / noise).argmax(dim=-1)  # [batch]
    return torch.where(greedy, greedy_tokens, sampled)


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
