"""Typed configuration of a train call, and its result.

`TrainConfig` (RL) and `TrainSFTConfig` (SFT) keep ART's names and defaults for
the fields ART has (`learning_rate`, `batch_size`, and every keyword of ART's
`LocalBackend.train` / key of `art.dev.TrainConfig`: `ppo`, `epsilon`,
`kl_penalty_coef`, `advantage_balance`, ...; docs/art-compatibility.md)
and add the knobs ART hides or ignores (`beta`, `loss`, batching). The model's
config (`InternalModelConfig`) is config/model.py's; it supplies these configs' defaults.
The batching knobs live here and nowhere else:

* An optimizer step is defined by data: `groups_per_optimizer_step` groups (RL) or
  `batch_size` trajectories (SFT). Each step's data is then packed into rows.
* `per_device_train_batch_size` rows go through one forward/backward pass (by
  default 2 on a GPU, 1 on a CPU), or, when `max_tokens_per_microbatch` is set,
  as many rows as fit that many tokens.
* `grad_accumulation_sequences`, when set, makes a step of that many packed rows
  instead (the packing-dependent meaning of ART's row-per-step trainer).

The loss of an optimizer step is normalised over that step's trainable tokens,
so row length, prompt sharing and micro-batch size change speed and memory,
never the math (docs/batching.md). All cross-field checks are in `check()`
methods; a train call's config is built and checked once, when the call
arrives (`InternalModelConfig.call_config` in config/model.py, LocalBackend), and passed down
checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypedDict, Union

import pydantic
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_param import ChatCompletionMessageParam
from openai.types.chat.chat_completion_tool_param import ChatCompletionToolParam

from .errors import ConfigError

# ART's message types (art.types). A message is an OpenAI chat message dict, kept as given
# (pydantic does not validate it; `revalidate` checks it before it is logged or trained on).
Message = Annotated[ChatCompletionMessageParam, pydantic.SkipValidation]
MessageOrChoice = Union[Message, Choice]
Messages = list[Message]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[ChatCompletionToolParam]

TooLongPolicy = Literal["drop", "truncate", "error"]


class StrictConfig(pydantic.BaseModel):
    """A config that refuses unknown fields and checks every assignment, raising ConfigError."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as e:
            raise ConfigError(f"{type(self).__name__} is invalid: {e}") from None


PER_DEVICE_TRAIN_BATCH_SIZE_CPU = 1
PER_DEVICE_TRAIN_BATCH_SIZE_ACCELERATOR = 2


