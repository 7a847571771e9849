"""Quantised base weights: 4-bit NF4 (QLoRA) and 8-bit LLM.int8, through bitsandbytes, on CPU and CUDA.

The settings are ART's (`init_args.load_in_4bit`, `load_in_8bit`) and Unsloth's choices for them:
4-bit is NF4 with double quantisation (the block scales quantised again: about 0.516 bytes a
weight), computing in the model's dtype (bf16 unless set; float32 on a CPU without a fast bf16 matmul,
below); 8-bit is LLM.int8 with no fp16 outlier copy. Only the decoder layers' linear projections are
quantised; embeddings, the LM head and the norms stay in the model's dtype, as transformers and Unsloth
leave them. The LoRA adapter sits on top of the quantised layers through peft and trains in float32.

Two families keep more in the model's dtype (`unquantized_modules`, checked after every load by
`check_quantized_layers`):

* a vision-language model: its vision tower and the projector into the language model (Qwen2.5-VL's
  `model.visual`, patch merger included) stay whole, as Unsloth keeps them; only the language model's
  projections are 4-bit. Left to its defaults, transformers would quantise every nn.Linear of the tower too.
* a mixture-of-experts model: bitsandbytes quantises nn.Linear layers, and transformers 5 keeps a layer's
  experts as two fused 3-D parameters (models/moe.py) and its router as a plain weight, so the experts and the
  routers stay in the model's dtype and only the attention projections (and any dense MLP's) are 4-bit. The
  experts are most of such a model's weights, so 4-bit saves little there; the memory plan counts them at the
  model's dtype, and the load says so at INFO.

Which models are quantised by default (`load_in_4bit` left at None; `resolve_quantization`,
`models.resolved.settle_quantization`):

    model                                    CUDA                     CPU
    a Hugging Face checkpoint (hub id,       4-bit (ART's default)    full precision (float32) when the memory
      or a directory artrl did not build)                             plan says it fits, else 4-bit (said at INFO)
    artrl's own (built-ins, random: shapes)  full precision           full precision

On a GPU 4-bit is ART's rule. On a CPU it is the slow choice and the less exact one: the
4-bit path dequantises every weight at every use and computes in bf16 (or float32, below), which widens the gap
between the sampler's and the trainer's logprobs (docs/models.md). So a CPU loads full precision
wherever it fits, and 4-bit only where the plan says it must. artrl's own models exist for tests
and benchmarks, and load in full precision unless asked.

On a CPU the 4-bit layers compute in float32 unless torch has a fast kernel for the model's half-precision
dtype there (oneDNN's, for CPUs with AVX512-BF16 or AMX: `fast_cpu_matmul`). Without one, a bfloat16 matmul
falls back to a scalar loop on one core, about 7x slower than float32 in the forward's orientation and 100x in
the backward's (`grad @ W`), and a 4-bit train call spent nearly all its time there (benchmarks/results/
2026-12-03-cpu). In float32 the weight is dequantised straight to float32 (bitsandbytes' OpenMP CPU kernel),
the matmul is MKL's on the thread's torch threads (artrl/runtime/threads.py), and
the layer's input and output stay in the model's dtype; it costs a float32 rather than a bfloat16 copy of one
layer's weight at a time, and serving computes the same (the engine shares these layers).

One switch of bitsandbytes is turned off on every 4-bit layer (`prepare_quantized`): on a CPU
with AVX512-BF16, a Linear4bit in eval mode repacks its weight *in place* for a bf16 inference
kernel the first time it sees an input without gradient. The packed weight then serves every
later call, training included, in bf16 and without a backward through it, and a serving copy
shares that weight with the trainer. Keeping the dequantise-and-matmul path everywhere makes
the sampler and the trainer compute the same thing (docs/token-record.md) at some decode speed.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ConfigError
from ..config.optimizers import BNB_INSTALL_HINT, bitsandbytes_installed  # also read from here

if TYPE_CHECKING:
    import torch

    from ..config.model import InternalModelConfig

log = logging.getLogger(__name__)

Quantization = Literal["4bit", "8bit"]

#: Block sizes and bytes per quantised weight (bitsandbytes' defaults for these settings).
NF4_BLOCKSIZE = 64
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / NF4_BLOCKSIZE + 4 / (NF4_BLOCKSIZE * 256)  # double quantisation: 8-bit block scales
INT8_BYTES_PER_WEIGHT = 1.0  # plus one float32 scale per output row (SCB)
QUANTIZED_DEVICE_TYPES = ("cpu", "cuda")

_KERNELS_NOTE = "Failed to load CPU gemm_4bit_forward from kernels-community"


def resolve_quantization(cfg: "InternalModelConfig", base_model: str, device_type: str) -> Quantization | None:
    """What base weights `cfg` asks for: "4bit", "8bit" or None (the dtype itself); see the module docstring
    for the default. Raises ConfigError for a combination that cannot load (both set; a device bitsandbytes
    does not run on; bitsandbytes missing)."""
    four, eight = cfg.load_in_4bit, cfg.load_in_8bit
    if four and eight:
        raise ConfigError("load_in_4bit=True and load_in_8bit=True: choose one (4-bit NF4 takes about half the "
                          "memory of 8-bit; ART's default is 4-bit).")
    if four is None and not eight:
        # the default: ART's 4-bit for a Hugging Face checkpoint on a GPU; on a CPU full precision, unless
        # `settle_quantization` (which has the memory plan) already set load_in_4bit=True for a model too big for it
        four = device_type != "cpu" and not is_own_model(base_model)
    mode: Quantization | None = "4bit" if four else "8bit" if eight else None
    if mode is None:
        return None
    name = "load_in_4bit" if mode == "4bit" else "load_in_8bit"
    if device_type not in QUANTIZED_DEVICE_TYPES:
        raise ConfigError(f"{name}=True on a {device_type!r} device: bitsandbytes quantises on "
                          f"{list(QUANTIZED_DEVICE_TYPES)} only. Set {name}=False (full precision) or use a CPU or "
                          "CUDA device.")
    if not bitsandbytes_installed():
        default = " (the default for a Hugging Face model, as in ART)" if cfg.load_in_4bit is None else ""
        raise ConfigError(f"{name}=True{default} needs bitsandbytes, which is not installed: {BNB_INSTALL_HINT}. "
                          f"Or set {name}=False to load the weights in full precision (about 2-4x the memory).")
    return mode


def is_own_model(base_model: str) -> bool:
    """A model artrl builds itself: a built-in name, a built-in's directory, or a random shape."""
    from pathlib import Path

    from .tiny import BUILD_MARKER_FILE, BUILTIN_MODELS
    from .shapes import RANDOM_SHAPES

    if base_model in BUILTIN_MODELS or base_model in RANDOM_SHAPES:
        return True
    path = Path(base_model).expanduser()
    return path.is_dir() and (path / BUILD_MARKER_FILE).is_file()


