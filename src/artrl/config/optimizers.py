"""The optimizers artrl runs, under ART's names (`trainer_args.optim`), and what each keeps a weight.

A table, read by the memory plan (models/memory_plan.py: the bytes of optimizer state), the
config check at register (types.py) and the trainer (train/optimizers.py builds the optimizer
a spec names); it sits below all three, so none of them imports another for it. Whether
bitsandbytes, the package of the 8-bit optimizers and of 4-bit and 8-bit weights
(models/quantization.py), is installed is answered here too, for the same reason.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ..errors import ConfigError

DEFAULT_OPTIM = "adamw_torch"
BNB_INSTALL_HINT = "pip install bitsandbytes"


@dataclass(frozen=True)
class OptimSpec:
    name: str  # ART's name, as given
    bnb: bool  # bitsandbytes' optimizer (else torch's AdamW)
    bits: int  # 8 or 32: the moments' storage
    paged: bool = False
    fused: bool | None = None  # torch only: None follows fused_optimizer / the device


_SPECS = {
    "adamw_torch": OptimSpec("adamw_torch", bnb=False, bits=32),
    "adamw_torch_fused": OptimSpec("adamw_torch_fused", bnb=False, bits=32, fused=True),
    "adamw_8bit": OptimSpec("adamw_8bit", bnb=True, bits=8),
    "adamw_bnb_8bit": OptimSpec("adamw_bnb_8bit", bnb=True, bits=8),
    "paged_adamw_8bit": OptimSpec("paged_adamw_8bit", bnb=True, bits=8, paged=True),
    "paged_adamw_32bit": OptimSpec("paged_adamw_32bit", bnb=True, bits=32, paged=True),
}
SUPPORTED_OPTIMS = tuple(_SPECS)


def bitsandbytes_installed() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def optim_spec(name: str | None) -> OptimSpec:
    """The optimizer `name` (ART's `trainer_args.optim`) means; ConfigError for one artrl does not run."""
    name = name or DEFAULT_OPTIM
    spec = _SPECS.get(name)
    if spec is None:
        raise ConfigError(f"optim={name!r} is not supported; artrl runs {list(SUPPORTED_OPTIMS)} (ART's names). "
                          "For the least memory use 'paged_adamw_8bit' (ART's default).")
    if spec.bnb and not bitsandbytes_installed():
        raise ConfigError(f"optim={name!r} needs bitsandbytes, which is not installed: {BNB_INSTALL_HINT}. Or "
                          f"use optim='{DEFAULT_OPTIM}'.")
    return spec