class BatchConfig(StrictConfig):
    """How rows become forward passes (shared by RL and SFT)."""

    per_device_train_batch_size: int | None = pydantic.Field(
        None, ge=1, description="Rows per forward/backward pass (a micro-batch). None (the default): "
        f"{PER_DEVICE_TRAIN_BATCH_SIZE_ACCELERATOR} on a GPU, {PER_DEVICE_TRAIN_BATCH_SIZE_CPU} on a CPU, where a second long row "
        "per pass adds memory traffic, not speed (docs/performance.md). Ignored when "
        "max_tokens_per_microbatch is set.")
    max_tokens_per_microbatch: int | None = pydantic.Field(
        None, ge=1, description="If set, a micro-batch takes as many rows as fit this many token "
        "slots (rows x row length); must be at least row_length when that is set, and bounds the automatic "
        "row length (a trajectory longer than it then follows on_too_long).")
    row_length: int | None = pydantic.Field(
        None, ge=16, description="Length of a packed row in tokens. None chooses it automatically "
        "(docs/batching.md: the shortest length within 1% of the fewest computed tokens, bounded by "
        "the model's maximum length, max_row_length and max_tokens_per_microbatch).")
    max_row_length: int | None = pydantic.Field(
        None, ge=16, description="Upper bound for the automatic row length (None: the model's maximum).")
    on_too_long: TooLongPolicy = pydantic.Field(
        "drop", description="A trajectory longer than a row: 'drop' it (counted and logged), "
        "'truncate' it to fit (counted), or raise an 'error'.")
    share_prompts: bool = pydantic.Field(
        True, description="Store a group's common prompt once per row (prefix-sharing attention).")

    def resolved_per_device_train_batch_size(self, device_type: str, rows_per_step: int | None = None) -> int:
        """per_device_train_batch_size, or its device default (never more than `rows_per_step`, the rows of a
        step when grad_accumulation_sequences sets them)."""
        if self.per_device_train_batch_size is not None:
            return self.per_device_train_batch_size
        rows = PER_DEVICE_TRAIN_BATCH_SIZE_CPU if device_type == "cpu" else PER_DEVICE_TRAIN_BATCH_SIZE_ACCELERATOR
        return min(rows, rows_per_step) if rows_per_step else rows

    def check(self) -> None:
        if (
            self.max_tokens_per_microbatch is not None
            and self.row_length is not None
            and self.max_tokens_per_microbatch < self.row_length
        ):
            raise ConfigError(
                f"max_tokens_per_microbatch={self.max_tokens_per_microbatch} is smaller than "
                f"row_length={self.row_length}, so no row fits a micro-batch; raise "
                "max_tokens_per_microbatch or lower row_length."
            )
        if self.row_length is not None and self.max_row_length is not None and self.row_length > self.max_row_length:
            raise ConfigError(
                f"row_length={self.row_length} exceeds max_row_length={self.max_row_length}; set one of them."
            )


class OptimizerConfig(StrictConfig):
    """AdamW settings of a train call (ART's trainer_args names), applied to every optimizer step of it."""

    adam_beta1: float = pydantic.Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = pydantic.Field(0.99, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = pydantic.Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = pydantic.Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    max_grad_norm: float | None = pydantic.Field(1.0, gt=0, description="Gradient clipping (None: off).")

    def optimizer_settings(self) -> dict[str, Any]:
        """The param-group entries a torch AdamW reads each step."""
        return {"betas": (self.adam_beta1, self.adam_beta2), "eps": self.adam_epsilon,
                "weight_decay": self.weight_decay}


# ART options accepted with a notice: they have no effect here (docs/art-compatibility.md).
_ROUTING_BUNDLE = ("it names an ART Megatron routing bundle; artrl replays the routing its server recorded with "
                   "each sampled token (moe_routing_replay, on by default)")
NO_EFFECT_TRAIN_OPTIONS = {
    "moe_routing_replay_path": _ROUTING_BUNDLE,
    "moe_routing_replay_bundle": _ROUTING_BUNDLE,
    "moe_routing_replay_strict": _ROUTING_BUNDLE,
    "scale_learning_rate_by_reward_std_dev": "ART 0.5.17's LocalBackend accepts it but no code path reads it "
                                             "(its learning-rate scaling by the reward std history was removed).",
}
_OPTIMIZER_IN_EVERY_CHECKPOINT = ("artrl writes the optimizer state into every checkpoint, so each step can resume "
                                  "with its optimizer whatever this says (ART's Megatron trainer saves it less often)")
# ...and those whose promise artrl keeps anyway: noticed once when set to anything but ART's default.
KEPT_ANYWAY_TRAIN_OPTIONS = {
    "optimizer_save_interval": (5, _OPTIMIZER_IN_EVERY_CHECKPOINT),
    "final_training_step": (None, _OPTIMIZER_IN_EVERY_CHECKPOINT),
}

ImportanceSamplingLevel = Literal["token", "sequence", "average", "geometric_average"]
IMPORTANCE_SAMPLING_CLIP_MAX = 3.0  # TRL's vllm_importance_sampling_clip_max default
ImportanceSamplingCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                                       "geometric_truncate", "geometric_mask"]

