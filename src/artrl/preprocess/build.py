"""One build path for every train call: data units -> optimizer steps -> packed rows -> micro-batches.

RL (groups), SFT (trajectories, each its own unit) and `artrl bench train` all go
through `build_call`:

1. **Steps by data.** The call's units (tokenized groups) are cut into optimizer
   steps of `units_per_step` consecutive units (None: all of them in one step).
   This happens before packing, so how many steps a call takes, and which data
   each step sees, depends on the data and the config only.
2. **One row length** for the whole call: `row_length` if set, else the
   automatic choice over all of the call's units (preprocess/pack.py), at most
   `max_length` and `max_tokens_per_microbatch` (a row must fit a micro-batch),
   so every step's rows stack into one tensor.
3. **Each step packed on its own**: a row never mixes two steps. Then each
   step's rows are cut into micro-batches of `per_device_train_batch_size` rows or
   `max_tokens_per_microbatch` token slots (preprocess/plan.py).

Row length, prompt sharing, rows per forward pass and the token budget change
speed and memory only: the loss of a step is normalised over that step's
trainable tokens (train/trainer.py), whatever its layout.

The one exception is `rows_per_step` (`grad_accumulation_sequences`, ART's
meaning): the whole call is packed at once and every `rows_per_step` consecutive
rows make a step, so the number of steps follows the packer. It exists for users
who ask for it by name, and is documented as packing-dependent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from .pack import check_row_length, choose_row_length, enforce_length, pack
from .rows import PackedRows, PackStats, concat_packed
from .plan import BatchPlan, plan_batches
from ..trajectories.sequences import TokenizedSequence

Units = Sequence[Sequence[TokenizedSequence]]


@dataclass
class BuiltCall:
    """The rows of every step, stacked, and the plan that runs them.

    `packed` / `plan` are None when nothing survived (every sequence too long). Steps are first cut
    from the units as given (`split_units`: `steps_cut` of them); a step whose every sequence was dropped
    disappears, so `kept_steps[k]` is the index, among the steps cut, of plan step k, and `step_units[k]`
    lists the units (indices into the call's units) it trains on.
    """

    packed: PackedRows | None
    plan: BatchPlan | None
    step_units: list[list[int]] = field(default_factory=list)
    kept_steps: list[int] = field(default_factory=list)
    stats: PackStats = field(default_factory=PackStats)
    steps_cut: int = 0

    @property
    def empty(self) -> bool:
        return self.plan is None or not self.plan.steps


def split_units(n_units: int, units_per_step: int | None) -> list[list[int]]:
    """Consecutive runs of `units_per_step` unit indices (None: one run of all)."""
    if units_per_step is not None and units_per_step < 1:
        raise ConfigError(f"units per optimizer step = {units_per_step}; it must be >= 1 (or None for all).")
    k = units_per_step or max(n_units, 1)
    return [list(range(i, min(i + k, n_units))) for i in range(0, n_units, k)]


def build_call(
    units: Units,
    *,
    units_per_step: int | None = None,
    rows_per_step: int | None = None,
    row_length: int | None = None,
    max_length: int = 32768,
    on_too_long: str = "drop",
    share_prompts: bool = True,
    pad_id: int = 0,
    per_device_train_batch_size: int = 1,
    max_tokens_per_microbatch: int | None = None,
) -> BuiltCall:
    """Build the steps of one train call; see the module docstring.

    Args:
        units: tokenized groups (RL) or one-sequence-list per trajectory (SFT), in call order.
        units_per_step: units per optimizer step (None: all in one step).
        rows_per_step: if set, ART's packing-dependent meaning instead: the call is packed at once and
            every `rows_per_step` rows make a step (units_per_step is then ignored).
        row_length: fixed row length, or None for the automatic choice over the whole call.
        max_length: the longest row allowed (the model's maximum, or a user bound); with an automatic row
            length, `max_tokens_per_microbatch` bounds it too.
    """
    check_row_length(row_length, max_length)
    if row_length is None and max_tokens_per_microbatch is not None:
        # a row must fit a micro-batch: the token budget bounds the automatic row length like the model's
        # maximum does (a trajectory longer than it then follows on_too_long)
        max_length = min(max_length, max_tokens_per_microbatch)
    stats = PackStats()
    cut = split_units(len(units), units_per_step) if rows_per_step is None else []
    limit = row_length if row_length is not None else max_length
    # one too-long pass over the call (each drop or truncation counted once); a unit may lose sequences
    kept: dict[int, list[TokenizedSequence]] = {}
    for i, unit in enumerate(units):
        survivors = enforce_length([unit], limit, on_too_long, stats)
        if survivors:
            kept[i] = survivors[0]
    if not kept:
        return BuiltCall(None, None, stats=stats, steps_cut=len(cut))
    L = row_length if row_length is not None else choose_row_length(list(kept.values()), max_length, share_prompts)

    def pack_units(idx: Sequence[int]) -> PackedRows:
        return pack([kept[i] for i in idx], row_length=L, max_length=max_length, share_prompts=share_prompts,
                    pad_id=pad_id)

    if rows_per_step is not None:
        order = sorted(kept)
        packed = pack_units(order)
        plan = plan_batches(packed, per_device_train_batch_size=per_device_train_batch_size,
                            max_tokens_per_microbatch=max_tokens_per_microbatch,
                            grad_accumulation_sequences=rows_per_step)
        unit_of = {id(seq): i for i in order for seq in kept[i]}
        step_units = [sorted({unit_of[id(packed.sequences[int(sid)])]
                              for sid in packed.sequence_ids[st.rows].unique() if sid >= 0})
                      for st in plan.steps]
        _merge_stats(packed.stats, stats)
        return BuiltCall(packed, plan, step_units, list(range(len(plan.steps))), packed.stats, len(plan.steps))

    parts: list[PackedRows] = []
    step_units: list[list[int]] = []
    kept_steps: list[int] = []
    for k, idx in enumerate(cut):
        present = [i for i in idx if i in kept]
        if not present:
            continue
        parts.append(pack_units(present))
        step_units.append(present)
        kept_steps.append(k)
    packed = concat_packed(parts)
    step_rows, start = [], 0
    for p in parts:
        step_rows.append(list(range(start, start + p.num_rows)))
        start += p.num_rows
    plan = plan_batches(packed, per_device_train_batch_size=per_device_train_batch_size,
                        max_tokens_per_microbatch=max_tokens_per_microbatch, step_rows=step_rows)
    _merge_stats(packed.stats, stats)
    return BuiltCall(packed, plan, step_units, kept_steps, packed.stats, len(cut))


def _merge_stats(into: PackStats, too_long: PackStats) -> None:
    """Drops and truncations were counted before packing; the per-step packs saw none."""
    into.dropped += too_long.dropped
    into.truncated += too_long.truncated
