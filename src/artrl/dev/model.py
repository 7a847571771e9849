"""ART's nested model configuration (`art.dev.InternalModelConfig` and its parts) mapped onto artrl's.

ART configures a trainable model with a nested dict: `init_args` (Unsloth's
model loading), `engine_args` (vLLM), `trainer_args` (Hugging Face's Trainer),
GPU ids and Tinker settings. artrl has
one flat, typed `InternalModelConfig` (types.py). `flatten_internal_config`
turns either shape (or a mix) into the flat one:

    section / key                                   -> artrl field
    init_args.max_seq_length                        -> max_length
    init_args.dtype                                 -> dtype ("bf16" -> "bfloat16", None -> "auto", ...)
    init_args.use_gradient_checkpointing,
    trainer_args.gradient_checkpointing             -> gradient_checkpointing
    init_args.random_state                          -> seed
    init_args.load_in_4bit / load_in_8bit           -> load_in_4bit / load_in_8bit (models/quantization.py)
    init_args/engine_args.trust_remote_code         -> trust_remote_code
    engine_args.max_num_seqs                        -> inference_max_batch_size
    engine_args.max_model_len                       -> inference_max_length
    engine_args.allowed_local_media_path            -> allowed_local_media_path (file:// images, artrl/chat/images.py)
    trainer_args.per_device_train_batch_size        -> per_device_train_batch_size (call default)
    trainer_args.gradient_accumulation_steps        -> grad_accumulation_sequences (rows per step, call default)
    trainer_args.adam_beta1 / adam_beta2 /
    adam_epsilon / weight_decay / max_grad_norm     -> the same names (call defaults)
    trainer_args.optim                              -> optim (config/optimizers.py)

`engine_args` are vLLM's engine arguments: the whole section is also kept as
artrl's `engine_args` field, which reaches vLLM when it serves the model
(`inference_engine="vllm"`, serve/engines/vllm_args.py). With the built-in engine they
cannot apply, and each unmapped one is noticed once when that engine opens
(`notice_unused_engine_args`), not when the config is built: the engine is only
known then.

ART's top-level keys without an artrl field (`vllm_runtime`,
`megatron_model_initialization`, `allow_unvalidated_arch`, the `chat_template*`
keys; `TOP_LEVEL_KEYS`) are accepted when their value asks for what artrl does
anyway ({'mode': 'managed'}, 'pretrained', ...) and refused with the reason
otherwise. `rollout_weight_update_mode` is artrl's field of that name.

Every other key is accepted and logged once per process (notices.py) with the
reason it has no effect: Unsloth's full fine-tuning (`full_finetuning`), the
Hugging Face Trainer's own loop (`lr_scheduler_type`, `logging_steps`), GPU
splits and Tinker. When two keys give one field different values, the first
in the order flat key, init_args, trainer_args, engine_args wins, with a notice.

The LoRA adapter is ART 0.5.23's `TrainableModel(lora_config=LoRAConfig(...))`
(config/lora.py maps it onto the same flat fields). ART 0.5.18's `peft_args`
section, and `PeftArgs(...)`, raise ART's migration message
(`PEFT_ARGS_MIGRATION_MESSAGE`), as ART 0.5.23 does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn

from typing_extensions import Required, TypedDict

from ..errors import ConfigError
from ..runtime.notices import notice_once
from .engine import EngineArgs


class InitArgs(TypedDict, total=False):
    """How ART loads the base model (Unsloth's FastLanguageModel); any key is accepted."""

    model_name: str
    max_seq_length: int
    dtype: str | None
    load_in_4bit: bool
    load_in_8bit: bool
    full_finetuning: bool
    trust_remote_code: bool
    use_gradient_checkpointing: str | bool
    random_state: int
    fast_inference: bool
    gpu_memory_utilization: float
    max_lora_rank: int
    enable_prefix_caching: bool


class LoRAConfig(TypedDict, total=False):
    """ART 0.5.23's LoRA adapter settings, `TrainableModel(lora_config=LoRAConfig(...))`.

    A plain dict at run time. config/lora.py says what each key does here (or why it is refused).
    """

    rank: int
    target_modules: list[str]
    alpha: int
    dropout: float
    bias: str
    layers_to_transform: list[int] | None
    layers_pattern: str | None
    use_gradient_checkpointing: str
    random_state: int
    max_seq_length: int
    use_rslora: bool
    modules_to_save: list[str] | None
    init_weights: bool
    loftq_config: dict
    temporary_location: str


#: ART 0.5.23's message for its removed `peft_args` (word for word, so a search for it finds the remedy).
PEFT_ARGS_MIGRATION_MESSAGE = (
    "`peft_args` has been replaced by top-level `TrainableModel(lora_config=...)`. Rename keys: r->rank, "
    "lora_alpha->alpha, lora_dropout->dropout, init_lora_weights->init_weights. Keep these keys under lora_config: "
    "target_modules, bias, layers_to_transform, layers_pattern, use_gradient_checkpointing, random_state, "
    "max_seq_length, use_rslora, modules_to_save, loftq_config, temporary_location.")


def PeftArgs(*_: object, **__: object) -> NoReturn:  # noqa: N802 (ART's name)
    """Removed in ART 0.5.23: raises its migration message (use `TrainableModel(lora_config=...)`)."""
    raise ConfigError(PEFT_ARGS_MIGRATION_MESSAGE)


class TrainerArgs(TypedDict, total=False):
    """Hugging Face TrainingArguments as ART passes them; the mapped keys are typed, any key is accepted."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    max_grad_norm: float
    gradient_checkpointing: bool
    lr_scheduler_type: str
    optim: str
    seed: int
    output_dir: str | None
    logging_steps: float
    report_to: str | list[str] | None


class TinkerTrainingClientArgs(TypedDict, total=False):
    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    user_metadata: dict[str, str] | None


class TinkerArgs(TypedDict, total=False):
    renderer_name: Required[str]
    training_client_args: TinkerTrainingClientArgs


class TinkerNativeArgs(TypedDict, total=False):
    renderer_name: Required[str]
    training_client_args: TinkerTrainingClientArgs


class InternalModelConfig(TypedDict, total=False):
    """ART's spelling of the model config: a dict that `artrl.InternalModelConfig` (config/model.py) accepts.

    ART's nested keys; artrl's flat keys (config/model.py's fields) may be mixed in. At run time this is a
    plain dict; `TrainableModel(_internal_config=...)` turns it into the typed `artrl.InternalModelConfig`
    through `flatten_internal_config`.
    """

    init_args: InitArgs
    engine_args: EngineArgs
    trainer_args: TrainerArgs
    tinker_args: TinkerArgs | None
    tinker_native_args: TinkerNativeArgs | None
    trainer_gpu_ids: list[int]
    inference_gpu_ids: list[int]
    rollout_weight_update_mode: str  # ART 0.5.23: "step_lora" or "in_flight_lora" (the built-in engine's)
    inference_replicas: int | None
    inference_endpoints: list[str] | None
    # ART 0.5.23's other keys: accepted where they ask for what artrl does, else refused (TOP_LEVEL_KEYS)
    chat_template_kwargs: dict[str, object]
    chat_template: str
    chat_template_path: str
    chat_template_content_format: str
    chat_template_tool_schema_format: Literal["default", "vllm_openai"]
    vllm_runtime: dict[str, Any]
    allow_unvalidated_arch: bool
    megatron_model_initialization: Literal["pretrained", "random"]
    # artrl's own flat names
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: list[str] | str | None
    use_rslora: bool
    init_lora_weights: bool
    layers_to_transform: list[int] | None
    layers_pattern: str | None
    dtype: str
    device: str | None
    attn_implementation: str | None
    gradient_checkpointing: bool
    trust_remote_code: bool
    max_length: int | None
    logprob_chunk_size: int
    inference_max_batch_size: int
    inference_cpu_threads: int | None
    inference_merge_lora: bool | None
    inference_attn_implementation: str | None
    inference_static_cache: bool
    inference_static_cache_len: int | None
    inference_cuda_graphs: bool | None
    inference_max_length: int | None
    inference_engine: Literal["auto", "builtin", "vllm"]
    seed: int


NESTED_SECTIONS = ("init_args", "trainer_args", "engine_args")  # precedence after flat keys

_DTYPES = {None: "auto", "auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "fp16": "float16", "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


def _dtype(value: Any) -> Any:
    name = str(value).removeprefix("torch.") if value is not None else None
    return _DTYPES.get(name, value)  # anything else reaches the field's own check (a clear ConfigError)


def checkpointing_flag(value: Any) -> bool:
    return bool(value) and value != "false"  # ART passes True or "unsloth"


Converter = Callable[[Any], Any]
_SAME: Converter = lambda v: v  # noqa: E731

# section -> ART key -> (artrl field, converter)
MAPPED: dict[str, dict[str, tuple[str, Converter]]] = {
    "init_args": {"max_seq_length": ("max_length", _SAME), "dtype": ("dtype", _dtype),
                  "load_in_4bit": ("load_in_4bit", _SAME), "load_in_8bit": ("load_in_8bit", _SAME),
                  "trust_remote_code": ("trust_remote_code", _SAME),
                  "use_gradient_checkpointing": ("gradient_checkpointing", checkpointing_flag),
                  "random_state": ("seed", _SAME)},
    "trainer_args": {"per_device_train_batch_size": ("per_device_train_batch_size", _SAME),
                     "gradient_accumulation_steps": ("grad_accumulation_sequences", _SAME),
                     "adam_beta1": ("adam_beta1", _SAME), "adam_beta2": ("adam_beta2", _SAME),
                     "adam_epsilon": ("adam_epsilon", _SAME), "weight_decay": ("weight_decay", _SAME),
                     "max_grad_norm": ("max_grad_norm", _SAME), "optim": ("optim", _SAME),
                     "gradient_checkpointing": ("gradient_checkpointing", checkpointing_flag)},
    "engine_args": {"max_num_seqs": ("inference_max_batch_size", _SAME),
                    "max_model_len": ("inference_max_length", _SAME),
                    "allowed_local_media_path": ("allowed_local_media_path", _SAME),
                    "trust_remote_code": ("trust_remote_code", _SAME)},
}

# Why a key has no effect: per key where it says more than its section's reason.
_SECTION_REASON = {
    "init_args": "it configures Unsloth's model loading; artrl loads the base model with transformers",
    "trainer_args": "it configures Hugging Face's Trainer; artrl runs its own loop (train/trainer.py): "
                    "per-call settings go in TrainConfig",
    "engine_args": "it is a vLLM engine argument; the built-in inference engine has no such setting "
                   "(inference_engine='vllm' applies it)",
}
_KEY_REASON = {
    ("init_args", "full_finetuning"): "artrl trains a LoRA adapter only",
    ("init_args", "model_name"): "the weights are `base_model` (and the run's latest checkpoint)",
    ("init_args", "fast_inference"): "it starts Unsloth's embedded vLLM; artrl serves with its own engine "
                                     "(inference_engine='vllm' picks vLLM)",
    ("init_args", "gpu_memory_utilization"): "it sizes Unsloth's embedded vLLM; with inference_engine='vllm', "
                                             "set engine_args.gpu_memory_utilization",
    ("engine_args", "gpu_memory_utilization"): "the built-in engine allocates its cache per batch, so there "
                                               "is no pool to size; inference_max_batch_size bounds it",
    ("engine_args", "dtype"): "the built-in engine shares one copy of the weights with the trainer; `dtype` "
                              "(init_args.dtype) decides it",
    ("engine_args", "enable_sleep_mode"): "the built-in engine shares one copy of the weights with the trainer, "
                                          "so nothing is put to sleep",
    ("trainer_args", "learning_rate"): "each train call's learning_rate decides (as in ART, which overwrites it "
                                       "per call)",
    ("trainer_args", "beta"): "ART's loss does not read TRL's beta either; use TrainConfig.beta (a KL loss "
                              "term) or kl_penalty_coef (KL-penalised advantages)",
}
_TOP_REASON = {
    "tinker_args": "the Tinker back end is not part of artrl; training runs locally",
    "tinker_native_args": "the Tinker back end is not part of artrl; training runs locally",
}

_CHAT_TEMPLATE = ("artrl renders training data with the tokenizer's own chat template and its server applies the "
                  "same one (chat/format.py); a template of the run's own is not supported yet. Set "
                  "tokenizer.chat_template in the model directory instead")
# ART's top-level keys that artrl has no field for: the values that ask for what artrl does anyway (accepted), and
# why any other value is refused (ConfigError naming the key, its value and this reason).
TOP_LEVEL_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "rollout_weights_mode": (lambda v: v == "lora", "ART 0.5.18: artrl serves the LoRA adapter itself ('lora'); "
                             "merged weights pushed to vLLM ('merged') are not available"),
    "vllm_runtime": (lambda v: isinstance(v, Mapping) and v.get("mode") == "managed" and len(v) == 1,
                     "artrl starts and manages its inference server ({'mode': 'managed'}); to use servers started "
                     "elsewhere, set inference_endpoints=['http://host:port', ...] (docs/distributed.md)"),
    "megatron_model_initialization": (lambda v: v == "pretrained", "the base model's weights are loaded "
                                      "('pretrained'); for random weights use base_model='random:<shape>'"),
    "allow_unvalidated_arch": (lambda v: isinstance(v, bool), "give True or False"),
    "chat_template": (lambda v: v is None, _CHAT_TEMPLATE),
    "chat_template_path": (lambda v: v is None, _CHAT_TEMPLATE),
    "chat_template_kwargs": (lambda v: not v, _CHAT_TEMPLATE),
    "chat_template_content_format": (lambda v: v is None or v == "auto", _CHAT_TEMPLATE),
    "chat_template_tool_schema_format": (lambda v: v is None or v == "default", _CHAT_TEMPLATE),
}


def _check_top_level(key: str, value: Any) -> None:
    same, reason = TOP_LEVEL_KEYS[key]
    if not same(value):
        from ..errors import ConfigError

        raise ConfigError(f"_internal_config {key}={value!r:.120} is not supported by artrl: {reason}.")


def _notice(where: str, value: Any, reason: str) -> None:
    notice_once(f"internal_config.{where}", f"_internal_config {where}={value!r:.80} has no effect in artrl: "
                f"{reason}.")


def flatten_internal_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """ART's nested `InternalModelConfig` (or artrl's flat one, or a mix) -> artrl's flat fields.

    Flat keys pass through unchanged (the typed config checks them); see the module docstring for the table.
    `peft_args` raises ART 0.5.23's migration message (ConfigError).
    """
    if "peft_args" in data:
        raise ConfigError(PEFT_ARGS_MIGRATION_MESSAGE)
    out = {k: v for k, v in data.items() if k not in NESTED_SECTIONS and k not in _TOP_REASON
           and k not in TOP_LEVEL_KEYS}
    source = {k: k for k in out}
    for key in TOP_LEVEL_KEYS.keys() & data.keys():
        _check_top_level(key, data[key])
    if data.get("allow_unvalidated_arch") is False:
        _notice("allow_unvalidated_arch", False, "artrl keeps no list of validated architectures: every one that "
                "transformers loads is allowed")
    for key, reason in _TOP_REASON.items():
        value = data.get(key)
        if value is not None:
            _notice(key, value, reason)
    for section in NESTED_SECTIONS:
        args = data.get(section)
        if args is None:
            continue
        if not isinstance(args, Mapping):
            # leave it to the typed config to refuse (it names the field)
            out[section] = args
            continue
        if section == "engine_args":
            out["engine_args"] = dict(args)  # for vLLM; noticed when the built-in engine opens instead
        for key, value in args.items():
            mapped = MAPPED[section].get(key)
            if mapped is None:
                if section != "engine_args":
                    _notice(f"{section}.{key}", value, _KEY_REASON.get((section, key), _SECTION_REASON[section]))
                continue
            field, convert = mapped
            value = convert(value)
            if field in out:
                if out[field] != value:
                    notice_once(f"internal_config.conflict.{section}.{key}",
                                f"_internal_config {section}.{key}={value!r} and {source[field]}={out[field]!r} both "
                                f"set {field}; using {out[field]!r}.")
                continue
            out[field], source[field] = value, f"{section}.{key}"
    return out


def notice_unused_engine_args(engine_args: Mapping[str, Any]) -> None:
    """Notice, once each, the vLLM engine arguments the built-in engine cannot apply (those that no artrl
    field took: `MAPPED["engine_args"]`)."""
    for key, value in engine_args.items():
        if key not in MAPPED["engine_args"]:
            reason = _KEY_REASON.get(("engine_args", key), _SECTION_REASON["engine_args"])
            notice_once(f"internal_config.engine_args.{key}", f"engine_args.{key}={value!r:.80} has no effect in "
                        f"artrl: {reason}.")
