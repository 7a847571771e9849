"""RL train call: groups -> tokenize -> pack -> plan -> policy-gradient steps.

Defaults (types.TrainConfig): CISPO-style loss, advantages scaled by the group
std, `grad_accumulation_sequences=8` rows per optimizer step, micro-batches of
`per_device_train_batch_size` rows (2 on a GPU, 1 on a CPU by default). The loss of each optimizer step is
normalised over that step's trainable tokens (train/loss.py, train/trainer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from ..chat_format import end_of_turn_ids
from ..preprocess.pack import pack
from ..preprocess.plan import plan_batches
from ..preprocess.tokenize import tokenize_groups
from ..trajectories import TrajectoryGroup
from ..types import TrainConfig
from .call import PreparedCall
from .trainer import TokenBatch, Trainer
from .loss import LossTerms, policy_loss


def _rl_loss(tb: TokenBatch, *, config: TrainConfig) -> LossTerms:
    return policy_loss(tb.logprobs, tb.old_logprobs, tb.advantages, tb.weights, tb.sequence_ids, tb.entropy,
                       kind=config.loss, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
                       beta=config.kl_coef(), ref=tb.ref_logprobs)


def prepare_rl(trainer: Trainer, groups: Sequence[TrajectoryGroup], config: TrainConfig) -> PreparedCall:
    config.check()
    tok = tokenize_groups(groups, trainer.tokenizer, scale_rewards=config.scale_rewards,
                          allow_training_without_logprobs=config.allow_training_without_logprobs,
                          require_logprobs=config.require_logprobs,
                          end_ids=end_of_turn_ids(trainer.tokenizer, trainer.model))
    if not tok.groups:
        return PreparedCall("rl", None, None, None, [], config.max_grad_norm, tok.stats)
    max_len = min(trainer.max_length, config.max_row_length or trainer.max_length)
    packed = pack(tok.groups, row_length=config.row_length, max_length=max_len, on_too_long=config.on_too_long,
                  share_prompts=config.share_prompts, pad_id=trainer.pad_id)
    if packed.num_rows == 0:
        return PreparedCall("rl", packed, None, None, [], config.max_grad_norm, tok.stats)
    plan = plan_batches(packed, per_device_train_batch_size=config.rows_per_forward(
                            trainer.device.type, config.grad_accumulation_sequences),
                        max_tokens_per_microbatch=config.max_tokens_per_microbatch,
                        grad_accumulation_sequences=config.grad_accumulation_sequences)
    return PreparedCall("rl", packed, plan, partial(_rl_loss, config=config),
                        [config.learning_rate] * len(plan.steps), config.max_grad_norm, tok.stats,
                        need_ref=config.kl_coef() > 0)
