"""The memory plan: what a model will take, worked out from its config before anything loads.

`plan_memory(shape, settings)` is a pure function: from the model's shape (models/shapes.py or
its config.json) and the run's settings it gives the bytes of every part a LoRA training
process holds, on the device the model trains on (host RAM on a CPU):

    part          what it counts                                                   when
    weights       decoder projections (4-bit: ~0.516 B, 8-bit: ~1 B, else the     always
                  dtype's bytes a weight), embeddings, LM head, norms (dtype)
    adapter       the LoRA weights in float32: the trained copy, the serving       always
                  copy and the policy versions the engine keeps (SERVED_ADAPTERS)
    gradients     float32, one per adapter weight                                  always
    optimizer     AdamW's two moments: 8 B a weight, 2 B with an 8-bit optim       always
    runtime       the interpreter, torch, transformers and the server (host)       always
    engine_cache  the engine's KV cache of `serving_tokens` tokens                 serving
    activations   one micro-batch of `micro_batch_tokens` tokens kept for          a train step
                  backward (every layer's, or with checkpointing one input per
                  layer and one layer at a time), the LM head's chunk, a 4-bit
                  layer's weight dequantised for its matmul, and on a CPU the
                  heap growth a small call's allocator setting allows (at most
                  256 MiB: `heap_allowance`, host_allocator.py)
    loading       while weights load: one tensor drawn or read in float32 and,     loading
                  when quantised, bitsandbytes' working set for it

The peak is the resident parts plus the larger of `loading` and `activations` (a model
loads before it trains). `check_fits` compares the peak with what the device has and, when
it does not fit, raises a ConfigError naming the settings that would (`alternatives`):
4-bit or 8-bit weights, activation checkpointing, an 8-bit optimizer, shorter micro-batches.
A session runs the check before it loads a model (`check_model_fits`, with `PLAN_TOKENS`
tokens of micro-batch and of cache: the least a run needs to do anything) and logs the plan;
`artrl bench memory` prints it beside the measured peak of a train call.

Inference replicas that load at once on one device are planned as a set, before any starts
(`check_replicas_fit`): each a serving process (`MemoryPlan.serving_peak`: no gradients,
optimizer or activations), their peaks summed with the trainer's when it loads on the same
device meanwhile; each replica then loads without a check of its own, which would compare one
replica's plan with the memory all of them share.

The per-token figures err high (train/memory.py measured 1.8 MB a token where this says 2.3
on the Qwen3-0.6B shape); `runtime` and the quantisation working sets were measured on this
project's CPU path (docs/getting-started.md has the table).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from ..errors import ConfigError
from ..runtime.host_allocator import heap_allowance
from .liger import liger_applies
from .quantization import INT8_BYTES_PER_WEIGHT, NF4_BYTES_PER_WEIGHT
from .shapes import RANDOM_DRAW_ROWS
from .structure import PROJECTIONS, text_config

log = logging.getLogger(__name__)

GB = 1e9
PLAN_TOKENS = 1024  # micro-batch and cache tokens of the check before loading
SERVED_ADAPTERS = 3  # adapter copies besides the trained one: the serving copy and two policy versions
RUNTIME_HOST_BYTES = int(0.6e9)  # a training process's own RSS besides the model (CPU; measured, see docs)
CUDA_CONTEXT_BYTES = int(0.6e9)  # the CUDA context and kernels, outside torch's allocator

Quantization = Literal["4bit", "8bit"]
_WEIGHT_BYTES = {"4bit": NF4_BYTES_PER_WEIGHT, "8bit": INT8_BYTES_PER_WEIGHT}


@dataclass(frozen=True)
class ModelShape:
    """The sizes the plan needs of a decoder-only transformer."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0  # a mixture-of-experts model's experts per layer (0: a dense MLP), models/moe.py
    top_k: int = 0
    expert_width: int = 0

    @classmethod
    def of(cls, config: Any) -> "ModelShape":
        from .moe import moe_shape

        config = text_config(config)  # a vision-language model's language model (its vision tower is left out)
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        moe = moe_shape(config)
        return cls(hidden=hidden, intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
                   layers=int(config.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
                   vocab=int(getattr(config, "vocab_size", 0) or 0),
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   experts=moe.experts if moe else 0, top_k=moe.top_k if moe else 0,
                   expert_width=moe.width if moe else 0)

    def projections(self) -> dict[str, tuple[int, int]]:
        """A layer's linear projections: name -> (in_features, out_features) (an MoE layer's attention only)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.experts:
            return attention
        return {**attention, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def expert_parameters(self) -> dict[str, tuple[int, int]]:
        """One expert's fused parameters of a layer: name -> (in, out) (empty for a dense model)."""
        if not self.experts:
            return {}
        h, w = self.hidden, self.expert_width
        return {"experts.gate_up_proj": (h, 2 * w), "experts.down_proj": (w, h)}

    def linear_weights(self) -> int:
        """The weights bitsandbytes can quantise: the decoder layers' linear projections."""
        return self.layers * sum(a * b for a, b in self.projections().values())

    def expert_weights(self) -> int:
        """An MoE model's expert weights (fused parameters: never quantised), all layers; the router's too."""
        if not self.experts:
            return 0
        router = self.experts * self.hidden
        return self.layers * (self.experts * sum(a * b for a, b in self.expert_parameters().values()) + router)

    def active_weights(self) -> int:
        """Non-embedding weights one token runs through: every projection, and top_k of each layer's experts."""
        per_expert = sum(a * b for a, b in self.expert_parameters().values())
        return self.linear_weights() + self.layers * self.top_k * per_expert

    def other_weights(self) -> int:
        """Embeddings, LM head (unless tied), norms."""
        norms = self.layers * (2 * self.hidden + 2 * self.head_dim) + self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + norms

    def largest_linear(self) -> tuple[int, int]:
        return max(self.projections().values(), key=lambda s: s[0] * s[1])


@dataclass(frozen=True)
class MemorySettings:
    """What the plan needs of a run's settings (`settings_for` reads them from an InternalModelConfig)."""

    device_type: str = "cpu"
    quantization: Quantization | None = None
    dtype_bytes: int = 4  # the dtype of the unquantised weights and of the activations
    lora_rank: int = 8
    target_modules: tuple[str, ...] | None = None  # None: the seven projections
    optim_bits: int = 32
    gradient_checkpointing: bool = False
    micro_batch_tokens: int = PLAN_TOKENS
    logprob_chunk_size: int = 1024
    head_tokens: int | None = None  # trained tokens of the micro-batch (None: all of them), which the LM head runs on
    offload_activations: bool = False  # checkpointed layer inputs kept in host memory (a GPU's plan)
    fused_kernels: bool = False  # Liger's RMSNorm and SwiGLU in the trainer (CUDA; train/kernels.py)
    serving_tokens: int = PLAN_TOKENS
    random_init: bool = False  # weights drawn in memory (models/random_init.py) rather than read


@dataclass
class MemoryPlan:
    """Bytes per part (see the module docstring); `peak` and `available` in bytes."""

    parts: dict[str, int]
    settings: MemorySettings
    shape: ModelShape
    available: int | None = None

    @property
    def resident(self) -> int:
        return sum(v for k, v in self.parts.items() if k not in ("activations", "loading"))

    @property
    def peak(self) -> int:
        return self.resident + max(self.parts["activations"], self.parts["loading"])

    @property
    def serving_peak(self) -> int:
        """The peak of a process that only serves this model (an inference replica): weights, adapters, runtime and
        cache, plus loading; no gradients, optimizer or activations."""
        return sum(self.parts[k] for k in ("weights", "adapter", "runtime", "engine_cache", "loading"))

    def fits(self) -> bool:
        return self.available is None or self.peak <= self.available

    def line(self) -> str:
        what = {None: f"{self.settings.dtype_bytes * 8}-bit", "4bit": "4-bit", "8bit": "8-bit"}[self.settings.quantization]
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.parts.items())
        room = f" of {self.available / GB:.1f} GB available" if self.available is not None else ""
        return f"memory plan ({what} weights, {self.settings.device_type}): peak {self.peak / GB:.1f} GB{room} ({parts} GB)"

    def as_json(self) -> dict[str, Any]:
        return {"peak_gb": round(self.peak / GB, 3), "available_gb": None if self.available is None else
                round(self.available / GB, 3), "parts_gb": {k: round(v / GB, 3) for k, v in self.parts.items()},
                "settings": asdict(self.settings)}


