"""Sampled-token logprobs and entropy without the full logits tensor.

Only trainable slots need a logprob, and each needs the hidden state of the slot
that predicts it (`prev_index`, which for a completion's first token is the last
token of its group's shared prompt). We gather those hidden states, then apply
the LM head in chunks of `chunk_size` rows, each under activation checkpointing:
peak memory is chunk_size x vocab (forward and backward), not seq x vocab, and
the head runs over trainable tokens only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 1024


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           softcap: float | None, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float()  # [chunk, vocab]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [chunk, vocab]
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [chunk]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [chunk]
    return logp, entropy


def token_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden: [n, hidden] states that predict `targets` [n] -> (logprobs [n], entropy [n]) in float32."""
    weight = lm_head.weight
    bias = getattr(lm_head, "bias", None)
    logps, ents = [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for s in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[s:s + chunk_size], targets[s:s + chunk_size]
        if grad:
            lp, en = checkpoint(_chunk, h, weight, bias, t, softcap, temperature, use_reentrant=False)
        else:
            lp, en = _chunk(h, weight, bias, t, softcap, temperature)
        logps.append(lp)
        ents.append(en)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


class TokenLogprobModel(torch.nn.Module):
    """The model's part of a train forward pass as one module: backbone, then the LM head on chosen slots.

    Holding backbone and head under one parent lets a wrapper that works per module call
    (FSDP2's `fully_shard`, distributed/sharding.py) see the whole pass, tied embeddings included.
    """

    def __init__(self, backbone: torch.nn.Module, lm_head: torch.nn.Module, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.lm_head = lm_head
        self.chunk_size = chunk_size
        self.softcap = softcap

    def forward(self, input_ids: torch.Tensor, attention_mask: object, position_ids: torch.Tensor,
                rows: torch.Tensor, prev: torch.Tensor, targets: torch.Tensor, *, chunk_size: int | None = None,
                **extra: object) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, position_ids: [rows, width]; rows, prev, targets: [n] -> (logprobs [n], entropy [n]).

        `chunk_size`: tokens per LM-head chunk for this pass (None: the module's own)."""
        with record_function("artrl/forward"):
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False, **extra).last_hidden_state  # [rows, width, hidden]
        with record_function("artrl/logprobs"):
            h = hidden[rows, prev]  # [n, hidden]
            return token_logprobs(h, self.lm_head, targets, chunk_size=chunk_size or self.chunk_size,
                                  softcap=self.softcap)
