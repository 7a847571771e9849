"""Tree attention for packed rows on CPU: SDPA per node, cost following the tree.

The dense boolean mask (train/attention.py) makes every row pay seq^2 attention even
though a completion only sees its group's prompt and itself. Here each node of
a row runs its own SDPA call: a prompt attends causally to itself; a completion
attends to [its prompt, itself] with a small boolean mask (all prompt keys, then
causal). Cost is sum over completions of |c| * (|prompt| + |c|), so long rows
holding a whole group cost no more attention than the group's sequences run
one by one, and no seq x seq mask is ever built.

It is made known to transformers as the attention implementation "artrl_tree"
by `register()`, which the model loader (models/loading.py) calls when it picks
this implementation (so it lives here, beside the loader, below the trainer); importing this module changes no global state. A forward
call that passes `artrl_tree=TreeLayout(...)` uses it; any other call
(generation with a KV cache, a plain forward) falls through to transformers' own
SDPA path, so one model object serves training and inference. The layout comes
from the packer (`PackedRows.nodes`), so nothing here walks the per-slot ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# One node of a row's tree, as slot ranges: (start, end, prompt_start, prompt_end). A completion's prompt is
# its group's shared prompt node; a prompt node, or a sequence without a shared prompt, has
# prompt_start == prompt_end == start. The packer (preprocess/pack.py) lays rows out as nodes; the attention
# here runs one call per node.
Node = tuple[int, int, int, int]


TREE_ATTENTION = "artrl_tree"


@dataclass
class TreeLayout:
    rows: list[list[Node]]  # nodes of each row, in order; slots after the last node are padding

    @classmethod
    def from_ids(cls, segment_ids: torch.Tensor, parent_ids: torch.Tensor) -> "TreeLayout":
        """The same layout derived from per-slot ids (contiguous runs of one segment id; padding -1 skipped).

        The trainer uses the packer's `nodes`; this derivation is the independent check of them.
        """
        seg = segment_ids.cpu().tolist()
        par = parent_ids.cpu().tolist()
        rows: list[list[Node]] = []
        for srow, prow in zip(seg, par):
            spans: dict[int, tuple[int, int]] = {}
            order: list[int] = []
            for i, s in enumerate(srow):
                if s < 0:
                    continue
                if s not in spans:
                    spans[s] = (i, i + 1)
                    order.append(s)
                else:
                    spans[s] = (spans[s][0], i + 1)
            nodes = []
            for s in order:
                start, end = spans[s]
                p = prow[start]
                ps, pe = spans[p] if p != s else (start, start)
                nodes.append((start, end, ps, pe))
            rows.append(nodes)
        return cls(rows)


class _PrefixedCausal(torch.autograd.Function):
    """A completion's attention on a CPU: all of its prompt's keys, then its own causally, with no mask.

    The same softmax over [prompt keys, own keys] as SDPA with an n x (p + n) mask, as two of torch's CPU flash
    kernels: the completion's queries over the prompt (no mask), and over its own keys (`is_causal`). Each
    returns its output and log-sum-exp; the two are merged by their log-sum-exps into the softmax over both.
    The backward runs the kernel's own backward on each part with the merged output and log-sum-exp, which is
    that softmax's gradient restricted to the part's keys (the decomposition ring and blockwise attention
    use). Memory is linear in p + n: no mask, no concatenated keys, nothing of size n x (p + n)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor,
                scale: float | None) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(q, kp, vp, 0.0, False, scale=scale)  # [1, heads, n, dim], [1, heads, n] (float32)
        o2, l2 = flash(q, kn, vn, 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = (o1.float() * (l1 - lse).exp()[..., None] + o2.float() * (l2 - lse).exp()[..., None]).to(q.dtype)
        ctx.save_for_backward(q, kp, vp, kn, vn, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kp, vp, kn, vn, out, lse = ctx.saved_tensors
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq1, dkp, dvp = back(grad, q, kp, vp, out, lse, 0.0, False, scale=ctx.scale)
        dq2, dkn, dvn = back(grad, q, kn, vn, out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, dkp, dvp, dkn, dvn, None


def _node_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, node: Node, scaling: float | None,
                    gqa: bool) -> torch.Tensor:
    s, e, ps, pe = node  # q, k, v: [heads, seq, dim] of one row
    qn = q[:, s:e][None]  # [1, heads, n, dim]
    if ps == pe:
        return F.scaled_dot_product_attention(qn, k[:, s:e][None], v[:, s:e][None], is_causal=True, scale=scaling,
                                              enable_gqa=gqa)[0]
    if q.device.type == "cpu":  # the kernel takes grouped key/value heads as they are
        return _PrefixedCausal.apply(qn, k[:, ps:pe][None], v[:, ps:pe][None], k[:, s:e][None], v[:, s:e][None],
                                     scaling)[0]
    kn = torch.cat([k[:, ps:pe], k[:, s:e]], dim=1)[None]  # [1, kv_heads, p + n, dim]
    vn = torch.cat([v[:, ps:pe], v[:, s:e]], dim=1)[None]
    n, p = e - s, pe - ps
    mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device)  # [n, p + n]
    mask[:, p:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(qn, kn, vn, attn_mask=mask, scale=scaling, enable_gqa=gqa)[0]


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [batch, heads, seq, dim] -> ([batch, seq, heads, dim], None)."""
    layout: TreeLayout | None = kwargs.pop(TREE_ATTENTION, None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, seq, dim = query.shape
    gqa = key.shape[1] != heads
    rows = []
    for b, nodes in enumerate(layout.rows):
        pieces = [_node_attention(query[b], key[b], value[b], node, scaling, gqa) for node in nodes]  # [heads, n, dim]
        used = nodes[-1][1] if nodes else 0
        if used < seq:
            pieces.append(query.new_zeros(heads, seq - used, dim))
        rows.append(torch.cat(pieces, dim=1))  # [heads, seq, dim]
    out = torch.stack(rows)  # [batch, heads, seq, dim]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make "artrl_tree" a known attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)
