"""Replicas started elsewhere (`inference_endpoints`) behind the real router: the publish rules under faults.

The two replicas are artrl servers this test starts in its own process (the same app a replica process
serves), so that a load on one of them can be held and made to fail: a publish waits for every replica
(none serves the new step before all have it), retries a failed load, and takes out a replica that keeps
refusing before the default moves; a replica that answers again rejoins with every retained version. Bad
endpoints are refused at register with the way out."""

from __future__ import annotations

import asyncio
import threading

import pytest

import artrl as art
from artrl.errors import CheckpointError, ConfigError
from artrl.replicas.client import ReplicaClient, http_call
from artrl.serve.http.served_models import ServedModels

pytestmark = pytest.mark.slow

KEY = "k-endpoints"
WAIT_S = 120.0


class GatedModels(ServedModels):
    """A replica's models whose loads of step >= 1 can be held (`hold`) and refused (`refusals` left)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.attempted = threading.Event()
        self.hold = threading.Event()
        self.hold.set()
        self.refusals = 0
        self.attempts = 0
        self.loaded = threading.Event()
        self.live_attempted, self.live_hold, self.live_done = threading.Event(), threading.Event(), threading.Event()
        self.live_hold.set()
        self.waiting = threading.Event()

    def load(self, name: str, step: int, path: str) -> None:
        if step >= 1:
            self.attempts += 1
            self.attempted.set()
            assert self.hold.wait(WAIT_S)
            if self.refusals > 0:
                self.refusals -= 1
                raise CheckpointError(f"refused on purpose (attempt {self.attempts})")
        super().load(name, step, path)
        if step >= 1:
            self.loaded.set()

    # the second phase of a publish: making step >= 1 live can be held too (`live_hold`)
    live_attempted: threading.Event
    live_hold: threading.Event
    live_done: threading.Event
    waiting: threading.Event  # a request for the bare name waits for this replica's switch

    def set_live(self, name: str, path: str, step: int) -> None:
        if step >= 1:
            self.live_attempted.set()
            assert self.live_hold.wait(WAIT_S)
        super().set_live(name, path, step)
        if step >= 1:
            self.live_done.set()

    async def _wait_for_switch(self, name, hold) -> None:
        self.waiting.set()
        await super()._wait_for_switch(name, hold)


def start_replica(replica_id: str, base_model: str = "artrl/tiny"):
    from artrl.chat.format import end_of_turn_ids
    from artrl.models.loading import load_model
    from artrl.serve.http.background import start_server
    from artrl.serve.engines.factory import open_engine
    from artrl.serve.http.server import create_app

    cfg = art.InternalModelConfig(seed=0, max_length=128)
    model, tok = load_model("artrl/tiny", cfg)
    engine = open_engine("builtin", tokenizer=tok, end_ids=end_of_turn_ids(tok, model), cfg=cfg, model=model)
    models = GatedModels("m", engine)
    models.add_base(base_model, engine)
    server = start_server(create_app(models, api_key=KEY, adapter_control=True, replica_id=replica_id,
                                     engine_kind="builtin", base_model=base_model))
    return server, engine, models


@pytest.fixture
def endpoints():
    started = [start_replica("A"), start_replica("B")]
    yield started
    for server, engine, _ in started:
        engine.close()
        server.stop()


def groups(make_choice) -> list[art.TrajectoryGroup]:
    return [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                                                      make_choice(f"a {i}")], reward=float(i))
                                 for i in range(3)])]


def live_version(server) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    return http_call(server.url, "POST", "/v1/chat/completions", body=body, api_key=KEY).json()["choices"][0][
        "policy_version"]


def backend_and_model(tmp_path, a, b):
    """A backend and a model whose rollouts go to the endpoints `a` and `b`."""
    backend = art.LocalBackend(path=str(tmp_path), api_key=KEY, show_progress=False)
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny",
                               _internal_config=art.InternalModelConfig(
                                   seed=0, max_length=128, inference_endpoints=[a.url, b.url]))
    return backend, model


def test_no_replica_serves_a_step_before_all_have_it_and_a_failed_load_is_retried(tmp_path, endpoints, make_choice):
    (a, _, a_models), (b, _, b_models) = endpoints
    backend, model = backend_and_model(tmp_path, a, b)

    async def main():
        await model.register(backend)
        replicas = backend.replicas(model)
        assert [r.kind for r in replicas.in_service()] == ["artrl", "artrl"]
        b_models.hold.clear()
        b_models.refusals = 1
        train = asyncio.create_task(model.train(groups(make_choice), config=art.TrainConfig(learning_rate=1e-3)))
        assert await asyncio.to_thread(b_models.attempted.wait, WAIT_S)
        assert await asyncio.to_thread(a_models.loaded.wait, WAIT_S)
        # A holds step 1, B does not yet: both serve step 0, and so does the name rollouts are given
        assert 1 in ReplicaClient(a.url, KEY).identity()["models"]["m"]["loaded_steps"]
        assert live_version(a) == live_version(b) == 0
        assert model.get_inference_name() == "m@0" and replicas.published == 0
        b_models.hold.set()  # B refuses once, then loads: the publish retries and completes
        async with asyncio.timeout(WAIT_S):
            result = await train
        assert result.step == 1 and b_models.attempts == 2
        assert live_version(a) == live_version(b) == 1 and model.get_inference_name() == "m@1"
        assert len(replicas.in_service()) == 2
        backend.close()

    asyncio.run(main())


def test_the_bare_name_moves_to_the_new_step_at_once_on_every_replica(tmp_path, endpoints, make_choice):
    """The second phase of a publish: A has made step 1 live, B is still making it live. A request for the bare
    name sent to B after A answered it with step 1 waits for B's switch and gets step 1, never step 0."""
    (a, _, a_models), (b, _, b_models) = endpoints
    backend, model = backend_and_model(tmp_path, a, b)

    async def main():
        await model.register(backend)
        b_models.live_hold.clear()
        train = asyncio.create_task(model.train(groups(make_choice), config=art.TrainConfig(learning_rate=1e-3)))
        try:
            assert await asyncio.to_thread(b_models.live_attempted.wait, WAIT_S)  # B is switching (held there)
            assert await asyncio.to_thread(a_models.live_done.wait, WAIT_S)  # A has switched
            assert await asyncio.to_thread(live_version, a) == 1  # a client sees step 1 on A ...
            state = ReplicaClient(b.url, KEY).identity()["models"]["m"]
            on_b = asyncio.create_task(asyncio.to_thread(live_version, b))  # ... then asks B: B answers it only
            waits = asyncio.create_task(asyncio.to_thread(b_models.waiting.wait, WAIT_S))  # once it has switched
            done, _ = await asyncio.wait({on_b, waits}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
            assert done
            if on_b in done:  # answered while B still served step 0 as its live weights
                assert on_b.result() == 1
            assert waits.result() is True
        finally:
            b_models.live_hold.set()
        async with asyncio.timeout(WAIT_S):
            assert await on_b == 1
            result = await train
        assert state["live_step"] == 0 and state["held_for_step"] == 1  # B was held, not serving step 0
        assert result.step == 1 and model.get_inference_name() == "m@1"
        assert ReplicaClient(b.url, KEY).identity()["models"]["m"]["held_for_step"] is None
        backend.close()

    asyncio.run(main())


def test_a_replica_that_keeps_refusing_is_taken_out_before_the_default_moves_and_rejoins(
        tmp_path, endpoints, make_choice, monkeypatch):
    from artrl.replicas import control

    monkeypatch.setattr(control, "ENDPOINT_CHECK_INTERVAL_S", 0.5)  # the monitor's pace, not its behaviour
    (a, _, _), (b, _, b_models) = endpoints
    backend, model = backend_and_model(tmp_path, a, b)

    async def main():
        await model.register(backend)
        replicas = backend.replicas(model)
        b_replica = replicas.replicas[1]
        b_models.refusals = 10**6
        b_models.hold.set()
        async with asyncio.timeout(WAIT_S):
            result = await model.train(groups(make_choice), config=art.TrainConfig(learning_rate=1e-3))
        # B refused every attempt: out of the router before step 1 became the default on A
        # (the monitor may already have tried to bring it back, and been refused too)
        assert result.step == 1 and b_models.attempts >= control.PUBLISH_ATTEMPTS
        assert [r.index for r in replicas.in_service()] == [0] and live_version(a) == 1
        assert replicas.router.workers() == [a.url]
        assert live_version(b) == 0  # B still serves 0, but no rollout reaches it
        b_models.refusals = 0  # B recovers: the monitor brings it back with every retained version
        assert await asyncio.to_thread(replicas.wait_for, lambda: b_replica.in_service, WAIT_S)
        assert live_version(b) == 1
        assert set(replicas.versions) <= set(ReplicaClient(b.url, KEY).identity()["models"]["m"]["loaded_steps"])
        assert sorted(replicas.router.workers()) == sorted([a.url, b.url])
        backend.close()

    asyncio.run(main())


def test_endpoints_that_cannot_serve_this_model_are_refused_at_register(tmp_path):
    from artrl.replicas.router import free_port

    other = start_replica("X", base_model="some/other-model")
    try:
        for urls, fragment in ([f"http://127.0.0.1:{free_port('127.0.0.1')}"], "does not answer"),  \
                              ([other[0].url], "must serve the base model"):
            backend = art.LocalBackend(path=str(tmp_path), api_key=KEY, show_progress=False)
            model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny",
                                       _internal_config=art.InternalModelConfig(inference_endpoints=urls))
            with pytest.raises(ConfigError, match=fragment):
                asyncio.run(model.register(backend))
            backend.close()
    finally:
        other[1].close()
        other[0].stop()
