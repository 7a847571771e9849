"""Random-init models of real shapes: "random:qwen3-8b" and its siblings, built in memory, never fetched.

They exist for benchmarks and memory plans at the sizes people train (the weights are random,
so the model says nothing useful). Each shape is the published config of the Qwen3 model of
that name (layers, widths, heads, vocabulary, tied or untied embeddings, RoPE base), with the
tiny model's tokenizer (its ids fit in the real vocabulary). `random_config` gives the
transformers config without building anything; models/random_init.py builds the weights one
tensor at a time, so a 4-bit build never holds the full-precision model.
"""

from __future__ import annotations

from typing import Any

#: Qwen3's published dense configs (hidden, MLP width, layers, heads, KV heads, head width, vocabulary, tying).
_QWEN3: dict[str, dict[str, Any]] = {
    "random:qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "random:qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "random:qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "random:qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                             num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "random:qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                             num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
RANDOM_DRAW_ROWS = 8192  # rows of a large tensor models/random_init.py draws at once, in float32 (the memory plan
# counts one such chunk)

_QWEN3_COMMON: dict[str, Any] = dict(max_position_embeddings=40960, rms_norm_eps=1e-6, initializer_range=0.02,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

#: Qwen3's published mixture-of-experts config: 128 experts of width 768, 8 per token, in every layer.
_QWEN3_MOE: dict[str, dict[str, Any]] = {
    "random:qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                 num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                                 mlp_only_layers=[], router_aux_loss_coef=0.001, vocab_size=151936,
                                 tie_word_embeddings=False),
}

#: name -> (transformers model_type, config fields)
RANDOM_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: ("qwen3", {**_QWEN3_COMMON, **fields}) for name, fields in _QWEN3.items()},
    **{name: ("qwen3_moe", {**_QWEN3_COMMON, **fields}) for name, fields in _QWEN3_MOE.items()},
}


def is_random(base_model: str) -> bool:
    return base_model in RANDOM_SHAPES


def random_config(base_model: str, **overrides: Any) -> Any:
    """The transformers config of random shape `base_model` (KeyError for another name); `overrides` replace
    fields (e.g. num_hidden_layers, for a cut-down benchmark)."""
    from transformers import AutoConfig

    model_type, fields = RANDOM_SHAPES[base_model]
    return AutoConfig.for_model(model_type, **{**fields, **overrides})
