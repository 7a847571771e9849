"""Prefix-sharing attention masks for packed rows.

A row holds nodes (preprocess/pack.py): a group's shared prompt, and
completions that follow it. Query slot q may attend key slot k iff

    k <= q  and  (segment[k] == segment[q]  or  segment[k] == parent[q])

i.e. causal within its own node, plus the whole of its group's prompt (which
precedes it in the row). Padding slots (segment -1) see only earlier padding, so
no softmax row is empty and no real token ever sees padding.

Two forms of the same rule:
* `dense_mask`: a boolean [batch, 1, seq, seq] tensor for SDPA
  (`attn_implementation="sdpa"`; memory grows with seq^2 per row), or its
  additive float form for the eager implementation. The CPU default is neither:
  tree attention (models/tree_attention.py) runs one SDPA call per node and
  builds no seq x seq mask.
* `block_mask`: a `flex_attention` BlockMask (GPU), built from the same rule
  as a mask_mod; blocks that no query sees are skipped, so memory and compute
  follow the tree, not seq^2.
"""

from __future__ import annotations

import torch


def dense_mask(segment_ids: torch.Tensor, parent_ids: torch.Tensor) -> torch.Tensor:
    """Boolean visibility, True = may attend. segment_ids, parent_ids: [batch, seq] -> [batch, 1, seq, seq]."""
    seq = segment_ids.shape[1]
    idx = torch.arange(seq, device=segment_ids.device)
    causal = idx[:, None] >= idx[None, :]  # [seq(q), seq(k)]
    k_seg = segment_ids[:, None, :]  # [batch, 1, seq(k)]
    same = k_seg == segment_ids[:, :, None]  # [batch, seq(q), seq(k)]
    prompt = k_seg == parent_ids[:, :, None]  # [batch, seq(q), seq(k)]
    return ((same | prompt) & causal)[:, None]  # [batch, 1, seq, seq]


def additive_mask(segment_ids: torch.Tensor, parent_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense rule as an additive float mask (0 visible, dtype-min hidden) for eager attention."""
    visible = dense_mask(segment_ids, parent_ids)
    out = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return out.masked_fill_(~visible, torch.finfo(dtype).min)


def block_mask(segment_ids: torch.Tensor, parent_ids: torch.Tensor, block_size: int = 128):
    """flex_attention BlockMask for the same rule (for attn_implementation='flex_attention')."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg = segment_ids
    par = parent_ids

    def mask_mod(b, h, q_idx, kv_idx):
        k_seg = seg[b, kv_idx]
        return (kv_idx <= q_idx) & ((k_seg == seg[b, q_idx]) | (k_seg == par[b, q_idx]))

    batch, length = seg.shape
    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=length, KV_LEN=length, device=seg.device,
                             BLOCK_SIZE=block_size)


def attention_mask_for(attn_implementation: str, segment_ids: torch.Tensor, parent_ids: torch.Tensor,
                       dtype: torch.dtype):
    """The mask object the model's attention implementation expects."""
    if attn_implementation == "flex_attention":
        return block_mask(segment_ids, parent_ids)
    if attn_implementation == "eager":
        return additive_mask(segment_ids, parent_ids, dtype)
    return dense_mask(segment_ids, parent_ids)
