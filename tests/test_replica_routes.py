"""A server as an inference replica (serve/http/control_routes.py) and the client's session affinity
(client/affinity.py): in one process, on the tiny model, no router. The replicas behind the real router
are tests/test_replicas.py's."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

import artrl as art
from artrl.errors import ConfigError
from artrl.client import affinity
from artrl.serve.http.served_models import ServedModels
from artrl.serve.http.server import create_app

KEY = "k-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of a tiny run (steps 0 and 1, different adapters): what a control plane loads."""
    from artrl.local.session import TrainingSession
    from artrl.run import storage

    run = tmp_path_factory.mktemp("run") / "p" / "models" / "m"
    cfg = art.InternalModelConfig(seed=0, max_length=128)
    session = TrainingSession.open(run, name="m", project="p", base_model="artrl/tiny", cfg=cfg)
    import torch

    with session.trainer.model_lock, torch.no_grad():
        for name, p in session.trainer.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)  # a different adapter: step 1 must sample differently
    from artrl.run import checkpoint

    checkpoint.save(session.trainer, run, 1, "artrl/tiny", None)
    session.close()
    return {0: str(storage.checkpoint_dir(run, 0)), 1: str(storage.checkpoint_dir(run, 1))}


@pytest.fixture(scope="module")
def replica():
    """A built-in engine serving 'm' as replica 'r7' (its own peft model, as a replica process holds)."""
    from artrl.chat.format import end_of_turn_ids
    from artrl.models.loading import load_model
    from artrl.serve.engines.factory import open_engine

    cfg = art.InternalModelConfig(seed=0, max_length=128)
    model, tok = load_model("artrl/tiny", cfg)
    engine = open_engine("builtin", tokenizer=tok, end_ids=end_of_turn_ids(tok, model), cfg=cfg, model=model)
    served = ServedModels("m", engine)
    served.add_base("artrl/tiny", engine)
    app = create_app(served, api_key=KEY, adapter_control=True, replica_id="r7", engine_kind="builtin",
                     base_model="artrl/tiny")
    with TestClient(app) as client:
        yield client, engine
    engine.close()


def complete(client, model: str, headers: dict | None = None):
    return client.post("/v1/chat/completions", headers={**AUTH, **(headers or {})},
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "seed": 3})


def test_a_replica_loads_publishes_and_unloads_checkpoints_by_the_control_routes(replica, checkpoints):
    client, engine = replica
    for step in (0, 1):
        r = client.post("/v1/load_lora_adapter", headers=AUTH, json={"lora_name": f"m@{step}",
                                                                     "lora_path": checkpoints[step]})
        assert r.status_code == 200 and "added successfully" in r.text
    # loaded, not live: `m` still serves what it served; `m@1` is version 1
    assert complete(client, "m@1").json()["choices"][0]["policy_version"] == 1
    assert engine.live_step is None
    r = client.post("/artrl/live_weights", headers=AUTH, json={"model": "m", "step": 1, "lora_path": checkpoints[1]})
    assert r.status_code == 200
    live = complete(client, "m").json()["choices"][0]
    named = complete(client, "m@1").json()["choices"][0]
    assert live["policy_version"] == 1 and live["token_ids"] == named["token_ids"]  # one adapter, not two copies
    assert engine.loaded_versions == [1] and engine.live_adapter.startswith("ckpt_m_1_")  # the named one, adopted
    identity = client.get("/artrl/replica", headers=AUTH).json()
    assert identity == {"replica": "r7", "engine": "builtin", "base_model": "artrl/tiny",
                        "models": {"m": {"live_step": 1, "loaded_steps": [0, 1], "held_for_step": None}}}
    # unloading: the named adapter of step 0 goes; the live one's name goes but its weights keep serving `m`
    assert client.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "m@0"}).status_code == 200
    assert client.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "m@0"}).status_code == 404
    assert client.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "m@1"}).status_code == 200
    assert complete(client, "m").json()["choices"][0]["policy_version"] == 1
    assert client.get("/artrl/replica", headers=AUTH).json()["models"]["m"]["loaded_steps"] == []


