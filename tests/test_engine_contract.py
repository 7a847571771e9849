"""The inference engine contract (serve/engines/base.py), checked on every engine.

Each engine is opened by a factory in `ENGINE_FACTORIES` on the tiny model (its
live weights start as the base model's) with the end-of-turn ids the test hands
it. Engines that run a model ("sampling" ones) are held to the whole contract:
raw logprobs (a plain transformers forward over the same ids, before temperature
and top-p), the end-of-turn token kept in the sampled ids, the stop-string rule,
`n`, seeds, the request check, and `set_live_weights` making a checkpoint the
weights that `adapter=None` serves. The scripted engine, which samples nothing,
is held to what applies to it (the check, `n`, the end-of-turn rule on what it
returns). Another engine joins by adding its factory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from artrl.chat.format import end_of_turn_ids
from artrl.serve.engines.base import (BASE_WEIGHTS, MAX_TOP_LOGPROBS, GenerationRequest, GenerationResult,
                                      InferenceEngine)
from artrl.serve.errors import InvalidRequestError
from artrl.serve.engines.factory import open_engine
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.config.model import InternalModelConfig

TOLERANCE = 1e-4
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
PROMPTS = ["Tell me a story about a cat.", "What colour is the sky?", "List three fruits please.", "Hello there!"]
MAX_MODEL_LEN = 512


@dataclasses.dataclass
class EngineCase:
    engine: InferenceEngine
    samples: bool  # runs a model: logprobs, seeds, stop strings and live weights apply
    script: Callable[[list[int]], None] | None = None  # a scripted engine: what it answers next


# (tiny model directory, end-of-turn ids) -> an engine serving that model, its context MAX_MODEL_LEN tokens
EngineFactory = Callable[[pathlib.Path, frozenset[int]], EngineCase]


def _base(tiny_path: pathlib.Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32).eval()


def open_builtin(tiny_path: pathlib.Path, end_ids: frozenset[int]) -> EngineCase:
    """The built-in engine as a worker session opens it: a peft model of its own, no trainer on it."""
    from artrl.models.tokenizer import load_tokenizer

    model = get_peft_model(_base(tiny_path), LORA)  # fresh LoRA: serves the base model's weights
    cfg = InternalModelConfig(inference_max_batch_size=8, inference_max_length=MAX_MODEL_LEN)
    engine = open_engine("builtin", tokenizer=load_tokenizer(str(tiny_path)), end_ids=end_ids, cfg=cfg, model=model)
    return EngineCase(engine, samples=True)


def open_builtin_static(tiny_path: pathlib.Path, end_ids: frozenset[int]) -> EngineCase:
    """The built-in engine decoding in static cache slots (the GPU switch, run eagerly here), merged LoRA on."""
    from artrl.models.tokenizer import load_tokenizer

    model = get_peft_model(_base(tiny_path), LORA)
    cfg = InternalModelConfig(inference_max_batch_size=8, inference_max_length=MAX_MODEL_LEN,
                              inference_static_cache=True, inference_static_cache_len=256, inference_merge_lora=True)
    engine = open_engine("builtin", tokenizer=load_tokenizer(str(tiny_path)), end_ids=end_ids, cfg=cfg, model=model)
    return EngineCase(engine, samples=True)


def open_scripted(tiny_path: pathlib.Path, end_ids: frozenset[int]) -> EngineCase:
    from artrl.models.tokenizer import load_tokenizer

    engine = ScriptedEngine(load_tokenizer(str(tiny_path)), end_ids, max_model_len=MAX_MODEL_LEN)

    def script(ids: list[int]) -> None:
        engine.next = (ids, [-1.0] * len(ids))

    return EngineCase(engine, samples=False, script=script)


def open_vllm(tiny_path: pathlib.Path, end_ids: frozenset[int]) -> EngineCase:
    """vLLM (its CPU build here) on the tiny model's directory; runs where vLLM is installed (marker `vllm`)."""
    from artrl.models.tokenizer import load_tokenizer

    cfg = InternalModelConfig(inference_max_length=MAX_MODEL_LEN, lora_rank=LORA.r)
    engine = open_engine("vllm", tokenizer=load_tokenizer(str(tiny_path)), end_ids=end_ids, cfg=cfg,
                         base_model_path=str(tiny_path))
    return EngineCase(engine, samples=True)


ENGINE_FACTORIES: dict[str, EngineFactory] = {"builtin": open_builtin, "builtin-static": open_builtin_static,
                                               "scripted": open_scripted, "vllm": open_vllm}
