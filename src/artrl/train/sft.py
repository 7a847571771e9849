"""SFT train call: trajectories -> tokenize (all assistant turns trainable, or each trajectory's final one with
`assistant_turns="last"`) -> steps -> rows.

`batch_size` trajectories make one optimizer step ('auto' = 2 as in ART, or all
when fewer); each step's trajectories are packed into rows of their own (a row never
mixes two steps), all at one row length chosen over the whole call unless set
(preprocess/build.py). `learning_rate` is one value or one per step
(artrl.schedules builds constant / linear / cosine lists).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..preprocess.build import BuiltCall
from ..trajectories.tokenization import tokenize_sft
from ..trajectories.data import Trajectory
from ..types import TrainSFTConfig
from .call import BuildContext, PreparedCall, build_batches
from .loss import LossTerms, sft_loss
from .trainer import TokenBatch


def _sft_loss(tb: TokenBatch) -> LossTerms:
    return sft_loss(tb.logprobs, tb.weights, tb.entropy)


def prepare_sft(ctx: BuildContext, trajectories: Sequence[Trajectory], config: TrainSFTConfig) -> PreparedCall:
    """Tokenize (validating each trajectory), cut into steps of `batch_size` trajectories, build and plan one
    SFT call with a checked `config`."""
    trajectories = list(trajectories)
    if config.shuffle:
        # a different order every call, reproducible from the seed and the restored optimizer step count
        random.Random(config.seed * 1_000_003 + ctx.optimizer_steps).shuffle(trajectories)
    tok = tokenize_sft(trajectories, ctx.tokenizer, end_ids=ctx.end_ids, vision=ctx.vision,
                       assistant_turns=config.assistant_turns)
    if not tok.groups:
        return PreparedCall("sft", BuiltCall(None, None), _sft_loss, [], config, tok.stats, step_unit="trajectories")
    built = build_batches(tok.groups, config, ctx, units_per_step=config.resolved_batch_size(len(tok.groups)))
    lrs = config.learning_rates(built.steps_cut)
    return PreparedCall("sft", built, _sft_loss, [lrs[k] for k in built.kept_steps], config, tok.stats,
                        step_unit="trajectories")