def layer_bytes(shape: ModelShape, dtype_bytes: int, fused: bool = False) -> int:
    """One decoder layer's activations per token, kept for its backward (`bytes_per_token` says what they are).
    `fused`: Liger's RMSNorm and SwiGLU (train/kernels.py, on CUDA): the MLP keeps its gate, up and product (the
    activation is recomputed) and the norms no float32 copies. Measured on one H200 (bf16, Liger on;
    docs/performance.md): 45 KB a layer a token on the Qwen3-0.6B shape against 54 KB so counted, 186 KB on the
    8B shape against 176 KB; without `fused` the count was 84 and 295 KB."""
    h = shape.hidden
    dense_mlp = (3 if fused else 5) * shape.intermediate
    mlp = shape.top_k * 5 * shape.expert_width + 4 * shape.experts if shape.experts else dense_mlp
    norms = 0 if fused and not shape.experts else 16 * h
    return dtype_bytes * (10 * h + 2 * (shape.heads + 2 * shape.kv_heads) * shape.head_dim + mlp) + norms


def _input_bytes(shape: ModelShape, dtype_bytes: int, offload: bool) -> int:
    """With checkpointing, what a token keeps on the device through the whole pass: each layer's input (on the host
    when offloaded, bar the one or two the backward is at)."""
    return (2 if offload else shape.layers) * shape.hidden * dtype_bytes


