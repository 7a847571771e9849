"""An optimizer step's running figures, added up on the device and read once per step.

Reading a CUDA tensor's value (`float(t)`, `.item()`, `.tolist()`) waits for every
kernel queued before it: one read per figure per micro-batch stalls the GPU as
often. `StepTotals` keeps what a micro-batch adds as tensors and turns them into
floats on the first read (one `tolist()` for all of them), which the trainer does
once, after the step's last backward. Python numbers (counts known on the host)
are added at once.

It is a `dict[str, float]` to its readers: `totals[key]` and `sorted(totals)` see
settled floats, so code that combines totals across ranks needs nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

KEYS = ("loss", "policy", "kl", "entropy", "clipped", "ratio", "weight", "computed", "kl_ref",
        "delta_sum", "delta_max", "delta_tokens",
        # a mixture-of-experts model's routing replay (train/routing.py), the first optimizer step's
        "routing_record", "routing_mismatch", "delta_free_max")


class StepTotals(dict):
    """Sums (and maxima, for keys ending in `_max`) of a step's figures; tensors are settled on first read."""

    def __init__(self) -> None:
        super().__init__(dict.fromkeys(KEYS, 0.0))
        self._pending: dict[str, list[torch.Tensor]] = {}

    def add(self, key: str, value: torch.Tensor | float) -> None:
        """Add `value` to `key` (the larger of the two for a `_max` key); a tensor is not read here."""
        if isinstance(value, torch.Tensor):
            self._pending.setdefault(key, []).append(value.detach().reshape(()))
            return
        current = dict.__getitem__(self, key)
        dict.__setitem__(self, key, max(current, value) if key.endswith("_max") else current + float(value))

    def settle(self) -> None:
        """Turn the pending tensors into floats: one host read for all of them."""
        if not self._pending:
            return
        keys = list(self._pending)
        parts = []
        for key in keys:
            vals = torch.stack([v.to(torch.float64) for v in self._pending[key]])  # [micro-batches]
            parts.append(vals.amax() if key.endswith("_max") else vals.sum())
        self._pending = {}
        for key, value in zip(keys, torch.stack(parts).tolist()):
            self.add(key, value)

    def __getitem__(self, key: str) -> float:
        self.settle()
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        self.settle()
        return dict.get(self, key, default)

    def items(self):  # type: ignore[override]
        self.settle()
        return dict.items(self)

    def values(self):  # type: ignore[override]
        self.settle()
        return dict.values(self)

    def as_dict(self) -> dict[str, float]:
        self.settle()
        return dict(self)
