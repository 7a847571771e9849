"""One optimizer step's rows split across data-parallel ranks, balanced by computed tokens.

Every rank of an FSDP group runs its forward and backward passes in lock step
(each pass all-gathers and reduce-scatters per layer), so two things matter:

* the NUMBER of passes must be equal on every rank, or the ranks wait for each
  other forever. A rank with fewer passes runs zero-weight padding passes
  (`Share.padding`): the shortest row of the step, its loss multiplied by 0, so
  it adds nothing to the gradient but takes part in every collective;
* the work of pass k should be alike on every rank, since the slowest one sets
  the pace.

The split (greedy longest-first, the LPT rule): the step's rows are taken from
the widest to the narrowest (width = the row's used length after trimming, so a
row's computed tokens), each going to the rank with the fewest computed tokens
so far among those that still have room. "Room" caps every rank at the rows
of `ceil(rows / (world x rows_per_pass))` passes when micro-batches are counted
in rows, so no rank gets more passes than needed. Each rank's rows, still
widest first, are then cut into micro-batches by the plan's own rule
(`BatchPlan.micro_batches`), so `per_device_train_batch_size` and
`max_tokens_per_microbatch` mean per rank what they mean in one process.

Worked example, rows of widths [9, 7, 5, 4, 2] on 2 ranks, one row per pass
(cap 3 rows each):

    9 -> rank 0 (loads 0 vs 0)    7 -> rank 1 (9 vs 0)     5 -> rank 1 (9 vs 7)
    4 -> rank 0 (9 vs 12)         2 -> rank 1 (13 vs 12)
    rank 0: [9, 4] = 13 tokens, 2 passes + 1 padding pass;  rank 1: [7, 5, 2] = 14 tokens, 3 passes

The loss stays normalised by the whole step's trainable weight (summed over all
ranks' rows), and the gradients are summed across ranks, so the update is the
single-process one whatever the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..preprocess.rows import PackedRows
from ..preprocess.plan import BatchPlan, MicroBatch, OptimizerStep


@dataclass
class Share:
    """One rank's part of one optimizer step."""

    rows: list[int] = field(default_factory=list)
    micro_batches: list[MicroBatch] = field(default_factory=list)
    padding: int = 0  # zero-weight passes after the real ones, so every rank runs the same number

    @property
    def computed_tokens(self) -> int:
        return sum(mb.tokens for mb in self.micro_batches)

    @property
    def passes(self) -> int:
        return len(self.micro_batches) + self.padding


def _width(packed: PackedRows, plan: BatchPlan, row: int) -> int:
    return int(packed.lengths[row]) if plan.trim_padding else packed.row_length


def split_step(packed: PackedRows, plan: BatchPlan, step: OptimizerStep, world_size: int) -> list[Share]:
    """The step's rows split over `world_size` ranks (index = rank); every share has the same `passes`."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; it must be >= 1")
    rows = sorted(step.rows, key=lambda r: (-_width(packed, plan, r), r))
    if plan.max_tokens_per_microbatch is None:
        per_pass = plan.per_device_train_batch_size
        cap = per_pass * math.ceil(len(rows) / (world_size * per_pass))
    else:
        cap = len(rows)  # passes follow the token budget: balancing tokens balances them
    shares = [Share() for _ in range(world_size)]
    load = [0] * world_size
    for r in rows:
        rank = min((k for k in range(world_size) if len(shares[k].rows) < cap), key=lambda k: (load[k], k))
        shares[rank].rows.append(r)
        load[rank] += _width(packed, plan, r)
    for s in shares:
        s.micro_batches = plan.micro_batches(packed, s.rows) if s.rows else []
    passes = max(len(s.micro_batches) for s in shares)
    for s in shares:
        s.padding = passes - len(s.micro_batches)
    return shares


def padding_batch(packed: PackedRows, plan: BatchPlan, step: OptimizerStep) -> MicroBatch:
    """What a padding pass runs: the step's narrowest row (its result is multiplied by 0)."""
    row = min(step.rows, key=lambda r: (_width(packed, plan, r), r))
    return MicroBatch([row], _width(packed, plan, row))


def balance(shares_per_step: list[list[Share]]) -> list[int]:
    """Computed tokens per rank over several steps (padding passes not counted)."""
    world = len(shares_per_step[0]) if shares_per_step else 0
    return [sum(step[k].computed_tokens for step in shares_per_step) for k in range(world)]