def kept_bytes(shape: ModelShape, s: "MemorySettings") -> int:
    """`_input_bytes` under settings `s`."""
    return _input_bytes(shape, s.dtype_bytes, s.offload_activations)


def bytes_per_token(shape: ModelShape, dtype_bytes: int, checkpointing: bool, offload: bool = False,
                    fused: bool = False) -> int:
    """Activation bytes one token keeps on the device for backward in a decoder-only transformer (an upper
    estimate; linear in length: attention keeps its output and log-sum-exp, never a seq x seq tensor).

    Per layer, in the compute dtype: the residual and norm outputs and LoRA inputs (~10 x hidden), q, k, v and the
    attention output twice each, the MLP's gate, up, activation, product and LoRA input (5 x intermediate); plus
    float32 copies made by RMSNorm (4 x hidden x 4 bytes). With checkpointing: each layer's input, and one layer's
    activations at a time (its recomputation in backward); with `offload` too, the layers' inputs wait in host
    memory (train/memory.py), and the device keeps one layer's. `fused`: Liger's kernels (`layer_bytes`).
    """
    per_layer = layer_bytes(shape, dtype_bytes, fused)
    if checkpointing:
        return _input_bytes(shape, dtype_bytes, offload) + per_layer  # the layers' inputs, one layer's at a time
    return shape.layers * per_layer


def head_bytes(vocab: int, chunk_size: int) -> int:
    """The LM head's working set for one chunk: float32 logits, log-softmax, its exp and a gradient."""
    return 4 * 4 * chunk_size * vocab


def lora_weights(shape: ModelShape, rank: int, targets: tuple[str, ...] | None) -> int:
    """The adapter's weights: r (in + out) per adapted projection, and per expert of an adapted expert parameter
    (an MoE model's default adapts the experts, as ART's; "experts" among `targets` does too)."""
    names = targets if targets is not None else (*PROJECTIONS, "experts")
    dense = sum(rank * (a + b) for n, (a, b) in shape.projections().items() if n in names)
    experts = shape.experts * sum(rank * (a + b) for a, b in shape.expert_parameters().values()) \
        if "experts" in names else 0
    return shape.layers * (dense + experts)