#: Engines that need an optional install, with the marker that runs them where it is.
NEEDS = {"vllm": pytest.mark.vllm}
ENGINES = [pytest.param(name, marks=NEEDS[name]) if name in NEEDS else name for name in sorted(ENGINE_FACTORIES)]


# ---- references, computed without any engine ------------------------------------------


@pytest.fixture(scope="module")
def reference_models(tiny_path: pathlib.Path) -> dict[str | None, Any]:
    """Plain transformers forwards: the base model (None) and, once made, checkpoint adapters by path."""
    return {None: _base(tiny_path)}


def raw_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] log_softmax of the raw logits that predicted each token (one unbatched forward)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [seq, vocab]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].log_softmax(-1)


def chosen(logprobs: torch.Tensor, tokens: list[int]) -> list[float]:
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def prompts(tok: Any) -> list[list[int]]:
    return [tok(text, add_special_tokens=False).input_ids for text in PROMPTS]


@pytest.fixture(scope="module")
def stop_plan(reference_models: dict[str | None, Any], prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """(prompt, greedy continuation) and an extra end-of-turn id: the continuation's third token, which the
    first two are not, so a greedy request must stop right after it."""
    for prompt in prompts:
        cont = greedy(reference_models[None], prompt, 8)
        if cont[2] not in cont[:2]:
            return prompt, cont
    raise AssertionError("no prompt's greedy continuation has a fresh third token")


def _default_end_ids(tok: Any, tiny_path: pathlib.Path) -> frozenset[int]:
    return end_of_turn_ids(tok, _base(tiny_path))


@pytest.fixture(scope="module", params=ENGINES)
def case(request: pytest.FixtureRequest, tiny_path: pathlib.Path, tok: Any,
         stop_plan: tuple[list[int], list[int]]) -> Iterator[EngineCase]:
    """One engine per factory; the greedy plan's third token is among its end-of-turn ids."""
    ends = _default_end_ids(tok, tiny_path) | {stop_plan[1][2]}
    opened = ENGINE_FACTORIES[request.param](tiny_path, ends)
    yield opened
    opened.engine.close()


def run(engine: InferenceEngine, request: GenerationRequest) -> list[GenerationResult]:
    return asyncio.run(engine.generate(request))


def needs_sampling(case: EngineCase) -> None:
    if not case.samples:
        pytest.skip("the scripted engine samples nothing (it returns what it is told to)")


# ---- the contract -----------------------------------------------------------------------


def test_logprobs_are_raw_taken_before_temperature_and_top_p(
        case: EngineCase, prompts: list[list[int]], reference_models: dict[str | None, Any]) -> None:
    needs_sampling(case)
    temperature, top_p = 0.7, 0.5
    worst, processed_gap = 0.0, 0.0
    for i, prompt in enumerate(prompts):
        (result,) = run(case.engine, GenerationRequest(prompt, max_tokens=6, temperature=temperature, top_p=top_p,
                                                       seed=i))
        assert len(result.token_ids) == len(result.logprobs) > 0
        raw = raw_logprobs(reference_models[None], prompt, result.token_ids)  # [tokens, vocab]
        expected = chosen(raw, result.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(result.logprobs, expected)))
        # what an engine reporting the sampling distribution would return instead
        probs = (raw / temperature).softmax(-1)
        ordered, order = probs.sort(-1, descending=True)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (ordered.cumsum(-1) - ordered) >= top_p)
        processed = chosen((probs.masked_fill(drop, 0) / probs.masked_fill(drop, 0).sum(-1, keepdim=True)).log(),
                           result.token_ids)
        processed_gap = max(processed_gap, max(abs(a - b) for a, b in zip(processed, expected)))
    assert worst < TOLERANCE
    assert processed_gap > 100 * TOLERANCE  # the test tells raw from processed logprobs apart


def test_end_of_turn_token_ends_the_sequence_and_is_included(
        case: EngineCase, stop_plan: tuple[list[int], list[int]]) -> None:
    prompt, cont = stop_plan
    if case.script is not None:
        case.script(cont[:3])
    (result,) = run(case.engine, GenerationRequest(prompt, max_tokens=8, temperature=0.0))
    assert result.token_ids == cont[:3] and result.finish_reason == "stop"
    assert result.token_ids[-1] in case.engine.end_of_turn_ids
    if case.script is not None:
        case.script(cont[:2])
    (cut,) = run(case.engine, GenerationRequest(prompt, max_tokens=2, temperature=0.0))
    assert cut.token_ids == cont[:2] and cut.finish_reason == "length"


