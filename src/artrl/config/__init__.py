"""The model configuration, apart from the per-call configs of types.py: `InternalModelConfig` (model.py: how a
model loads, adapts, trains and serves), ART's `LoRAConfig` applied onto it (lora.py), and the optimizer table it
checks (optimizers.py).

Imports types (the call configs it supplies defaults to), dev (ART's nested spelling it accepts), errors and
runtime; models, train, serve and the backends read it.
"""

from .lora import apply_lora_config
from .model import CALL_DEFAULT_FIELDS, InternalModelConfig
from .optimizers import OptimSpec, optim_spec

__all__ = ["CALL_DEFAULT_FIELDS", "InternalModelConfig", "OptimSpec", "apply_lora_config", "optim_spec"]
