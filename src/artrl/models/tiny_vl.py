"""The offline tiny vision-language model, `artrl/tiny-vl`: the tiny model's tokenizer and size, with eyes.

Architecture: Qwen2.5-VL (transformers' `Qwen2_5_VLForConditionalGeneration`), chosen over Qwen3-VL
because its forward takes our 3-D position ids and precomputed image features as they are (Qwen3-VL's
"deepstack" also writes visual features into the hidden states of early layers in place), and vLLM's CPU
build knows the architecture. Random weights from a fixed seed, built by tiny.py like `artrl/tiny`:

1. **Tokens.** The tiny tokenizer plus Qwen's four vision tokens, `<|vision_start|>`, `<|vision_end|>`,
   `<|image_pad|>`, `<|video_pad|>` (special, ids 2048-2051). An image part renders as
   `<|vision_start|><|image_pad|><|vision_end|>`; the processor's grid then says how many
   `<|image_pad|>` tokens the image takes (models/vision.py expands them).
2. **Chat template.** The tiny template, whose content macro also renders image parts (`{"type":
   "image"}` or `{"type": "image_url"}`) in every role but the assistant's: user turns, the system
   prompt, tool results.
3. **Vision tower.** Qwen2.5-VL's (Conv3d patches of 2 x 14 x 14 pixels, 2-D rotary positions, window
   and full attention blocks, a 2 x 2 patch merger into the language model's width), cut to 2 blocks of
   width 64: about 0.26M of the model's 1.3M parameters. The language model is the tiny model's size
   (4 layers of width 128) with Qwen2.5-VL's multimodal rotary positions (`mrope_section` [4, 6, 6] of the
   16 rotary frequencies: time, height, width).
4. **Image processor.** Qwen2-VL's (`Qwen2VLImageProcessorPil`, no torchvision needed), patch 14, merge 2,
   images resized to between 56 x 56 and 224 x 224 pixels: a 56 x 56 image is a (1, 4, 4) grid of patches
   and 4 image tokens, the largest 64.
"""

from __future__ import annotations

from typing import Any, Final

TINY_VL_NAME: Final = "artrl/tiny-vl"

VISION_TOKENS: Final = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Added as special tokens after the tiny vocabulary, in this order (ids 2048-2051)."""

TINY_VL_SHAPE: Final = {
    "model_type": "qwen2_5_vl",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.1,  # as the tiny model, so LoRA can fit (tiny.MODEL_SHAPE says why)
    "mrope_section": [4, 6, 6],  # head_dim 32: 16 rotary frequencies for time, height, width
    "vision": {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
        "in_channels": 3,
    },
}

IMAGE_PROCESSOR: Final = {
    "min_pixels": 56 * 56,
    "max_pixels": 224 * 224,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
"""The tiny-vl image processor's settings (Qwen2-VL's processor; real Qwen2.5-VL allows up to 12.8M pixels)."""

_IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
_TEXT_PARTS = "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
_TEXT_AND_IMAGE_PARTS = ("{%- if part.type == 'text' -%}{{- part.text -}}"
                         "{%- elif part.type == 'image' or part.type == 'image_url' -%}{{- '" + _IMAGE_MARKUP + "' -}}"
                         "{%- endif -%}")


def chat_template(text_template: str) -> str:
    """The tiny template with image parts rendered (module docstring, point 2)."""
    if text_template.count(_TEXT_PARTS) != 1:
        raise ValueError("the tiny chat template no longer has the content macro tiny_vl.py extends")
    return text_template.replace(_TEXT_PARTS, _TEXT_AND_IMAGE_PARTS)


def recipe() -> dict[str, Any]:
    """What the tiny-vl build depends on beyond the tiny model's recipe (for its fingerprint)."""
    return {"vision_tokens": VISION_TOKENS, "image_processor": IMAGE_PROCESSOR}


def add_vision_tokens(tokenizer: Any) -> None:
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})


def build_model(tokenizer: Any, shape: dict[str, Any], *, max_positions: int, eos_id: int, pad_id: int,
                seed: int) -> Any:
    """A randomly initialised Qwen2.5-VL sized by `shape` for `tokenizer` (which has the vision tokens)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    shape = dict(shape)
    shape.pop("model_type", None)
    vision = dict(shape.pop("vision"))
    mrope = shape.pop("mrope_section")
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    text = dict(vocab_size=len(tokenizer), max_position_embeddings=max_positions, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
                bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, **shape)
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config={**vision, "out_hidden_size": shape["hidden_size"]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is untouched
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model


def build_image_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)
