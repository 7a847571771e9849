"""Whether the trainer applies Liger Kernel's fused kernels: one rule for the trainer (train/kernels.py), which
applies them, and the memory plan (models/memory_plan.py), which counts their smaller activations."""

from __future__ import annotations

import importlib.util
from typing import Any


def liger_available() -> bool:
    """Whether liger_kernel is installed (nothing is imported)."""
    return importlib.util.find_spec("liger_kernel") is not None


def liger_applies(cfg: Any, device_type: str) -> bool:
    """The kernels are applied on CUDA when `cfg.liger_kernel` is True, or None (the default) and the package is
    installed; never elsewhere (the trainer refuses True off CUDA, and without the package)."""
    if device_type != "cuda" or cfg.liger_kernel is False:
        return False
    return bool(cfg.liger_kernel) or liger_available()
