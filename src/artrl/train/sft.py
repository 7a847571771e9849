"""SFT train call: trajectories -> tokenize (all assistant turns trainable) -> pack -> plan.

`batch_size` trajectories make one optimizer step ('auto' = 8, or all when
fewer). Each batch is packed into its own rows (so a row never mixes two
optimizer steps); all batches share one row length, chosen automatically over
the whole call unless set. `learning_rate` is one value or one per step
(artrl.schedules builds constant / linear / cosine lists).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ..chat_format import end_of_turn_ids
from ..preprocess.pack import ROW_TENSORS, PackedRows, PackStats, choose_row_length, pack
from ..preprocess.plan import plan_batches
from ..preprocess.tokenize import tokenize_sft
from ..trajectories import Trajectory
from ..types import TrainSFTConfig
from .call import PreparedCall
from .trainer import TokenBatch, Trainer
from .loss import LossTerms, sft_loss


def _sft_loss(tb: TokenBatch) -> LossTerms:
    return sft_loss(tb.logprobs, tb.weights, tb.entropy)


def concat_packed(parts: Sequence[PackedRows]) -> PackedRows:
    """Stack packed rows of equal row length; sequence ids are renumbered."""
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
    return PackedRows(**tensors, sequence_ids=torch.cat(seq_ids), lengths=torch.cat([p.lengths for p in parts]),
                      sequences=sequences, stats=stats)


def prepare_sft(trainer: Trainer, trajectories: Sequence[Trajectory], config: TrainSFTConfig) -> PreparedCall:
    config.check()
    trajectories = list(trajectories)
    if config.shuffle:
        # a different order every call, reproducible from the seed and the restored optimizer step count
        random.Random(config.seed * 1_000_003 + trainer.optimizer_steps).shuffle(trajectories)
    tok = tokenize_sft(trajectories, trainer.tokenizer, end_ids=end_of_turn_ids(trainer.tokenizer, trainer.model))
    if not tok.groups:
        return PreparedCall("sft", None, None, None, [], config.max_grad_norm, tok.stats)
    bs = config.resolved_batch_size(len(tok.groups))
    batches = [tok.groups[i:i + bs] for i in range(0, len(tok.groups), bs)]
    lrs = config.learning_rates(len(batches))
    max_len = min(trainer.max_length, config.max_row_length or trainer.max_length)
    row_length = config.row_length
    if row_length is None:
        # all batches share one row length: the automatic choice over the whole call
        longest = max(len(s) for g in tok.groups for s in g)
        row_length = choose_row_length(tok.groups, max_len) if longest <= max_len else max_len
    parts = [pack(b, row_length=row_length, max_length=max_len, on_too_long=config.on_too_long,
                  share_prompts=config.share_prompts, pad_id=trainer.pad_id) for b in batches]
    kept = [(p, lr) for p, lr in zip(parts, lrs) if p.num_rows]
    if not kept:
        return PreparedCall("sft", parts[0], None, None, [], config.max_grad_norm, tok.stats)
    packed = concat_packed([p for p, _ in kept])
    step_rows, start = [], 0
    for p, _ in kept:
        step_rows.append(list(range(start, start + p.num_rows)))
        start += p.num_rows
    plan = plan_batches(packed, per_device_train_batch_size=config.rows_per_forward(trainer.device.type),
                        max_tokens_per_microbatch=config.max_tokens_per_microbatch, step_rows=step_rows)
    return PreparedCall("sft", packed, plan, _sft_loss, [lr for _, lr in kept], config.max_grad_norm, tok.stats)
