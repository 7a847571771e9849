"""Sampled-token logprobs and entropy without the full logits tensor.

Only trainable slots need a logprob, and each needs the hidden state of the slot
that predicts it (`prev_index`, which for a completion's first token is the last
token of its group's shared prompt). We gather those hidden states, then apply
the LM head in chunks of `chunk_size` rows, each under activation checkpointing:
peak memory is chunk_size x vocab (forward and backward), not seq x vocab, and
the head runs over trainable tokens only. A half-precision head on a CPU without a fast half-precision
matmul computes in float32, a slice of its vocabulary at a time (`_Float32Head`).

A vision-language model's micro-batch brings its images (`images`: in the order the rows' image tokens
come): the vision tower runs once per distinct image (by content hash; a group's shared image once), without
gradient unless some of its weights are trained (frozen by default: LoRA adapts the language model), and its
features go to the backbone as precomputed encoder outputs, which it scatters into the image tokens' slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from ..models.quantization import fast_cpu_matmul

DEFAULT_CHUNK_SIZE = 1024


#: Vocabulary rows of a half-precision LM head upcast at a time on a CPU without a fast half-precision matmul.
HEAD_SLICE_ROWS = 8192


class _Float32Head(torch.autograd.Function):
    """`F.linear(hidden, weight, bias)` in float32 for a half-precision head on a CPU whose half-precision matmul
    is the slow fallback (models/quantization.py's `fast_cpu_matmul`): the weight is upcast `HEAD_SLICE_ROWS`
    vocabulary rows at a time, in the forward and again in the backward, so no float32 copy of the whole head is
    kept; the backward's `grad @ W` (the 100x slow orientation in bfloat16) runs in float32 too."""

    @staticmethod
    def forward(ctx: object, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        h = hidden.float()  # [chunk, hidden]
        out = h.new_empty(hidden.shape[0], weight.shape[0])  # [chunk, vocab]
        for s in range(0, weight.shape[0], HEAD_SLICE_ROWS):
            torch.matmul(h, weight[s:s + HEAD_SLICE_ROWS].float().t(), out=out[:, s:s + HEAD_SLICE_ROWS])
        if bias is not None:
            out += bias.float()
        ctx.save_for_backward(hidden, weight)  # type: ignore[attr-defined]
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        need_h, need_w, need_b = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad = grad.float()  # [chunk, vocab]
        grad_h = grad_w = grad_b = None
        if need_h:
            acc = grad.new_zeros(hidden.shape)  # [chunk, hidden]
            for s in range(0, weight.shape[0], HEAD_SLICE_ROWS):
                acc += grad[:, s:s + HEAD_SLICE_ROWS] @ weight[s:s + HEAD_SLICE_ROWS].float()
            grad_h = acc.to(hidden.dtype)
        if need_w:  # a trained head: [vocab, hidden]
            grad_w = (grad.t() @ hidden.float()).to(weight.dtype)
        if need_b and ctx.has_bias:  # type: ignore[attr-defined]
            grad_b = grad.sum(0)
        return grad_h, grad_w, grad_b


def _head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The LM head's logits in float32: [chunk, hidden] -> [chunk, vocab]."""
    if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16) \
            and not fast_cpu_matmul(weight.dtype):
        return _Float32Head.apply(hidden, weight, bias)
    return F.linear(hidden, weight, bias).float()


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           softcap: float | None, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _head(hidden, weight, bias)  # [chunk, vocab]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [chunk, vocab]
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [chunk]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [chunk]
    return logp, entropy


def token_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    softcap: float | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden: [n, hidden] states that predict `targets` [n] -> (logprobs [n], entropy [n]) in float32."""
    weight = lm_head.weight
    bias = getattr(lm_head, "bias", None)
    logps, ents = [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for s in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[s:s + chunk_size], targets[s:s + chunk_size]
        if grad:
            lp, en = checkpoint(_chunk, h, weight, bias, t, softcap, temperature, use_reentrant=False)
        else:
            lp, en = _chunk(h, weight, bias, t, softcap, temperature)
        logps.append(lp)
        ents.append(en)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


class TokenLogprobModel(torch.nn.Module):
    """The model's part of a train forward pass as one module: backbone, then the LM head on chosen slots.

    Holding backbone and head under one parent lets a wrapper that works per module call
    (FSDP2's `fully_shard`, distributed/sharding.py) see the whole pass, tied embeddings included.
    """

    def __init__(self, backbone: torch.nn.Module, lm_head: torch.nn.Module, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.lm_head = lm_head
        self.chunk_size = chunk_size
        self.softcap = softcap

    def forward(self, input_ids: torch.Tensor, attention_mask: object, position_ids: torch.Tensor,
                rows: torch.Tensor, prev: torch.Tensor, targets: torch.Tensor, *, chunk_size: int | None = None,
                images: list | None = None, **extra: object) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids: [rows, width], position_ids: [rows, width] (or [3, rows, width] for a vision-language model);
        rows, prev, targets: [n] -> (logprobs [n], entropy [n]).

        `chunk_size`: tokens per LM-head chunk for this pass (None: the module's own). `images`: the rows' images
        in slot order (models/vision.py's processed images), None or empty without."""
        if images:
            extra["mm_encoder_outputs"] = {"image": self.image_features(images, input_ids.device)}
        with record_function("artrl/forward"):
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False, **extra).last_hidden_state  # [rows, width, hidden]
        with record_function("artrl/logprobs"):
            h = hidden[rows, prev]  # [n, hidden]
            return token_logprobs(h, self.lm_head, targets, chunk_size=chunk_size or self.chunk_size,
                                  softcap=self.softcap)

    def image_features(self, images: list, device: torch.device) -> object:
        """The vision tower's output for `images` (each distinct one computed once), as the backbone's
        `mm_encoder_outputs["image"]`: per image, its [tokens, hidden] features in the given order."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        unique: dict[str, int] = {}
        for image in images:
            unique.setdefault(image.digest, len(unique))
        firsts = {image.digest: image for image in reversed(images)}
        distinct = [firsts[d] for d in unique]
        pixels = torch.cat([image.pixels for image in distinct]).to(device)  # [patches, patch values]
        grid = torch.tensor([image.grid for image in distinct], dtype=torch.long, device=device)  # [images, 3]
        trains = any(p.requires_grad for p in self.backbone.visual.parameters())
        with record_function("artrl/vision"), torch.set_grad_enabled(torch.is_grad_enabled() and trains):
            out = self.backbone.get_image_features(pixels, grid, return_dict=True)
        features = out.pooler_output  # per distinct image: [tokens, hidden]
        return BaseModelOutputWithPooling(pooler_output=tuple(features[unique[image.digest]] for image in images))
