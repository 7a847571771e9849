"""Tokenized sequences -> fixed-length rows with shared group prompts.

Layout of a row: a sequence of *nodes*. A node is either a group's shared
prompt (the longest common token prefix of the group's sequences, cut before
the first trainable token) or one sequence's completion (everything after that
prompt). A completion sees its own earlier tokens and its group's prompt in the
same row, nothing else (tree / prefix attention); positions restart at 0 for
every prompt and continue after it for each completion, exactly as if the
sequence ran alone. Trajectories of one group placed in one row therefore share
one copy of their prompt.

The packer (`pack`) is a best-fit-decreasing bin packer that knows prompts
can be shared: groups are taken largest first, each group's completions largest
first; a completion goes to the row that already holds its group's prompt and
has the least room left that still fits it; only if none fits does it open its
prompt in the best-fitting other row, or a new row. A second strategy places
whole groups (prompt once, completions filling the row, the rest spilling into
the next) and the better of the two layouts is kept: fewer rows, and between
layouts with as many rows (hence as much padding), the one whose emptiest row is
fullest, so the leftover room sits in one row. `choose_row_length` picks the row length when the user sets none: the
shortest multiple of 128 that is at least the longest sequence and whose
computed tokens (rows x row length) are within 1% of the least over all
candidate lengths up to the bound (the model's maximum length, capped at
`MAX_AUTO_ROW_FACTOR` x the longest sequence).

`pack_reference` reproduces the reference (ART) layout for comparison: row
length ceil(longest / 2048) * 2048, sequences in group order, a new row whenever
the next one does not fit.

Images (a vision-language model's): a sequence's images travel with it, placed at its image tokens'
slots (`PackedRows.images`), and so do its 3-D rotary positions (`PackedRows.rope_position_ids`, each
sequence's own, models/vision.py). Two sequences share a prompt only where their images are the same
images too (same content hash at the same place): two images of one size have the same token ids. A
truncation never cuts an image: it cuts before it.

Too-long sequences follow `on_too_long`: "drop" (counted, logged), "truncate"
(cut to the row length, counted) or "error".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, PackingError
from ..models.tree_attention import Node
from .rows import PackedRows, PackStats
from ..trajectories.sequences import TokenizedSequence

log = logging.getLogger(__name__)

ROW_LENGTH_MULTIPLE = 128
REFERENCE_ROW_MULTIPLE = 2048
MAX_AUTO_ROW_FACTOR = 4
AUTO_ROW_TOLERANCE = 0.01


# --------------------------------------------------------------------------- trees


@dataclass
class PromptTree:
    """A group's shared prompt and the completions that follow it: what the packer places (a "unit" is
    build.py's word for the data of a step: a group or a trajectory)."""

    prompt: list[int]  # token ids shared by all completions (may be empty)
    sequences: list[TokenizedSequence]

    @property
    def p(self) -> int:
        return len(self.prompt)

    def completion_length(self, k: int) -> int:
        return len(self.sequences[k]) - self.p


def shared_prefix_length(seqs: Sequence[TokenizedSequence]) -> int:
    """Longest common prefix of the sequences (tokens, and images by content), cut before any trainable token."""
    if len(seqs) < 2:
        return 0
    limit = min(_shareable(s) for s in seqs)
    first = seqs[0].token_ids
    n = 0
    while n < limit and all(s.token_ids[n] == first[n] for s in seqs[1:]):
        n += 1
    return min([n, *(_first_image_difference(seqs[0], s, n) for s in seqs[1:])])


def _shareable(seq: TokenizedSequence) -> int:
    """How many leading tokens of `seq` a shared prompt may hold: none trainable, and none with a routing record. A
    turn's record may start at its last prompt position (models/moe.py): that slot stays each completion's own, so
    each replays the experts its own request's prefill picked there (separate prefills of one prompt can differ
    where float noise flips a near tie), at the cost of one token per completion."""
    return min([seq.first_trainable, *(start for start, _ in seq.routing)])


def _first_image_difference(a: TokenizedSequence, b: TokenizedSequence, n: int) -> int:
    """The start of the first image before token `n` that `a` and `b` do not share (`n` when none): equal token
    ids there may stand for different images."""
    theirs = {start: image.digest for start, image in b.images if start < n}
    for start, image in a.images:
        if start >= n:
            break
        if theirs.pop(start, None) != image.digest:
            return start
    return min([n, *theirs])


