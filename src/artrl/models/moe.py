"""Mixture-of-experts models (Qwen3-MoE): what artrl knows of them, and routing replay.

An MoE layer's feed-forward is `num_experts` small MLPs; a router picks `top_k` of them per token
(Qwen3-MoE: softmax over the experts, the top k, renormalised) and sums their outputs weighted by
the picked probabilities. transformers 5 keeps a layer's experts as two fused parameters
(`experts.gate_up_proj` [experts, 2 x width, hidden], `experts.down_proj` [experts, hidden, width])
and computes them per routed token: its default "grouped_mm" implementation sorts the (token,
expert) pairs by expert and runs one grouped matrix multiply over them (torch's grouped GEMM
where the device has one, a loop over the experts that were hit elsewhere); never every expert
on every token. artrl keeps that (`EXPERTS_IMPLEMENTATION`; tests/test_moe.py checks it against
the dense reference).

LoRA on the experts: ART's default target modules for an MoE model add "experts" to the
attention projections; with fused experts that means peft's `target_parameters` on
`experts.gate_up_proj` and `experts.down_proj` (a rank-r adapter per expert, stored as one
[experts x r, in] A and one [out, experts x r] B; `lora_targets`). peft adds the adapter to the
whole expert stack for the length of each forward (W + B A of every expert, one copy of the
layer's experts), so LoRA on the experts costs that copy per layer in memory; checkpointing
keeps it to one layer at a time.

Routing replay: the router is a discrete choice, so the experts picked while sampling and while
training the same token can differ (another batch shape rounds differently, or the policy moved).
The built-in engine records, for every sampled token, the experts each layer picked when the token
was fed back in (`RoutingRecorder`; [tokens, layers, top_k] ids, -1 where there is none: the last
sampled token is never fed back), and from the prefill the experts of the prompt's last position,
whose output is the first sampled token's distribution; the server returns them with the token
record (`encode_routing`; the last prompt position in its own optional field, PROMPT_LAST_KEY), and
the trainer makes each router pick the recorded experts at those positions (train/routing.py, the
one home of the trainer's side), with their probabilities taken from its own router logits (so the
router still gets a gradient). So every sampled token is predicted from a replayed position. The
other prompt tokens route freely (the engine records nothing of them; they only reach a sampled
token's logprob through attention), and so does a turn's last prompt position where the record has
no such field (an older server's, or vLLM's, which returns the fed tokens only). The packer never
shares a replayed position between completions (preprocess/pack.py): each replays its own request's.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import Any

import torch

from .structure import PROJECTIONS

log = logging.getLogger(__name__)

EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
EXPERTS_IMPLEMENTATION = "grouped_mm"
ART_EXPERTS_TARGET = "experts"  # ART's name among target_modules for the experts of an MoE model
RECORD_KEY = "routed_experts"  # the choice's field holding the record (serve/http/server.py)


def is_moe(config: Any) -> bool:
    """Whether a transformers config describes a mixture-of-experts model."""
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0) > 0


@dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    layers: int  # MoE layers (all of them for Qwen3-MoE's defaults)
    width: int  # one expert's MLP width


def moe_shape(config: Any) -> MoeShape | None:
    if not is_moe(config):
        return None
    layers = int(config.num_hidden_layers)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return MoeShape(experts=int(getattr(config, "num_experts", 0) or config.num_local_experts),
                    top_k=int(config.num_experts_per_tok), layers=len(sparse),
                    width=int(getattr(config, "moe_intermediate_size", 0) or config.intermediate_size))


def routers(model: Any) -> list[tuple[int, Any]]:
    """(MoE layer index 0.., router module) of every sparse layer, in order."""
    found = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    return list(enumerate(found))


def lora_targets(model: Any, target_modules: list[str] | str | None) -> tuple[list[str] | str, list[str] | None]:
    """(peft target_modules, target_parameters) for `model`: for an MoE model the attention projections (and any dense
    MLP projections) as modules, the experts as parameters, as ART's default; "experts" in a user's list means the
    experts' parameters. For a dense model (target_modules, None)."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if not is_moe(model.config):
        return target_modules, None  # type: ignore[return-value]
    if target_modules is None:
        modules = [p for p in PROJECTIONS if p in names]
        return modules, list(EXPERT_PARAMETERS)
    if isinstance(target_modules, str):
        return target_modules, None
    modules = [t for t in target_modules if t != ART_EXPERTS_TARGET]
    return modules, list(EXPERT_PARAMETERS) if ART_EXPERTS_TARGET in target_modules else None


DENSE_REFERENCE = "artrl_dense_reference"


