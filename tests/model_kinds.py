"""The kinds of model every end-to-end property is checked on: the tiny model as it is, with quantised base weights,
and the tiny mixture-of-experts model. Each kind is (base_model, InternalModelConfig fields). 4-bit computes in
float32 here so that float noise stays at the dense model's level and the same tolerances hold."""

from __future__ import annotations

from typing import Any

KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("artrl/tiny", {}),
    "4bit": ("artrl/tiny", {"load_in_4bit": True, "dtype": "float32"}),
    "moe": ("artrl/tiny-moe", {}),
}