def _same_prefix(a: TokenizedSequence, b: TokenizedSequence, p: int) -> bool:
    return a.token_ids[:p] == b.token_ids[:p] and _first_image_difference(a, b, p) == p


def prompt_trees(groups: Sequence[Sequence[TokenizedSequence]], share_prompts: bool = True) -> list[PromptTree]:
    """One tree per group (its main conversations share a prompt); the other sequences stand alone."""
    trees: list[PromptTree] = []
    for group in groups:
        if not share_prompts:
            trees += [PromptTree(prompt=[], sequences=[s]) for s in group]
            continue
        main = [s for s in group if s.history_index == 0]
        p = shared_prefix_length(main)
        prompt = main[0].token_ids[:p] if p else []
        shared = [s for s in group if p and _same_prefix(s, main[0], p) and _shareable(s) >= p]
        if len(shared) >= 2:
            trees.append(PromptTree(prompt=prompt, sequences=shared))
        else:
            shared = []
        trees += [PromptTree(prompt=[], sequences=[s]) for s in group if not any(s is t for t in shared)]
    return trees


# --------------------------------------------------------------------------- too long


def _truncate(seq: TokenizedSequence, n: int) -> TokenizedSequence | None:
    n = min([n, *(start for start, image in seq.images if start < n < start + image.tokens)])  # never in an image
    if not any(seq.trainable_mask[:n]):
        return None
    return TokenizedSequence(
        token_ids=seq.token_ids[:n], trainable_mask=seq.trainable_mask[:n], logprobs=seq.logprobs[:n],
        advantage=seq.advantage, weight=seq.weight, group_index=seq.group_index,
        trajectory_index=seq.trajectory_index, history_index=seq.history_index,
        routing=[(start, r[:n - start]) for start, r in seq.routing if start < n],
        images=[(start, image) for start, image in seq.images if start < n],
        rope_positions=seq.rope_positions[:, :n] if seq.rope_positions is not None else None,
    )


def enforce_length(
    groups: Sequence[Sequence[TokenizedSequence]], max_length: int, on_too_long: str, stats: PackStats
) -> list[list[TokenizedSequence]]:
    """Apply the too-long policy: every returned sequence has at most max_length tokens."""
    out: list[list[TokenizedSequence]] = []
    for group in groups:
        kept: list[TokenizedSequence] = []
        for s in group:
            if len(s) <= max_length:
                kept.append(s)
                continue
            if on_too_long == "error":
                raise PackingError(
                    f"{s.name} has {len(s)} tokens, more than the row length {max_length}. Set "
                    "on_too_long='drop' or 'truncate', raise row_length (bounded by the model's maximum "
                    "length, max_row_length and max_tokens_per_microbatch), or shorten the episode."
                )
            if on_too_long == "truncate":
                t = _truncate(s, max_length)
                if t is not None:
                    stats.truncated += 1
                    log.warning("%s: truncated from %d to %d tokens", s.name, len(s), max_length)
                    kept.append(t)
                    continue
            stats.dropped += 1
            log.warning("%s: %d tokens exceed the row length %d; dropped", s.name, len(s), max_length)
        if kept:
            out.append(kept)
    return out


# --------------------------------------------------------------------------- assignment

# A placement is (tree index, sequence index within the tree); a row is a list of them.
Placement = tuple[int, int]


@dataclass
class _OpenRow:
    free: int
    trees: set[int] = field(default_factory=set)
    items: list[Placement] = field(default_factory=list)


def _place(row: _OpenRow, u: int, k: int, cost: int) -> None:
    row.free -= cost
    row.trees.add(u)
    row.items.append((u, k))


def _assign_items(trees: Sequence[PromptTree], L: int) -> list[list[Placement]]:
    """Best fit decreasing over completions, preferring rows that hold the group's prompt."""
    rows: list[_OpenRow] = []
    order = sorted(range(len(trees)), key=lambda u: -(trees[u].p + sum(len(s) - trees[u].p for s in trees[u].sequences)))
    for u in order:
        tree = trees[u]
        ks = sorted(range(len(tree.sequences)), key=lambda k: -tree.completion_length(k))
        for k in ks:
            c = tree.completion_length(k)
            best = None
            for r in rows:
                if u in r.trees and r.free >= c and (best is None or r.free < best.free):
                    best = r
            if best is not None:
                _place(best, u, k, c)
                continue
            for r in rows:
                if r.free >= tree.p + c and (best is None or r.free < best.free):
                    best = r
            if best is None:
                best = _OpenRow(free=L)
                rows.append(best)
            _place(best, u, k, tree.p + c)
    return [r.items for r in rows]


