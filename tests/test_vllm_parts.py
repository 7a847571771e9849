"""The parts of the vLLM engine that need no vLLM: its engine arguments, the batch gate, sleep around training.

serve/engines/vllm_args.py turns a model config and ART's `engine_args` into vLLM's arguments;
`_KindGate` keeps base-model and adapter requests out of each other's batches without
starving either; `training()` puts vLLM to sleep and wakes it (checked against a recording
stand-in for vLLM's AsyncLLM, since sleep mode needs a GPU). The engine on vLLM itself:
tests/test_vllm_engine.py (marker `vllm`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import artrl as art
from artrl.runtime import notices
from artrl.errors import ConfigError
from artrl.serve.errors import EngineClosedError
from artrl.serve.engines.vllm_args import FIXED, GRAMMAR_PROCESSOR, engine_arguments, lora_rank_slot
from artrl.serve.engines.vllm_engine import ADAPTER, BASE, VLLMEngine, _KindGate, _result, _spread

KNOWN = {"model", "tokenizer", "dtype", "seed", "max_model_len", "trust_remote_code", "max_lora_rank", "max_loras",
         "generation_config", "disable_log_stats", "max_num_seqs", "enable_sleep_mode", "gpu_memory_utilization",
         "kv_cache_memory_bytes", "logprobs_mode", "enable_lora", "enforce_eager", "enable_prefix_caching"}


def arguments(engine_args: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    settings_ = dict(model_path="/models/tiny", device_type="cpu", dtype="float32", max_model_len=512, lora_rank=8,
                     seed=0, trust_remote_code=False, max_num_seqs=None, engine_args=engine_args or {}, known=KNOWN)
    settings_.update(overrides)
    return engine_arguments(**settings_)


@pytest.fixture(autouse=True)
def fresh_notices():
    notices.forget()
    yield
    notices.forget()


def notice_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "artrl.notices"]


# ---- engine arguments ---------------------------------------------------------------------


def test_artrls_defaults_on_cpu_and_what_the_token_record_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = arguments()
    assert args["model"] == args["tokenizer"] == "/models/tiny"
    assert (args["dtype"], args["max_model_len"], args["seed"], args["max_lora_rank"]) == ("float32", 512, 0, 8)
    assert args["logprobs_mode"] == "raw_logprobs" and args["enable_lora"] is True
    assert args["generation_config"] == "vllm" and args["kv_cache_memory_bytes"] == 1024**3
    assert "enable_sleep_mode" not in args and "gpu_memory_utilization" not in args and "max_num_seqs" not in args
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert arguments()["kv_cache_memory_bytes"] == 3 * 1024**3


def test_on_a_gpu_sleep_mode_and_arts_memory_share() -> None:
    assert (arguments(device_type="cuda")["enable_sleep_mode"], arguments(device_type="cuda")[
        "gpu_memory_utilization"]) == (True, 0.79)
    off = arguments({"enable_sleep_mode": False}, device_type="cuda")
    assert (off["enable_sleep_mode"], off["gpu_memory_utilization"]) == (False, 0.55)
    mine = arguments({"gpu_memory_utilization": 0.4}, device_type="cuda")
    assert mine["gpu_memory_utilization"] == 0.4 and "kv_cache_memory_bytes" not in mine


def test_arts_engine_args_reach_vllm_and_fields_decide_what_both_engines_read() -> None:
    args = arguments({"enforce_eager": True, "enable_prefix_caching": False, "max_model_len": 99,
                      "max_num_seqs": 7, "max_loras": 2}, max_num_seqs=3)
    assert (args["enforce_eager"], args["enable_prefix_caching"], args["max_loras"]) == (True, False, 2)
    # max_model_len / max_num_seqs come through the artrl fields they set (the caller passes those)
    assert (args["max_model_len"], args["max_num_seqs"]) == (512, 3)
    assert "max_model_len" not in arguments(max_model_len=None)


def test_artrls_grammar_processor_joins_the_logits_processors_given() -> None:
    assert arguments()["logits_processors"] == [GRAMMAR_PROCESSOR]
    mine = "my.module:Processor"
    assert arguments({"logits_processors": [mine]})["logits_processors"] == [mine, GRAMMAR_PROCESSOR]
    assert arguments({"logits_processors": [GRAMMAR_PROCESSOR, mine]})["logits_processors"] == [mine, GRAMMAR_PROCESSOR]


@pytest.mark.parametrize("key", sorted(FIXED))
def test_what_the_token_record_needs_cannot_be_changed(key: str) -> None:
    arguments({key: FIXED[key]})  # the same value is fine
    with pytest.raises(ConfigError, match=f"engine_args.{key}=.* cannot be honoured"):
        arguments({key: "processed_logprobs" if key == "logprobs_mode" else False})


def test_arguments_without_effect_are_noticed_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="artrl.notices"):
        for _ in range(2):
            args = arguments({"model": "Qwen/Qwen3-8B", "served_model_name": "x", "disable_log_requests": True,
                              "enable_sleep_mode": True})
    lines = notice_lines(caplog)
    assert len(lines) == 4, lines
    assert any("engine_args.model" in m and "/models/tiny" in m for m in lines)
    assert any("served_model_name" in m for m in lines)
    assert any("disable_log_requests" in m and "no such engine argument" in m for m in lines)
    assert any("enable_sleep_mode" in m and "GPUs only" in m for m in lines)
    assert args["model"] == "/models/tiny" and "disable_log_requests" not in args and "enable_sleep_mode" not in args


def test_device_and_dtype_follow_the_trainers_rule() -> None:
    from artrl.serve.engines.vllm_args import device_and_dtype

    assert device_and_dtype(None, "auto", cuda_available=False) == ("cpu", "float32")
    assert device_and_dtype(None, "auto", cuda_available=True) == ("cuda", "bfloat16")
    assert device_and_dtype("cuda:1", "float16", cuda_available=True) == ("cuda", "float16")
    assert device_and_dtype("cpu", "auto", cuda_available=True) == ("cpu", "float32")


def test_lora_ranks_round_up_to_what_vllm_serves() -> None:
    assert [lora_rank_slot(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]
    with pytest.raises(ConfigError, match="above the largest LoRA rank"):
        lora_rank_slot(513)
    with pytest.raises(ConfigError, match="below lora_rank=16"):
        arguments({"max_lora_rank": 8}, lora_rank=16)


def test_the_openai_client_config_engine_args_join_the_models_own(tmp_path: Any, tiny_path: Any) -> None:
    async def main() -> Any:
        model = art.TrainableModel(name="m", project="p", base_model=str(tiny_path),
                                   _internal_config={"engine_args": {"enforce_eager": False}})
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        await model.register(backend, _openai_client_config={"engine_args": {"enforce_eager": True,
                                                                             "max_loras": 2}})
        cfg = backend._runs["m"].cfg
        backend.close()
        return cfg

    cfg = asyncio.run(main())
    assert cfg.engine_args == {"enforce_eager": False, "max_loras": 2}  # the model's own win


# ---- the batch gate -----------------------------------------------------------------------


def test_a_kind_waits_for_the_other_and_arrivals_do_not_jump_the_queue() -> None:
    async def main() -> list[str]:
        gate, log = _KindGate(), []
        releases = {name: asyncio.Event() for name in ("b1", "a1", "b2", "a2")}

        async def request(name: str, kind: str) -> None:
            async with gate.admitted(kind):
                log.append(f"+{name}")
                await releases[name].wait()
                log.append(f"-{name}")

        tasks = [asyncio.ensure_future(request("b1", BASE))]
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(request("a1", ADAPTER)))  # waits for b1
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(request("b2", BASE)))  # same kind as b1, but a1 waits: queues
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(request("a2", ADAPTER)))
        await asyncio.sleep(0)
        assert log == ["+b1"] and gate.waited == 3
        releases["b1"].set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert log == ["+b1", "-b1", "+a1"]  # only a1: b2 is next in line, a2 behind it
        for name in ("a1", "b2", "a2"):
            releases[name].set()
        await asyncio.gather(*tasks)
        return log

    assert asyncio.run(main()) == ["+b1", "-b1", "+a1", "-a1", "+b2", "-b2", "+a2", "-a2"]


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from([BASE, ADAPTER]), st.integers(0, 3), st.integers(0, 4),
                          st.booleans()), min_size=1, max_size=12))
def test_the_kinds_never_overlap_and_every_request_gets_its_turn(plan: list[tuple[str, int, int, bool]]) -> None:
    """Random arrivals (a few loop turns apart), hold times and cancellations while waiting."""

    async def main() -> None:
        gate = _KindGate()
        running: dict[str, int] = {BASE: 0, ADAPTER: 0}
        served, cancelled, entered = [], [], set()

        async def request(i: int, kind: str, hold: int) -> None:
            async with gate.admitted(kind):
                entered.add(i)
                running[kind] += 1
                assert running[BASE] == 0 or running[ADAPTER] == 0, "base and adapter requests overlapped"
                for _ in range(hold):
                    await asyncio.sleep(0)
                running[kind] -= 1
            served.append(i)

        tasks = []
        for i, (kind, gap, hold, cancel) in enumerate(plan):
            for _ in range(gap):
                await asyncio.sleep(0)
            task = asyncio.ensure_future(request(i, kind, hold))
            tasks.append(task)
            if cancel:
                await asyncio.sleep(0)
                if i not in entered:  # still waiting at the gate: its caller gives up
                    task.cancel()
                    cancelled.append(i)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(results[i], asyncio.CancelledError) for i in cancelled)
        assert sorted(served + cancelled) == list(range(len(plan)))  # every other request was served
        assert gate._running == 0 and not gate._queue

    asyncio.run(main())


# ---- sleep mode around a train call, results ------------------------------------------------


class _RecordingLLM:
    """Stands in for vLLM's AsyncLLM where the real one needs a GPU (sleep mode)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", (level, mode)))

    async def wake_up(self, tags: Any = None) -> bool:
        self.calls.append(("wake_up", tags))
        return True