def import_bitsandbytes() -> Any:
    import bitsandbytes

    return bitsandbytes


class _DropKernelsNotice(logging.Filter):
    """Drops bitsandbytes' one-line notice, at its import, that an optional CPU kernel could not be fetched from
    the Hugging Face hub (`pip install kernels`): artrl never fetches code at run time, and bitsandbytes' own CPU
    kernels run instead. Every other record of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _KERNELS_NOTE not in str(record.msg)


def quiet_kernels_notice() -> None:
    """Install `_DropKernelsNotice` on bitsandbytes' CPU logger (once; `import artrl` does it, before anything
    imports bitsandbytes: peft does when it is imported)."""
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropKernelsNotice) for f in cpu_ops.filters):
        cpu_ops.addFilter(_DropKernelsNotice())


LM_HEAD = "lm_head"


def unquantized_modules(config: Any) -> list[str] | None:
    """The modules a load of `config`'s model must leave in the model's dtype besides transformers' defaults, as
    bitsandbytes' `llm_int8_skip_modules` (which replaces the defaults, so the LM head is named again): a
    vision-language model's vision tower and projector; None (transformers' defaults: the LM head and tied
    weights) for a text model, whose fused experts, if any, bitsandbytes does not quantise anyway."""
    from .vision import VISION_TOWERS, is_vision_model

    if config is None or not is_vision_model(config):
        return None
    return [LM_HEAD, VISION_TOWERS[config.model_type]]


def bnb_config(mode: Quantization, compute_dtype: "torch.dtype", skip_modules: list[str] | None = None) -> Any:
    """transformers' BitsAndBytesConfig for `mode`, as Unsloth configures it; `skip_modules`: `unquantized_modules`."""
    import torch
    from transformers import BitsAndBytesConfig

    import_bitsandbytes()
    if mode == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=torch.uint8,
                                  llm_int8_skip_modules=skip_modules)
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip_modules)