def _adapts_experts(s: MemorySettings) -> bool:
    return s.target_modules is None or "experts" in s.target_modules


def plan_memory(shape: ModelShape, s: MemorySettings, available: int | None = None) -> MemoryPlan:
    """The plan of one training process (see the module docstring). Pure: no device is asked."""
    weights = int(shape.linear_weights() * (_WEIGHT_BYTES[s.quantization] if s.quantization else s.dtype_bytes)
                  + (shape.expert_weights() + shape.other_weights()) * s.dtype_bytes)
    lora = lora_weights(shape, s.lora_rank, s.target_modules)
    optimizer = lora * (2 if s.optim_bits == 8 else 8)
    largest = shape.largest_linear()[0] * shape.largest_linear()[1]
    on_cpu = s.device_type == "cpu"
    # a 4-bit matmul dequantises its weight: on a CPU through int32 codes and float32 values, on CUDA in a kernel
    dequant = largest * ((4 + 4 + s.dtype_bytes) if on_cpu else s.dtype_bytes) if s.quantization else 0
    # LoRA on fused experts: peft adds B A to the whole expert stack for each forward (models/moe.py), a layer's
    # experts in the compute dtype, kept for backward by every layer (one at a time with checkpointing)
    stack = shape.expert_weights() // max(shape.layers, 1) * s.dtype_bytes
    experts_lora = stack * (1 if s.gradient_checkpointing else shape.layers) if _adapts_experts(s) else 0
    head_tokens = s.micro_batch_tokens if s.head_tokens is None else min(s.head_tokens, s.micro_batch_tokens)
    head = head_bytes(shape.vocab, min(s.logprob_chunk_size, head_tokens))
    n = s.micro_batch_tokens
    if s.gradient_checkpointing:
        # the layers' inputs stay through the pass; the LM head's chunks run (backward first) before any layer is
        # recomputed, so the larger of the two comes on top, not both (measured: docs/performance.md)
        activations = n * kept_bytes(shape, s) + max(head, n * layer_bytes(shape, s.dtype_bytes, s.fused_kernels))
    else:
        activations = n * token_bytes(shape, s) + head  # every layer's activations held while the head runs
    activations += dequant + experts_lora
    if on_cpu:  # the heap growth a small call's allocator setting allows (runtime: host_allocator.py)
        activations += heap_allowance(n, shape.hidden, s.dtype_bytes, shape.layers)
    draw = RANDOM_DRAW_ROWS * shape.largest_linear()[0] * 4 if s.random_init else largest * 4
    # bitsandbytes' quantiser holds the tensor in float32 twice and its codes as int32 (its CPU path)
    quantize = largest * (s.dtype_bytes + 4 + 4 + 4 + 1) if s.quantization else 0
    kv_per_token = kv_bytes_per_token(shape, s.dtype_bytes)
    parts = {
        "weights": weights,
        "adapter": lora * 4 * (1 + SERVED_ADAPTERS),
        "gradients": lora * 4,
        "optimizer": optimizer,
        "runtime": RUNTIME_HOST_BYTES if on_cpu else CUDA_CONTEXT_BYTES,
        "engine_cache": s.serving_tokens * kv_per_token,
        "activations": int(activations),
        "loading": int(draw + quantize),
    }
    return MemoryPlan(parts=parts, settings=s, shape=shape, available=available)


