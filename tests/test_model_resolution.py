"""A base model's name is resolved once per `register` (models/resolved.py): its source checked, its files found
and its config read one time each, and the loader, the tokenizer, the memory plan and the engine read the result."""

from __future__ import annotations

import asyncio
import collections
import sys

import pytest

import artrl as art
from artrl.local import session as _session  # noqa: F401 (loaded, so that its bindings are counted too)
from artrl.models import loading, resolved, source, tokenizer  # noqa: F401 (likewise)

COUNTED = ("check_model_source", "resolve_name", "load_config", "read_config")


def count_resolutions(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Each call of `COUNTED` from now on, wherever artrl's modules bound the function."""
    counts: collections.Counter = collections.Counter()
    for name in COUNTED:
        real = getattr(source, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("artrl") and getattr(module, name, None) is real:
                monkeypatch.setattr(module, name, counted)
    return counts


def _register(path: str, base_model: str) -> None:
    async def main() -> None:
        backend = art.LocalBackend(path=path, show_progress=False)
        model = art.TrainableModel(name="m", project="p", base_model=base_model)
        try:
            await model.register(backend)
        finally:
            await backend.close()

    asyncio.run(main())


@pytest.mark.parametrize("base_model", ["artrl/tiny", "tiny_path"])
def test_register_resolves_the_base_model_once(base_model, tiny_path, tmp_path, monkeypatch):
    """The built-in name, and a model directory (what a Hugging Face checkpoint on disk is)."""
    name = str(tiny_path) if base_model == "tiny_path" else base_model
    counts = count_resolutions(monkeypatch)
    _register(str(tmp_path / "runs"), name)
    assert dict(counts) == {"check_model_source": 1, "resolve_name": 1, "read_config": 1}


def test_a_loader_given_the_resolution_asks_nothing_again(tiny_path, monkeypatch):
    model = resolved.resolve_base_model(str(tiny_path), art.InternalModelConfig())
    assert (model.name, model.path, model.random, model.quantization) == (str(tiny_path), str(tiny_path), False, None)
    counts = count_resolutions(monkeypatch)
    loading.load_model(model)
    assert dict(counts) == {}


def test_a_random_shape_resolves_to_the_tiny_tokenizer_and_a_config_built_in_memory():
    model = resolved.resolve_base_model("random:qwen3-0.6b", art.InternalModelConfig(device="cpu"),
                                        shape_overrides={"num_hidden_layers": 1})
    assert model.random and model.config.num_hidden_layers == 1 and model.path == source.resolve_name("artrl/tiny")
    with pytest.raises(art.ConfigError, match="shape overrides"):
        resolved.resolve_base_model("artrl/tiny", shape_overrides={"num_hidden_layers": 1})
