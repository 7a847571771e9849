"""In-flight LoRA updates (ART's `rollout_weight_update_mode="in_flight_lora"`) on the built-in engine.

A new policy version goes live under running rows at a step boundary; each token records the version that
sampled it (`policy_token_spans`), and its logprob is exactly that version's. Orders are made with a hook
on the decode worker's step, never with timing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from peft import PeftModel

import artrl as art
from artrl.errors import ConfigError
from artrl.serve import GenerationRequest, TransformersEngine
from artrl.serve.http.core import policy_token_spans_json
from artrl.models.tiny import load_tiny
from engine_helpers import StepHook, prompt_of, random_adapter as _adapter, recompute, submit

TOLERANCE = 1e-4
# The first train call moves the policy little enough that the next call's delta over version 0's tokens (policy
# drift, not a record error) stays within 1e-3, and enough that the two checkpoints' logprobs tell apart.
FIRST_STEP_LR = 3e-6
RECORD_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny model with an adapter, and the checkpoints of two other adapters (versions 1 and 2) on disk."""
    cache = tmp_path_factory.mktemp("tiny-cache")
    root = tmp_path_factory.mktemp("ckpts")
    paths = {}
    for step, seed in ((1, 21), (2, 22)):
        paths[step] = str(root / f"{step:04d}")
        _adapter(cache, seed).save_pretrained(paths[step])
    _, tokenizer = load_tiny(cache)
    return {"model": _adapter(cache, 3), "tokenizer": tokenizer, "paths": paths, "cache": cache}


def reference(setup: dict[str, Any], step: int) -> PeftModel:
    return PeftModel.from_pretrained(load_tiny(setup["cache"])[0], setup["paths"][step]).eval()


def gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def swap_during(engine: TransformersEngine, request: GenerationRequest, paths: dict[int, str], at: int,
                loop: asyncio.AbstractEventLoop, timeout: float = 120) -> list[Any]:
    """`request`'s results on `engine`, version 1 live from the start and version 2 going live before decode step
    `at`; the engine is closed after."""
    try:
        engine.set_live_weights(paths[1], 1)
        StepHook(engine, at=at, action=lambda: engine.set_live_weights(paths[2], 2))
        return submit(loop, engine, request).result(timeout)
    finally:
        engine.close()


def _sample_across_a_swap(setup: dict[str, Any], loop: asyncio.AbstractEventLoop, *, in_flight: bool, n: int = 1,
                          static_cache: bool = False, swap_at: int = 5) -> tuple[GenerationRequest, list[Any], Any]:
    """Rows of version 1; version 2 goes live before decode step `swap_at` (its token is still version 1's)."""
    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(model, tokenizer, end_ids=frozenset(), in_flight_updates=in_flight,
                                static_cache=static_cache)
    request = GenerationRequest(prompt_ids=prompt_of(tokenizer, "tell me a story"), n=n, max_tokens=16, seed=7)
    results = swap_during(engine, request, paths, swap_at, loop)
    return request, results, engine


@pytest.mark.parametrize("static_cache", [False, True])
def test_a_row_spanning_a_swap_records_two_spans_each_sampled_by_its_version(
        setup: dict[str, Any], loop: asyncio.AbstractEventLoop, static_cache: bool) -> None:
    request, results, engine = _sample_across_a_swap(setup, loop, in_flight=True, n=2, static_cache=static_cache)
    v1, v2 = reference(setup, 1), reference(setup, 2)
    assert engine.rows_updated_in_flight == 2
    for result in results:
        spans = result.policy_token_spans
        assert [(a, b, v) for a, b, v, _ in spans] == [(0, 5, 1), (5, 16, 2)]
        assert spans[0][3] != spans[1][3]  # two adapters' weights
        assert result.policy_version == 1  # the version it started on
        by_v1 = recompute(v1, request.prompt_ids, result.token_ids)
        by_v2 = recompute(v2, request.prompt_ids, result.token_ids)
        assert gap(result.logprobs[:5], by_v1[:5]) < TOLERANCE
        assert gap(result.logprobs[5:], by_v2[5:]) < TOLERANCE
        assert gap(result.logprobs[5:], by_v1[5:]) > 100 * TOLERANCE  # the versions differ: the check can fail
        # ART's field, as the server puts it on the choice
        art_spans = policy_token_spans_json(result)
        assert [(s["start_token"], s["end_token"], s["policy_version"]) for s in art_spans] == [(0, 5, 1), (5, 16, 2)]
        assert set(art_spans[0]) == {"start_token", "end_token", "generation_id", "policy_version", "lora_slot",
                                     "update_seq"}


