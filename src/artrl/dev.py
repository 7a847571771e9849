"""ART's `art.dev` names: advanced per-call options and the model-level config."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError
from .types import InternalModelConfig, TrainConfig as _TrainConfig, TrainSFTConfig as _TrainSFTConfig

__all__ = ["InternalModelConfig", "TrainConfig", "TrainSFTConfig"]


def _options(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - set(cls.model_fields))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} options {unknown}; known: {sorted(cls.model_fields)}")
    return dict(kwargs)


def TrainConfig(**kwargs: Any) -> dict[str, Any]:  # noqa: N802 - ART's name
    """Extra RL options passed as `model.train(..., _config=art.dev.TrainConfig(...))`."""
    return _options(_TrainConfig, kwargs)


def TrainSFTConfig(**kwargs: Any) -> dict[str, Any]:  # noqa: N802 - ART's name
    """Extra SFT options passed as `model.train_sft(..., _config=art.dev.TrainSFTConfig(...))`."""
    return _options(_TrainSFTConfig, kwargs)
