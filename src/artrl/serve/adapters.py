"""Loading a checkpoint's peft adapter into the served model, frozen, without disturbing a trainer.

Switching between loaded adapters (`serving`) is artrl/adapter_switch.py's, shared with the trainer.
"""

from __future__ import annotations

from typing import Any

from artrl.adapter_switch import preserved_training_state
from artrl.serve.engine import InvalidRequestError


def load_frozen_adapter(model: Any, name: str, path: str) -> None:
    """Load the peft adapter saved in `path` into `model` as `name`, frozen; the active adapter stays."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise InvalidRequestError(
            f"Cannot load adapter {name!r} from {path}: the served model is a "
            f"{type(model).__name__}, not a peft PeftModel. Wrap it first, e.g. "
            "`peft.PeftModel.from_pretrained(model, path)` or `peft.get_peft_model(model, config)`."
        )
    with preserved_training_state(model):
        try:
            model.load_adapter(str(path), adapter_name=name, is_trainable=False)
        except Exception:
            if name in model.peft_config:  # peft may have injected the adapter before its weights failed
                model.delete_adapter(name)
            raise