def test_stop_token_ids_of_a_request_end_it_like_end_of_turn_ids(
        case: EngineCase, stop_plan: tuple[list[int], list[int]]) -> None:
    needs_sampling(case)
    prompt, cont = stop_plan
    (result,) = run(case.engine, GenerationRequest(prompt, max_tokens=8, temperature=0.0,
                                                   stop_token_ids=[cont[1]]))
    assert result.token_ids == cont[:2] and result.finish_reason == "stop"


def test_a_stop_string_ends_with_the_token_that_completes_it(
        case: EngineCase, tok: Any, prompts: list[list[int]], reference_models: dict[str | None, Any]) -> None:
    needs_sampling(case)
    plan = None
    for prompt in prompts:
        cont = greedy(reference_models[None], prompt, 8)
        for k in range(2, 8):  # a character the k-th token adds to the text, new to it
            before, text = tok.decode(cont[: k - 1]), tok.decode(cont[:k])
            added = text[len(before):]
            if text.startswith(before) and added.strip() and "\ufffd" not in added and added[-1] not in before:
                plan = (prompt, cont[:k], added[-1])
                break
        if plan:
            break
    assert plan is not None, "no greedy continuation adds a fresh character"
    prompt, expected, stop = plan
    (result,) = run(case.engine, GenerationRequest(prompt, max_tokens=8, temperature=0.0, stop_strings=[stop]))
    assert result.token_ids == expected and result.finish_reason == "stop"


def test_n_sequences_come_back_in_order_and_differ(case: EngineCase, prompts: list[list[int]]) -> None:
    if case.script is not None:
        case.script([5, 6, 7])
    results = run(case.engine, GenerationRequest(prompts[0], n=4, max_tokens=8, seed=3))
    assert len(results) == 4
    assert all(len(r.token_ids) == len(r.logprobs) for r in results)
    if case.samples:
        assert len({tuple(r.token_ids) for r in results}) > 1  # each sample draws on its own


def test_an_engine_that_streams_hands_over_every_token_before_it_answers(
        case: EngineCase, prompts: list[list[int]]) -> None:
    """Point 8: on_token sees each sample's tokens, logprobs and top logprobs, in order, all before `generate`
    returns; and they are the tokens of the same request sampled without it."""
    if not case.engine.streams_tokens:
        pytest.skip(f"{type(case.engine).__name__} hands no tokens over (it streams from the finished reply)")
    request = GenerationRequest(prompts[0], n=3, max_tokens=8, seed=7, top_logprobs=2)
    events: list[tuple[int, int, float, Any]] = []

    async def generate() -> tuple[list[GenerationResult], int]:
        results = await case.engine.generate(request, on_token=lambda *event: events.append(event))
        return results, len(events)

    results, seen = asyncio.run(generate())
    assert seen == len(events) == sum(len(r.token_ids) for r in results)
    for sample, result in enumerate(results):
        mine = [e[1:] for e in events if e[0] == sample]
        assert [(t, lp, top) for t, lp, top in mine] == list(zip(result.token_ids, result.logprobs,
                                                                 result.top_logprobs or []))
    assert [r.token_ids for r in run(case.engine, request)] == [r.token_ids for r in results]


def test_a_seed_reproduces_its_samples(case: EngineCase, prompts: list[list[int]]) -> None:
    needs_sampling(case)
    request = GenerationRequest(prompts[1], n=2, max_tokens=8, seed=11, top_logprobs=2)
    first, again = run(case.engine, request), run(case.engine, request)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    other = run(case.engine, dataclasses.replace(request, seed=12))
    assert [r.token_ids for r in other] != [r.token_ids for r in first]
    for result in first:
        assert result.top_logprobs is not None and len(result.top_logprobs) == len(result.token_ids)
        assert all(len(top) == 2 and top[0][1] >= top[1][1] for top in result.top_logprobs)


