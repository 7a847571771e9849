"""The parts of a transformers model that artrl walks: its repeated decoder layers, its language model's config."""

from __future__ import annotations

from typing import Any


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks of a transformers model (the classes it names in `_no_split_modules`)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"found no decoder layers in {type(model).__name__} (looked for {sorted(names)})")
    return layers


def text_config(config: Any) -> Any:
    """The config of a model's language model: a vision-language model's `text_config`, else the config itself (a
    plain namespace of fields included)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config