def test_a_held_bare_name_waits_for_the_switch_and_a_named_step_does_not(replica, checkpoints):
    """The first half of a switch (replicas/control.py, rule 2): once held, a request for the bare name is
    never served the old step; it waits for `live_weights` (here past its wait: a 503 the client retries)."""
    client, engine = replica
    assert engine.live_step == 1  # the test above made step 1 live
    hold = {"model": "m", "step": 1, "wait_s": 30.0}
    assert client.post("/artrl/hold_live", headers=AUTH, json=hold).json()["held"] is False  # already live
    hold = {"model": "m", "step": 2, "wait_s": 0.2}
    assert client.post("/artrl/hold_live", headers=AUTH, json=hold).json()["held"] is True
    assert client.get("/artrl/replica", headers=AUTH).json()["models"]["m"]["held_for_step"] == 2
    waited = complete(client, "m")
    assert waited.status_code == 503 and waited.json()["error"]["code"] == "live_weights_switching"
    assert "step 2" in waited.json()["error"]["message"]
    load = {"lora_name": "m@1", "lora_path": checkpoints[1]}
    assert client.post("/v1/load_lora_adapter", headers=AUTH, json=load).status_code == 200
    assert complete(client, "m@1").json()["choices"][0]["policy_version"] == 1  # a named step is not held
    live = {"model": "m", "step": 2, "lora_path": checkpoints[1]}
    assert client.post("/artrl/live_weights", headers=AUTH, json=live).status_code == 200
    assert client.get("/artrl/replica", headers=AUTH).json()["models"]["m"]["held_for_step"] is None
    assert complete(client, "m").json()["choices"][0]["policy_version"] == 2
    unknown = client.post("/artrl/hold_live", headers=AUTH, json={"model": "x", "step": 1, "wait_s": 1.0})
    assert unknown.status_code == 404


@pytest.mark.parametrize("body, status, fragment", [
    ({"lora_name": "other@1", "lora_path": "/x"}, 400, "'<model>@<step>'"),
    ({"lora_name": "m", "lora_path": "/x"}, 400, "'<model>@<step>'"),
    ({"lora_name": "m@9", "lora_path": "/no/such/dir"}, 500, "cannot be loaded"),
])
def test_a_bad_load_is_refused_with_its_reason(replica, body, status, fragment):
    client, _ = replica
    r = client.post("/v1/load_lora_adapter", headers=AUTH, json=body)
    assert r.status_code == status and fragment in r.json()["error"]["message"]


def test_a_replica_names_itself_and_refuses_a_turn_meant_for_another(replica):
    client, _ = replica
    assert client.get("/health").status_code == 200  # the router probes it without a key
    assert client.get("/v1/models").status_code == 401  # everything else needs it
    ok = complete(client, "m", {affinity.EXPECTED_HEADER: "r7"})
    assert ok.status_code == 200 and ok.headers[affinity.REPLICA_HEADER] == "r7"
    gone = complete(client, "m", {affinity.EXPECTED_HEADER: "r3.0"})
    assert gone.status_code == 410 and gone.headers["x-should-retry"] == "false"
    assert "'r3.0'" in gone.json()["error"]["message"] and gone.json()["error"]["code"] == "replica_gone"


def test_control_routes_exist_only_when_asked_for():
    from artrl.serve.engines.scripted import ScriptedEngine
    from artrl.models.tiny import build_tiny_tokenizer

    app = create_app(ServedModels("m", ScriptedEngine.from_text(build_tiny_tokenizer(), "ok")))
    with TestClient(app) as client:
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "m@1", "lora_path": "/x"}).status_code == 404
        assert affinity.REPLICA_HEADER not in client.get("/health").headers


# ---------------------------------------------------------------------------------------------- session affinity


