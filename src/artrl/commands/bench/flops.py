"""Model FLOPs of a train step, and the hardware peak to compare them with (MFU).

Per real (non-padding) token of a forward+backward pass, with N the
non-embedding parameters of the base model that a token runs through (a
mixture-of-experts layer: top_k of its experts, so MFU counts active parameters):

* dense training:       6 N           (2 N forward, 4 N backward: input and weight gradients)
* LoRA-aware (default): 4 N + 6 N_lora (frozen base weights need no weight gradient)
* attention:            12 * layers * heads * head_dim * visible_keys
                        (QK^T and AV, 2 FLOPs per multiply-add, x3 for forward and backward;
                        visible_keys = the token's position + 1: its prompt and its own prefix)
* LM head, trainable tokens only (our trainer computes no other logits):
                        4 * hidden * vocab LoRA-aware (no weight gradient), 6 * hidden * vocab dense

Padding and recomputation (activation checkpointing of the LM-head chunks) are
not model FLOPs, so MFU counts only useful work.

Peak: on GPU the dense bf16 figure of known devices (`GPU_PEAK_TFLOPS`) and a
measured large matmul; on CPU a measured large matmul in the training dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


@dataclass
class ModelShape:
    non_embedding_params: int
    lora_params: int
    layers: int
    heads: int
    head_dim: int
    hidden: int
    vocab: int

    @classmethod
    def of(cls, model: Any) -> "ModelShape":
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        cfg = inner.config
        emb = {id(p) for p in inner.get_input_embeddings().parameters()}
        emb |= {id(p) for p in inner.get_output_embeddings().parameters()}
        from ...models.moe import moe_shape
        from ...models.quantization import weight_numel

        # a mixture-of-experts layer runs top_k of its experts per token: its expert weights (and their adapters)
        # count by the active share (models/moe.py)
        moe = moe_shape(cfg)
        share = moe.top_k / moe.experts if moe else 1.0

        def active(name: str, p: Any) -> float:
            return weight_numel(p) * (share if ".experts." in name or name.endswith(".experts") else 1.0)

        named = list(inner.named_parameters())
        base = int(sum(active(n, p) for n, p in named if id(p) not in emb and not p.requires_grad))
        lora = int(sum(active(n, p) for n, p in named if p.requires_grad))
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(base, lora, cfg.num_hidden_layers, heads, head_dim, cfg.hidden_size, cfg.vocab_size)

    def flops(self, real_tokens: int, trainable_tokens: int, visible_keys: int, lora_aware: bool = True) -> float:
        linear = (4 * self.non_embedding_params + 6 * self.lora_params) if lora_aware else \
            6 * (self.non_embedding_params + self.lora_params)
        head = (4 if lora_aware else 6) * self.hidden * self.vocab
        attn = 12 * self.layers * self.heads * self.head_dim
        return float(linear) * real_tokens + float(head) * trainable_tokens + float(attn) * visible_keys


def packed_counts(packed: Any, rows: list[int] | None = None) -> tuple[int, int, int]:
    """(real tokens, trainable tokens, summed visible keys) of the given rows of PackedRows."""
    idx = torch.as_tensor(rows if rows is not None else list(range(packed.num_rows)), dtype=torch.long)
    real = packed.segment_ids[idx] >= 0
    keys = int((packed.position_ids[idx][real] + 1).sum())
    return int(real.sum()), int(packed.trainable_mask[idx].sum()), keys


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, n: int | None = None,
                          repeats: int = 5) -> float:
    """Best FLOP/s of an n x n x n matmul (n = 8192 on GPU, 2048 on CPU)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        (a @ b).sum().item() if device.type == "cuda" else a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first run warms up
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def hardware_peak(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The peak used for MFU (table value on known GPUs, else the measured matmul) and how it was found."""
    measured = measured_matmul_flops(device, dtype)
    out: dict[str, Any] = {"measured_matmul_tflops": round(measured / 1e12, 3)}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        out["device_name"] = name
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                out.update(peak_tflops=tflops, peak_source=f"table ({key} dense bf16)")
                return out
    out.update(peak_tflops=out["measured_matmul_tflops"], peak_source=f"measured {dtype} matmul")
    return out
