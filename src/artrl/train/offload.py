"""Activation offloading: a train forward's saved tensors wait in host memory until its backward needs them.

With activation checkpointing on, what a forward saves outside the checkpointed layers is each layer's input (and
the LM head's chunks' inputs); `offload_activations` keeps those in pinned host memory instead of on the GPU
(train/memory.py decides when). torch's `save_on_cpu` copies every tensor the forward saves, and a checkpointed
region saves its inputs, weights among them: each 1,024-token chunk of the LM head (train/logprobs.py) took a host
copy of the whole head (1.24 GB on the Qwen3-8B shape), so a 16k-token call on one H200 pinned 40 GB of host memory
and took 40 s instead of 14 (docs/performance.md, "Offloading on a GPU"). Here a parameter, or any view of one,
is never copied: it stays where it is, as it would without offloading; neither are tensors under `MIN_BYTES`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

MIN_BYTES = 1024  # smaller saved tensors stay where they are: a copy would cost more than it frees


class HostOffload:
    """Saved-tensor hooks that move a forward's saved activations to host memory (pinned on CUDA), never a parameter
    of `model`. `bytes` counts what the last `saving()` moved, `tensors` how many."""

    def __init__(self, model: torch.nn.Module, *, pin_memory: bool) -> None:
        self.model = model
        self.pin_memory = pin_memory
        self._resident: set[int] = set()
        self.bytes = 0
        self.tensors = 0

    def _pack(self, t: torch.Tensor) -> Any:
        size = t.numel() * t.element_size()
        if t.layout is not torch.strided or size < MIN_BYTES or _storage(t) in self._resident:
            return t
        self.bytes += size
        self.tensors += 1
        if t.device.type == "cpu":  # already in host memory (a CPU run of this path, for its tests)
            return (None, t)
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=self.pin_memory)
        host.copy_(t)
        return (t.device, host)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host if device is None else host.to(device, non_blocking=self.pin_memory)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The forward under this context offloads what it saves."""
        # storages, not tensors: a transposed or sliced weight (lm_head.weight[:, ...], weight.t()) is its own tensor
        # over the parameter's storage; read at each forward, since adapters come and go (KL references)
        self._resident = {_storage(p) for p in self.model.parameters()} | {_storage(b) for b in self.model.buffers()}
        self.bytes = 0
        self.tensors = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


def _storage(t: torch.Tensor) -> int | None:
    """The address of `t`'s storage (None for a tensor without one, e.g. a wrapper subclass)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