def test_each_rollout_task_sends_its_own_session_and_then_expects_its_replica():
    """The client's hooks: one X-Session-ID per asyncio task, the same on every turn; after the first answer
    names its replica, later turns say they expect it; a header set by the caller is kept."""
    seen: list[tuple[str, str | None, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get(affinity.SESSION_HEADER),
                     request.headers.get(affinity.EXPECTED_HEADER)))
        return httpx.Response(200, json={}, headers={affinity.REPLICA_HEADER: f"r-{len(seen) % 2}"})

    async def main():
        hooks = affinity.event_hooks()
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler), event_hooks=hooks)

        async def rollout(k: int) -> None:
            for turn in range(3):
                await client.get(f"http://router/{k}/{turn}")

        await asyncio.gather(*(rollout(k) for k in range(3)))
        await client.get("http://router/mine", headers={affinity.SESSION_HEADER: "mine"})
        await client.aclose()

    asyncio.run(main())
    by_rollout: dict[str, list[tuple[str | None, str | None]]] = {}
    for path, session, expected in seen[:-1]:
        by_rollout.setdefault(path.split("/")[1], []).append((session, expected))
    assert len(by_rollout) == 3
    sessions = {turns[0][0] for turns in by_rollout.values()}
    assert len(sessions) == 3 and None not in sessions  # one session per rollout
    for turns in by_rollout.values():
        assert len({s for s, _ in turns}) == 1  # the same on every turn
        assert turns[0][1] is None and turns[1][1] is not None and turns[1][1] == turns[2][1]
    assert seen[-1][1] == "mine" and seen[-1][2] is None


def test_a_task_whose_replica_is_gone_starts_a_new_session_after_the_failed_turn():
    """A long-lived task (PipelineTrainer's rollout worker) is not tied to a dead replica: the turn answered 410
    fails, the task's next request goes out on a new session without an expected replica; `new_session()` starts
    one on purpose."""
    seen: list[tuple[str | None, str | None]] = []
    answers = iter([(200, "r0"), (410, "r1"), (200, "r1"), (200, "r1")])

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers.get(affinity.SESSION_HEADER), request.headers.get(affinity.EXPECTED_HEADER)))
        status, replica = next(answers)
        return httpx.Response(status, json={}, headers={affinity.REPLICA_HEADER: replica})

    async def main():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler), event_hooks=affinity.event_hooks())
        for _ in range(3):
            await client.get("http://router/")
        affinity.new_session()
        await client.get("http://router/")
        await client.aclose()

    asyncio.run(main())
    (s0, e0), (s1, e1), (s2, e2), (s3, e3) = seen
    assert e0 is None and s1 == s0 and e1 == "r0"  # the second turn expects the first one's replica
    assert s2 != s1 and e2 is None  # after the 410: a new session, no replica expected
    assert s3 != s2 and e3 is None  # new_session(): another one