def check_quantized_layers(model: Any, mode: Quantization) -> None:
    """Raise when a load quantised what it must not (a vision tower or projector: `unquantized_modules`, and the
    LM head), and say at INFO what of an MoE model stays in its dtype (the module docstring)."""
    from .moe import is_moe

    names = [n for n, _ in quantized_modules(model)]
    kept = [m for m in unquantized_modules(model.config) or [LM_HEAD]]
    wrong = [n for n in names if any(n == k or n.startswith(k + ".") for k in kept)]
    if wrong:
        raise RuntimeError(f"{mode} loading quantised {len(wrong)} layers that must stay in the model's dtype "
                           f"({wrong[:3]}...; {kept} are kept whole): this version of transformers does not honour "
                           "llm_int8_skip_modules as artrl passes it. Load with load_in_4bit=False, or pin "
                           "transformers to a tested version.")
    if is_moe(model.config):
        import torch

        experts = sum(p.numel() for n, p in model.named_parameters()
                      if n.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj") and p.dim() == 3)
        total = sum(weight_numel(p) for p in model.parameters())
        dtype = next((p.dtype for n, p in model.named_parameters() if p.dim() == 3), torch.get_default_dtype())
        log.info("%s %s: %d attention/MLP projections are %s; the experts (%.0f%% of the weights, fused parameters "
                 "bitsandbytes does not quantise) and the routers stay in %s", type(model).__name__, mode,
                 len(names), mode, 100 * experts / max(total, 1), str(dtype).removeprefix("torch."))


def quantized_linear(linear: "torch.nn.Linear", mode: Quantization, compute_dtype: "torch.dtype") -> Any:
    """An empty bitsandbytes layer of `linear`'s shape (on the meta device), for models/random_init.py."""
    bnb = import_bitsandbytes()
    bias = linear.bias is not None
    if mode == "4bit":
        return bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, compute_dtype=compute_dtype,
                                 compress_statistics=True, quant_type="nf4", device="meta")
    return bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                               threshold=0.0, device="meta")


def quantized_weight(layer: Any, data: "torch.Tensor", device: "torch.device") -> Any:
    """`data` (full precision, on the CPU or `device`) quantised into `layer`'s kind of weight on `device`."""
    bnb = import_bitsandbytes()
    if isinstance(layer, bnb.nn.Linear4bit):
        param = bnb.nn.Params4bit(data, requires_grad=False, quant_type="nf4", compress_statistics=True,
                                  module=layer)
    else:
        param = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
    return param.to(device)


def weight_numel(p: Any) -> int:
    """The weights a parameter stands for: a 4-bit weight packs two in a byte, its quantisation state knows the
    shape."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    if shape is None:
        return p.numel()
    n = 1
    for d in shape:
        n *= int(d)
    return n


def quantized_modules(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of every bitsandbytes linear layer in `model`."""
    if not bitsandbytes_installed():
        return []
    bnb = import_bitsandbytes()
    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]


def quantization_of(model: Any) -> Quantization | None:
    """"4bit" / "8bit" when `model` (or the model a peft model wraps) holds bitsandbytes layers, else None."""
    found = quantized_modules(model)
    if not found:
        return None
    bnb = import_bitsandbytes()
    return "4bit" if isinstance(found[0][1], bnb.nn.Linear4bit) else "8bit"


def quantized_params(model: Any) -> list[Any]:
    """The quantised weights (and their biases) of `model`: frozen, never sharded, never copied."""
    params = []
    for _, module in quantized_modules(model):
        params.extend(module.parameters(recurse=False))
    return params


@functools.lru_cache(maxsize=None)
def fast_cpu_matmul(dtype: "torch.dtype") -> bool:
    """Whether torch multiplies `dtype` matrices on this CPU with a vectorised kernel: float32 always, bfloat16 /
    float16 only through oneDNN's kernels for CPUs with AVX512 (BF16 / FP16) or AMX. Without them torch falls back
    to a scalar loop that is about 7x slower than float32 for `x @ W.T` and 100x for `grad @ W` (the
    backward's), on one core (AMD EPYC with AVX2 only, torch 2.13: 1.4 s against 17 ms for a
    [64, 3072] @ [3072, 1024] product)."""
    import torch

    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def cpu_compute_dtype(dtype: "torch.dtype") -> "torch.dtype":
    """The dtype a 4-bit layer on a CPU computes in: the model's `dtype` where torch has a fast matmul for it,
    float32 elsewhere (the weight is dequantised straight to float32; activations stay in `dtype`)."""
    import torch

    return dtype if fast_cpu_matmul(dtype) else torch.float32


def prepare_quantized(model: Any, mode: Quantization) -> None:
    """Mark `model` as quantised for peft, keep every 4-bit layer on the dequantise-and-matmul path, and on a CPU
    without a fast half-precision matmul have it compute in float32 (the module docstring says why)."""
    setattr(model, "is_loaded_in_4bit" if mode == "4bit" else "is_loaded_in_8bit", True)
    upcast = 0
    for _, module in quantized_modules(model):
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        compute = getattr(module, "compute_dtype", None)
        if mode == "4bit" and compute is not None and module.weight.device.type == "cpu":
            wanted = cpu_compute_dtype(compute)
            if wanted != compute:
                upcast += 1
            # set, and marked as set: bitsandbytes otherwise takes the first input's dtype at the first forward
            module.compute_dtype, module.compute_type_is_set = wanted, True
    if upcast:
        log.info("%d 4-bit layers compute in float32 on this CPU: torch has no fast bfloat16/float16 matmul for it "
                 "(no AVX512-BF16 or AMX), and float32 is several times faster (models/quantization.py)", upcast)