def token_bytes(shape: ModelShape, s: MemorySettings) -> int:
    """`bytes_per_token` under settings `s` (offload counts only with checkpointing, as a call runs it)."""
    return bytes_per_token(shape, s.dtype_bytes, s.gradient_checkpointing,
                           offload=s.offload_activations and s.gradient_checkpointing, fused=s.fused_kernels)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """The engine's KV cache for one token: keys and values of every layer."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes


def max_context(shape: ModelShape, s: MemorySettings, available: int, *, cached_sequences: int = 0) -> int:
    """The most tokens one micro-batch of settings `s` may hold within `available` bytes at the plan's peak
    (every token trained: the LM head's chunk counted whole); 0 when the model alone does not fit. The engine's
    cache: `cached_sequences` sequences of that length when given (the engine held what it sampled, on the same
    device), else `s.serving_tokens`. Pure, and the inverse of `plan_memory`: the plan of that many tokens fits,
    a few more do not."""
    cache = s.serving_tokens if not cached_sequences else 0
    fixed = plan_memory(shape, replace(s, micro_batch_tokens=0, head_tokens=None, serving_tokens=cache), available)
    head = head_bytes(shape.vocab, s.logprob_chunk_size)
    room = available - fixed.resident - fixed.parts["activations"]  # less the dequantised weight, experts' delta
    if room - head <= 0 or fixed.resident + fixed.parts["loading"] > available:
        return 0
    cache_per = cached_sequences * kv_bytes_per_token(shape, s.dtype_bytes)
    if not s.gradient_checkpointing:
        n = int((room - head) // (token_bytes(shape, s) + cache_per))
    else:
        # activations(n) = n * kept + max(head, n * layer): both n * kept + head and n * (kept + layer) must fit
        kept, layer = kept_bytes(shape, s) + cache_per, layer_bytes(shape, s.dtype_bytes, s.fused_kernels)
        n = int(min((room - head) // kept, room // (kept + layer)))

    def fits(tokens: int) -> bool:
        return plan_memory(shape, replace(s, micro_batch_tokens=tokens, head_tokens=None,
                                          serving_tokens=cache + cached_sequences * tokens), available).fits()

    if n > 0 and s.device_type == "cpu" and not fits(n):
        # a micro-batch small enough for the allocator's heap allowance (host_allocator.py): the plan is not linear
        # there, so the longest one that fits is searched for
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        n = lo
    return n


def alternatives(shape: ModelShape, s: MemorySettings, available: int) -> list[tuple[str, MemoryPlan]]:
    """Changes of settings (as a user writes them) whose plan fits `available` bytes, the least change first."""
    tries: list[tuple[str, MemorySettings]] = []
    if s.quantization != "4bit":
        # quantised weights compute in bf16 by default (models/loading.py)
        tries.append(("load_in_4bit=True", replace(s, quantization="4bit", dtype_bytes=2)))
    if s.quantization is None:
        tries.append(("load_in_8bit=True", replace(s, quantization="8bit", dtype_bytes=2)))
    if s.quantization is None and s.dtype_bytes == 4:
        tries.append(("dtype='bfloat16'", replace(s, dtype_bytes=2)))
    if not s.gradient_checkpointing:
        tries.append(("gradient_checkpointing=True", replace(s, gradient_checkpointing=True)))
    if s.optim_bits != 8:
        tries.append(("optim='paged_adamw_8bit'", replace(s, optim_bits=8)))
    tries.append(("load_in_4bit=True, gradient_checkpointing=True, optim='paged_adamw_8bit'",
                  replace(s, quantization="4bit", dtype_bytes=2, gradient_checkpointing=True, optim_bits=8)))
    out, seen = [], set()
    for what, settings in tries:
        plan = plan_memory(shape, settings, available)
        if plan.fits() and what not in seen:
            seen.add(what)
            out.append((what, plan))
    if not out:  # shorter micro-batches, the rest as is
        fixed = plan_memory(shape, replace(s, micro_batch_tokens=0), available)
        per = token_bytes(shape, s)
        room = available - fixed.resident - fixed.parts["activations"]
        if room > 0 and fixed.parts["loading"] <= room and room // per >= 16:
            n = int(room // per)
            out.append((f"max_tokens_per_microbatch={n} (and rows no longer)",
                        plan_memory(shape, replace(s, micro_batch_tokens=n), available)))
    return out


# ----------------------------------------------------------------------------------------------- the device side

def available_bytes(device_type: str, device_index: int | None = None) -> int:
    """What a process may still hold on the device: free GPU memory plus what torch already holds there, or on a
    CPU the host's available memory (the cgroup's limit too, when lower) plus this process's own RSS."""
    if device_type == "cuda":
        import torch

        dev = torch.device("cuda", device_index if device_index is not None else torch.cuda.current_device())
        free, cap = cuda_free_and_cap(dev)
        held = int(free + torch.cuda.memory_reserved(dev))
        return held if cap is None else min(held, cap)
    return host_available_bytes() + current_rss_bytes()