# ART's clip defaults, which depend on the loss (art/loss.py): CISPO clips the detached importance weight to
# [1 - 1.0, 1 + 4.0] = [0, 5]; PPO's surrogate clips the ratio to [0.8, 1.2].
CISPO_EPSILON, CISPO_EPSILON_HIGH = 1.0, 4.0
PPO_EPSILON = 0.2


class TrainConfig(BatchConfig, OptimizerConfig):
    """One RL train call (`model.train(groups, config=TrainConfig(...))`, or `backend.train(model, groups, **fields)`).

    The fields after `learning_rate` that ART has (`art.dev.TrainConfig`, `LocalBackend.train`'s keywords) keep
    ART's meaning and default; docs/art-compatibility.md lists where the result differs and why.
    """

    learning_rate: float = pydantic.Field(5e-6, gt=0, description="AdamW learning rate for this call.")
    # ----------------------------------------------------------------- policy loss (ART names)
    ppo: bool = pydantic.Field(
        False, description="ART: PPO's clipped surrogate instead of CISPO (the default). Same as loss='ppo'.")
    loss: Literal["cispo", "ppo", "gspo"] | None = pydantic.Field(
        None, description="Policy loss (train/loss.py): clipped, detached importance weight times advantage times "
        "logprob ('cispo'), PPO's clipped surrogate ('ppo'), or PPO with a sequence-level ratio value and "
        "token-level gradient ('gspo', GSPO-token). None: 'ppo' if ppo else 'cispo'.")
    epsilon: float | None = pydantic.Field(
        None, gt=0, description="Lower clip: ratio >= 1 - epsilon. None: ART's default for the loss, "
        f"{CISPO_EPSILON} for CISPO, {PPO_EPSILON} for PPO-shaped losses ('ppo', 'gspo').")
    epsilon_high: float | None = pydantic.Field(
        None, gt=0, description="Upper clip: ratio <= 1 + epsilon_high. None: ART's default, "
        f"{CISPO_EPSILON_HIGH} for CISPO, epsilon for PPO-shaped losses.")
    importance_sampling_level: ImportanceSamplingLevel = pydantic.Field(
        "token", description="ART: the importance ratio of a token is its own ('token'), its sequence's "
        "exp(mean log-ratio) ('sequence'), the mean of the two ('average') or their geometric mean "
        "('geometric_average').")
    max_negative_advantage_importance_sampling_weight: float | None = pydantic.Field(
        None, ge=0, description="ART: cap every token's importance ratio at this value (ART applies it to all "
        "tokens, whatever the advantage's sign). None or 0: off.")
    mask_prob_ratio: bool = pydantic.Field(
        False, description="ART: a ratio outside (1 - epsilon, 1 + epsilon_high) becomes 0 before clipping.")
    kimi_k2_tau: float | None = pydantic.Field(
        None, description="ART (Kimi K2): per-token advantage -= tau * (new - sampled logprob), detached. "
        "None or 0: off.")
    truncated_importance_sampling: float | None = pydantic.Field(
        None, gt=0, description="ART: multiply each token's loss by the detached importance ratio capped at "
        "this value; with precalculate_logprobs the ratio is trainer / sampler (the sampler mismatch).")
    precalculate_logprobs: bool = pydantic.Field(
        False, description="ART: before the first step, recompute the logprobs of every trainable token with "
        "the current weights and use them as the old logprobs (the sampled ones are kept for "
        "truncated_importance_sampling). One extra no-grad forward over the call.")
    # ----------------------------------------------------------------- off-policy corrections (artrl, TRL's names)
    importance_sampling_correction: ImportanceSamplingCorrection | None = pydantic.Field(
        None, description="artrl (TRL's vllm_importance_sampling_mode, for any sampler): weigh each token's policy "
        "loss by the trainer/sampler ratio, the trainer's logprob at the weights the call starts from over the "
        "token record's sampled one (kernel mismatch and staleness alike; in-flight replies per token): the "
        "token's own ('token_*'), its sequence's product ('sequence_*') or their geometric mean "
        "('geometric_*'), clipped into [importance_sampling_clip_min, importance_sampling_clip_max] "
        "('*_truncate') or zeroed outside it ('*_mask'). The loss's old logprobs are then the trainer's "
        "(the first pass's own in a one-step call, else recomputed once before the first step, as "
        "precalculate_logprobs). None (the default): off. docs/off-policy.md.")
    importance_sampling_clip_min: float | None = pydantic.Field(
        None, ge=0, description="artrl (TRL's vllm_importance_sampling_clip_min): lower bound of "
        "importance_sampling_correction's ratio (IcePop-style masking of ratios below it). None: no lower bound.")
    importance_sampling_clip_max: float | None = pydantic.Field(
        None, gt=0, description="artrl (TRL's vllm_importance_sampling_clip_max): upper bound of "
        "importance_sampling_correction's ratio. None: "
        f"{IMPORTANCE_SAMPLING_CLIP_MAX}, TRL's default.")
    off_policy_mask_threshold: float | None = pydantic.Field(
        None, gt=0, description="artrl (TRL's name; DeepSeek-V3.2's off-policy sequence masking, its delta): leave "
        "out of the policy loss every sequence with a negative advantage whose mean (sampled - current) logprob "
        "exceeds this many nats, each optimizer step. None: off.")
    use_bias_correction_kl: bool = pydantic.Field(
        False, description="artrl (TRL's name; DeepSeek-V3.2's unbiased KL estimate): multiply each token's beta "
        "k3 term by exp(new - sampled logprob), with its gradient, since the tokens came from the sampler. "
        "Needs beta > 0.")
    # ----------------------------------------------------------------- advantages (ART names)
    scale_rewards: bool = pydantic.Field(
        True, description="Divide group-relative advantages by the group's reward std.")
    advantage_balance: float = pydantic.Field(
        0.0, ge=-1, le=1, description="ART: > 0 scales negative advantages by (1 - balance), < 0 scales positive "
        "ones by (1 + balance); the call's mean |advantage| per token is then restored (1: positives only, "
        "-1: negatives only).")
    kl_penalty_coef: float = pydantic.Field(
        0.0, ge=0, description="ART: KL-penalised advantages. Each trainable token's advantage gets "
        "coef * (mean_kl - kl_t) with kl_t = new - reference logprob (detached) and mean_kl its mean over the "
        "optimizer step: tokens that drift more from the reference get less advantage. Needs a reference "
        "forward pass per micro-batch. Not a loss term (that is `beta`).")
    kl_penalty_reference_step: int | None = pydantic.Field(
        None, ge=0, description="ART: the reference of kl_penalty_coef (and beta) is this checkpoint of the model "
        "(None: the base model, adapter off).")
    kl_ref_adapter_path: str | None = pydantic.Field(
        None, description="ART: the reference is the LoRA adapter saved in this directory (overrides "
        "kl_penalty_reference_step).")
    kl_penalty_source: Literal["current_learner", "sample"] = pydantic.Field(
        "current_learner", description="ART 0.5.23: whose logprobs kl_penalty_coef compares with the reference: "
        "the trainer's current ones ('current_learner': kl_t = new - ref) or the rollout policy's ('sample': "
        "kl_t = old - ref, old being the sampled logprobs, or the recomputed ones with precalculate_logprobs; a "
        "token without one uses new). Also what loss/kl_policy_ref reports.")
    kl_penalty_step_lag: int | None = pydantic.Field(
        None, ge=1, description="ART 0.5.23 (art.dev.TrainConfig; PipelineTrainer's moving reference): the KL "
        "reference is the model's checkpoint this many steps before the current one (max(0, step - lag)). "
        "Excludes kl_penalty_reference_step and kl_ref_adapter_path.")
    beta: float = pydantic.Field(
        0.0, ge=0, description="artrl: a KL loss term beta * k3(reference, new) per token (train/loss.py), against "
        "the base model or the reference named above. 0 turns it off. ART's kl_penalty_coef adjusts "
        "advantages instead.")
    # ----------------------------------------------------------------- learning rate (ART names)
    num_trajectories_learning_rate_multiplier_power: float = pydantic.Field(
        0.0, description="ART: each optimizer step's learning rate is multiplied by (sequences in the step) ** "
        "power. 0: off.")
    scale_learning_rate_by_reward_std_dev: bool = pydantic.Field(
        False, description="ART 0.5.17 accepts it and no code path reads it; no effect here either (one notice).")
    # ----------------------------------------------------------------- mixture-of-experts models
    moe_routing_replay: bool = pydantic.Field(
        True, description="A mixture-of-experts model's sampled tokens take, in every MoE layer, the experts the "
        "engine's router picked for them (the token record's routed_experts; train/routing.py). False: the "
        "trainer's router decides (the call still counts the tokens whose choice differs).")
    moe_routing_replay_path: str | None = pydantic.Field(
        None, description="ART 0.5.18 (Megatron back end): a routing bundle to replay from. No effect here: artrl "
        "replays the routing the server recorded with each sampled token (one notice).")
    moe_routing_replay_bundle: Any = pydantic.Field(
        None, description="ART 0.5.18 (Megatron back end): an in-memory routing bundle. No effect here (one notice).")
    moe_routing_replay_strict: bool = pydantic.Field(
        True, description="ART 0.5.18 (Megatron back end): fail when a bundle misses a router. No effect here.")
    # ----------------------------------------------------------------- checkpoints (ART 0.5.23)
    optimizer_save_interval: int = pydantic.Field(
        5, ge=1, description="ART 0.5.23: save the optimizer state at least every this many steps (and at "
        "final_training_step); ART's Megatron trainer reads it. artrl writes the optimizer state into every "
        "checkpoint, which keeps that promise at any value (a value other than 5 is noticed once).")
    final_training_step: int | None = pydantic.Field(
        None, ge=1, description="ART 0.5.23: the run's last step, whose checkpoint must hold the optimizer state "
        "(ART's Megatron trainer also finishes publishing there). Every artrl checkpoint holds it (noticed once "
        "when set).")
    # ----------------------------------------------------------------- data and engine
    allow_training_without_logprobs: bool = pydantic.Field(
        False, description="ART's meaning: also train the plain assistant message dicts of RL trajectories, "
        "as on-policy (importance ratio 1). Sampled turns (Choices) without logprobs train as on-policy "
        "whatever this says, unless require_logprobs.")
    require_logprobs: bool = pydantic.Field(
        False, description="Refuse a sampled turn that carries no logprobs (TrajectoryError naming the "
        "trajectory) instead of training it as on-policy (counted as data/turns_missing_logprobs). Our "
        "server returns logprobs on every choice; turn this on to catch rollouts from servers that do not.")
    logprob_calculation_chunk_size: int | None = pydantic.Field(
        None, ge=1, description="ART: tokens per LM-head chunk when computing logprobs (memory only, never the "
        "math). None: the model's logprob_chunk_size (1024, as ART).")
    plot_tensors: bool = pydantic.Field(
        False, description="ART: draw the call's packed rows (token ids, logprobs, segments, mask, advantages, "
        "weights) as heatmaps into the model's run directory (packed_tensors_plot_<ms>.png).")
    groups_per_optimizer_step: int | None = pydantic.Field(
        None, ge=1, description="Trajectory groups per optimizer step, in the order given; None (the default) "
        "trains the whole call in one step. Steps are cut before packing, so the layout never changes them.")
    grad_accumulation_sequences: int | None = pydantic.Field(
        None, ge=1, description="If set, packed rows per optimizer step instead of groups_per_optimizer_step: the "
        "number of steps then depends on how the call was packed (row_length, share_prompts), as in a "
        "row-per-step trainer. Leave None unless you want that.")

    def resolved_loss(self) -> Literal["cispo", "ppo", "gspo"]:
        """The policy loss: `loss` if set, else 'ppo' when ppo, else 'cispo'."""
        if self.loss is not None:
            return self.loss
        return "ppo" if self.ppo else "cispo"

    def clip_bounds(self) -> tuple[float, float]:
        """(epsilon, epsilon_high) with ART's loss-dependent defaults filled in."""
        if self.resolved_loss() == "cispo":
            eps = self.epsilon if self.epsilon is not None else CISPO_EPSILON
            high = self.epsilon_high if self.epsilon_high is not None else CISPO_EPSILON_HIGH
        else:
            eps = self.epsilon if self.epsilon is not None else PPO_EPSILON
            high = self.epsilon_high if self.epsilon_high is not None else eps
        return eps, high

    def notice_ignored(self) -> None:
        """Log once per process each option set on this config that has no effect here (and why)."""
        from .runtime.notices import notice_once

        for name, why in NO_EFFECT_TRAIN_OPTIONS.items():
            if name in self.model_fields_set:
                notice_once(f"TrainConfig.{name}", f"TrainConfig {name}={getattr(self, name)!r} has no effect in "
                            f"artrl: {why}")
        for name, (default, why) in KEPT_ANYWAY_TRAIN_OPTIONS.items():
            if getattr(self, name) != default:
                notice_once(f"TrainConfig.{name}", f"TrainConfig {name}={getattr(self, name)!r}: {why}.")

    def needs_reference(self) -> bool:
        """Whether a train step needs reference logprobs (a KL term or KL-penalised advantages)."""
        return self.beta > 0 or self.kl_penalty_coef > 0

    def check(self) -> None:
        super().check()
        if self.require_logprobs and self.allow_training_without_logprobs:
            raise ConfigError(
                "require_logprobs=True refuses turns without logprobs, and allow_training_without_logprobs=True "
                "trains assistant dicts (which have none) as on-policy; set only one of them."
            )
        if self.kl_penalty_step_lag is not None and (self.kl_penalty_reference_step is not None
                                                     or self.kl_ref_adapter_path is not None):
            raise ConfigError(
                f"kl_penalty_step_lag={self.kl_penalty_step_lag} names a moving KL reference, and "
                f"kl_penalty_reference_step={self.kl_penalty_reference_step} / kl_ref_adapter_path="
                f"{self.kl_ref_adapter_path!r} a fixed one; set only one of them.")
        if self.ppo and self.loss == "cispo":
            raise ConfigError("ppo=True and loss='cispo' contradict each other; ppo=True is loss='ppo' (or set "
                              "loss='gspo'). Set only one of them.")
        if self.loss == "gspo" and self.importance_sampling_level != "token":
            raise ConfigError(
                f"loss='gspo' already uses a sequence-level ratio; importance_sampling_level="
                f"{self.importance_sampling_level!r} would apply a second one. Use loss='gspo' alone, or "
                f"ppo=True with importance_sampling_level={self.importance_sampling_level!r} (ART's GSPO).")
        self._check_off_policy()
        if self.groups_per_optimizer_step is not None and self.grad_accumulation_sequences is not None:
            raise ConfigError(
                f"groups_per_optimizer_step={self.groups_per_optimizer_step} and grad_accumulation_sequences="
                f"{self.grad_accumulation_sequences} both define optimizer steps; set one (groups_per_optimizer_step "
                "keeps the steps independent of packing).")
        if self.max_tokens_per_microbatch is None and self.grad_accumulation_sequences is not None \
                and self.per_device_train_batch_size is not None:
            if self.per_device_train_batch_size > self.grad_accumulation_sequences:
                raise ConfigError(
                    f"per_device_train_batch_size={self.per_device_train_batch_size} is larger than "
                    f"grad_accumulation_sequences={self.grad_accumulation_sequences}; a micro-batch never "
                    "spans two optimizer steps, so the effective batch would be "
                    f"{self.grad_accumulation_sequences}. Lower per_device_train_batch_size or raise "
                    "grad_accumulation_sequences."
                )


    def _check_off_policy(self) -> None:
        """artrl's off-policy options: each refused where it cannot apply (never accepted and ignored)."""
        mode = self.importance_sampling_correction
        bounds = {k: getattr(self, k) for k in ("importance_sampling_clip_min", "importance_sampling_clip_max")
                  if getattr(self, k) is not None}
        if mode is None and bounds:
            named = ", ".join(f"{k}={v}" for k, v in bounds.items())
            raise ConfigError(f"{named} bounds the weights of importance_sampling_correction, which is None, so it "
                              "would change nothing; set importance_sampling_correction (e.g. 'token_mask'), or "
                              "drop the bound.")
        if mode is not None and self.truncated_importance_sampling:
            raise ConfigError(
                f"importance_sampling_correction={mode!r} and truncated_importance_sampling="
                f"{self.truncated_importance_sampling} both weigh the loss by the trainer/sampler ratio; set one. "
                f"ART's truncated_importance_sampling=c (with precalculate_logprobs=True) is "
                f"importance_sampling_correction='token_truncate' with importance_sampling_clip_max=c.")
        lo, hi = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if mode is not None and lo is not None and lo >= (hi if hi is not None else IMPORTANCE_SAMPLING_CLIP_MAX):
            raise ConfigError(f"importance_sampling_clip_min={lo} is not below importance_sampling_clip_max="
                              f"{hi if hi is not None else f'{IMPORTANCE_SAMPLING_CLIP_MAX} (its default)'}: no ratio "
                              "would lie between them. "
                              "Lower the minimum or raise the maximum.")
        sequence_ratio = "loss='gspo'" if self.resolved_loss() == "gspo" else (
            "importance_sampling_level='sequence'" if self.importance_sampling_level == "sequence" else None)
        if mode is not None and sequence_ratio and not mode.startswith("geometric_"):
            raise ConfigError(
                f"importance_sampling_correction={mode!r} contradicts {sequence_ratio}: that policy ratio is one "
                "per sequence, the geometric mean of its tokens' ratios, while this correction weighs "
                + ("each token by its own ratio" if mode.startswith("token_") else "a sequence by the product of "
                   "its tokens' ratios")
                + f". Use importance_sampling_correction='geometric_{mode.partition('_')[2]}' (the same ratio as "
                "the policy's), or " + ("loss='ppo' (a token-level ratio)." if sequence_ratio.startswith("loss")
                                        else "importance_sampling_level='token'."))
        if self.use_bias_correction_kl and self.beta <= 0:
            raise ConfigError("use_bias_correction_kl=True weighs the beta KL loss term, and beta=0 has none (ART's "
                              "kl_penalty_coef shapes advantages instead); set beta > 0, or drop the option.")

    def off_policy_options(self) -> list[str]:
        """The artrl off-policy options this config turns on, as `name=value` (for messages)."""
        on = [(n, getattr(self, n)) for n in ("importance_sampling_correction", "off_policy_mask_threshold")
              if getattr(self, n) is not None]
        on += [("use_bias_correction_kl", True)] if self.use_bias_correction_kl else []
        return [f"{n}={v!r}" for n, v in on]


