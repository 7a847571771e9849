"""Building a random-init model of a real shape without ever holding it in full precision.

`build_random_model` makes the model's modules on the meta device (no memory), swaps the
decoder layers' linear projections for bitsandbytes layers when the weights are quantised,
then gives every parameter its values one tensor at a time, in the order the model lists
them: drawn in float32 (normal, std `initializer_range`, as transformers initialises a
causal LM; norms 1, biases 0), cast to the model's dtype, and quantised at once when the
layer is quantised. At any moment the process holds the finished part of the model plus one
tensor in float32, so a 4-bit 14B build peaks near its 4-bit size, never at its 56 GB
float32 or 30 GB bf16 size. The C heap is trimmed after each quantised tensor (artrl/runtime/heap.py):
bitsandbytes' temporaries would otherwise stay resident as holes until the build ends.

The values depend only on the seed and the parameter's name (each tensor has a generator
of its own, seeded from both): the same shape gives the same weights in any dtype, quantised
or not, on any number of layers (`num_hidden_layers` cut for a benchmark keeps the first
layers' weights), and a model's 4-bit weights are the quantisation of its full-precision ones.
Generation runs on the CPU for a CPU model and on the device for a CUDA one (a CUDA
generator: the same seed gives other values there).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from ..runtime.heap import release_free_memory
from ..runtime.progress import progress_bar
from .shapes import RANDOM_DRAW_ROWS
from .quantization import (Quantization, prepare_quantized, quantized_linear, quantized_modules,
                           quantized_weight)
from .structure import decoder_layers

log = logging.getLogger(__name__)

LARGE_MODEL_WEIGHTS = 1_000_000_000  # builds of this many weights show a progress bar
ROWS_PER_CHUNK = RANDOM_DRAW_ROWS  # a 151,936-row embedding is drawn in 19 float32 chunks


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _drawn(shape: torch.Size, std: float, gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """normal(0, std) of `shape` in `dtype`, drawn in float32 a few thousand rows at a time."""
    out = torch.empty(shape, dtype=dtype, device=device)
    rows = shape[0] if len(shape) else 1
    flat = out.view(rows, -1)
    for start in range(0, rows, ROWS_PER_CHUNK):
        stop = min(rows, start + ROWS_PER_CHUNK)
        chunk = torch.empty((stop - start, flat.shape[1]), dtype=torch.float32, device=device)
        chunk.normal_(0.0, std, generator=gen)
        flat[start:stop] = chunk.to(dtype)
    return out


def _quantize_layers(model: Any, mode: Quantization, compute_dtype: torch.dtype) -> None:
    """Replace every nn.Linear inside the decoder layers by an empty bitsandbytes layer of its shape."""
    for layer in decoder_layers(model):
        for name, module in list(layer.named_modules()):
            if type(module) is torch.nn.Linear:
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, child, quantized_linear(module, mode, compute_dtype))


def _rebuild_buffers(model: Any, device: torch.device) -> None:
    """Modules whose buffers are computed at construction (rotary embeddings' inverse frequencies), made again
    on `device`: a meta build left them empty."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        try:
            with device:
                fresh = type(module)(config=model.config)
        except TypeError as e:
            raise NotImplementedError(f"random-init build: cannot rebuild the buffers of {name} "
                                      f"({type(module).__name__}) on {device}") from e
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fresh)


def build_random_model(config: Any, *, device: torch.device, dtype: torch.dtype, attn_implementation: str,
                       seed: int, quantization: Quantization | None = None) -> Any:
    """A causal LM of `config` with random weights on `device`; see the module docstring."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if quantization is not None:
        _quantize_layers(model, quantization, dtype)
    quantized = {id(m) for _, m in quantized_modules(model)}
    std = float(getattr(config, "initializer_range", 0.02))
    done: dict[int, torch.nn.Parameter] = {}  # tied parameters appear once
    total = sum(p.numel() for p in model.parameters())
    bar = progress_bar(total=total, desc="random-init weights", unit="weight", unit_scale=True, leave=False,
                       disable=total < LARGE_MODEL_WEIGHTS)
    for module_name, module in list(model.named_modules()):
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in done:
                module._parameters[pname] = done[id(param)]
                continue
            full = f"{module_name}.{pname}" if module_name else pname
            if pname == "bias":
                values = torch.zeros(param.shape, dtype=dtype, device=device)
            elif param.dim() == 1:  # a norm's weight
                values = torch.ones(param.shape, dtype=dtype, device=device)
            else:
                values = _drawn(param.shape, std, _generator(seed, full, device), device, dtype)
            if pname == "weight" and id(module) in quantized:
                new = quantized_weight(module, values, device)
                release_free_memory()
            else:
                new = torch.nn.Parameter(values, requires_grad=param.requires_grad)
            done[id(param)] = new
            module._parameters[pname] = new
            bar.update(param.numel())
            del values
    bar.close()
    _rebuild_buffers(model, device)
    if quantization is not None:
        model.config.quantization_config = _quantization_config(quantization, dtype)
        prepare_quantized(model, quantization)
    return model.eval()


def _quantization_config(mode: Quantization, dtype: torch.dtype) -> Any:
    """What transformers records in a quantised model's config (peft reads it when saving an adapter)."""
    from .quantization import bnb_config

    return bnb_config(mode, dtype)
