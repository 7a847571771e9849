"""RL train call: groups -> tokenize -> steps of groups -> packed rows -> policy-gradient steps.

Defaults (types.TrainConfig): CISPO-style loss, advantages scaled by the group
std, the whole call in one optimizer step (`groups_per_optimizer_step=None`), micro-batches
of `per_device_train_batch_size` rows (2 on a GPU, 1 on a CPU by default). The
loss of each optimizer step is normalised over that step's trainable tokens
(train/loss.py, train/trainer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from ..chat_format import end_of_turn_ids
from ..preprocess.build import BuiltCall, build_call
from ..preprocess.tokenize import tokenize_groups
from ..trajectories import TrajectoryGroup
from ..types import TrainConfig
from .call import PreparedCall
from .loss import LossTerms, policy_loss
from .trainer import TokenBatch, Trainer


def _rl_loss(tb: TokenBatch, *, config: TrainConfig) -> LossTerms:
    return policy_loss(tb.logprobs, tb.old_logprobs, tb.advantages, tb.weights, tb.sequence_ids, tb.entropy,
                       kind=config.loss, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
                       beta=config.kl_coef(), ref=tb.ref_logprobs)


def rl_loss_fn(config: TrainConfig):
    """The loss a TrainConfig asks for, as the trainer calls it (one TokenBatch -> LossTerms)."""
    return partial(_rl_loss, config=config)


def build_rl(groups: Sequence[Sequence], config: TrainConfig, *, max_length: int, pad_id: int,
             device_type: str) -> BuiltCall:
    """Tokenized groups -> steps -> rows -> micro-batches, as config says (also used by `artrl bench train`)."""
    return build_call(
        groups, units_per_step=config.groups_per_optimizer_step, rows_per_step=config.grad_accumulation_sequences,
        row_length=config.row_length, max_length=min(max_length, config.max_row_length or max_length),
        on_too_long=config.on_too_long, share_prompts=config.share_prompts, pad_id=pad_id,
        rows_per_forward=config.rows_per_forward(device_type, config.grad_accumulation_sequences),
        max_tokens_per_microbatch=config.max_tokens_per_microbatch)


def prepare_rl(trainer: Trainer, groups: Sequence[TrajectoryGroup], config: TrainConfig) -> PreparedCall:
    config.check()
    tok = tokenize_groups(groups, trainer.tokenizer, scale_rewards=config.scale_rewards,
                          allow_training_without_logprobs=config.allow_training_without_logprobs,
                          require_logprobs=config.require_logprobs,
                          end_ids=end_of_turn_ids(trainer.tokenizer, trainer.model))
    built = build_rl(tok.groups, config, max_length=trainer.max_length, pad_id=trainer.pad_id,
                     device_type=trainer.device.type) if tok.groups else BuiltCall(None, None)
    n_steps = len(built.plan.steps) if built.plan is not None else 0
    return PreparedCall("rl", built, rl_loss_fn(config), [config.learning_rate] * n_steps, config, tok.stats,
                        unit_name="groups", need_ref=config.kl_coef() > 0)
