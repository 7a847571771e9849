"""Decoding with another attention implementation than the one the shared model trains with.

The trainer picks its attention for packed training rows: block-sparse `flex_attention`
on a GPU, the tree attention of models/tree_attention.py on a CPU (docs/performance.md).
A decode step is one query token per row against a left-padded cache, where neither
helps: flex attention builds a block mask every step. `attention_for_serving(model,
"sdpa")` switches the model to `impl` with transformers' own `set_attn_implementation`
for the duration of a decode batch (the engine holds the model lock, so the trainer never
sees it) and switches it back on exit, exceptions included. None, or the implementation
the model already has, changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _transformers_model(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def current_attention(model: Any) -> str | None:
    """The attention implementation `model` (or the transformers model inside a peft one) runs."""
    return getattr(_transformers_model(model).config, "_attn_implementation", None)


@contextlib.contextmanager
def attention_for_serving(model: Any, impl: str | None) -> Iterator[None]:
    """Inside: `model` computes attention with `impl` (None: as it is)."""
    inner = _transformers_model(model)
    previous = current_attention(model)
    if impl is None or impl == previous or not hasattr(inner, "set_attn_implementation"):
        yield
        return
    inner.set_attn_implementation(impl)
    try:
        yield
    finally:
        inner.set_attn_implementation(previous)
