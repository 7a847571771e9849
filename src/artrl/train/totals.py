"""An optimizer step's running figures, added up on the device and read once per step.

Reading a CUDA tensor's value (`float(t)`, `.item()`, `.tolist()`) waits for every
kernel queued before it: one read per figure per micro-batch stalls the GPU as
often. `StepTotals` keeps what a micro-batch adds as tensors and turns them into
floats on the first read (one `tolist()` for all of them), which the trainer does
once, after the step's last backward. Python numbers (counts known on the host)
are added at once.

It is a `dict[str, float]` to its readers: `totals[key]` and `sorted(totals)` see
settled floats, so code that combines totals across ranks needs nothing else. A
vector figure (the importance-ratio histogram) is added with `add_vector` and settles
into one float per element, under `<key>/<index>`, so it sums across ranks the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from .loss import RATIO_BUCKETS
from .offpolicy import AGE_BUCKETS, AGE_FIELDS, AGE_VECTOR_KEY, MISMATCH_KEYS

KEYS = ("loss", "policy", "kl", "entropy", "clipped", "ratio", "weight", "computed", "kl_ref",
        # ART 0.5.23's off-policy figures (train/loss.py): tokens, sum of their raw ratios, clipped tokens
        "ratio_tokens", "ratio_raw", "ratio_clipped",
        "delta_sum", "delta_max", "delta_tokens",
        # a mixture-of-experts model's routing replay (train/routing.py), the first optimizer step's
        "routing_record", "routing_mismatch", "delta_free_max",
        # the sampler/trainer mismatch (train/offpolicy.py; first step), tokens the off-policy sequence mask drops
        *MISMATCH_KEYS, "opsm_masked")
RATIO_HISTOGRAM_KEY = "ratio_hist"
VECTORS = {RATIO_HISTOGRAM_KEY: RATIO_BUCKETS, AGE_VECTOR_KEY: AGE_BUCKETS * len(AGE_FIELDS)}
"""Vector figures and their sizes: the importance-ratio histogram of RL losses (train/loss.py), the mismatch sums by
policy age (train/offpolicy.py). Their elements are
present (0) in every StepTotals, so ranks always combine the same keys."""


class StepTotals(dict):
    """Sums (and maxima, for keys ending in `_max`) of a step's figures; tensors are settled on first read."""

    def __init__(self) -> None:
        super().__init__(dict.fromkeys(KEYS, 0.0))
        for key, size in VECTORS.items():
            self.update(dict.fromkeys((f"{key}/{i}" for i in range(size)), 0.0))
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._vectors: dict[str, list[torch.Tensor]] = {}

    def add(self, key: str, value: torch.Tensor | float) -> None:
        """Add `value` to `key` (the larger of the two for a `_max` key); a tensor is not read here."""
        if isinstance(value, torch.Tensor):
            self._pending.setdefault(key, []).append(value.detach().reshape(()))
            return
        current = dict.__getitem__(self, key)
        dict.__setitem__(self, key, max(current, value) if key.endswith("_max") else current + float(value))

    def add_vector(self, key: str, value: torch.Tensor) -> None:
        """Add the 1-d tensor `value` element-wise to the vector figure `key` (not read here)."""
        self._vectors.setdefault(key, []).append(value.detach().reshape(-1))

    def settle(self) -> None:
        """Turn the pending tensors into floats: one host read for all of them."""
        if not self._pending and not self._vectors:
            return
        keys = list(self._pending)
        parts = []
        for key in keys:
            vals = torch.stack([v.to(torch.float64) for v in self._pending[key]])  # [micro-batches]
            parts.append(vals.amax().reshape(1) if key.endswith("_max") else vals.sum().reshape(1))
        names = list(keys)
        for key, vals in self._vectors.items():
            total = torch.stack([v.to(torch.float64) for v in vals]).sum(0)  # [elements]
            parts.append(total)
            names += [f"{key}/{i}" for i in range(total.numel())]
        self._pending, self._vectors = {}, {}
        for key, value in zip(names, torch.cat([p.to(parts[0].device) for p in parts]).tolist()):
            if "/" in key:  # an element of a vector figure
                dict.__setitem__(self, key, dict.get(self, key, 0.0) + value)
            else:
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


def vector_figure(totals: dict[str, float], key: str) -> list[float]:
    """The elements of vector figure `key` (VECTORS) in `totals`, a StepTotals or the plain dict that ranks
    combine it into."""
    if isinstance(totals, StepTotals):
        totals.settle()
    return [totals.get(f"{key}/{i}", 0.0) for i in range(VECTORS[key])]
