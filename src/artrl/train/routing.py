"""The trainer's side of a mixture-of-experts model: routing replay and router health.

The routing record (what the engine's routers picked, and its JSON form) is models/moe.py's; making the
trainer's routers follow it is this module's, and only this module's.

`TrainerRouting` sits on the routers of the trained model (forward hooks, for the trainer's life):

* **Replay.** Inside `replaying(mb)`, a micro-batch's tokens that carry a routing record (the experts
  the engine's routers picked for each sampled token, `PackedRows.routing`) take the recorded experts in
  every MoE layer, weighted by the trainer's own router probabilities of them (`RoutingReplay`).
  It covers the forward and, with activation checkpointing, its recomputation in backward. Off with
  `TrainConfig(moe_routing_replay=False)`.
* **Counts** of the first optimizer step (the weights that sampled the data, as the token record's
  `sampled_logprob_delta_*`): `routing_record_tokens` (tokens with a record) and
  `routing_mismatch_tokens` (those whose own top-k, the trainer's choice, differs from the record in some
  layer: the tokens replay routes as sampled, or that route otherwise without it), and, with replay,
  `sampled_logprob_delta_max_without_replay` from one more forward of the step's micro-batches that routes
  freely, without gradient.
* **Router health** over every training forward of a step (real tokens, not padding): each layer's
  expert load, the share of the routed (token, expert) pairs each expert got times the experts
  (1 everywhere when balanced; `router_expert_load_max` / `_min`, and per layer
  `router_expert_load_max_l{layer}`), and the auxiliary load-balancing loss the model's own training would
  add (Switch / Qwen3-MoE form, experts x sum over experts of load share x mean router probability, averaged
  over layers; top_k when balanced). Reported, not trained on: ART's RL loss has no such term.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.moe import is_moe, routers

COUNT_KEYS = ("routing_record_tokens", "routing_mismatch_tokens")


@dataclass
class ReplayCounts:
    """What a replayed forward saw: tokens with a record, and those whose own choice differed in some layer."""

    replayed: int = 0
    rerouted: int = 0
    _pending: list[torch.Tensor] = field(default_factory=list)


class RoutingReplay:
    """Makes each router pick recorded experts (the trainer's side of routing replay).

    `forced` [tokens, layers, top_k] (tokens as the routers see them: rows x width flattened; -1 rows route freely) is
    set with `replaying(forced)`. A token with a record takes its recorded experts in every layer, weighted by the
    router's own probabilities of them (renormalised as the router would); the others keep the router's output bit
    for bit. `counts` add up the tokens with a record and those whose own top-k differed from it (as sets).
    """

    def __init__(self, model: Any) -> None:
        self.routers = routers(model)
        self.forced: torch.Tensor | None = None
        self.apply = True
        self.counts = ReplayCounts()
        self._counted = False

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, output: Any) -> Any:
            forced = self.forced
            if forced is None:
                return None
            logits, scores, indices = output  # [T, E], [T, k], [T, k]
            if forced.shape[1] != len(self.routers):
                raise RuntimeError(f"routing replay: a record of {forced.shape[1]} MoE layers for a model of "
                                   f"{len(self.routers)}")
            want = forced[:, layer, :].to(indices.device, torch.long)  # [T, k]
            if want.shape[0] != indices.shape[0] or want.shape[1] != indices.shape[1]:
                raise RuntimeError(f"routing replay: a record of {tuple(want.shape)} (tokens, top_k) for a router "
                                   f"that saw {tuple(indices.shape)}")
            on = want[:, 0] >= 0  # [T]
            if not self._counted:  # once per replaying(): a checkpointed layer runs its forward again in backward
                own = torch.sort(indices, dim=-1).values
                mine = torch.sort(want.clamp(min=0), dim=-1).values
                self.counts._pending.append(on & (own != mine).any(-1))  # [T]: this layer chose otherwise
                if layer == len(self.routers) - 1:
                    self.counts.replayed += int(on.sum())
                    self.counts.rerouted += int(torch.stack(self.counts._pending).any(0).sum())
                    self.counts._pending.clear()
                    self._counted = True
            if not self.apply:
                return None
            probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
            picked = probs.gather(-1, want.clamp(min=0))  # [T, k]
            if getattr(module, "norm_topk_prob", False):
                picked = picked / picked.sum(-1, keepdim=True)
            new_scores = torch.where(on[:, None], picked.to(scores.dtype), scores)
            new_indices = torch.where(on[:, None], want.to(indices.dtype), indices)
            return logits, new_scores, new_indices
        return hook

    @contextlib.contextmanager
    def installed(self) -> Iterator["RoutingReplay"]:
        handles = [router.register_forward_hook(self._hook(i)) for i, router in self.routers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def replaying(self, forced: torch.Tensor | None, apply: bool = True) -> Iterator[None]:
        """Replay `forced` in the forward passes (and their recomputation) inside, counted once; `apply=False`
        only counts (the router keeps its own choice)."""
        before, self.forced, self.apply = self.forced, forced, apply
        self._counted = False
        try:
            yield
        finally:
            self.forced, self.apply = before, True


class TrainerRouting:
    """See the module docstring. `None`-free: build it only for an MoE model (`for_model`)."""

    def __init__(self, model: Any) -> None:
        self.replay = RoutingReplay(model)
        self.layers = len(self.replay.routers)
        self.experts = int(self.replay.routers[0][1].num_experts) if self.layers else 0
        self.top_k = int(self.replay.routers[0][1].top_k) if self.layers else 0
        self._handles: list[Any] = []
        self._mask: torch.Tensor | None = None  # [tokens] real tokens of the forward in progress
        self._stats = True
        self._health_layers: set[int] = set()
        self.reset_health()

    @classmethod
    def for_model(cls, model: Any) -> "TrainerRouting | None":
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not is_moe(inner.config):
            return None
        routing = cls(inner)
        routing.install()
        return routing

    def install(self) -> None:
        # replay first: a hook's returned output is what the next hook (health) and the layer see
        self._replay_hooks = self.replay.installed()
        self._replay_hooks.__enter__()
        self._handles = [router.register_forward_hook(self._health_hook(i)) for i, router in self.replay.routers]

    # ------------------------------------------------------------------ a micro-batch
    @contextlib.contextmanager
    def replaying(self, routing: torch.Tensor | None, real: torch.Tensor, *, replay: bool = True,
                  count: bool = True, stats: bool = True) -> Iterator[None]:
        """Forward (and backward) passes over a micro-batch: `routing` [rows, width, layers, k] (None: no record),
        `real` [rows, width] its real tokens. `replay` False routes freely; `count`: add to the counts (the first
        optimizer step's passes); `stats`: add to the router health (the training forwards)."""
        forced = routing.reshape(-1, *routing.shape[2:]) if routing is not None else None
        before, self._mask, self._stats = self._mask, real.reshape(-1), stats
        self._health_layers: set[int] = set()  # layers counted in this context (checkpointing runs them twice)
        counts_before = (self.replay.counts.replayed, self.replay.counts.rerouted)
        try:
            with self.replay.replaying(forced, apply=replay):
                yield
        finally:
            self._mask = before
            if not count:
                self.replay.counts.replayed, self.replay.counts.rerouted = counts_before

    def counts(self) -> dict[str, float]:
        c = self.replay.counts
        return {"routing_record_tokens": float(c.replayed), "routing_mismatch_tokens": float(c.rerouted)}

    def reset_counts(self) -> None:
        self.replay.counts.replayed = self.replay.counts.rerouted = 0

    # ------------------------------------------------------------------ router health
    def reset_health(self) -> None:
        self._load = torch.zeros(self.layers, self.experts, dtype=torch.float64)  # routed pairs per expert
        self._prob = torch.zeros(self.layers, self.experts, dtype=torch.float64)  # summed router probabilities
        self._tokens = torch.zeros(self.layers, dtype=torch.float64)

    def _health_hook(self, layer: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            if not self._stats or self._mask is None or not torch.is_grad_enabled() or layer in self._health_layers:
                return  # passes without gradient (references, measures) and recomputation add nothing
            self._health_layers.add(layer)
            logits, _, indices = output  # [T, E], [T, k], [T, k]
            real = self._mask.to(indices.device)
            if real.shape[0] != indices.shape[0]:
                return
            with torch.no_grad():
                picked = indices[real]  # [t, k]
                load = torch.bincount(picked.reshape(-1), minlength=self.experts).double().cpu()
                prob = torch.softmax(logits[real].float(), -1).sum(0).double().cpu()  # [E]
            self._load[layer] += load
            self._prob[layer] += prob
            self._tokens[layer] += float(real.sum())
        return hook

    def health(self) -> dict[str, float]:
        """The step's router health (module docstring); {} when no training forward ran."""
        tokens = self._tokens.clamp(min=1)[:, None]  # [L, 1]
        if float(self._tokens.sum()) == 0:
            return {}
        share = self._load / (tokens * self.top_k)  # [L, E] of routed pairs
        load = share * self.experts  # 1 when balanced
        aux = (self.experts * (self._load / tokens) * (self._prob / tokens)).sum(-1)  # [L]
        out = {"router_expert_load_max": float(load.max()), "router_expert_load_min": float(load.min()),
               "router_aux_loss": float(aux.mean())}
        out.update({f"router_expert_load_max_l{i}": float(v) for i, v in enumerate(load.max(-1).values)})
        return out

    def reduce(self, all_reduce: Any) -> None:
        """Sum the health figures over ranks (a sharded trainer: every rank calls it)."""
        for t in (self._load, self._prob, self._tokens):
            all_reduce(t)
