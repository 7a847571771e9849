"""`art.dev.TrainConfig` / `art.dev.TrainSFTConfig`: extra per-call options as a plain dict.

In ART these are TypedDicts passed as `model.train(..., _config=...)`. Here they
return a dict whose keys are checked against artrl's `TrainConfig` /
`TrainSFTConfig` fields, which include every key ART's `dev.TrainConfig` has
(`advantage_balance`, `importance_sampling_level`, `ppo`, `precalculate_logprobs`,
...). A misspelt key is refused here, where the typo is, not at train time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_type_hints

from ..errors import ConfigError
from ..types import SFTMetricLoggingConfig, TrainConfig as _TrainConfig, TrainSFTConfig as _TrainSFTConfig


def _options(cls: type, options: Mapping[str, Any] | None, kwargs: dict[str, Any],
             extra: frozenset[str] = frozenset()) -> dict[str, Any]:
    merged = {**dict(options or {}), **kwargs}
    unknown = sorted(set(merged) - set(cls.model_fields) - extra)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} options {unknown}; known: {sorted(set(cls.model_fields) | extra)}")
    return merged


# ART 0.5.23's art.dev.TrainSFTConfig key that is not a TrainSFTConfig field: what `model.train_sft` tells the
# backend about logging (SFTMetricLoggingConfig: enabled, target_training_step).
METRIC_LOGGING = "metric_logging"
_METRIC_LOGGING_TYPES = get_type_hints(SFTMetricLoggingConfig)  # {"enabled": bool, "target_training_step": int}


def check_metric_logging(value: Any) -> dict[str, Any]:
    """A `metric_logging` value as ART's SFTMetricLoggingConfig has it, or a ConfigError naming what is wrong."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"TrainSFTConfig metric_logging={value!r}; give a dict such as {{'enabled': False}}.")
    for key, v in value.items():
        kind = _METRIC_LOGGING_TYPES.get(key)
        if kind is None or not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ConfigError(f"TrainSFTConfig metric_logging[{key!r}]={v!r}; its keys are 'enabled' (a bool) and "
                              "'target_training_step' (an int).")
    return dict(value)


def sft_metric_logging(dev_config: Mapping[str, Any] | None, log_metrics: bool) -> dict[str, Any]:
    """What `model.train_sft(..., log_metrics=)` passes its backend as `_config["metric_logging"]` (ART 0.5.23
    sets it from log_metrics, replacing any given). A given value that says otherwise is refused rather than
    replaced: `enabled` against log_metrics, and `target_training_step`, which ART sets only for backends that
    log remotely (the row is written here, at the step the call makes)."""
    given = (dev_config or {}).get(METRIC_LOGGING)
    if given is not None:
        given = check_metric_logging(given)
        if "target_training_step" in given:
            raise ConfigError(f"_config metric_logging target_training_step={given['target_training_step']}: "
                              "train_sft writes its row at the step the call makes; drop the key.")
        if given.get("enabled", log_metrics) != log_metrics:
            raise ConfigError(f"_config metric_logging enabled={given['enabled']} contradicts "
                              f"train_sft(log_metrics={log_metrics}), which decides it (as in ART); pass "
                              f"log_metrics={given['enabled']} instead.")
    return {"enabled": log_metrics}


# ART's art.dev.TrainConfig key that is not a TrainConfig field: the packed row length (TrainConfig.row_length),
# translated where the call is made (LocalBackend._train_model, through art_train_overrides' checks).
PACKED_SEQUENCE_LENGTH = "packed_sequence_length"


def TrainConfig(options: Mapping[str, Any] | None = None, /, **kwargs: Any) -> dict[str, Any]:  # noqa: N802
    """Extra RL options passed as `model.train(..., _config=art.dev.TrainConfig(...))`; like ART's TypedDict,
    it takes keywords and/or one mapping: TrainConfig fields, and ART's `packed_sequence_length`."""
    return _options(_TrainConfig, options, kwargs, frozenset({PACKED_SEQUENCE_LENGTH}))


def TrainSFTConfig(options: Mapping[str, Any] | None = None, /, **kwargs: Any) -> dict[str, Any]:  # noqa: N802
    """Extra SFT options passed as `model.train_sft(..., _config=art.dev.TrainSFTConfig(...))`: TrainSFTConfig
    fields, and ART's `metric_logging` ({'enabled': bool}; train_sft's log_metrics decides it)."""
    merged = _options(_TrainSFTConfig, options, kwargs, frozenset({METRIC_LOGGING}))
    if METRIC_LOGGING in merged:
        merged[METRIC_LOGGING] = check_metric_logging(merged[METRIC_LOGGING])
    return merged