def _assign_groups(trees: Sequence[PromptTree], L: int) -> list[list[Placement]]:
    """Whole groups, largest first: a group's remainder goes to the best-fitting row that takes
    it whole; otherwise it fills a fresh row (largest completions first, then any that still fit)
    and the rest spills over."""
    rows: list[_OpenRow] = []
    order = sorted(range(len(trees)), key=lambda u: -(trees[u].p + sum(len(s) - trees[u].p for s in trees[u].sequences)))
    for u in order:
        tree = trees[u]
        remaining = sorted(range(len(tree.sequences)), key=lambda k: -tree.completion_length(k))
        while remaining:
            need = tree.p + sum(tree.completion_length(k) for k in remaining)
            best = None
            for r in rows:
                if r.free >= need and (best is None or r.free < best.free):
                    best = r
            if best is not None:
                cost = tree.p
                for k in remaining:
                    _place(best, u, k, cost + tree.completion_length(k))
                    cost = 0
                remaining = []
                continue
            # fill the row with the most room (or a new one) with what fits
            target = max(rows, key=lambda r: r.free, default=None)
            if target is None or target.free < tree.p + tree.completion_length(remaining[-1]):
                target = _OpenRow(free=L)
                rows.append(target)
            cost = tree.p
            rest = []
            for k in remaining:
                c = tree.completion_length(k)
                if target.free >= cost + c:
                    _place(target, u, k, cost + c)
                    cost = 0
                else:
                    rest.append(k)
            remaining = rest
    return [r.items for r in rows]


def _assign_in_order(trees: Sequence[PromptTree], L: int) -> list[list[Placement]]:
    """The reference layout: sequences in group order, a new row when the next does not fit."""
    rows: list[_OpenRow] = []
    cur: _OpenRow | None = None
    for u, tree in enumerate(trees):
        for k in range(len(tree.sequences)):
            c = tree.completion_length(k)
            cost = c if cur is not None and u in cur.trees else tree.p + c
            if cur is None or cur.free < cost:
                cur = _OpenRow(free=L)
                rows.append(cur)
                cost = tree.p + c
            _place(cur, u, k, cost)
    return [r.items for r in rows]


def _used(trees: Sequence[PromptTree], row: list[Placement]) -> int:
    seen: set[int] = set()
    n = 0
    for u, k in row:
        if u not in seen:
            seen.add(u)
            n += trees[u].p
        n += trees[u].completion_length(k)
    return n


def _best_assignment(trees: Sequence[PromptTree], L: int) -> list[list[Placement]]:
    """The better of the two strategies: fewer rows, then the fuller emptiest row (see module docstring)."""
    candidates = [_assign_items(trees, L), _assign_groups(trees, L)]
    return min(candidates, key=lambda rows: (len(rows), -min((_used(trees, r) for r in rows), default=0)))


# --------------------------------------------------------------------------- rows