def _engine_on(llm: Any, sleep_mode: bool) -> VLLMEngine:
    engine = object.__new__(VLLMEngine)  # everything but vLLM: its loop thread and the stand-in
    engine._loop = asyncio.new_event_loop()
    engine._thread = threading.Thread(target=engine._run_loop, daemon=True)
    engine._thread.start()
    engine._llm, engine._sleep_mode = llm, sleep_mode
    return engine


def test_training_puts_vllm_to_sleep_and_wakes_it_even_when_the_call_fails() -> None:
    llm = _RecordingLLM()
    engine = _engine_on(llm, sleep_mode=True)
    try:
        with engine.training():
            assert llm.calls == [("sleep", (1, "keep"))]  # weights offloaded, running requests kept
        assert llm.calls[-1] == ("wake_up", None)
        with pytest.raises(RuntimeError, match="trainer failed"):
            with engine.training():
                raise RuntimeError("trainer failed")
        assert [name for name, _ in llm.calls] == ["sleep", "wake_up", "sleep", "wake_up"]
        without = _RecordingLLM()
        engine._llm, engine._sleep_mode = without, False
        with engine.training():
            pass
        assert without.calls == []  # on CPU: nothing to do
    finally:
        engine._stop_loop()


def _output(token_ids: list[int], steps: list[dict[int, tuple[float, int]]], reason: str = "stop") -> Any:
    return SimpleNamespace(token_ids=token_ids, finish_reason=reason, stop_reason=None,
                           logprobs=[{t: SimpleNamespace(logprob=lp, rank=rank) for t, (lp, rank) in step.items()}
                                     for step in steps])


