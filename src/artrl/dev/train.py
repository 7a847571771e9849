"""`art.dev.TrainConfig` / `art.dev.TrainSFTConfig`: extra per-call options as a plain dict.

In ART these are TypedDicts passed as `model.train(..., _config=...)`. Here they
return a dict whose keys are checked against artrl's `TrainConfig` /
`TrainSFTConfig` fields, which include every key ART's `dev.TrainConfig` has
(`advantage_balance`, `importance_sampling_level`, `ppo`, `precalculate_logprobs`,
...). A misspelt key is refused here, where the typo is, not at train time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..types import TrainConfig as _TrainConfig, TrainSFTConfig as _TrainSFTConfig


def _options(cls: type, options: Mapping[str, Any] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    merged = {**dict(options or {}), **kwargs}
    unknown = sorted(set(merged) - set(cls.model_fields))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} options {unknown}; known: {sorted(cls.model_fields)}")
    return merged


def TrainConfig(options: Mapping[str, Any] | None = None, /, **kwargs: Any) -> dict[str, Any]:  # noqa: N802
    """Extra RL options passed as `model.train(..., _config=art.dev.TrainConfig(...))`; like ART's TypedDict,
    it takes keywords and/or one mapping."""
    return _options(_TrainConfig, options, kwargs)


def TrainSFTConfig(options: Mapping[str, Any] | None = None, /, **kwargs: Any) -> dict[str, Any]:  # noqa: N802
    """Extra SFT options passed as `model.train_sft(..., _config=art.dev.TrainSFTConfig(...))`."""
    return _options(_TrainSFTConfig, options, kwargs)
