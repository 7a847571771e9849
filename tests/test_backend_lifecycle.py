"""LocalBackend's ART lifecycle (constructor, close awaited or not, with / async with) and the served names."""

from __future__ import annotations

import asyncio
import http.client
import logging
import threading
from pathlib import Path

import pytest
import torch

import artrl as art
from artrl.runtime import notices
from artrl.serve import GenerationRequest, TransformersEngine
from artrl.serve.errors import EngineClosedError
from artrl.models.loading import load_base_model, load_model
from artrl.config.model import InternalModelConfig

PROBE = [{"role": "user", "content": "Name a colour."}]


def tiny_model(name: str = "m") -> art.TrainableModel:
    return art.TrainableModel(name=name, project="p", base_model="artrl/tiny",
                              _internal_config=art.InternalModelConfig(max_length=128))


def health(base_url: str) -> int | None:
    """The server's answer to GET /health (its status), or None when nothing listens there any more.

    Only a refused connection counts as closed; a slow answer is waited for (the timeout only bounds a hung
    test and fails it), so a loaded machine can neither fail an open server nor pass for a closed one.
    """
    host, port = base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except ConnectionRefusedError:
        return None
    finally:
        conn.close()


def server_answers(base_url: str) -> bool:
    """Open (True) or closed (False): anything else (an error status, no answer) fails the test.

    A backend's server checks its key on every route, so an open one answers this keyless GET with 401."""
    status = health(base_url)
    assert status in (200, 401, None), f"GET /health answered {status}"
    return status is not None


# --------------------------------------------------------------------------- constructor

def test_arts_constructor_arguments(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    notices.forget("LocalBackend.in_process")
    with caplog.at_level(logging.WARNING, logger="artrl.notices"):
        backend = art.LocalBackend(in_process=False, path=None, gpu_cost_per_hour_usd=2.5)
        art.LocalBackend(in_process=False)
    assert sum("in_process=False" in r.getMessage() for r in caplog.records) == 1
    assert backend.path == Path(".art")  # ART's default: ./.art
    assert art.LocalBackend(in_process=True, path=str(tmp_path / "x")).path == tmp_path / "x"
    model = tiny_model()
    asyncio.run(model.register(backend))
    try:
        assert (tmp_path / ".art" / "p" / "models" / "m").is_dir()
        assert backend.supports_automatic_train_step_metrics()
        # ART: no GPU cost on a CPU, whatever the price
        assert backend.automatic_gpu_cost_per_hour_usd(model) is None
    finally:
        backend.close()
    with pytest.raises(art.ConfigError, match="gpu_cost_per_hour_usd=-1"):
        art.LocalBackend(gpu_cost_per_hour_usd=-1)


# --------------------------------------------------------------------------- close

def test_close_awaited_in_async_code(tmp_path):
    async def main():
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        model = tiny_model()
        await model.register(backend)
        url = backend.base_url
        assert server_answers(url)
        await backend.close()
        assert not server_answers(url)
        await backend.close()  # idempotent

    asyncio.run(main())


def test_close_called_plainly_from_sync_and_async_code(tmp_path):
    backend = art.LocalBackend(path=str(tmp_path / "a"), show_progress=False)
    asyncio.run(tiny_model().register(backend))
    url = backend.base_url
    backend.close()  # sync code: does the work, nothing to await
    assert not server_answers(url)

    async def main():
        other = art.LocalBackend(path=str(tmp_path / "b"), show_progress=False)
        await tiny_model().register(other)
        other_url = other.base_url
        other.close()  # not awaited: still done
        return other_url

    assert not server_answers(asyncio.run(main()))


def test_with_and_async_with(tmp_path):
    with art.LocalBackend(path=str(tmp_path / "a"), show_progress=False) as backend:
        asyncio.run(tiny_model().register(backend))
        url = backend.base_url
        assert server_answers(url)
    assert not server_answers(url)

    async def main():
        async with art.LocalBackend(path=str(tmp_path / "b"), show_progress=False) as inner:
            await tiny_model().register(inner)
            inner_url = inner.base_url
            assert server_answers(inner_url)
        return inner_url

    assert not server_answers(asyncio.run(main()))


def test_closing_the_engine_fails_generation_in_flight_and_joins_the_worker(tiny_path):
    model, tok = load_model(str(tiny_path), InternalModelConfig(seed=0))
    engine = TransformersEngine(model, tok, max_model_len=4096)
    prompt = tok("hello", add_special_tokens=False).input_ids
    steps_seen = threading.Event()
    hook = model.register_forward_hook(lambda *args: steps_seen.set())
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            asyncio.run(engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=3000, temperature=1.0,
                                                          stop_token_ids=[])))
            outcome["result"] = "finished"
        except EngineClosedError as error:
            outcome["result"] = error

    caller = threading.Thread(target=run)
    caller.start()
    assert steps_seen.wait(300)  # decoding has started (the timeout only bounds a hung test)
    engine.close()
    caller.join(300)
    hook.remove()
    assert not caller.is_alive() and isinstance(outcome.get("result"), EngineClosedError), outcome
    assert engine._worker is None and engine.decode_steps < 3000  # closing cut the 3000-token decode short
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=2)))


# --------------------------------------------------------------------------- served names

