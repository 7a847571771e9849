"""ART 0.5.23's `TrainableModel(lora_config=art.LoRAConfig(...))` onto the adapter artrl builds.

ART hands `lora_config` to Unsloth / peft. Here each key sets one field of the model's
`InternalModelConfig` (types.py), and that config builds the one adapter the trainer trains
(models/loading.py `add_lora`, in this process or in every training worker); each checkpoint
saves it in peft's format (its `adapter_config.json` records rank, alpha, targets), and the
inference engines serve those checkpoints, so the served and saved adapter is the trained one.

    lora_config key              InternalModelConfig field
    rank                         lora_rank                 (peft's r)
    alpha                        lora_alpha                (peft's lora_alpha)
    dropout                      lora_dropout
    target_modules               target_modules
    use_rslora                   use_rslora
    init_weights                 init_lora_weights         (peft's init_lora_weights; ART types it bool)
    layers_to_transform          layers_to_transform
    layers_pattern               layers_pattern
    random_state                 seed                      (the adapter's initialisation)
    max_seq_length               max_length
    use_gradient_checkpointing   gradient_checkpointing    (ART's "unsloth" or True: on)

Refused with a ConfigError naming the key unless it has its no-op value (REFUSED says why):
`bias` (only "none"), `modules_to_save` (only None or []), `loftq_config` (only None or {}),
`temporary_location` (never). An unknown key is refused too, with the renames for peft's own
names (r -> rank, ...). A key that the model's `_internal_config` also sets, to another value,
is refused rather than one of them winning quietly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..dev.model import LoRAConfig, checkpointing_flag
from ..errors import ConfigError
from .model import InternalModelConfig

_SAME: Callable[[Any], Any] = lambda v: v  # noqa: E731

#: lora_config key -> (InternalModelConfig field, converter)
HONOURED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "rank": ("lora_rank", _SAME),
    "alpha": ("lora_alpha", _SAME),
    "dropout": ("lora_dropout", _SAME),
    "target_modules": ("target_modules", _SAME),
    "use_rslora": ("use_rslora", _SAME),
    "init_weights": ("init_lora_weights", _SAME),
    "layers_to_transform": ("layers_to_transform", _SAME),
    "layers_pattern": ("layers_pattern", _SAME),
    "random_state": ("seed", _SAME),
    "max_seq_length": ("max_length", _SAME),
    "use_gradient_checkpointing": ("gradient_checkpointing", checkpointing_flag),
}

#: lora_config key -> (is the value a no-op here, why any other value cannot be honoured)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bias": (lambda v: v == "none",
             "artrl trains, saves and serves the LoRA matrices only; trained biases of the base model would be "
             "missing from the served model (the engines apply LoRA adapters, not changed base weights). Use "
             "bias='none' (ART's default)"),
    "modules_to_save": (lambda v: v is None or v == [],
                        "a full trained copy of a module (peft's modules_to_save) is not served: the engines apply "
                        "LoRA adapters only. Leave it None"),
    "loftq_config": (lambda v: v is None or v == {},
                     "LoftQ initialisation (peft's init_lora_weights='loftq') is not supported; leave it unset"),
    "temporary_location": (lambda _v: False,
                           "it is Unsloth's scratch directory for saving merged models, and artrl saves no merged "
                           "model (checkpoints are peft adapters); remove it"),
}

#: peft's names that ART 0.5.23 renamed (the keys of its old peft_args)
PEFT_RENAMES = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "init_lora_weights": "init_weights"}


def lora_config_fields() -> tuple[str, ...]:
    """The keys of ART's `LoRAConfig`, in its order."""
    return tuple(LoRAConfig.__annotations__)


def lora_config_updates(lora: Any) -> dict[str, Any]:
    """`lora_config` -> the InternalModelConfig fields it sets; ConfigError for a key artrl cannot honour."""
    if lora is None:
        return {}
    if not isinstance(lora, Mapping):
        raise ConfigError(f"lora_config={lora!r:.120} is a {type(lora).__name__}; pass art.LoRAConfig(...) (a "
                          "dict), e.g. art.LoRAConfig(rank=16, alpha=32).")
    updates: dict[str, Any] = {}
    for key, value in lora.items():
        if key in PEFT_RENAMES:
            raise ConfigError(f"lora_config key {key!r} is peft's name; ART's LoRAConfig calls it "
                              f"{PEFT_RENAMES[key]!r}: use lora_config={{{PEFT_RENAMES[key]!r}: {value!r}}}.")
        if key in REFUSED:
            no_op, why = REFUSED[key]
            if not no_op(value):
                raise ConfigError(f"lora_config[{key!r}]={value!r:.120} cannot be honoured: {why}.")
            continue
        if key not in HONOURED:
            raise ConfigError(f"lora_config has an unknown key {key!r}; ART's LoRAConfig keys are "
                              f"{list(lora_config_fields())}.")
        field, convert = HONOURED[key]
        updates[field] = convert(value)
    return updates


def apply_lora_config(cfg: InternalModelConfig, lora: Any) -> InternalModelConfig:
    """`cfg` with `lora` (ART's lora_config) applied; the same `cfg` when `lora` sets nothing.

    A field `cfg` sets itself to another value is a ConfigError naming both; a value the field refuses
    (rank 0, ...) is one naming the lora_config key.
    """
    updates = lora_config_updates(lora)
    if not updates:
        return cfg
    keys = {field: key for key, (field, _) in HONOURED.items()}
    for field, value in updates.items():
        if field in cfg.model_fields_set and getattr(cfg, field) != value:
            raise ConfigError(f"lora_config[{keys[field]!r}] gives {field}={value!r} but _internal_config sets "
                              f"{field}={getattr(cfg, field)!r}; set it in one place (lora_config, as in ART).")
    try:
        return type(cfg)(**{**{name: getattr(cfg, name) for name in cfg.model_fields_set}, **updates})
    except ConfigError as e:
        named = ", ".join(f"{keys[f]} -> {f}" for f in updates)
        raise ConfigError(f"lora_config={dict(lora)!r:.200} is invalid ({named}): {e}") from e
