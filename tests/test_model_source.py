"""A base model that cannot load fails in seconds with artrl's way out, and a failed register claims nothing."""

from __future__ import annotations

import asyncio
import logging

import pytest

import artrl as art
from artrl.errors import ConfigError
from artrl.run import storage
from artrl.models import source as model_source


@pytest.fixture
def no_hub(monkeypatch):
    """Any request to the Hugging Face hub fails the test: the code under test must not make one."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError(f"the hub was asked: {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "model_info", refuse)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)


@pytest.mark.parametrize("name", ["artrl/tinyy", "artrl/Tiny", "random:qwen3-9b"])
def test_a_name_in_artrls_namespace_never_reaches_the_network(name, no_hub):
    with pytest.raises(ConfigError, match="not a built-in model") as e:
        model_source.check_model_source(name)
    assert "artrl/tiny" in str(e.value) and "random:qwen3-0.6b" in str(e.value)


@pytest.fixture
def hub_cache(monkeypatch, tmp_path):
    """An empty Hugging Face cache; `cache(repo_id)` puts the tiny model's files in it as that repo's snapshot."""
    import shutil

    from huggingface_hub import constants

    from artrl.models.tiny import tiny_model_path

    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))

    def cache(repo_id: str):
        repo = root / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / ("a" * 40)
        snapshot.mkdir(parents=True)
        for f in tiny_model_path().iterdir():
            if f.is_file():
                shutil.copy(f, snapshot / f.name)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("a" * 40)
        return snapshot

    return cache


def _unreachable(repo_id, **kwargs):
    assert kwargs.get("timeout"), "the probe must carry a timeout"
    raise OSError("[Errno -2] Name or service not known")


def test_a_hub_id_fails_fast_when_the_hub_cannot_be_reached(monkeypatch, hub_cache):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "model_info", _unreachable)
    with pytest.raises(ConfigError) as e:
        model_source.check_model_source("Qwen/Qwen3-0.6B")
    msg = str(e.value)
    assert "cannot be reached" in msg and "HF_HUB_OFFLINE=1" in msg and "artrl/tiny" in msg
    assert "local model directory" in msg


def test_offline_mode_and_an_uncached_hub_id_say_so(monkeypatch, hub_cache):
    import huggingface_hub
    from huggingface_hub import errors

    def offline(repo_id, **kwargs):
        raise errors.OfflineModeIsEnabled("offline mode is enabled")

    monkeypatch.setattr(huggingface_hub, "model_info", offline)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        model_source.check_model_source("Qwen/Qwen3-0.6B")


def test_a_cached_hub_id_in_offline_mode_is_not_probed(monkeypatch, no_hub, hub_cache):
    from huggingface_hub import constants

    hub_cache("someorg/tiny-chat")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert model_source.check_model_source("someorg/tiny-chat") is None  # transformers loads it, no request


def test_a_cached_hub_id_loads_from_its_snapshot_when_the_hub_does_not_answer(monkeypatch, hub_cache, tmp_path,
                                                                              caplog):
    """Measured before: a cached model without network took 165 s of transformers' and peft's retries."""
    import huggingface_hub

    snapshot = hub_cache("someorg/tiny-chat")
    monkeypatch.setattr(huggingface_hub, "model_info", _unreachable)
    with caplog.at_level(logging.INFO, logger="artrl"):
        assert model_source.check_model_source("someorg/tiny-chat") == str(snapshot)
    assert "loading it from the local cache" in caplog.text

    async def register():
        backend = art.LocalBackend(path=str(tmp_path / "runs"), show_progress=False)
        model = art.TrainableModel(name="m", project="p", base_model="someorg/tiny-chat")
        try:
            await model.register(backend)
            return backend._runs["m"].trainer.model.get_base_model().config._name_or_path
        finally:
            backend.close()

    assert asyncio.run(register()) == str(snapshot)  # loaded from the directory: nothing asked the hub
    meta = (storage.run_dir(tmp_path / "runs", "p", "m") / storage.MODEL_FILE).read_text()
    assert '"base_model": "someorg/tiny-chat"' in meta  # the run still names the model, not the directory


def test_a_hub_error_that_is_not_about_the_model_lets_the_load_go_on(monkeypatch, caplog):
    import httpx
    import huggingface_hub
    from huggingface_hub import errors

    def busy(repo_id, **kwargs):
        response = httpx.Response(429, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))
        raise errors.HfHubHTTPError("429 Too Many Requests", response=response)

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "model_info", busy)
    model_source.check_model_source("Qwen/Qwen3-0.6B")
    assert "loading it anyway" in caplog.text


def test_a_failed_register_writes_nothing_and_the_corrected_name_then_works(tmp_path, monkeypatch):
    """The first hour's trap: register with an unloadable model, then fix base_model on the same run directory."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "model_info",
                        lambda repo_id, **kw: (_ for _ in ()).throw(OSError("Name or service not known")))

    async def register(base_model):
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        model = art.TrainableModel(name="agent-001", project="demo", base_model=base_model,
                                   _internal_config=art.InternalModelConfig(max_length=128))
        try:
            await model.register(backend)
            return await model.get_step()
        finally:
            backend.close()

    run = storage.run_dir(tmp_path, "demo", "agent-001")
    with pytest.raises(ConfigError, match="cannot be reached"):
        asyncio.run(register("Qwen/Qwen3-0.6B"))
    assert not (run / storage.MODEL_FILE).exists()
    assert not tmp_path.joinpath("demo").exists()  # not even an empty directory
    assert asyncio.run(register("artrl/tiny")) == 0
    assert (run / storage.MODEL_FILE).exists()


def test_a_load_that_fails_after_the_check_writes_no_model_file(tmp_path, monkeypatch):
    """The check passes (a local directory), the load fails: model.json must still not name it."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")

    async def register(base_model):
        backend = art.LocalBackend(path=str(tmp_path / "runs"), show_progress=False)
        model = art.TrainableModel(name="m", project="p", base_model=base_model)
        try:
            await model.register(backend)
        finally:
            backend.close()

    with pytest.raises(Exception):
        asyncio.run(register(str(bad)))
    assert not (storage.run_dir(tmp_path / "runs", "p", "m") / storage.MODEL_FILE).exists()
    asyncio.run(register("artrl/tiny"))


def test_register_refuses_a_typo_of_the_tiny_model_without_the_network(tmp_path, no_hub):
    async def register():
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        try:
            await art.TrainableModel(name="m", project="p", base_model="artrl/tinyy").register(backend)
        finally:
            backend.close()

    with pytest.raises(ConfigError, match=r"'artrl/tinyy' is not a built-in model.*'artrl/tiny'"):
        asyncio.run(register())
