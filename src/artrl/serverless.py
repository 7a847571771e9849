"""ART's `ServerlessBackend` (training hosted by Weights & Biases): not available here.

The name exists so that ART code importing it still imports; constructing it
raises a `ConfigError` that says what to use instead.
"""

from __future__ import annotations

from typing import Any

from .backend import Backend
from .errors import ConfigError


class ServerlessBackend(Backend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            "ServerlessBackend (ART's training hosted by W&B) is not available in artrl: it trains on this "
            "machine. Use `backend = art.LocalBackend()` and `await model.register(backend)` instead."
        )
