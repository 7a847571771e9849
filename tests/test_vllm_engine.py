"""The vLLM engine (serve/engines/vllm_engine.py) on vLLM's CPU build, beyond the engine contract.

Base-model requests among LoRA requests come back with the base model's tokens (vLLM's CPU
LoRA kernels would apply an adapter to them in a mixed batch); a request keeps the live
adapter it started with when the live weights move on, and the superseded adapter leaves
vLLM; a caller that stops waiting aborts its request; starting vLLM leaves the caller's
RNGs, environment and thread count as they were; closing fails what is in flight and ends
vLLM's processes. References are plain transformers + peft forwards of the same weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import random
import threading
from typing import Any

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from artrl.chat.format import end_of_turn_ids
from artrl.serve.engines.base import BASE_WEIGHTS, GenerationRequest
from artrl.serve.errors import EngineClosedError, InvalidRequestError
from artrl.serve.engines.factory import open_engine
from artrl.config.model import InternalModelConfig

pytestmark = pytest.mark.vllm

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
PROMPTS = ["Tell me a story about a cat.", "What colour is the sky?", "List three fruits please.", "Hello there!"]
LONG = 400  # tokens: a request still running when the test acts on it (the untrained model rarely ends a turn)


def _base(tiny_path: pathlib.Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32).eval()


def _adapter(tiny_path: pathlib.Path, directory: pathlib.Path, seed: int) -> pathlib.Path:
    """A saved LoRA adapter that changes the tiny model's greedy replies."""
    torch.manual_seed(seed)
    model = get_peft_model(_base(tiny_path), LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(8.0)
    model.save_pretrained(directory)
    return directory


def greedy(model: Any, prompt: list[int], steps: int, end_ids: frozenset[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] in end_ids:
                break
    return ids[len(prompt):]


def open_vllm(tiny_path: pathlib.Path, tok: Any, **engine_args: Any) -> Any:
    cfg = InternalModelConfig(inference_max_length=512, lora_rank=LORA.r, engine_args=engine_args)
    return open_engine("vllm", tokenizer=tok, end_ids=end_of_turn_ids(tok, _base(tiny_path)), cfg=cfg,
                       base_model_path=str(tiny_path))


@dataclasses.dataclass
class Started:
    engine: Any
    before: tuple[Any, ...]  # the caller's RNG states, environment and torch threads before vLLM was imported
    children: set[int]  # this process's child processes before


@pytest.fixture(scope="module")
def started(tiny_path: pathlib.Path, tok: Any) -> Any:
    """One engine for the module (each start costs tens of seconds on a small CPU); the last test closes it."""
    import psutil

    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    before = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(),
              dict(os.environ), torch.get_num_threads())
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    # One adapter slot (ART's engine_args reach vLLM): a base row batched with LoRA rows would then take the
    # loaded adapter (vLLM's CPU kernels read "no adapter", index -1, as the last slot). With more slots the
    # same happens once every slot holds an adapter, e.g. after a few training steps' live weights.
    opened = open_vllm(tiny_path, tok, max_loras=1)
    assert opened._llm.vllm_config.lora_config.max_loras == 1
    yield Started(opened, before, children)
    opened.close()


@pytest.fixture
def engine(started: Started) -> Any:
    return started.engine


@pytest.fixture(scope="module")
def adapters(tiny_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: _adapter(tiny_path, root / name, seed) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def prompts(tok: Any) -> list[list[int]]:
    return [tok(text, add_special_tokens=False).input_ids for text in PROMPTS]


def lora_ids(engine: Any) -> set[int]:
    return set(engine._call(engine._llm.list_loras()))


def test_starting_left_the_callers_process_alone(started: Started, prompts: list[list[int]]) -> None:
    """The module's first test: nothing else has touched the RNGs since the snapshot."""
    asyncio.run(started.engine.generate(GenerationRequest(prompts[0], max_tokens=4, seed=5)))
    rng, state, numpy_state, environ, threads = started.before
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert random.getstate() == state and np.array_equal(np.random.get_state()[1], numpy_state)
    assert _environ(os.environ) == _environ(environ) and torch.get_num_threads() == threads


def _environ(environ: Any) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's own, per test phase


def test_base_model_requests_among_lora_requests_get_base_model_tokens(
        engine: Any, tiny_path: pathlib.Path, adapters: dict[str, pathlib.Path], prompts: list[list[int]]) -> None:
    ends = engine.end_of_turn_ids
    base_model = _base(tiny_path)
    checkpoint = PeftModel.from_pretrained(_base(tiny_path), adapters["a"]).eval()
    expected_base = [greedy(base_model, p, 12, ends) for p in prompts]
    expected_lora = [greedy(checkpoint, p, 12, ends) for p in prompts]
    assert expected_base != expected_lora  # the adapter changes the replies: a wrong batch would show
    engine.set_live_weights(str(adapters["a"]), 1)
    waited = engine._gate.waited

    async def traffic() -> tuple[list[Any], list[Any]]:
        lora, base = [], []
        for round_ in range(3):  # LoRA requests in flight, base requests arriving among them, and back again
            lora += [asyncio.ensure_future(engine.generate(GenerationRequest(p, max_tokens=12, temperature=0.0)))
                     for p in prompts]
            await asyncio.sleep(0)
            base += [asyncio.ensure_future(engine.generate(
                GenerationRequest(p, max_tokens=12, temperature=0.0, adapter=BASE_WEIGHTS))) for p in prompts]
        return await asyncio.gather(*lora), await asyncio.gather(*base)

    lora_results, base_results = asyncio.run(traffic())
    assert [r[0].token_ids for r in base_results] == expected_base * 3
    assert [r[0].token_ids for r in lora_results] == expected_lora * 3
    assert engine._gate.waited > waited  # the two kinds really met: one waited for the other


def test_a_request_keeps_its_live_adapter_and_the_superseded_one_leaves_vllm(
        engine: Any, tiny_path: pathlib.Path, adapters: dict[str, pathlib.Path], prompts: list[list[int]]) -> None:
    ends = engine.end_of_turn_ids
    engine.set_live_weights(str(adapters["a"]), 1)
    first_live = engine._live.lora_int_id
    expected_a = greedy(PeftModel.from_pretrained(_base(tiny_path), adapters["a"]).eval(), prompts[0], 40, ends)
    expected_b = greedy(PeftModel.from_pretrained(_base(tiny_path), adapters["b"]).eval(), prompts[0], 40, ends)

    async def scenario() -> tuple[Any, Any]:
        running = asyncio.ensure_future(engine.generate(GenerationRequest(prompts[0], max_tokens=40,
                                                                          temperature=0.0)))
        while not engine._tasks:  # handed to the engine loop: it holds adapter a now
            await asyncio.sleep(0)
        await asyncio.to_thread(engine.set_live_weights, str(adapters["b"]), 2)
        after = await engine.generate(GenerationRequest(prompts[0], max_tokens=40, temperature=0.0))
        return await running, after

    started_on_a, after = asyncio.run(scenario())
    assert started_on_a[0].token_ids == expected_a and after[0].token_ids == expected_b
    assert engine.wait_idle(timeout=60)
    assert first_live not in lora_ids(engine) and engine._live.lora_int_id in lora_ids(engine)


def test_named_adapters_load_once_and_refuse_another_path(
        engine: Any, adapters: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    engine.load_adapter("ckpt-a", str(adapters["a"]))
    engine.load_adapter("ckpt-a", str(adapters["a"]))  # the same again: nothing to do
    assert engine.has_adapter("ckpt-a") and not engine.has_adapter("ckpt-b")
    with pytest.raises(InvalidRequestError, match="already loaded from"):
        engine.load_adapter("ckpt-a", str(adapters["b"]))
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(Exception):  # noqa: B017 - vLLM's own error; ServedModels turns it into a CheckpointError
        engine.load_adapter("broken", str(tmp_path))
    assert not engine.has_adapter("broken")


def test_a_caller_that_stops_waiting_aborts_its_request(engine: Any, prompts: list[list[int]]) -> None:
    served, aborted = engine.requests_served, engine.requests_aborted

    async def leave_early() -> None:
        task = asyncio.ensure_future(engine.generate(GenerationRequest(prompts[1], max_tokens=LONG)))
        while not engine._tasks:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_early())
    assert engine.wait_idle(timeout=60)
    assert engine.requests_aborted == aborted + 1 and engine.requests_served == served
    assert engine._call(_unfinished(engine)) == 0  # vLLM holds nothing for it any more


async def _unfinished(engine: Any) -> int:
    return engine._llm.get_num_unfinished_requests()


def test_training_on_cpu_leaves_rollouts_running(engine: Any, prompts: list[list[int]]) -> None:
    with engine.training():  # no sleep mode on CPU: vLLM keeps serving from its own copy of the weights
        (result,) = asyncio.run(engine.generate(GenerationRequest(prompts[2], max_tokens=4, temperature=0.0)))
    assert len(result.token_ids) >= 1


def test_seeded_samples_are_independent_across_nearby_seeds(engine: Any, prompts: list[list[int]]) -> None:
    request = GenerationRequest(prompts[3], n=2, max_tokens=8, seed=40)
    two = asyncio.run(engine.generate(request))
    next_seed = asyncio.run(engine.generate(dataclasses.replace(request, n=1, seed=41)))
    assert two[1].token_ids != next_seed[0].token_ids  # vLLM alone would seed sample 1 of 40 like sample 0 of 41


def test_closing_fails_what_is_in_flight_and_ends_vllms_processes(started: Started,
                                                                   prompts: list[list[int]]) -> None:
    """The module's last test: it closes the engine."""
    import psutil

    engine = started.engine
    # vLLM's engine runs in processes of its own (multiprocessing's resource tracker, which the first spawn
    # starts and which lives as long as the program, is Python's, not the engine's)
    vllm_processes = [p for p in psutil.Process().children(recursive=True)
                      if p.pid not in started.children and "resource_tracker" not in " ".join(p.cmdline())]
    assert vllm_processes
    outcome: dict[str, BaseException] = {}
    running = threading.Event()

    def caller() -> None:  # a server thread with a request in flight
        async def wait_for_it() -> None:
            future = asyncio.ensure_future(engine.generate(GenerationRequest(prompts[0], max_tokens=LONG)))
            while not engine._tasks:
                await asyncio.sleep(0)
            running.set()
            await future

        try:
            asyncio.run(wait_for_it())
        except BaseException as error:  # noqa: BLE001 - recorded for the assertion below
            outcome["error"] = error

    thread = threading.Thread(target=caller)
    thread.start()
    assert running.wait(timeout=120)

    async def close_from_async_code() -> None:  # as `await backend.close()` in a user's loop does
        engine.close()

    asyncio.run(close_from_async_code())
    thread.join(timeout=120)
    assert isinstance(outcome.get("error"), EngineClosedError)
    assert not engine._thread.is_alive()
    _, alive = psutil.wait_procs(vllm_processes, timeout=30)
    assert alive == []
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.generate(GenerationRequest(prompts[0], max_tokens=4)))
    with pytest.raises(EngineClosedError):
        engine.load_adapter("late", "/nowhere")
    engine.close()  # idempotent