def _materialize(
    trees: Sequence[PromptTree], assignment: list[list[Placement]], L: int, pad_id: int, stats: PackStats
) -> PackedRows:
    R = len(assignment)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    segment_ids = torch.full((R, L), -1, dtype=torch.long)
    parent_ids = torch.full((R, L), -1, dtype=torch.long)
    prev_index = torch.full((R, L), -1, dtype=torch.long)
    trainable_mask = torch.zeros((R, L), dtype=torch.bool)
    logprobs = torch.full((R, L), math.nan, dtype=torch.float32)
    advantages = torch.zeros((R, L), dtype=torch.float32)
    weights = torch.zeros((R, L), dtype=torch.float32)
    sequence_ids = torch.full((R, L), -1, dtype=torch.long)
    lengths = torch.zeros(R, dtype=torch.long)
    routing = _routing_tensor(trees, R, L)  # [R, L, moe layers, top_k], or None
    with_images = any(s.images for t in trees for s in t.sequences)
    rope = torch.zeros((R, L, 3), dtype=torch.long) if with_images else None  # [R, L, 3]
    images: list[list[tuple[int, Any]]] = [[] for _ in range(R)] if with_images else []
    sequences: list[TokenizedSequence] = []
    nodes: list[list[Node]] = []
    for r, row in enumerate(assignment):
        # keep a group's completions right after its prompt: order placements by tree
        first_seen: dict[int, int] = {}
        for u, _ in row:
            first_seen.setdefault(u, len(first_seen))
        row = sorted(row, key=lambda pk: (first_seen[pk[0]], pk[1]))
        pos = 0
        node = 0
        prompt_node: dict[int, tuple[int, int]] = {}  # tree -> (node id, last slot)
        row_nodes: list[Node] = []
        prompt_span: dict[int, tuple[int, int]] = {}  # tree -> (first slot, end slot) of its prompt
        for u, k in row:
            tree = trees[u]
            seq = tree.sequences[k]
            if u not in prompt_node and tree.p:
                n = tree.p
                sl = slice(pos, pos + n)
                input_ids[r, sl] = torch.tensor(tree.prompt)
                position_ids[r, sl] = torch.arange(n)
                segment_ids[r, sl] = node
                parent_ids[r, sl] = node
                prev_index[r, pos + 1:pos + n] = torch.arange(pos, pos + n - 1)
                prompt_node[u] = (node, pos + n - 1)
                prompt_span[u] = (pos, pos + n)
                if rope is not None:
                    _place_vision(tree.sequences[0], 0, n, pos, rope[r], images[r] if images else None)
                row_nodes.append((pos, pos + n, pos, pos))
                node += 1
                pos += n
            n = len(seq) - tree.p
            sl = slice(pos, pos + n)
            gid = len(sequences)
            sequences.append(seq)
            input_ids[r, sl] = torch.tensor(seq.token_ids[tree.p:])
            position_ids[r, sl] = torch.arange(tree.p, len(seq))
            if rope is not None:
                _place_vision(seq, tree.p, len(seq), pos, rope[r], images[r])
            segment_ids[r, sl] = node
            prev = torch.arange(pos - 1, pos + n - 1)
            if tree.p:
                parent_ids[r, sl] = prompt_node[u][0]
                prev[0] = prompt_node[u][1]
            else:
                parent_ids[r, sl] = node
                prev[0] = -1
            prev_index[r, sl] = prev
            mask = torch.tensor(seq.trainable_mask[tree.p:], dtype=torch.bool)
            if not tree.p:
                mask[0] = False  # nothing precedes the first token, it cannot be predicted
            trainable_mask[r, sl] = mask
            logprobs[r, sl] = torch.tensor(seq.logprobs[tree.p:], dtype=torch.float32)
            for start, record in seq.routing:  # never in a shared prompt (`_shareable`)
                at = pos + start - tree.p
                routing[r, at:at + len(record)] = record  # type: ignore[index]
            advantages[r, sl] = seq.advantage
            weights[r, sl] = mask.float() * seq.weight
            sequence_ids[r, sl] = gid
            ps, pe = prompt_span[u] if tree.p else (pos, pos)
            row_nodes.append((pos, pos + n, ps, pe))
            node += 1
            pos += n
        lengths[r] = pos
        nodes.append(row_nodes)
    stats.rows = R
    stats.row_length = L
    stats.computed_tokens = R * L
    stats.real_tokens = int(lengths.sum())
    stats.trainable_tokens = int(trainable_mask.sum())
    stats.sequences = len(sequences)
    return PackedRows(input_ids, position_ids, segment_ids, parent_ids, prev_index, trainable_mask, logprobs,
                      advantages, weights, sequence_ids, lengths, sequences, stats, nodes, routing=routing,
                      rope_position_ids=rope, images=images)


def _place_vision(seq: TokenizedSequence, start: int, end: int, pos: int, rope: torch.Tensor,
                  images: list[tuple[int, Any]] | None) -> None:
    """Tokens [start, end) of `seq` go to slots from `pos` of a row: write their 3-D positions into `rope`
    ([row_length, 3]) and add their images to the row's `images`."""
    n = end - start
    if seq.rope_positions is not None:
        rope[pos:pos + n] = seq.rope_positions[:, start:end].T  # [n, 3]
    else:  # text only: the same position on every axis
        rope[pos:pos + n] = torch.arange(start, end)[:, None]
    if images is not None:
        images += [(pos + first - start, image) for first, image in seq.images if start <= first < end]


