"""RL train call: groups -> tokenize -> steps of groups -> packed rows -> policy-gradient steps.

Defaults (types.TrainConfig): CISPO-style loss with ART's clip bounds, advantages
scaled by the group std, the whole call in one optimizer step
(`groups_per_optimizer_step=None`), micro-batches of `per_device_train_batch_size` rows
(2 on a GPU, 1 on a CPU by default). The loss of each optimizer step is
normalised over that step's trainable tokens (train/loss.py, train/trainer.py).

ART's per-call options land here: `advantage_balance` on the tokenized call
(preprocess/advantages.py), the learning-rate multiplier
`num_trajectories_learning_rate_multiplier_power` per optimizer step, and the
loss options (importance sampling level, masks, KL-penalised advantages,
truncated importance sampling) in the loss function.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from ..preprocess.advantages import balance_advantages
from ..preprocess.build import BuiltCall
from ..trajectories.tokenization import tokenize_groups
from ..trajectories.data import TrajectoryGroup
from ..types import TrainConfig
from .call import BuildContext, PreparedCall, build_batches
from .loss import LossTerms, policy_loss
from .trainer import StepOptions, TokenBatch


def _rl_loss(tb: TokenBatch, *, config: TrainConfig) -> LossTerms:
    epsilon, epsilon_high = config.clip_bounds()
    return policy_loss(tb.logprobs, tb.old_logprobs, tb.advantages, tb.weights, tb.sequence_ids, tb.entropy,
                       kind=config.resolved_loss(), epsilon=epsilon, epsilon_high=epsilon_high, beta=config.beta,
                       ref=tb.ref_logprobs, importance_sampling_level=config.importance_sampling_level,
                       max_ratio=config.max_negative_advantage_importance_sampling_weight,
                       mask_prob_ratio=config.mask_prob_ratio, kimi_k2_tau=config.kimi_k2_tau,
                       kl_penalty_coef=config.kl_penalty_coef, kl_mean=tb.kl_mean,
                       truncated_importance_sampling=config.truncated_importance_sampling,
                       original=tb.original_logprobs, kl_source=config.kl_penalty_source)


def rl_loss_fn(config: TrainConfig):
    """The loss a TrainConfig asks for, as the trainer calls it (one TokenBatch -> LossTerms)."""
    return partial(_rl_loss, config=config)


def step_options(config: TrainConfig, ref_adapter: str | None = None) -> StepOptions:
    """What the trainer computes per step for this config (reference pass, KL step mean, chunking, precalc)."""
    return StepOptions(need_ref=config.needs_reference(), ref_adapter=ref_adapter,
                       kl_step_mean=config.kl_penalty_coef > 0, kl_source=config.kl_penalty_source,
                       offpolicy_figures=True,
                       chunk_size=config.logprob_calculation_chunk_size,
                       precalculate_logprobs=config.precalculate_logprobs,
                       routing_replay=config.moe_routing_replay)


def build_rl(groups: Sequence[Sequence], config: TrainConfig, ctx: BuildContext) -> BuiltCall:
    """Tokenized groups -> steps of groups -> rows -> micro-batches, as config says (also `artrl bench train`)."""
    return build_batches(groups, config, ctx, units_per_step=config.groups_per_optimizer_step,
                         rows_per_step=config.grad_accumulation_sequences)


def learning_rates(built: BuiltCall, config: TrainConfig) -> list[float]:
    """One learning rate per optimizer step: `learning_rate * sequences_in_step ** power` (ART's multiplier)."""
    if built.plan is None:
        return []
    power = config.num_trajectories_learning_rate_multiplier_power
    return [config.learning_rate * (float(step.sequences) ** power if power else 1.0) for step in built.plan.steps]


def prepare_rl(ctx: BuildContext, groups: Sequence[TrajectoryGroup], config: TrainConfig, *,
               ref_adapter: str | None = None) -> PreparedCall:
    """Tokenize (validating each trajectory), balance, build and plan one RL call with a checked `config`.
    `ref_adapter`: a loaded adapter as the KL reference."""
    tok = tokenize_groups(groups, ctx.tokenizer, scale_rewards=config.scale_rewards,
                          allow_training_without_logprobs=config.allow_training_without_logprobs,
                          require_logprobs=config.require_logprobs, end_ids=ctx.end_ids, vision=ctx.vision)
    if config.advantage_balance:
        balance_advantages(tok.groups, config.advantage_balance)
    built = build_rl(tok.groups, config, ctx) if tok.groups else BuiltCall(None, None)
    return PreparedCall("rl", built, rl_loss_fn(config), learning_rates(built, config), config, tok.stats,
                        step_unit="groups", options=step_options(config, ref_adapter))