def test_base_model_is_served_under_its_own_name_with_the_adapter_off(tmp_path, tiny_path, make_choice):
    async def main():
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        model = tiny_model()
        await model.register(backend)
        user = {"role": "user", "content": "Pick a colour."}
        groups = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[user, make_choice(c)], reward=r)
                                       for c, r in (("blue", 1.0), ("red", 0.0))])]
        await backend.train(model, groups, learning_rate=5e-2)  # the live adapter now differs from the base
        client = model.openai_client()
        names = [m.id for m in (await client.models.list()).data]
        kwargs = dict(messages=PROBE, max_tokens=6, temperature=0, logprobs=True)
        base = await client.chat.completions.create(model="artrl/tiny", **kwargs)
        live = await client.chat.completions.create(model=model.get_inference_name(), **kwargs)
        backend.close()
        return names, base, live

    names, base, live = asyncio.run(main())
    assert names[:2] == ["m", "artrl/tiny"]
    choice = base.choices[0]
    sampled = [t.logprob for t in choice.logprobs.content]
    ids = choice.model_extra["token_ids"]
    # the base model's own logprobs of the same tokens, computed without any adapter
    reference, _ = load_base_model(str(tiny_path), InternalModelConfig())
    full = torch.tensor([base.model_extra["prompt_token_ids"] + ids])
    with torch.no_grad():
        logits = reference(input_ids=full).logits[0, :-1].float().log_softmax(-1)
    start = len(base.model_extra["prompt_token_ids"]) - 1
    expected = logits[start:start + len(ids)].gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()
    assert sampled == pytest.approx(expected, abs=1e-4)
    live_lp = [t.logprob for t in live.choices[0].logprobs.content]
    assert live_lp[:1] != pytest.approx(sampled[:1], abs=1e-4)  # the live name serves the trained adapter


def test_openai_server_config_sets_the_key_and_notices_the_rest(tmp_path, caplog):
    async def main():
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        model = tiny_model()
        with caplog.at_level(logging.WARNING, logger="artrl.notices"):
            base_url, api_key = await backend._prepare_backend_for_training(
                model, {"server_args": {"api_key": "secret", "tool_call_parser": "hermes"},
                        "engine_args": {"enforce_eager": True}, "log_file": "/tmp/x.log"})
        unauthorised = health(base_url) == 401  # /health needs the key now
        ok = await model.openai_client().models.list()
        backend.close()
        return api_key, unauthorised, [m.id for m in ok.data]

    notices.forget()
    api_key, unauthorised, names = asyncio.run(main())
    assert api_key == "secret" and unauthorised and "m" in names
    noticed = [r.getMessage() for r in caplog.records if r.name == "artrl.notices"]
    assert len(noticed) == 3 and any("tool_call_parser" in m for m in noticed)
    assert any("enforce_eager" in m for m in noticed) and any("log_file" in m for m in noticed)


def test_the_key_a_model_is_given_is_the_key_the_server_checks(tmp_path):
    """Without api_key the backend makes one: requests without it or with another get 401, the model's client passes."""
    import openai

    async def main():
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        model = tiny_model()
        await model.register(backend)
        refused = []
        for key in ("artrl-local", "wrong"):
            client = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=key, max_retries=0)
            try:
                await client.models.list()
            except openai.AuthenticationError as error:
                refused.append(error.status_code)
        names = [m.id for m in (await model.openai_client().models.list()).data]
        other = art.LocalBackend(path=str(tmp_path / "other"), show_progress=False)._api_key
        status = health(model.inference_base_url)
        backend.close()
        return model, status, refused, names, other

    model, status, refused, names, other = asyncio.run(main())
    assert status == 401 and refused == [401, 401] and "m" in names
    assert model.inference_api_key.startswith("artrl-") and model.inference_api_key != other  # one per backend


def test_register_takes_arts_openai_client_config(tmp_path, caplog):
    """ART's `model.register(backend, _openai_client_config=...)`: the config reaches the server before it starts."""
    async def main():
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        model = tiny_model()
        with caplog.at_level(logging.WARNING, logger="artrl.notices"):
            await model.register(backend, _openai_client_config={"server_args": {"api_key": "k2"},
                                                                 "engine_args": {"enforce_eager": True}})
        status = health(model.inference_base_url)
        names = [m.id for m in (await model.openai_client().models.list()).data]
        step = await model.get_step()
        backend.close()
        return model, status, names, step

    notices.forget()
    model, status, names, step = asyncio.run(main())
    assert model.inference_api_key == "k2" and status == 401  # /health needs the key
    assert "m" in names and step == 0 and model.base_path == str(tmp_path)
    assert [r.getMessage() for r in caplog.records if "enforce_eager" in r.getMessage()]


def test_local_backend_is_an_art_backend_with_its_hooks(tmp_path):
    """ART's Backend protocol: _model_inference_name and _delete_checkpoint_files (the latest always stays)."""
    from artrl.run import storage

    async def main():
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        assert isinstance(backend, art.Backend)
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny")
        await model.register(backend)
        data = [art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"}])]
        for _ in range(3):
            await model.train_sft(data, config=art.TrainSFTConfig(learning_rate=1e-4))
        run = storage.run_dir(tmp_path, "p", "m")
        assert model.get_inference_name() == "m" and model.get_inference_name(step=2) == "m@2"
        await backend._delete_checkpoint_files(model, [1])
        assert storage.list_checkpoints(run) == [1, 3]  # 1 kept as asked, 3 because it is the latest
        await backend.close()

    asyncio.run(main())


def test_delete_checkpoints_through_an_art_style_backend(tmp_path):
    """A backend that implements only ART's `_delete_checkpoint_files` gets ART's call from the model."""
    calls = []

    class ArtStyle(art.Backend):
        async def register(self, model):
            pass

        async def _get_step(self, model):
            return 5

        async def _delete_checkpoint_files(self, model, steps_to_keep):
            calls.append(steps_to_keep)

    async def main():
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", base_path=str(tmp_path))
        await model.log(metrics={"val/reward": 0.9}, step=2)
        await model.log(metrics={"val/reward": 0.1}, step=4)
        model._backend = ArtStyle()
        await model.delete_checkpoints()

    asyncio.run(main())
    assert calls == [[5, 2]]