def _routing_tensor(trees: Sequence[PromptTree], rows: int, width: int) -> torch.Tensor | None:
    """An all -1 [rows, width, moe layers, top_k] int16 tensor when some sequence has a routing record."""
    shapes = {tuple(r.shape[1:]) for t in trees for s in t.sequences for _, r in s.routing}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise PackingError(f"routing records of different shapes {sorted(shapes)} (moe layers, top_k) in one call: "
                           "they come from different models")
    layers, k = shapes.pop()
    return torch.full((rows, width, layers, k), -1, dtype=torch.int16)


def _unique_tokens(trees: Sequence[PromptTree]) -> int:
    return sum(u.p + sum(len(s) - u.p for s in u.sequences) for u in trees)


# --------------------------------------------------------------------------- public


def choose_row_length(groups: Sequence[Sequence[TokenizedSequence]], max_length: int,
                      share_prompts: bool = True) -> int:
    """The automatic row length (see the module docstring for the rule)."""
    longest = max((len(s) for g in groups for s in g), default=1)
    lo = _round_up(longest, ROW_LENGTH_MULTIPLE)
    hi = min(max_length, MAX_AUTO_ROW_FACTOR * lo)
    if lo > hi:
        return max_length
    trees = prompt_trees(groups, share_prompts)
    candidates = list(range(lo, hi + 1, ROW_LENGTH_MULTIPLE))
    computed = {L: len(_best_assignment(trees, L)) * L for L in candidates}
    best = min(computed.values())
    return next(L for L in candidates if computed[L] <= best * (1 + AUTO_ROW_TOLERANCE))


def check_row_length(row_length: int | None, max_length: int) -> None:
    """The one bound on a fixed row length: the model's maximum (ConfigError)."""
    if row_length is not None and row_length > max_length:
        raise ConfigError(f"row_length={row_length} exceeds the model's maximum length {max_length}; lower "
                          "row_length, or leave it None to choose it automatically.")


def pack(
    groups: Sequence[Sequence[TokenizedSequence]],
    *,
    row_length: int | None = None,
    max_length: int = 32768,
    on_too_long: str = "drop",
    share_prompts: bool = True,
    pad_id: int = 0,
) -> PackedRows:
    """Pack tokenized groups into rows.

    Args:
        row_length: fixed row length, or None for the automatic choice.
        max_length: the model's maximum sequence length (bounds rows and sequences).
        on_too_long: "drop", "truncate" or "error" for sequences longer than a row.
    """
    if on_too_long not in ("drop", "truncate", "error"):
        raise PackingError(f"on_too_long={on_too_long!r}; expected 'drop', 'truncate' or 'error'.")
    check_row_length(row_length, max_length)
    stats = PackStats()
    limit = row_length if row_length is not None else max_length
    kept = enforce_length(groups, limit, on_too_long, stats)
    L = row_length if row_length is not None else choose_row_length(kept, max_length, share_prompts)
    trees = prompt_trees(kept, share_prompts)
    rows = _materialize(trees, _best_assignment(trees, L), L, pad_id, stats)
    stats.unique_tokens = _unique_tokens(trees)
    return rows


def reference_row_length(groups: Sequence[Sequence[TokenizedSequence]], multiple: int = REFERENCE_ROW_MULTIPLE) -> int:
    longest = max((len(s) for g in groups for s in g), default=1)
    return _round_up(longest, multiple)


def pack_reference(
    groups: Sequence[Sequence[TokenizedSequence]],
    *,
    row_length: int | None = None,
    multiple: int = REFERENCE_ROW_MULTIPLE,
    pad_id: int = 0,
) -> PackedRows:
    """The reference (ART) layout; see the module docstring."""
    stats = PackStats()
    L = row_length if row_length is not None else reference_row_length(groups, multiple)
    kept = enforce_length(groups, L, "drop", stats)
    trees = prompt_trees(kept, True)
    rows = _materialize(trees, _assign_in_order(trees, L), L, pad_id, stats)
    stats.unique_tokens = _unique_tokens(trees)
    return rows


def _round_up(n: int, m: int) -> int:
    return max(m, math.ceil(n / m) * m)