def test_results_take_the_sampled_logprob_and_the_top_k_by_rank() -> None:
    steps = [{7: (-3.0, 5), 4: (-0.5, 1), 9: (-1.0, 2)}, {4: (-0.1, 1), 9: (-2.5, 2)}]
    result = _result(_output([7, 4], steps), 2, closed=False)
    assert result.token_ids == [7, 4] and result.logprobs == [-3.0, -0.1] and result.finish_reason == "stop"
    assert result.top_logprobs == [[(4, -0.5), (9, -1.0)], [(4, -0.1), (9, -2.5)]]
    assert _result(_output([7, 4], steps), 0, closed=False).top_logprobs is None
    with pytest.raises(EngineClosedError):
        _result(_output([7], steps[:1], reason="abort"), 0, closed=True)
    with pytest.raises(RuntimeError, match="finish_reason='abort'"):
        _result(_output([7], steps[:1], reason="abort"), 0, closed=False)
    with pytest.raises(RuntimeError, match="2 logprob entries for 1 sampled tokens"):
        _result(_output([7], steps), 0, closed=False)


def test_seeds_are_spread_so_nearby_seeds_do_not_share_samples() -> None:
    assert _spread(None) is None and _spread(3) == _spread(3)
    spread = [_spread(s) for s in range(1000)]
    assert all(0 <= s < 2**62 for s in spread)
    # vLLM seeds sample i with seed + i: no request's first 32 samples meet another's
    assert all(abs(a - b) >= 32 for i, a in enumerate(spread) for b in spread[i + 1:])


