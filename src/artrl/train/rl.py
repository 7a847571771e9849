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
truncated importance sampling) in the loss function; artrl's off-policy options
(train/offpolicy.py) there too, and in what the trainer computes per step. Each
sequence's policy age (the call's version minus the one its rollout started on)
goes to the trainer for the mismatch figures by age.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from ..errors import ConfigError
from ..preprocess.advantages import balance_advantages
from ..preprocess.build import BuiltCall
from ..trajectories.tokenization import tokenize_groups
from ..trajectories.data import TrajectoryGroup, sampled_policy_versions
from ..types import TrainConfig
from .call import BuildContext, PreparedCall, build_batches
from .loss import LossTerms, policy_loss
from .offpolicy import Correction
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
                       original=tb.original_logprobs, kl_source=config.kl_penalty_source,
                       correction=Correction.from_config(config))


def rl_loss_fn(config: TrainConfig):
    """The loss a TrainConfig asks for, as the trainer calls it (one TokenBatch -> LossTerms)."""
    return partial(_rl_loss, config=config)


def step_options(config: TrainConfig, ref_adapter: str | None = None,
                 sequence_ages: tuple[int, ...] | None = None) -> StepOptions:
    """What the trainer computes per step for this config (reference pass, KL step mean, chunking, precalc, the
    off-policy correction's trainer logprobs and the mismatch figures' bounds)."""
    correction = Correction.from_config(config)
    return StepOptions(need_ref=config.needs_reference(), ref_adapter=ref_adapter,
                       kl_step_mean=config.kl_penalty_coef > 0, kl_source=config.kl_penalty_source,
                       offpolicy_figures=True,
                       chunk_size=config.logprob_calculation_chunk_size,
                       precalculate_logprobs=config.precalculate_logprobs,
                       routing_replay=config.moe_routing_replay,
                       trainer_old_logprobs=correction.mode is not None, mismatch_bounds=correction.bounds,
                       mask_threshold=correction.mask_threshold, sequence_ages=sequence_ages)


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
    ages = None
    if built.packed is not None:
        _refuse_without_sampled_logprobs(built, config)
        ages = policy_ages(groups, built.packed.sequences, ctx.policy_version)
    return PreparedCall("rl", built, rl_loss_fn(config), learning_rates(built, config), config, tok.stats,
                        step_unit="groups", options=step_options(config, ref_adapter, ages))


def policy_ages(groups: Sequence[TrajectoryGroup], sequences: Sequence, version: int | None) -> tuple[int, ...] | None:
    """Each packed sequence's policy age: `version` (the one the call trains) minus the version its trajectory's
    first sampled turn records (else its `initial_policy_version`); -1 where either is unknown. None when no
    sequence has one."""
    if version is None:
        return None
    ages = []
    for seq in sequences:
        trajectory = groups[seq.group_index].trajectories[seq.trajectory_index]
        recorded = sampled_policy_versions(trajectory)
        start = recorded[0] if recorded else trajectory.initial_policy_version
        ages.append(version - start if start is not None and start <= version else -1)
    return tuple(ages) if any(a >= 0 for a in ages) else None


def _refuse_without_sampled_logprobs(built: BuiltCall, config: TrainConfig) -> None:
    """An off-policy option compares sampled logprobs with the trainer's: a call none of whose trainable tokens
    carries one would train as if it were off, so it is refused, naming the option."""
    named = config.off_policy_options()
    packed = built.packed
    if not named or packed is None:
        return
    trainable = packed.logprobs[packed.trainable_mask]  # [trainable tokens]
    if trainable.numel() and not bool(trainable.isfinite().any()):
        raise ConfigError(
            f"{', '.join(named)} compares the trainer's logprobs with the sampled ones, and none of this call's "
            f"{trainable.numel()} trainable tokens carries a sampled logprob (turns without logprobs are trained as "
            "on-policy: data/turns_missing_logprobs), so the option would change nothing. Train on choices that "
            "carry logprobs (artrl's server records them), or drop the option.")