def test_model_openai_clients_carry_the_session_header(tmp_path):
    """`model.openai_client()` (cached, and with kwargs) sends the rollout's session: ART's code is unchanged."""
    from artrl.client.openai import OpenAIClients

    async def main():
        clients = OpenAIClients()
        cached = clients.get("http://127.0.0.1:9/v1", "k", (5.0, 1.0))
        model = art.Model(name="x", project="p", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k")
        fresh = model.openai_client(max_retries=0)
        for client in (cached, fresh):
            hooks = client._client.event_hooks["request"]
            assert any(h is affinity._on_request for h in hooks)

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize("kw, fragment", [
    (dict(inference_replicas=2, inference_endpoints=["http://127.0.0.1:1"]), "set one of them"),
    (dict(inference_replicas=2, inference_gpu_ids=[0, 1]), "drop inference_replicas"),
    (dict(inference_endpoints=["http://127.0.0.1:1"], inference_gpu_ids=[0]), "drop inference_gpu_ids"),
    (dict(inference_endpoints=[]), "at least one server"),
    (dict(inference_endpoints=["127.0.0.1:8000"]), "'http://host:port'"),
    (dict(inference_endpoints=["http://a:1", "http://a:1/"]), "names a server twice"),
    (dict(inference_gpu_ids=[1, 1]), "distinct"),
    # ART 0.5.23's spelling of one engine over two GPUs: replicas cannot honour it
    (dict(inference_gpu_ids=[1, 2], engine_args={"tensor_parallel_size": 2}), "drop tensor_parallel_size"),
])
def test_replica_settings_are_checked_with_the_way_out(kw, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        art.InternalModelConfig(**kw).check()


def test_where_the_replicas_run():
    assert art.InternalModelConfig(inference_replicas=3, device="cpu").replica_devices() == ["cpu"] * 3
    assert art.InternalModelConfig(inference_gpu_ids=[2, 3]).replica_devices() == ["cuda:2", "cuda:3"]
    assert art.InternalModelConfig(inference_gpu_ids=[2], inference_replicas=2).replica_devices() == ["cuda:2"] * 2
    assert art.InternalModelConfig(inference_endpoints=["http://h:1"]).replica_devices() == []
    assert not art.InternalModelConfig(inference_gpu_ids=[1]).replicated  # one GPU: served in this process
    assert art.InternalModelConfig(inference_replicas=1).replicated


def test_replicas_on_one_device_are_planned_as_a_set_before_any_starts(tmp_path, monkeypatch):
    """Three CPU replicas and the trainer load at once on one host: their peaks together are checked against what
    the host has, not each replica's alone against all of it."""
    import torch

    from artrl.models import memory_plan
    from artrl.replicas.control import ReplicaSet
    from artrl.replicas.router import Router

    cfg = art.InternalModelConfig(inference_replicas=3, device="cpu", max_length=128)
    one = memory_plan.plan_for("artrl/tiny", cfg, torch.device("cpu"))
    assert memory_plan.replica_set_peak(one, 3, with_trainer=True) == 3 * one.serving_peak + one.peak
    assert one.serving_peak < one.peak  # a replica holds no gradients, optimizer or activations
    # room for the trainer and one and a half replicas: each replica alone would fit, the three do not
    room = one.peak + int(1.5 * one.serving_peak)
    monkeypatch.setattr(memory_plan, "available_bytes", lambda *_: room)
    monkeypatch.setattr(Router, "start", lambda self: pytest.fail("the router started before the memory check"))
    replicas = ReplicaSet(name="m", base_model="artrl/tiny", cfg=cfg, run=tmp_path, api_key="k")
    with pytest.raises(ConfigError, match=r"3 inference replicas of artrl/tiny .* 1 fit: set inference_replicas=1"):
        replicas.start()
    assert all(r.process is None for r in replicas.replicas)
    monkeypatch.setattr(memory_plan, "available_bytes", lambda *_: one.peak + 3 * one.serving_peak)
    replicas.check_memory()  # the three fit: no error
    # a replica process started by the set does not check its own plan again
    argv, _ = replicas.command(replicas.replicas[0])
    assert "--memory-planned" in argv


def test_replicas_are_refused_on_a_non_loopback_host(tmp_path):
    backend = art.LocalBackend(path=str(tmp_path), host="0.0.0.0", api_key="k", show_progress=False)
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny",
                               _internal_config=art.InternalModelConfig(inference_replicas=2))
    with pytest.raises(ConfigError, match="loopback only"):
        asyncio.run(model.register(backend))
    backend.close()


def test_vllm_replicas_of_a_random_shape_are_refused_before_anything_starts(tmp_path):
    from artrl.replicas.control import ReplicaSet

    cfg = art.InternalModelConfig(inference_replicas=2, inference_engine="vllm")
    with pytest.raises(ConfigError, match="inference_engine='builtin'"):
        ReplicaSet(name="m", base_model="random:qwen3-8b", cfg=cfg, run=tmp_path, api_key="k")


def test_each_gpu_replica_sees_only_its_gpu(tmp_path):
    import json

    from artrl.replicas.control import ReplicaSet

    cfg = art.InternalModelConfig(inference_gpu_ids=[2, 5], trainer_gpu_ids=[0, 1], lora_rank=4)
    replicas = ReplicaSet(name="m", base_model="artrl/tiny", cfg=cfg, run=tmp_path, api_key="k")
    for replica, gpu in zip(replicas.replicas, ("2", "5")):
        argv, env = replicas.command(replica)
        config = json.loads(argv[argv.index("--config") + 1])
        assert env["CUDA_VISIBLE_DEVICES"] == gpu and config["device"] == "cuda"
        assert config["lora_rank"] == 4 and config["inference_gpu_ids"] is None and config["trainer_gpu_ids"] is None