BAD_REQUESTS = [
    ({"prompt_ids": []}, "prompt_ids"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs"),
    ({"adapter": "never-loaded"}, "adapter"),
]


@pytest.mark.parametrize(("change", "field"), BAD_REQUESTS)
def test_generate_refuses_what_check_refuses(case: EngineCase, change: dict[str, Any], field: str) -> None:
    request = dataclasses.replace(GenerationRequest([5, 6, 7], max_tokens=4), **change)
    with pytest.raises(InvalidRequestError) as info:
        run(case.engine, request)
    assert [p.field for p in info.value.problems] == [field]


def test_prompt_ids_must_lie_in_the_vocabulary(case: EngineCase) -> None:
    vocab = case.engine.vocab_size
    if case.script is not None:
        case.script([5])
    assert run(case.engine, GenerationRequest([vocab - 1], max_tokens=1, temperature=0.0))
    for bad in (vocab, -1):
        with pytest.raises(InvalidRequestError, match=rf"prompt token id {bad} is outside the vocabulary"):
            run(case.engine, GenerationRequest([5, bad], max_tokens=1))


def test_the_base_weights_are_always_servable(case: EngineCase, prompts: list[list[int]],
                                              reference_models: dict[str | None, Any]) -> None:
    needs_sampling(case)
    assert case.engine.has_adapter(BASE_WEIGHTS)
    (result,) = run(case.engine, GenerationRequest(prompts[3], max_tokens=4, temperature=0.0, adapter=BASE_WEIGHTS))
    expected = chosen(raw_logprobs(reference_models[None], prompts[3], result.token_ids), result.token_ids)
    assert max(abs(a - b) for a, b in zip(result.logprobs, expected)) < TOLERANCE


@pytest.mark.parametrize("engine_name", ENGINES)
def test_live_weights_follow_the_checkpoint(
        engine_name: str, tiny_path: pathlib.Path, tok: Any, tmp_path: pathlib.Path, prompts: list[list[int]],
        reference_models: dict[str | None, Any]) -> None:
    """After `set_live_weights(path, step)`, `adapter=None` samples from that checkpoint (every sampling engine)."""
    torch.manual_seed(1)
    trained = get_peft_model(_base(tiny_path), dataclasses.replace(LORA, init_lora_weights=False))
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_" in name:
                p.mul_(8.0)  # make the adapter change the logits clearly
    path = tmp_path / "0001"
    trained.save_pretrained(path)
    checkpoint = PeftModel.from_pretrained(_base(tiny_path), path).eval()
    ends = _default_end_ids(tok, tiny_path)
    opened = ENGINE_FACTORIES[engine_name](tiny_path, ends)
    name = engine_name
    try:
        if not opened.samples:
            pytest.skip(f"the {name} engine samples nothing")
        request = GenerationRequest(prompts[2], max_tokens=6, temperature=0.0)
        (before,) = run(opened.engine, request)
        assert max(abs(a - b) for a, b in zip(
            before.logprobs, chosen(raw_logprobs(reference_models[None], prompts[2], before.token_ids),
                                    before.token_ids))) < TOLERANCE, name
        opened.engine.set_live_weights(str(path), 1)
        (after,) = run(opened.engine, request)
        expected = chosen(raw_logprobs(checkpoint, prompts[2], after.token_ids), after.token_ids)
        assert max(abs(a - b) for a, b in zip(after.logprobs, expected)) < TOLERANCE, name
        assert after.token_ids == greedy(checkpoint, prompts[2], len(after.token_ids)), name
        base = chosen(raw_logprobs(reference_models[None], prompts[2], after.token_ids), after.token_ids)
        assert max(abs(a - b) for a, b in zip(after.logprobs, base)) > 100 * TOLERANCE, name
    finally:
        opened.engine.close()


# ---- the one request check, without an engine -------------------------------------------


def test_check_lists_every_problem_with_its_field() -> None:
    request = GenerationRequest([1, 99], n=0, max_tokens=4, temperature=-1.0, top_p=0.0, adapter="x")
    with pytest.raises(InvalidRequestError) as info:
        request.check(vocab_size=50, max_model_len=100, has_adapter=lambda name: False)
    assert [p.field for p in info.value.problems] == ["prompt_ids", "n", "temperature", "top_p", "adapter"]
    assert all(p.message in str(info.value) for p in info.value.problems)


def test_check_bounds_prompt_plus_completion_by_the_context() -> None:
    ok = dict(vocab_size=50, has_adapter=lambda name: True)
    GenerationRequest([1] * 10, max_tokens=90).check(max_model_len=100, **ok)
    with pytest.raises(InvalidRequestError, match="the prompt has 10 tokens and max_tokens=91 asks for more than "
                                                  "the 90 left"):
        GenerationRequest([1] * 10, max_tokens=91).check(max_model_len=100, **ok)
    with pytest.raises(InvalidRequestError, match="leaves no room to generate") as info:
        GenerationRequest([1] * 100, max_tokens=1).check(max_model_len=100, **ok)
    assert [p.field for p in info.value.problems] == ["prompt_ids"]
