"""Packed rows as tensors: the data a train step runs on, and how rows of several steps stack.

`PackedRows` is what the packer (preprocess/pack.py) produces and the trainer
consumes: per-slot [rows, row_length] tensors describing a tree of nodes per
row (a group's shared prompt, and completions that see it), plus the same tree
as slot ranges (`nodes`) for attention. `concat_packed` stacks the rows of
several optimizer steps (preprocess/build.py). Plain data, no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.tree_attention import Node
from ..trajectories.sequences import TokenizedSequence


@dataclass
class PackStats:
    rows: int = 0
    row_length: int = 0
    sequences: int = 0
    real_tokens: int = 0  # token slots holding data (shared prompts once per row)
    computed_tokens: int = 0  # rows x row_length
    unique_tokens: int = 0  # tokens if every group's prompt were stored once
    trainable_tokens: int = 0
    dropped: int = 0
    truncated: int = 0

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        d = {k: v for k, v in self.__dict__.items()}
        d["padding_fraction"] = round(self.padding_fraction, 6)
        return d



# The per-slot [rows, row_length] tensors of PackedRows, in field order.
ROW_TENSORS = ("input_ids", "position_ids", "segment_ids", "parent_ids", "prev_index", "trainable_mask", "logprobs",
               "advantages", "weights", "sequence_ids")



@dataclass
class PackedRows:
    """Rows as tensors, all [rows, row_length]; see the module docstring for the layout.

    input_ids        token id in each slot (pad id in padding)
    position_ids     position of the token in its own sequence (0 for padding)
    segment_ids      node id within the row (-1 for padding)
    parent_ids       node id whose tokens a slot may also see (its group's prompt; itself otherwise)
    prev_index       slot whose hidden state predicts this slot's token (-1 if none)
    trainable_mask   True on trainable tokens
    logprobs         sampled logprob (nan where unknown)
    advantages       advantage of the slot's sequence
    weights          per-token loss weight (0 off the trainable tokens)
    sequence_ids     global index of the slot's sequence (-1 for prompts and padding)
    lengths          [rows] used slots per row
    nodes            per row, its nodes in slot order (the same tree as segment_ids / parent_ids, kept
                     as ranges so attention never rebuilds it from the per-slot ids)

    A worked row (row_length 12): a group prompt P = [p0 p1 p2] shared by completions A = [a0 a1] and
    B = [b0 b1 b2], then 4 slots of padding:

        slot          0   1   2   3   4   5   6   7   8   9  10  11
        input_ids     p0  p1  p2  a0  a1  b0  b1  b2  .   .   .   .
        position_ids  0   1   2   3   4   3   4   5   0   0   0   0
        segment_ids   0   0   0   1   1   2   2   2  -1  -1  -1  -1
        parent_ids    0   0   0   0   0   0   0   0  -1  -1  -1  -1
        prev_index   -1   0   1   2   3   2   5   6  -1  -1  -1  -1
        nodes         (0, 3, 0, 0), (3, 5, 0, 3), (5, 8, 0, 3)

    b0 is predicted from p2's hidden state (prev_index 2), and b sees P and itself, never A.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    parent_ids: torch.Tensor
    prev_index: torch.Tensor
    trainable_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    sequence_ids: torch.Tensor
    lengths: torch.Tensor
    sequences: list[TokenizedSequence]
    stats: PackStats
    nodes: list[list[Node]] = field(default_factory=list)
    # [rows, row_length, moe layers, top_k] int16: the experts a sampled token's record says each MoE layer picked
    # (models/moe.py), -1 where there is none; None when no sequence has a record
    routing: torch.Tensor | None = None
    # [rows, row_length, 3] (time, height, width) position ids of a vision-language model's rows (models/vision.py):
    # each sequence's own, placed as position_ids are; None when no sequence has images
    rope_position_ids: torch.Tensor | None = None
    # per row, its images in slot order: (slot of the image's first token, the processed image); a shared prompt's
    # image is in its row once. Empty when no sequence has images.
    images: list[list[tuple[int, Any]]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def row_length(self) -> int:
        return int(self.input_ids.shape[1])

    def select(self, rows: Sequence[int], width: int | None = None) -> "PackedRows":
        """A sub-batch of rows, `width` columns wide (default: trimmed to the longest selected row)."""
        rows = list(rows)
        idx = torch.as_tensor(rows, dtype=torch.long)
        if width is None:
            width = int(self.lengths[idx].max()) if len(idx) else self.row_length
        if len(idx) and width < int(self.lengths[idx].max()):
            raise ValueError(f"width {width} cuts into used slots (longest selected row: "
                             f"{int(self.lengths[idx].max())})")
        tensors = {name: getattr(self, name)[idx, :width] for name in ROW_TENSORS}
        return PackedRows(**tensors, lengths=self.lengths[idx], sequences=self.sequences, stats=self.stats,
                          nodes=[self.nodes[r] for r in rows],
                          routing=self.routing[idx, :width] if self.routing is not None else None,
                          rope_position_ids=self.rope_position_ids[idx, :width]
                          if self.rope_position_ids is not None else None,
                          images=[self.images[r] for r in rows] if self.images else [])

    def row_images(self) -> list[Any]:
        """Every image of the rows, row by row in slot order: the order a model fills image tokens in."""
        return [image for row in self.images for _, image in row]


def concat_packed(parts: Sequence[PackedRows]) -> PackedRows:
    """Stack packed rows of equal row length (e.g. one part per optimizer step); sequence ids are renumbered."""
    lengths = {p.row_length for p in parts}
    if len(lengths) != 1:
        raise ValueError(f"cannot stack rows of different lengths {sorted(lengths)}")
    tensors = {n: torch.cat([getattr(p, n) for p in parts]) for n in ROW_TENSORS if n != "sequence_ids"}
    seq_ids, sequences, offset = [], [], 0
    for p in parts:
        s = p.sequence_ids.clone()
        s[s >= 0] += offset
        seq_ids.append(s)
        sequences += p.sequences
        offset += len(p.sequences)
    stats = PackStats(row_length=parts[0].row_length)
    for p in parts:
        for k in ("rows", "computed_tokens", "real_tokens", "unique_tokens", "trainable_tokens", "sequences",
                  "dropped", "truncated"):
            setattr(stats, k, getattr(stats, k) + getattr(p.stats, k))
    routing = None
    if any(p.routing is not None for p in parts):
        shape = next(p.routing.shape[2:] for p in parts if p.routing is not None)
        routing = torch.cat([p.routing if p.routing is not None else
                             torch.full((p.num_rows, p.row_length, *shape), -1, dtype=torch.int16) for p in parts])
    rope = None
    if any(p.rope_position_ids is not None for p in parts):
        rope = torch.cat([p.rope_position_ids if p.rope_position_ids is not None else
                          p.position_ids[..., None].expand(-1, -1, 3) for p in parts])  # [rows, row_length, 3]
    images = [row for p in parts for row in (p.images or [[] for _ in range(p.num_rows)])] \
        if any(p.images for p in parts) else []
    return PackedRows(**tensors, sequence_ids=torch.cat(seq_ids), lengths=torch.cat([p.lengths for p in parts]),
                      sequences=sequences, stats=stats, nodes=[n for p in parts for n in p.nodes], routing=routing,
                      rope_position_ids=rope, images=images)
