"""Per-row next-token sampling for a batch whose rows asked for different settings.

`model.generate` applies one temperature and one top-p to the whole batch; a server
batches requests that each chose their own, so this module does it row by row, in
one vectorised pass where it can:

1. temperature 0 means greedy (argmax of the raw logits), any other value divides
   the logits before the softmax;
2. top-p keeps the smallest set of most likely tokens whose probability reaches
   `top_p` (the most likely token is always kept);
3. each row draws with its own `torch.Generator`, so a seeded request samples the
   same tokens whatever else shares its batch. The draw is the exponential-race
   form of sampling, `argmax(p_i / E_i)` with `E_i ~ Exp(1)`, which picks token i
   with probability `p_i` and needs no renormalisation after top-p.

A grammar (structured outputs) acts before all of this: `mask_logits` sets the logits
of the tokens it forbids to -inf in the rows that have one, so temperature, top-p and
the draw only ever see allowed tokens; rows without a grammar are left as they are.

Logprobs reported to callers are NOT computed here: they are the raw log-softmax of
the unscaled, unmasked logits (see `serve/engine.py`).
"""

from __future__ import annotations

import torch


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator],
) -> torch.Tensor:
    """Sample one token per row.

    logits: [batch, vocab] float32; temperature, top_p: [batch] float32 on the
    same device; generators: one per row, on the same device. Returns [batch] long.
    """
    greedy = temperature <= 0  # [batch]
    greedy_tokens = logits.argmax(dim=-1)  # [batch]
    if bool(greedy.all()):
        return greedy_tokens

    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)  # [batch]
    probs = torch.softmax(logits / safe_temperature[:, None], dim=-1)  # [batch, vocab]

    if bool((top_p < 1.0).any()):
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)  # [batch, vocab] each
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [batch, vocab]
        drop_sorted = mass_before >= top_p[:, None]  # [batch, vocab]; never drops the first
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)  # [batch, vocab]
        probs = probs.masked_fill(drop, 0.0)

    race = torch.empty_like(probs)  # [batch, vocab]
    for row, generator in enumerate(generators):
        if not bool(greedy[row]):
            race[row].exponential_(1.0, generator=generator)
    race = torch.where(greedy[:, None], torch.ones_like(race), race)
    sampled = (probs / race).argmax(dim=-1)  # [batch]
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


def row_generator(device: torch.device, seed: int | None, row: int) -> torch.Generator:
    """A generator for sample `row` of a request: seeded from `(seed, row)`, or fresh entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        # Mix the row index in so the n samples of one seeded request differ.
        generator.manual_seed((seed * 0x9E3779B97F4A7C15 + row * 0xBF58476D1CE4E5B9) % (2**63))
    return generator