def cuda_free_and_cap(dev: Any) -> tuple[int, int | None]:
    """The CUDA device's free memory and this process's cap on what torch's allocator may reserve there
    (`torch.cuda.set_per_process_memory_fraction` x the device's memory: a process sharing its GPU, or made to plan
    as on a smaller card), None when no cap is set. The plan and the trainer's budgets count the cap as the device's
    size, so a capped process plans, chooses checkpointing and offloading, and refuses too-long calls within it
    rather than failing at the cap with an out-of-memory error."""
    import torch

    index = dev.index if dev.index is not None else torch.cuda.current_device()  # the fraction wants an index
    free, total = torch.cuda.mem_get_info(index)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.9
    fraction = float(getter(index)) if getter is not None else 1.0
    return int(free), (int(fraction * total) if fraction < 1.0 else None)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, or less when a cgroup (v2) limit leaves less."""
    avail = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        import psutil  # noqa: PLC0415 -- only where /proc/meminfo is missing

        avail = int(psutil.virtual_memory().available)
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read().strip())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def current_rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set (ru_maxrss, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def settings_for(cfg: Any, base_model: str, device_type: str, **workload: Any) -> MemorySettings:
    """The plan's settings of InternalModelConfig `cfg` for `base_model` on `device_type` (`workload`:
    micro_batch_tokens, serving_tokens)."""
    from ..config.optimizers import optim_spec
    from .quantization import resolve_quantization
    from .shapes import RANDOM_SHAPES

    quantization = resolve_quantization(cfg, base_model, device_type)
    if cfg.dtype == "auto":
        dtype_bytes = 2 if device_type == "cuda" or quantization else 4
    else:
        dtype_bytes = 4 if cfg.dtype == "float32" else 2
    targets = cfg.target_modules
    targets = tuple([targets] if isinstance(targets, str) else targets) if targets not in (None, "all-linear") else None
    checkpointing = bool(cfg.gradient_checkpointing) if cfg.gradient_checkpointing is not None else False
    fused = liger_applies(cfg, device_type)  # the trainer's rule (train/kernels.py)
    return MemorySettings(device_type=device_type, quantization=quantization, dtype_bytes=dtype_bytes,
                          fused_kernels=fused,
                          lora_rank=cfg.lora_rank, target_modules=targets, optim_bits=optim_spec(cfg.optim).bits,
                          gradient_checkpointing=checkpointing, logprob_chunk_size=cfg.logprob_chunk_size,
                          random_init=base_model in RANDOM_SHAPES, **workload)


def plan_for(base_model: str, cfg: Any, device: Any, *, config: Any = None, **workload: Any) -> MemoryPlan:
    """The plan of `base_model` under InternalModelConfig `cfg` on `device`, with what the device has now.
    `config`: the model's transformers config (else read); `workload`: micro_batch_tokens, serving_tokens (else
    PLAN_TOKENS each). With gradient_checkpointing=None a call turns checkpointing on when it needs to
    (train/memory.py), so the plan takes the cheaper of the two."""
    from .source import load_config

    config = config if config is not None else load_config(base_model, cfg)
    shape = ModelShape.of(config)
    settings = settings_for(cfg, base_model, device.type, **workload)
    if cfg.gradient_checkpointing is None:
        checkpointed = replace(settings, gradient_checkpointing=True)
        if plan_memory(shape, checkpointed).peak < plan_memory(shape, settings).peak:
            settings = checkpointed
    return plan_memory(shape, settings, available_bytes(device.type, device.index))


def replica_set_peak(plan: MemoryPlan, replicas: int, *, with_trainer: bool) -> int:
    """The bytes `replicas` serving processes of `plan`'s model take at their peak on one device, loading at once,
    plus the trainer's peak when it loads on that device too (`with_trainer`). Pure; errs high (peaks summed)."""
    return replicas * plan.serving_peak + (plan.peak if with_trainer else 0)