# ART (art/local/backend.py `_train_sft`): batch_size="auto" is 2 trajectories per optimizer step.
SFT_AUTO_BATCH_SIZE = 2


class TrainSFTConfig(BatchConfig, OptimizerConfig):
    """One SFT train call (`model.train_sft(trajectories, config=TrainSFTConfig(...))`)."""

    learning_rate: float | list[float] = pydantic.Field(
        5e-5, description="One value for every optimizer step, or a list with one value per "
        "optimizer step (see artrl.schedules for constant/linear/cosine helpers).")
    batch_size: int | Literal["auto"] = pydantic.Field(
        "auto", description=f"Trajectories per optimizer step; 'auto' = {SFT_AUTO_BATCH_SIZE} "
        "(or all of them when fewer).")
    assistant_turns: Literal["all", "last"] = pydantic.Field(
        "all", description="ART 0.5.23: train every assistant turn ('all') or only the final message of each "
        "trajectory, which must then be an assistant turn ('last'; a trajectory ending otherwise is refused, "
        "naming it, and its additional_histories train nothing).")
    shuffle: bool = pydantic.Field(False, description="Shuffle trajectories (with `seed`) before batching.")
    seed: int = pydantic.Field(0, description="Seed of the shuffle (mixed with the model's optimizer step count, "
                               "so every call shuffles differently and reproducibly).")

    def resolved_batch_size(self, n_trajectories: int) -> int:
        if self.batch_size == "auto":
            return max(1, min(SFT_AUTO_BATCH_SIZE, n_trajectories))
        if self.batch_size < 1:
            raise ConfigError(f"TrainSFTConfig.batch_size={self.batch_size}; it must be >= 1 or 'auto'.")
        return self.batch_size

    def learning_rates(self, n_steps: int) -> list[float]:
        lr = self.learning_rate
        if isinstance(lr, list):
            if len(lr) != n_steps:
                raise ConfigError(
                    f"TrainSFTConfig.learning_rate has {len(lr)} values but this call makes {n_steps} "
                    "optimizer steps (trajectories / batch_size, rounded up); give one value per step, "
                    "e.g. artrl.schedules.cosine(peak, n_steps)."
                )
            rates = lr
        else:
            rates = [lr] * n_steps
        for i, r in enumerate(rates):
            # 0 is allowed: ART's linear schedules (art.utils.sft.create_lr_schedule) end at min_lr=0.
            if not 0 <= r < float("inf"):
                raise ConfigError(f"TrainSFTConfig.learning_rate[{i}]={r}; learning rates must be finite and >= 0.")
        return rates


