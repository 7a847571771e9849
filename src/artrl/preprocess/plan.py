"""Rows -> micro-batches -> optimizer steps: a plain object that says what will run.

* An optimizer step takes explicit row groups (the rows packed from one step's
  data: preprocess/build.py), or `grad_accumulation_sequences` consecutive rows
  (None = all rows in one step).
* Within a step, a micro-batch (one forward/backward pass) takes
  `per_device_train_batch_size` rows, or, when `max_tokens_per_microbatch` is
  set, as many rows as fit that many token slots (rows x the width of the
  widest row in it after trimming trailing padding). A micro-batch never spans
  two optimizer steps.
* Each step records its trainable-token count: the loss of a step is
  normalised by it, never per micro-batch, so the grouping of rows into
  micro-batches changes speed and memory, not the gradient.

The reference (ART) mode is `reference_plan`: one row per micro-batch and one
micro-batch per optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from .rows import PackedRows


@dataclass
class MicroBatch:
    rows: list[int]  # row indices into PackedRows
    width: int  # slots per row after trimming trailing padding

    @property
    def tokens(self) -> int:
        return len(self.rows) * self.width


@dataclass
class OptimizerStep:
    micro_batches: list[MicroBatch]
    trainable_tokens: int
    sequences: int

    @property
    def rows(self) -> list[int]:
        return [r for mb in self.micro_batches for r in mb.rows]


@dataclass
class BatchPlan:
    steps: list[OptimizerStep] = field(default_factory=list)
    row_length: int = 0
    # the rule that cut the steps' rows into micro-batches (`micro_batches` applies it to other rows)
    per_device_train_batch_size: int = 1
    max_tokens_per_microbatch: int | None = None
    trim_padding: bool = True

    def micro_batches(self, packed: PackedRows, rows: Sequence[int]) -> list[MicroBatch]:
        """`rows`, in this order, cut into micro-batches by this plan's rule (distributed/balance.py cuts
        each rank's share of a step with it)."""
        return _micro_batches(packed, rows, self.per_device_train_batch_size, self.max_tokens_per_microbatch,
                              self.trim_padding)

    @property
    def num_micro_batches(self) -> int:
        return sum(len(s.micro_batches) for s in self.steps)

    @property
    def num_rows(self) -> int:
        return sum(len(s.rows) for s in self.steps)

    @property
    def max_rows_per_micro_batch(self) -> int:
        return max((len(mb.rows) for s in self.steps for mb in s.micro_batches), default=0)

    def describe(self) -> str:
        n, mbs, rows = len(self.steps), self.num_micro_batches, self.max_rows_per_micro_batch
        # "<=" only where micro-batches may differ: one micro-batch, or one row each, is exact
        size = f"{rows} row{'' if rows == 1 else 's'}" if mbs == 1 or rows == 1 else f"<={rows} rows"
        return (f"{mbs} micro-batch{'' if mbs == 1 else 'es'} of {size}; "
                f"{n} optimizer step{'' if n == 1 else 's'}")


def _micro_batches(packed: PackedRows, rows: Sequence[int], per_device: int,
                   max_tokens: int | None, trim: bool) -> list[MicroBatch]:
    out: list[MicroBatch] = []
    cur: list[int] = []
    width = 0
    for r in rows:
        w = int(packed.lengths[r]) if trim else packed.row_length
        if max_tokens is not None:
            if w > max_tokens:
                raise ConfigError(
                    f"row {r} holds {w} tokens but max_tokens_per_microbatch={max_tokens}; raise "
                    "max_tokens_per_microbatch to at least the row length, or lower row_length."
                )
            fits = (len(cur) + 1) * max(width, w) <= max_tokens
        else:
            fits = len(cur) < per_device
        if cur and not fits:
            out.append(MicroBatch(cur, width))
            cur, width = [], 0
        cur.append(r)
        width = max(width, w)
    if cur:
        out.append(MicroBatch(cur, width))
    return out


def _step(packed: PackedRows, rows: Sequence[int], per_device: int, max_tokens: int | None,
          trim: bool) -> OptimizerStep:
    rows = list(rows)
    mask = packed.trainable_mask[rows]
    seqs = packed.sequence_ids[rows]
    return OptimizerStep(
        micro_batches=_micro_batches(packed, rows, per_device, max_tokens, trim),
        trainable_tokens=int(mask.sum()),
        sequences=int(seqs[seqs >= 0].unique().numel()),
    )


def plan_batches(
    packed: PackedRows,
    *,
    per_device_train_batch_size: int = 2,
    max_tokens_per_microbatch: int | None = None,
    grad_accumulation_sequences: int | None = None,
    step_rows: Sequence[Sequence[int]] | None = None,
    trim_padding: bool = True,
) -> BatchPlan:
    """Plan the rows of `packed` into optimizer steps and micro-batches.

    Args:
        grad_accumulation_sequences: rows per optimizer step (None: all rows, one step).
        step_rows: explicit rows of each optimizer step (overrides grad_accumulation_sequences).
        trim_padding: run each micro-batch only as wide as its longest row (else the full row length).
    """
    if per_device_train_batch_size < 1:
        raise ConfigError(f"per_device_train_batch_size={per_device_train_batch_size}; it must be >= 1.")
    n = packed.num_rows
    if step_rows is None:
        k = grad_accumulation_sequences or max(n, 1)
        if k < 1:
            raise ConfigError(f"grad_accumulation_sequences={k}; it must be >= 1.")
        step_rows = [list(range(i, min(i + k, n))) for i in range(0, n, k)]
    plan = BatchPlan(row_length=packed.row_length, per_device_train_batch_size=per_device_train_batch_size,
                     max_tokens_per_microbatch=max_tokens_per_microbatch, trim_padding=trim_padding)
    for rows in step_rows:
        if rows:
            plan.steps.append(_step(packed, rows, per_device_train_batch_size, max_tokens_per_microbatch,
                                    trim_padding))
    return plan


def reference_plan(packed: PackedRows) -> BatchPlan:
    """The reference trainer's plan: one full-length row per forward pass, one optimizer step per row."""
    return plan_batches(packed, per_device_train_batch_size=1, grad_accumulation_sequences=1, trim_padding=False)