def check_replicas_fit(base_model: str, cfg: Any, device: Any, replicas: int, *, with_trainer: bool,
                       config: Any = None) -> MemoryPlan:
    """`replicas` inference replicas of `base_model` on `device`, planned as one set (module docstring): a
    ConfigError naming how many fit when their peaks together pass what the device has now (a warning with
    `cfg.check_memory` False). Returns the plan of one process."""
    plan = plan_for(base_model, cfg, device, config=config)
    need = replica_set_peak(plan, replicas, with_trainer=with_trainer)
    trainer = f" and the trainer's {plan.peak / GB:.1f} GB, loading meanwhile" if with_trainer else ""
    log.info("%s: %d inference replicas on %s: %.1f GB at their peak (%.2f GB each%s) of %.1f GB available",
             base_model, replicas, device, need / GB, plan.serving_peak / GB, trainer, (plan.available or 0) / GB)
    if plan.available is None or need <= plan.available:
        return plan
    room = plan.available - (plan.peak if with_trainer else 0)
    fit = max(0, int(room // plan.serving_peak)) if plan.serving_peak else 0
    message = (f"{replicas} inference replicas of {base_model} on this {device.type} device do not fit its memory: "
               f"they load at once and need {need / GB:.1f} GB together at their peak ({plan.serving_peak / GB:.2f} "
               f"GB each{trainer}), and {plan.available / GB:.1f} GB is available. "
               + (f"{fit} fit: set inference_replicas={fit}, " if fit else "None fits beside the trainer: ")
               + "or use 4-bit weights (load_in_4bit=True), or put replicas on other GPUs (inference_gpu_ids) or "
               "machines (inference_endpoints). The plan errs high; check_memory=False in the model's "
               "InternalModelConfig starts them anyway.")
    if not cfg.check_memory:
        log.warning("%s (check_memory=False: starting them anyway)", message)
        return plan
    raise ConfigError(message)


def check_model_fits(base_model: str, cfg: Any, device: Any, *, config: Any = None) -> MemoryPlan:
    """`plan_for`, logged; raises ConfigError when it does not fit (unless `cfg.check_memory` is False: then a
    warning)."""
    plan = plan_for(base_model, cfg, device, config=config)
    settings = plan.settings
    # said at INFO where it matters (a model of a gigabyte or more), at DEBUG for the small ones
    log.log(logging.INFO if plan.parts["weights"] >= GB else logging.DEBUG, "%s: %s", base_model, plan.line())
    if plan.fits():
        return plan
    ways = alternatives(plan.shape, settings, plan.available or 0)
    remedy = ("; ".join(f"{what} (peak {p.peak / GB:.1f} GB)" for what, p in ways) if ways else
              "none of 4-bit weights, checkpointing, an 8-bit optimizer or shorter micro-batches is enough here: "
              "use a smaller model or a device with more memory")
    message = (f"{base_model} does not fit the memory of this {device.type} device: its plan needs "
               f"{plan.peak / GB:.1f} GB at its peak and {plan.available / GB:.1f} GB is available ({plan.line()}). "
               f"Settings that fit: {remedy}. The plan assumes micro-batches of {settings.micro_batch_tokens} tokens "
               "and errs high; set check_memory=False in the model's InternalModelConfig to load anyway "
               "(docs/getting-started.md, 'Memory').")
    if not cfg.check_memory:
        log.warning("%s (check_memory=False: loading anyway)", message)
        return plan
    raise ConfigError(message)