@dataclass
class TrainResult:
    """What `backend.train(...)` returns (ART's `art.TrainResult`).

    Attributes:
        step: the model's step after this call.
        metrics: the call's aggregated metrics (loss, gradient norm, data counts...).
    """

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LocalTrainResult(TrainResult):
    """What `LocalBackend.train(...)` returns (ART's `art.LocalTrainResult`).

    Attributes:
        checkpoint_path: the checkpoint directory this call wrote, or None when it wrote none.
    """

    checkpoint_path: str | None = None


@dataclass
class ServerlessTrainResult(TrainResult):
    """ART's result type of `ServerlessBackend.train` (that backend is not available here; see serverless.py)."""

    artifact_name: str | None = None


class SFTMetricLoggingConfig(TypedDict, total=False):
    """ART's `metric_logging` of an SFT call (`_config["metric_logging"]`): whether the call logs its metrics, and
    at which step (dev/train.py checks a given value against these keys)."""

    enabled: bool
    target_training_step: int


Verbosity = Literal[0, 1, 2]  # ART's verbosity of a train call's output

#: ART 0.5.23's configs of its Megatron back end, which artrl does not have: importing one says so.
_MEGATRON_NAMES = frozenset({"MegatronTopologyConfig", "MegatronRuntimeConfig"})


def __getattr__(name: str) -> object:
    if name in _MEGATRON_NAMES:
        raise AttributeError(f"artrl has no {name}: it configures ART's Megatron back end, which artrl does not "
                             "have (LocalBackend trains with transformers + peft; docs/art-compatibility.md)")
    raise AttributeError(f"module 'artrl.types' has no attribute {name!r}")
