"""Policy versions in the built-in engine: serving while training, versions pinned per row, mixed batches.

Orders are made with events and forward hooks, never with timing: a trainer blocked inside
its call on an event, a decode worker held at a step boundary.
"""

from __future__ import annotations

import asyncio
import pathlib
import threading
import time
from typing import Any

import pytest
from peft import PeftModel

import artrl as art
from artrl.serve import GenerationRequest, ServedModels, TransformersEngine
from artrl.serve.engines.base import BASE_WEIGHTS
from artrl.models.tiny import load_tiny
from artrl.trajectories import choice_policy_version, sampled_policy_versions
from engine_helpers import StepHook, prompt_of, random_adapter as _adapter, recompute, submit

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny model with a live adapter, and two checkpoints of other adapters (versions 1 and 2) on disk."""
    cache = tmp_path_factory.mktemp("tiny-cache")
    root = tmp_path_factory.mktemp("ckpts")
    paths = {}
    for step, seed in ((1, 11), (2, 12), (3, 13)):
        paths[step] = str(root / f"{step:04d}")
        _adapter(cache, seed).save_pretrained(paths[step])
    _, tokenizer = load_tiny(cache)
    return {"model": _adapter(cache, 3), "tokenizer": tokenizer, "paths": paths, "cache": cache}


def reference(setup: dict[str, Any], step: int) -> PeftModel:
    return PeftModel.from_pretrained(load_tiny(setup["cache"])[0], setup["paths"][step]).eval()


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b)), default=0.0) < TOLERANCE


# ---- mixed-version batches ---------------------------------------------------------------------------


@pytest.mark.parametrize("switches", [{}, {"merge_lora": True}, {"static_cache": True, "static_cache_len": 64}],
                         ids=["plain", "merged", "static"])
def test_a_mixed_batch_samples_what_single_adapter_batches_sample(setup: dict[str, Any],
                                                                   loop: asyncio.AbstractEventLoop,
                                                                   switches: dict[str, Any]) -> None:
    """Two versions and the base weights in one forward: the same tokens and logprobs as each alone (single-
    adapter batches run merged weights, or the static slots, where switched on)."""
    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(model, tokenizer, max_batch_size=8, end_ids=frozenset(), **switches)
    engine.set_live_weights(paths[1], 1)
    engine.load_adapter("m@1", paths[1])  # the name a pinned rollout asks for: version 1, shared
    engine.set_live_weights(paths[2], 2)
    requests = [
        GenerationRequest(prompt_ids=prompt_of(tokenizer, "what colour is the sky"), n=2, max_tokens=9,
                          seed=1, adapter="m@1", top_logprobs=2),
        GenerationRequest(prompt_ids=prompt_of(tokenizer, "hi"), max_tokens=12, seed=2),  # the live version
        GenerationRequest(prompt_ids=prompt_of(tokenizer, "tell me a story"), max_tokens=7, seed=3,
                          temperature=0.7, adapter=BASE_WEIGHTS),
        GenerationRequest(prompt_ids=prompt_of(tokenizer, "good morning to you"), max_tokens=5, seed=4,
                          temperature=0.0, adapter="m@1"),
    ]
    shapes: list[tuple[int, ...]] = []
    handle = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        alone = [submit(loop, engine, r).result(120) for r in requests]
        batches, shapes[:] = engine.batches_served, []
        with engine.model_lock:  # hold the worker so all four queue up and start one batch together
            futures = [submit(loop, engine, r) for r in requests]
            deadline = time.monotonic() + 120  # a bound, not a timing check: requests that never queue fail here
            while engine.pending_requests < len(requests):
                assert time.monotonic() < deadline, f"{engine.pending_requests} of {len(requests)} requests queued"
                threading.Event().wait(0.005)
        mixed = [f.result(120) for f in futures]
    finally:
        handle.remove()
        engine.close()
    assert engine.batches_served == batches + 1
    assert (8 if switches.get("static_cache") else 5, 1) in shapes  # 2 + 1 + 1 + 1 rows of three adapters
    if switches.get("merge_lora"):
        assert engine._merger is not None and engine._merger.rebuilds > 0
    for one, many in zip(alone, mixed):
        assert [r.token_ids for r in many] == [r.token_ids for r in one]
        for a, b in zip(one, many):
            assert close(a.logprobs, b.logprobs)
            assert a.policy_version == b.policy_version
    assert [r.policy_version for r in mixed[0]] == [1, 1] and mixed[1][0].policy_version == 2
    assert mixed[2][0].policy_version is None and mixed[3][0].policy_version == 1
    # and each is the right weights: exact against an unbatched forward of that checkpoint (and of the base)
    v1, v2 = reference(setup, 1), reference(setup, 2)
    assert close(mixed[0][1].logprobs, recompute(v1, requests[0].prompt_ids, mixed[0][1].token_ids))
    assert close(mixed[1][0].logprobs, recompute(v2, requests[1].prompt_ids, mixed[1][0].token_ids))
    with v1.disable_adapter():
        assert close(mixed[2][0].logprobs, recompute(v1, requests[2].prompt_ids, mixed[2][0].token_ids))


# ---- versions pinned per row --------------------------------------------------------------------------


def test_a_running_row_keeps_its_version_across_set_live_weights(setup: dict[str, Any],
                                                                  loop: asyncio.AbstractEventLoop) -> None:
    """set_live_weights from another thread while a row decodes: loaded at a step boundary, the row keeps
    version 1 to its end, and the next request samples version 2."""
    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(model, tokenizer, max_batch_size=8, end_ids=frozenset())
    long = GenerationRequest(prompt_ids=prompt_of(tokenizer, "a long story about the sea"), max_tokens=30,
                             temperature=0.0)
    engine.set_live_weights(paths[1], 1)
    at_step: list[int] = []
    original_add = engine._versions.add_version

    def add_version(path: str, step: int) -> str:
        at_step.append(engine.decode_steps)
        return original_add(path, step)

    engine._versions.add_version = add_version  # type: ignore[method-assign]
    try:
        before = submit(loop, engine, long).result(120)[0]
        held, queued = threading.Event(), threading.Event()
        original_put = engine._queue.put

        def put(item: Any, *args: Any, **kwargs: Any) -> None:
            original_put(item, *args, **kwargs)
            if type(item).__name__ == "EngineTask":
                queued.set()

        engine._queue.put = put  # type: ignore[method-assign]

        def hold() -> None:  # on the worker, between two steps: wait until the load is queued behind us
            held.set()
            assert queued.wait(120), "set_live_weights never queued its load"

        hook = StepHook(engine, at=4, action=hold)
        steps_before = engine.decode_steps
        try:
            running = submit(loop, engine, long)
            assert held.wait(120)
            loader = threading.Thread(target=engine.set_live_weights, args=(paths[2], 2))
            loader.start()
            during = running.result(120)[0]
            loader.join(120)
        finally:
            hook.remove()
        after = submit(loop, engine, long).result(120)[0]
    finally:
        engine.close()
    assert not loader.is_alive()
    assert 0 < at_step[-1] - steps_before < 30  # loaded in the middle of the 30-step row, not after it
    assert during.token_ids == before.token_ids and close(during.logprobs, before.logprobs)
    assert during.policy_version == before.policy_version == 1
    assert after.policy_version == 2
    assert close(after.logprobs, recompute(reference(setup, 2), long.prompt_ids, after.token_ids))
    assert engine.live_step == 2


def test_the_rows_of_one_request_share_the_version_it_started_on(setup: dict[str, Any],
                                                                  loop: asyncio.AbstractEventLoop) -> None:
    """n=3 with room for 2 rows: the third joins after a new version went live, and still samples the first."""
    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(model, tokenizer, max_batch_size=2, end_ids=frozenset())
    request = GenerationRequest(prompt_ids=prompt_of(tokenizer, "count to three"), n=3, max_tokens=4, seed=5)
    try:
        engine.set_live_weights(paths[1], 1)
        batches = engine.batches_served
        hook = StepHook(engine, at=2, action=lambda: engine.set_live_weights(paths[2], 2))
        try:
            results = submit(loop, engine, request).result(120)
        finally:
            hook.remove()
    finally:
        engine.close()
    assert engine.batches_served == batches + 1 and engine.live_step == 2
    assert [r.policy_version for r in results] == [1, 1, 1]
    v1 = reference(setup, 1)
    for result in results:
        assert close(result.logprobs, recompute(v1, request.prompt_ids, result.token_ids))


def test_name_at_the_live_step_and_the_live_name_agree(setup: dict[str, Any],
                                                         loop: asyncio.AbstractEventLoop) -> None:
    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(model, tokenizer, end_ids=frozenset())
    served = ServedModels("m", engine, checkpoint_path=lambda name, step: paths.get(step))
    request = GenerationRequest(prompt_ids=prompt_of(tokenizer, "name a colour"), max_tokens=8, temperature=0.0,
                                top_logprobs=3)
    try:
        engine.set_live_weights(paths[2], 2)
        results = {}
        for name in ("m", "m@2", "m@1"):
            _, adapter = asyncio.run_coroutine_threadsafe(served.resolve(name), loop).result(120)
            results[name] = served.with_versions(name, submit(loop, engine, GenerationRequest(
                **{**request.__dict__, "adapter": adapter})).result(120))[0]
    finally:
        engine.close()
    live, pinned, old = results["m"], results["m@2"], results["m@1"]
    assert pinned.token_ids == live.token_ids and pinned.logprobs == live.logprobs
    assert pinned.top_logprobs == live.top_logprobs
    assert live.policy_version == pinned.policy_version == 2 and old.policy_version == 1
    assert engine.loaded_versions == [2]  # m@2 is the loaded version itself, not a second copy
    assert close(old.logprobs, recompute(reference(setup, 1), request.prompt_ids, old.token_ids))


def test_prune_never_unloads_a_version_a_row_uses(setup: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(model, tokenizer, end_ids=frozenset())
    served = ServedModels("m", engine, checkpoint_path=lambda name, step: paths.get(step))
    long = GenerationRequest(prompt_ids=prompt_of(tokenizer, "once upon a time"), max_tokens=20, temperature=0.0)
    pruned_during: list[list[int]] = []
    try:
        engine.set_live_weights(paths[1], 1)
        alone = submit(loop, engine, long).result(120)[0]
        engine.set_live_weights(paths[2], 2)
        _, pinned = asyncio.run_coroutine_threadsafe(served.resolve("m@1"), loop).result(120)
        engine.set_live_weights(paths[3], 3)
        assert engine.loaded_versions == [1, 2, 3]
        hook = StepHook(engine, at=5, action=lambda: pruned_during.append(served.prune("m", retain_steps=[])))
        try:
            during = submit(loop, engine, GenerationRequest(**{**long.__dict__, "adapter": pinned})).result(120)[0]
        finally:
            hook.remove()
        assert pruned_during == [[2]]  # version 1 decodes a row (and m@1 names it), 3 is live
        assert engine.loaded_versions == [1, 3]
        assert served.prune("m", retain_steps=[3]) == [1]  # the row ended: version 1 and its name go
        assert engine.loaded_versions == [3] and not engine.has_adapter(pinned)
        # a later request for m@1 loads it again from its checkpoint
        _, again = asyncio.run_coroutine_threadsafe(served.resolve("m@1"), loop).result(120)
        reloaded = submit(loop, engine, GenerationRequest(**{**long.__dict__, "adapter": again})).result(120)[0]
    finally:
        engine.close()
    assert during.token_ids == alone.token_ids and during.policy_version == 1
    assert reloaded.token_ids == alone.token_ids and reloaded.policy_version is None
    assert served.with_versions("m@1", [reloaded])[0].policy_version == 1


def test_idle_versions_are_bounded_without_a_pruner(setup: dict[str, Any]) -> None:
    from artrl.serve.engines.adapter_versions import IDLE_VERSIONS_KEPT

    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(model, tokenizer)
    try:
        for step in range(1, IDLE_VERSIONS_KEPT + 5):
            engine.set_live_weights(paths[1 + step % 3], step)
            if step == 1:
                engine.load_adapter("m@1", paths[2])  # version 1's checkpoint: a name that keeps version 1
    finally:
        engine.close()
    last = IDLE_VERSIONS_KEPT + 4
    assert engine.loaded_versions == [1, *range(last - IDLE_VERSIONS_KEPT, last + 1)]


# ---- serving while training ---------------------------------------------------------------------------

SFT_DATA = [art.Trajectory(messages_and_choices=[{"role": "user", "content": f"Say {w}."},
                                                 {"role": "assistant", "content": w}], reward=0.0)
            for w in ("red", "green", "blue", "yellow")]


def test_requests_are_answered_while_a_train_call_runs(tmp_path: pathlib.Path) -> None:
    """The trainer is held inside its call (its lock held, the model in train mode): a request is answered
    meanwhile, from the version before the call; after the call, greedy replies follow the new weights."""
    from artrl.local.session import TrainingSession

    cfg = art.InternalModelConfig(max_length=128, inference_engine="builtin")
    session = TrainingSession.open(tmp_path / "run", name="m", project="p", base_model="artrl/tiny", cfg=cfg)
    engine = session.engine
    assert engine.serve_copy and engine.model is not session.trainer.model
    request = GenerationRequest(prompt_ids=prompt_of(engine.tokenizer, "Say red."), max_tokens=6, temperature=0.0)
    inside, release = threading.Event(), threading.Event()
    original = session.trainer._step

    def blocked(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        assert release.wait(120), "the test never released the trainer"
        return original(*args, **kwargs)

    session.trainer._step = blocked  # type: ignore[method-assign]
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            call = cfg.call_config(art.TrainSFTConfig(learning_rate=5e-2, batch_size=2))
            outcome["result"] = session.train("sft", SFT_DATA, call, show_progress=False)
        except BaseException as error:  # reported by the assertions below
            outcome["error"] = error

    async def generate() -> Any:
        async with asyncio.timeout(120):
            return (await engine.generate(request))[0]

    try:
        before = asyncio.run(generate())
        trainer = threading.Thread(target=train)
        trainer.start()
        assert inside.wait(120), outcome
        during = asyncio.run(generate())  # answered with the trainer still inside its call
        assert trainer.is_alive() and not release.is_set()
        release.set()
        trainer.join(120)
        assert "error" not in outcome, outcome
        after = asyncio.run(generate())
        trained = session.trainer.model
        trained.eval()
        expected = recompute(trained, request.prompt_ids, after.token_ids)
    finally:
        release.set()
        session.close()
    assert before.policy_version == during.policy_version == 0
    assert during.token_ids == before.token_ids and during.logprobs == before.logprobs
    assert outcome["result"].step == 1 and after.policy_version == 1
    assert close(after.logprobs, expected)  # the engine serves what the trainer now holds
    assert not close(before.logprobs, recompute(trained, request.prompt_ids, before.token_ids))  # which changed


# ---- the record ---------------------------------------------------------------------------------------


def test_a_choice_carries_its_policy_version_to_the_trajectory(setup: dict[str, Any]) -> None:
    from fastapi.testclient import TestClient
    from openai.types.chat.chat_completion import ChatCompletion

    from artrl.serve import create_app

    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(model, tokenizer)
    served = ServedModels("m", engine, checkpoint_path=lambda name, step: paths.get(step))
    try:
        engine.set_live_weights(paths[2], 2)
        with TestClient(create_app(served)) as client:
            replies = []
            for name in ("m", "m@1"):
                response = client.post("/v1/chat/completions", json={
                    "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1})
                assert response.status_code == 200, response.text
                replies.append(ChatCompletion.model_validate(response.json()))
    finally:
        engine.close()
    live, pinned = (art.choice_from_completion(r) for r in replies)
    assert choice_policy_version(live) == 2 and choice_policy_version(pinned) == 1
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, pinned,
                                                      {"role": "user", "content": "again"}, live])
    assert sampled_policy_versions(trajectory) == [1, 2]


def test_a_serving_copy_keeps_its_adapter_between_batches_and_switches_when_the_version_changes(setup):
    """Batches of the live version one after another (a rollout's turns) switch no adapter on the engine's own
    copy (peft's set_adapter walks every module); the next version is switched in at its first batch."""
    tokenizer = setup["tokenizer"]
    engine = TransformersEngine(setup["model"], tokenizer, serve_copy=True, end_ids=frozenset())
    copy = engine.model
    switched: list[str] = []
    set_adapter = copy.set_adapter

    def counting(adapter: str, *args: Any, **kwargs: Any) -> Any:
        switched.append(adapter)
        return set_adapter(adapter, *args, **kwargs)

    copy.set_adapter = counting
    prompt = prompt_of(tokenizer, "tell me about the sea")
    request = GenerationRequest(prompt_ids=prompt, max_tokens=4, temperature=0)
    try:
        for step in (1, 2):
            engine.set_live_weights(setup["paths"][step], step)
            before = len(switched)
            results = [asyncio.run(engine.generate(request))[0] for _ in range(4)]  # four batches, one at a time
            assert len(switched) == before + 1, switched[before:]  # in at the first batch, then kept
            expected = recompute(reference(setup, step), prompt, results[0].token_ids)
            for result in results:
                assert result.policy_version == step and result.token_ids == results[0].token_ids
                assert close(result.logprobs, expected)
    finally:
        engine.close()