def test_a_failed_start_says_that_the_main_script_needs_its_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from artrl.serve.engines.vllm_engine import _start_failure

    monkeypatch.setattr(sys.modules["__main__"], "__file__", "/home/me/train.py", raising=False)
    message = _start_failure(RuntimeError("Engine core initialization failed"))
    assert "Engine core initialization failed" in message and "/home/me/train.py" in message
    assert 'if __name__ == "__main__":' in message


# ---- quantised base weights ---------------------------------------------------------------


def test_4bit_weights_are_served_by_vllms_bitsandbytes_path_on_a_gpu() -> None:
    args = arguments(device_type="cuda", dtype="bfloat16", quantization="4bit")
    assert args["quantization"] == "bitsandbytes" and args["dtype"] == "bfloat16"
    assert "quantization" not in arguments(device_type="cuda")  # full-precision weights: vLLM's own choice


@pytest.mark.parametrize(("quantization", "device_type", "engine_args", "says"), [
    ("4bit", "cpu", {}, "CPU build has no bitsandbytes"),
    ("8bit", "cuda", {}, "to 4-bit only"),
    ("4bit", "cuda", {"quantization": "fp8"}, "engine_args.quantization='fp8'"),
    ("4bit-moe", "cuda", {}, "mixture-of-experts model: vLLM's bitsandbytes path quantises the experts"),
])
def test_what_vllm_cannot_serve_is_one_clear_error_before_it_starts(quantization, device_type, engine_args,
                                                                     says) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        arguments(engine_args, device_type=device_type, quantization=quantization.removesuffix("-moe"),
                  moe=quantization.endswith("-moe"))
    assert "inference_engine='builtin'" in str(e.value) or "load_in_4bit=False" in str(e.value)


def test_quantised_weights_compute_in_bf16_by_default() -> None:
    from artrl.serve.engines.vllm_args import device_and_dtype

    assert device_and_dtype("cpu", "auto", cuda_available=False, quantized=True) == ("cpu", "bfloat16")


def test_a_mixture_of_experts_model_gets_vllms_3d_lora_format_on_a_gpu_and_a_clear_error_on_a_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    known = KNOWN | {"enable_mixed_moe_lora_format", "enable_return_routed_experts"}
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    gpu = arguments(device_type="cuda", dtype="bfloat16", moe=True, known=known)
    assert gpu["enable_mixed_moe_lora_format"] is True and "enable_return_routed_experts" not in gpu
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert arguments(device_type="cuda", dtype="bfloat16", moe=True, known=known)["enable_return_routed_experts"]
    with pytest.raises(ConfigError, match="CPU build runs a mixture-of-experts model's LoRA adapters through Triton"):
        arguments(moe=True, known=known)
    with pytest.raises(ConfigError, match="no enable_mixed_moe_lora_format"):
        arguments(device_type="cuda", dtype="bfloat16", moe=True)
    assert "enable_mixed_moe_lora_format" not in arguments(device_type="cuda", known=known)  # a dense model
