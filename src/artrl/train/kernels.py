"""Kernel switches of the trainer on CUDA, each from a maintained library and each switchable.

* `liger_kernel`: Liger Kernel's fused RMSNorm, SwiGLU MLP and RoPE (Triton), put into the
  loaded model by `liger_kernel.transformers._apply_liger_kernel_to_instance`, which
  knows the model families Liger supports (Qwen3, Llama, Mistral, ...). Liger's fused
  linear cross-entropy is not used: it returns a reduced loss, while the RL loss needs
  each token's log-probability with its own gradient; our LM head (train/logprobs.py)
  already never holds more than a chunk of logits. Liger patches the transformers
  module of the family as well as the instance, i.e. process-wide.
* `compile_layers`: `module.compile()` on each decoder layer (regional compilation:
  the layers share one compiled graph; the module tree and its state-dict keys stay
  as they are, so adapters save and load unchanged).
* `fused_optimizer`: AdamW with `fused=True`, one kernel for the whole step.

Defaults (`None`): Liger and the fused optimizer on when training on CUDA (Liger only if it
imports), compilation off; on a CPU all off, so the CPU path is what it was.
`benchmarks/gpu.sh` A/Bs each on the device.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import ConfigError
from ..models.liger import liger_applies, liger_available
from ..config.model import InternalModelConfig

log = logging.getLogger(__name__)


def fused_adamw(cfg: InternalModelConfig, device: torch.device) -> bool:
    """Whether the trainer's AdamW runs fused."""
    if cfg.fused_optimizer is None:
        return device.type == "cuda"
    if cfg.fused_optimizer and device.type != "cuda":
        raise ConfigError(f"fused_optimizer=True needs a CUDA device; the model is on {device}. Leave it None.")
    return cfg.fused_optimizer


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (models/structure.py), or a ConfigError for compile_layers."""
    from ..models.structure import decoder_layers as layers_of

    try:
        return layers_of(model)
    except ValueError as e:
        raise ConfigError(f"compile_layers: {e}; set compile_layers=False.") from e


def apply_liger(model: torch.nn.Module) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE in `model` (a transformers PreTrainedModel), in place."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def apply_kernels(model: torch.nn.Module, cfg: InternalModelConfig, device: torch.device) -> dict[str, Any]:
    """Apply the configured kernels to `model` (the transformers model under the adapter); returns what was
    applied, e.g. {"liger_kernel": True, "compile_layers": False, "fused_optimizer": True}."""
    cuda = device.type == "cuda"
    liger = cfg.liger_kernel
    if liger is None:
        liger = liger_applies(cfg, device.type)
    elif liger and not cuda:
        raise ConfigError(f"liger_kernel=True needs a CUDA device (Liger's kernels are Triton); the model is on "
                          f"{device}. Leave it None or False.")
    elif liger and not liger_available():
        raise ConfigError("liger_kernel=True but liger_kernel is not installed: `pip install liger-kernel`, or "
                          "leave it None.")
    if liger:
        apply_liger(model)
    compile_layers = bool(cfg.compile_layers)
    if compile_layers:
        for layer in decoder_layers(model):
            layer.compile()
    applied = {"liger_kernel": bool(liger), "compile_layers": compile_layers,
               "fused_optimizer": fused_adamw(cfg, device)}
    if cuda:
        log.info("trainer kernels: %s", ", ".join(f"{k}={v}" for k, v in applied.items()))
    return applied
