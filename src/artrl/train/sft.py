"""SFT train call: trajectories -> tokenize (all assistant turns trainable) -> steps -> rows.

`batch_size` trajectories make one optimizer step ('auto' = 2 as in ART, or all
when fewer); each step's trajectories are packed into rows of their own (a row never
mixes two steps), all at one row length chosen over the whole call unless set
(preprocess/build.py). `learning_rate` is one value or one per step
(artrl.schedules builds constant / linear / cosine lists).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..preprocess.build import BuiltCall, build_call, split_units
from ..preprocess.tokenize import tokenize_sft
from ..trajectories import Trajectory
from ..types import TrainSFTConfig
from .call import PreparedCall
from .loss import LossTerms, sft_loss
from .trainer import TokenBatch, Trainer


def _sft_loss(tb: TokenBatch) -> LossTerms:
    return sft_loss(tb.logprobs, tb.weights, tb.entropy)


def prepare_sft(trainer: Trainer, trajectories: Sequence[Trajectory], config: TrainSFTConfig) -> PreparedCall:
    config.check()
    trajectories = list(trajectories)
    if config.shuffle:
        # a different order every call, reproducible from the seed and the restored optimizer step count
        random.Random(config.seed * 1_000_003 + trainer.optimizer_steps).shuffle(trajectories)
    tok = tokenize_sft(trajectories, trainer.tokenizer, end_ids=trainer.end_ids)
    if not tok.groups:
        return PreparedCall("sft", BuiltCall(None, None), _sft_loss, [], config, tok.stats, unit_name="trajectories")
    bs = config.resolved_batch_size(len(tok.groups))
    lrs = config.learning_rates(len(split_units(len(tok.groups), bs)))
    max_len = min(trainer.max_length, config.max_row_length or trainer.max_length)
    built = build_call(tok.groups, units_per_step=bs, row_length=config.row_length, max_length=max_len,
                       on_too_long=config.on_too_long, share_prompts=config.share_prompts, pad_id=trainer.pad_id,
                       rows_per_forward=config.rows_per_forward(trainer.device.type),
                       max_tokens_per_microbatch=config.max_tokens_per_microbatch)
    return PreparedCall("sft", built, _sft_loss, [lrs[k] for k in built.kept_steps], config, tok.stats,
                        unit_name="trajectories")