def dense_experts_forward(experts: Any, hidden: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The dense reference of a fused experts module's forward: every expert on every token, weighted by the
    [tokens, experts] routing matrix (zero off each token's top-k). What a routed implementation must equal, and
    what `artrl bench train --dense-experts` times against it; never used to train."""
    gate_up = torch.einsum("th,eoh->teo", hidden, experts.gate_up_proj)  # [T, E, 2W]
    gate, up = gate_up.chunk(2, dim=-1)  # [T, E, W] each
    out = torch.einsum("tew,ehw->teh", experts.act_fn(gate) * up, experts.down_proj)  # [T, E, H]
    dense = torch.zeros(hidden.shape[0], experts.num_experts, dtype=out.dtype, device=out.device)  # [T, E]
    dense = dense.scatter(1, top_k_index, top_k_weights.to(out.dtype))
    return (out * dense[:, :, None]).sum(1)  # [T, H]


def use_dense_reference(model: Any) -> None:
    """Make `model`'s experts run `dense_experts_forward` (registered under DENSE_REFERENCE with transformers'
    experts interface, its extension point; for benchmarks and tests)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if DENSE_REFERENCE not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS[DENSE_REFERENCE] = dense_experts_forward
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = DENSE_REFERENCE


# ----------------------------------------------------------------------------------------- the routing record

PROMPT_LAST_KEY = "prompt_last_int16"  # the record's optional field: the prompt's last position, [layers, top_k]


def _int16(ids: torch.Tensor) -> str:
    return base64.b64encode(ids.to(torch.int16).contiguous().cpu().numpy().tobytes()).decode("ascii")


def encode_routing(ids: torch.Tensor, prompt_last: torch.Tensor | None = None) -> dict[str, Any]:
    """A [tokens, layers, top_k] record of expert ids (-1: none) as JSON: little-endian int16, base64. `prompt_last`
    ([layers, top_k], the experts of the prompt's last position) rides along under PROMPT_LAST_KEY, same encoding;
    a reader that does not know the field reads the record as before."""
    record: dict[str, Any] = {"shape": list(ids.shape), "int16": _int16(ids)}
    if prompt_last is not None:
        record[PROMPT_LAST_KEY] = _int16(prompt_last)
    return record


def decode_routing(record: Any) -> torch.Tensor:
    """`encode_routing`'s JSON back to a [tokens, layers, top_k] int16 tensor; ValueError when malformed."""
    return decode_routing_with_prompt(record)[0]


def decode_routing_with_prompt(record: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`encode_routing`'s JSON back to ([tokens, layers, top_k], [layers, top_k] of the prompt's last position or
    None: a record without it, as older servers wrote) int16 tensors; ValueError when malformed."""
    import numpy as np

    try:
        shape = [int(n) for n in record["shape"]]
        raw = base64.b64decode(record["int16"], validate=True)
        if len(shape) != 3 or len(raw) != 2 * shape[0] * shape[1] * shape[2]:
            raise ValueError(f"{len(raw)} bytes for shape {shape}")
        ids = torch.from_numpy(np.frombuffer(raw, dtype="<i2").copy()).view(*shape)
        last = None
        if record.get(PROMPT_LAST_KEY) is not None:
            raw = base64.b64decode(record[PROMPT_LAST_KEY], validate=True)
            if len(raw) != 2 * shape[1] * shape[2]:
                raise ValueError(f"{len(raw)} bytes of {PROMPT_LAST_KEY} for {shape[1:]} (layers, top_k)")
            last = torch.from_numpy(np.frombuffer(raw, dtype="<i2").copy()).view(*shape[1:])
        return ids, last
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed {RECORD_KEY} record ({e})") from e


def record_of_fed_tokens(routed: Any, n_tokens: int) -> torch.Tensor:
    """The record of `n_tokens` sampled tokens from an engine's routing of the tokens it fed in after the prompt
    (vLLM's `routed_experts` with `routed_experts_prompt_start` at the prompt's end: [fed tokens, layers, top_k],
    row i the experts sampled token i took when it was fed back in): [n_tokens, layers, top_k] int16, row i sampled
    token i's, -1 for the tokens never fed in (the last). The same alignment as `RoutingRecorder`'s record, which
    the trainer replays at each sampled token's own position."""
    fed = torch.as_tensor(routed).to(torch.int16)[:n_tokens]  # [<= n_tokens, layers, top_k]
    pad = torch.full((n_tokens - fed.shape[0], *fed.shape[1:]), -1, dtype=torch.int16)
    return torch.cat([fed, pad])


class RoutingRecorder:
    """The experts each router picked in the model's latest forward (the engine's side of routing replay).

    Hooks on the routers of `model` (the engine's own copy) for as long as the recorder lives (`remove()` takes
    them off): after a forward, `latest` is a [moe layers, tokens, top_k] tensor (tokens in the order the routers
    saw them: the batch's rows, flattened); `clear()` before a forward whose choices are wanted, so a forward
    that ran no hook (a replayed CUDA graph) leaves None.
    """

    def __init__(self, model: Any) -> None:
        self.routers = routers(model)
        self._current: list[torch.Tensor | None] = [None] * len(self.routers)
        self.latest: torch.Tensor | None = None
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in self.routers]

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            self._current[layer] = output[2].detach()  # router_indices [tokens, top_k]
            if layer == len(self.routers) - 1:
                self.latest = torch.stack([t for t in self._current if t is not None]).to(torch.int16)
        return hook

    def clear(self) -> None:
        self.latest = None
        self._current = [None] * len(self.routers)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