def test_a_grammar_held_row_spanning_a_swap_records_each_versions_raw_logprobs(
        setup: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    """A reply held to a JSON schema (what a forced tool call is) keeps its grammar across the swap, and each
    span's logprobs are its version's raw (unmasked) logprobs, as without a grammar."""
    import json

    from artrl.serve.structured import StructuredOutput

    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    schema = {"type": "object", "properties": {"guess": {"type": "string", "maxLength": 40}}, "required": ["guess"]}
    engine = TransformersEngine(model, tokenizer, end_ids=frozenset({tokenizer.eos_token_id}), in_flight_updates=True)
    request = GenerationRequest(prompt_ids=prompt_of(tokenizer, "guess a word"), n=2, max_tokens=40, seed=3,
                                structured=StructuredOutput(kind="json_schema", schema=schema))
    results = swap_during(engine, request, paths, 4, loop)
    v1, v2 = reference(setup, 1), reference(setup, 2)
    for result in results:
        assert [(a, v) for a, _, v, _ in result.policy_token_spans] == [(0, 1), (4, 2)]
        cut = result.policy_token_spans[0][1]
        assert gap(result.logprobs[:cut], recompute(v1, request.prompt_ids, result.token_ids)[:cut]) < TOLERANCE
        assert gap(result.logprobs[cut:], recompute(v2, request.prompt_ids, result.token_ids)[cut:]) < TOLERANCE
        text = tokenizer.decode([t for t in result.token_ids if t != tokenizer.eos_token_id])
        assert text.startswith('{"guess"'), text  # the grammar holds the reply from its first token
        if result.finish_reason == "stop":
            assert isinstance(json.loads(text)["guess"], str)  # and across the swap to its end


def test_a_waiting_row_of_the_request_takes_the_new_version_from_its_first_token(
        setup: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    """n=3 with room for 2 rows: the third waits holding version 1, and moves to version 2 before it starts."""
    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(model, tokenizer, max_batch_size=2, end_ids=frozenset(), in_flight_updates=True)
    request = GenerationRequest(prompt_ids=prompt_of(tokenizer, "count to three"), n=3, max_tokens=6, seed=5)
    results = swap_during(engine, request, paths, 2, loop)
    assert [[(a, b, v) for a, b, v, _ in r.policy_token_spans] for r in results] == \
        [[(0, 2, 1), (2, 6, 2)]] * 2 + [[(0, 6, 2)]]
    assert results[2].policy_version == 2
    assert gap(results[2].logprobs, recompute(reference(setup, 2), request.prompt_ids, results[2].token_ids)) < \
        TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("static_cache", [False, True])
def test_on_a_gpu_merged_weights_and_graphs_follow_the_swap(setup: dict[str, Any], loop: asyncio.AbstractEventLoop,
                                                           static_cache: bool) -> None:
    """CUDA: single-adapter batches run merged weights (and, with the static cache, a captured graph); a swap
    must leave both for the new version's."""
    tokenizer, paths = setup["tokenizer"], setup["paths"]
    engine = TransformersEngine(_adapter(setup["cache"], 3).to("cuda"), tokenizer, end_ids=frozenset(),
                                in_flight_updates=True, merge_lora=True, static_cache=static_cache,
                                cuda_graphs=static_cache)
    request = GenerationRequest(prompt_ids=prompt_of(tokenizer, "tell me a story"), n=2, max_tokens=16, seed=7)
    results = swap_during(engine, request, paths, 5, loop, timeout=300)
    v1, v2 = reference(setup, 1), reference(setup, 2)
    for result in results:
        assert [(a, b, v) for a, b, v, _ in result.policy_token_spans] == [(0, 5, 1), (5, 16, 2)]
        by_v1 = recompute(v1, request.prompt_ids, result.token_ids)
        by_v2 = recompute(v2, request.prompt_ids, result.token_ids)
        assert gap(result.logprobs[:5], by_v1[:5]) < 1e-3 and gap(result.logprobs[5:], by_v2[5:]) < 1e-3
        assert gap(result.logprobs[5:], by_v1[5:]) > 1e-2


def test_a_seeded_row_draws_the_same_uniforms_across_the_swap(setup: dict[str, Any],
                                                              loop: asyncio.AbstractEventLoop) -> None:
    """The recomputed row keeps its sampling counter: a swap to the same weights changes no token."""
    model, tokenizer, paths = setup["model"], setup["tokenizer"], setup["paths"]
    request = GenerationRequest(prompt_ids=prompt_of(tokenizer, "a seeded row"), max_tokens=12, seed=3)
    engine = TransformersEngine(model, tokenizer, end_ids=frozenset(), in_flight_updates=True)
    try:
        engine.set_live_weights(paths[1], 1)
        alone = submit(loop, engine, request).result(120)[0]
        StepHook(engine, at=4, action=lambda: engine.set_live_weights(paths[1], 5))  # same weights, a new step
        swapped = submit(loop, engine, request).result(120)[0]
    finally:
        engine.close()
    assert swapped.token_ids == alone.token_ids and gap(swapped.logprobs, alone.logprobs) < TOLERANCE
    assert [(a, b, v) for a, b, v, _ in swapped.policy_token_spans] == [(0, 4, 1), (4, 12, 5)]


def test_by_default_a_running_row_keeps_its_version(setup: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    request, results, engine = _sample_across_a_swap(setup, loop, in_flight=False)
    result = results[0]
    assert result.policy_token_spans is None and policy_token_spans_json(result) is None
    assert result.policy_version == 1 and engine.rows_updated_in_flight == 0
    assert gap(result.logprobs, recompute(reference(setup, 1), request.prompt_ids, result.token_ids)) < TOLERANCE


def test_a_stop_string_cuts_the_spans_with_the_tokens(setup: dict[str, Any]) -> None:
    from artrl.serve.http.core import _cut_at_stop
    from artrl.serve.engines.base import GenerationResult

    tokenizer = setup["tokenizer"]
    ids = prompt_of(tokenizer, "one two three STOP four five six seven")
    spans = [(0, 2, 1, "a"), (2, len(ids) - 2, 2, "b"), (len(ids) - 2, len(ids), 3, "c")]
    result = GenerationResult(ids, [-1.0] * len(ids), None, "length", policy_version=1, policy_token_spans=spans)
    text, cut = _cut_at_stop(tokenizer, result, tokenizer.decode(ids), ["STOP"])
    keep = len(cut.token_ids)
    assert 2 < keep < len(ids) - 2
    assert cut.policy_token_spans == [(0, 2, 1, "a"), (2, keep, 2, "b")]


# ---- where the mode is refused -------------------------------------------------------------------------------


def test_in_flight_lora_is_accepted_for_the_built_in_engine_and_refused_for_vllm():
    in_flight = art.dev.InternalModelConfig(rollout_weight_update_mode="in_flight_lora")
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", _internal_config=in_flight)
    assert model.name == "m"
    for refused in ({"inference_engine": "vllm"}, {"inference_replicas": 2},
                    {"inference_endpoints": ["http://h:8000"]}):
        with pytest.raises(ConfigError, match="rollout_weight_update_mode='in_flight_lora' is not supported with"):
            art.TrainableModel(name="m", project="p", base_model="artrl/tiny", _internal_config=art.dev.
                               InternalModelConfig(rollout_weight_update_mode="in_flight_lora", **refused))


def test_the_vllm_engine_refuses_in_flight_updates_before_it_starts():
    pytest.importorskip("vllm")
    from artrl.serve.engines.vllm_engine import VLLMEngine
    from artrl.config.model import InternalModelConfig

    cfg = InternalModelConfig(rollout_weight_update_mode="in_flight_lora")
    with pytest.raises(ConfigError, match="not supported by the vLLM engine"):
        VLLMEngine(tokenizer=None, end_ids=frozenset(), cfg=cfg, base_model_path="/nonexistent")


def test_a_mixture_of_experts_engine_refuses_in_flight_updates():
    from artrl.models.loading import load_model

    model, tokenizer = load_model("artrl/tiny-moe", art.InternalModelConfig())
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        TransformersEngine(model, tokenizer, in_flight_updates=True)


# ---- through the local backend: the record, the trainer, the staleness figures ----------------------------------


def test_a_rollout_spanning_a_train_call_trains_on_each_tokens_own_version(tmp_path):
    """A rollout is held at its 5th decode step while a train call writes step 1; the rollout's choices then
    carry two spans, each span's logprobs are its checkpoint's, the next train call's sampled-logprob delta is
    at float tolerance, and the staleness figures count each token's own version."""
    import json
    import threading

    from artrl.pipeline_trainer.options import score_metrics

    messages = [{"role": "user", "content": "Tell me a story."}]

    async def main() -> None:
        model = art.TrainableModel(name="inflight", project="p", base_model="artrl/tiny", _internal_config=art.
                                   InternalModelConfig(rollout_weight_update_mode="in_flight_lora"))
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            client = model.openai_client()
            async with backend.adapter_lease(model, 0):
                assert model.get_inference_name() == model.name  # the live weights, not name@0

            async def sample(seed: int) -> Any:
                return await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                            n=2, max_tokens=16, temperature=1.0, seed=seed)

            warm = (await sample(1)).choices
            warm_group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*messages, c], reward=float(k))
                                              for k, c in enumerate(warm)])
            engine = backend._runs[model.name].engine
            held, queued = threading.Event(), threading.Event()
            original_put = engine._queue.put

            def put(item: Any, *args: Any, **kwargs: Any) -> None:
                original_put(item, *args, **kwargs)
                if type(item).__name__ == "EngineTask":
                    queued.set()

            engine._queue.put = put

            def hold() -> None:  # on the decode worker, before step 5: until step 1's load is queued behind it
                held.set()
                assert queued.wait(300), "the train call never handed its checkpoint to the engine"

            StepHook(engine, at=5, action=hold)
            spanning = asyncio.create_task(sample(2))
            assert await asyncio.to_thread(held.wait, 300)
            await model.train([warm_group], config=art.TrainConfig(learning_rate=FIRST_STEP_LR))
            choices = (await spanning).choices
            engine._step = engine._step.original
            assert engine.rows_updated_in_flight == 2
            for choice in choices:
                spans = choice.model_extra["policy_token_spans"]
                n = len(choice.model_extra["token_ids"])
                assert [(s["start_token"], s["end_token"], s["policy_version"]) for s in spans] == \
                    [(0, 5, 0), (5, n, 1)], spans
                assert choice.model_extra["policy_version"] == 0
                prompt, ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
                record = [c.logprob for c in choice.logprobs.content]
                by = {v: recompute(PeftModel.from_pretrained(load_tiny()[0], backend._checkpoint_path(model.name, v))
                                   .eval(), prompt, ids) for v in (0, 1)}
                assert gap(record[:5], by[0][:5]) < RECORD_TOLERANCE and gap(record[5:], by[1][5:]) < RECORD_TOLERANCE
                assert gap(record[5:], by[0][5:]) > 2.5 * RECORD_TOLERANCE  # the versions differ: this can fail
            group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*messages, c], reward=float(k),
                                                        initial_policy_version=0)
                                         for k, c in enumerate(choices)])
            json.dumps(group.model_dump(mode="json"))  # the spans travel with the trajectory
            # staleness per token, trained from step 1: the 5 tokens of version 0 are 1 step old, the rest 0
            total = sum(len(c.model_extra["token_ids"]) for c in choices)
            figures = score_metrics(1, [group], step_seconds=1.0, result_metrics={}, reference_groups=None,
                                    reference_rollouts=None)
            assert figures["offpolicy/token_weighted_policy_age_steps"] == pytest.approx(10 / total)
            result = await model.train([group], config=art.TrainConfig(learning_rate=1e-4))
            assert result.metrics["train/sampled_logprob_tokens"] == total
            assert result.metrics["train/sampled_logprob_delta_max"] < 1e-3, result.metrics

    asyncio.run(main())
