"""The parts of a transformers model that artrl walks: its repeated decoder layers and their projections, its
language model's config."""

from __future__ import annotations

from typing import Any

#: The linear projections of a Llama/Qwen/Mistral-style decoder layer: LoRA's default targets (models/loading.py),
#: what the memory plan counts (models/memory_plan.py); an MoE layer has the attention ones (models/moe.py).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = (*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS)


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


# Where a model's config says its longest sequence, in the order ART 0.5.23 reads them
# (art/dev/sequence_lengths.py); a vision-language model's language model is asked first.
MAX_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", "model_max_length")


def config_max_length(config: Any) -> int | None:
    """The longest sequence a transformers config says its model takes (None when none of MAX_LENGTH_KEYS does)."""
    nested = [getattr(config, k, None) for k in ("text_config", "llm_config", "language_config")]
    for section in (text_config(config), *[n for n in nested if n is not None], config):
        for key in MAX_LENGTH_KEYS:
            value = getattr(section, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1_000_000_000:
                return value
    return None
