"""The built-in engine's decode loop: rows joining a running batch, leaving it early, device sampling, merged LoRA.

The tiny model with a non-zero LoRA adapter, driven through `TransformersEngine.generate`
from an event loop on a thread of its own, so the test can pause the decode worker at a
step boundary (a forward hook waiting on an event) and queue a request exactly then.
"""

from __future__ import annotations

import asyncio
import pathlib
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear

from artrl.serve import GenerationRequest, TransformersEngine
from artrl.serve.engines.sampling import row_key, row_uniforms, sample_next_tokens
from artrl.models.tiny import load_tiny
from engine_helpers import prompt_of, recompute, submit

TOLERANCE = 1e-4
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
                  init_lora_weights=False)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> tuple[PeftModel, Any]:
    """The tiny model with a LoRA adapter that clearly changes its logits."""
    base, tokenizer = load_tiny(tmp_path_factory.mktemp("tiny-cache"))
    torch.manual_seed(3)
    model = get_peft_model(base, LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return model.eval(), tokenizer


def assert_exact(model: Any, prompt: list[int], results: list[Any]) -> None:
    for result in results:
        expected = recompute(model, prompt, result.token_ids)
        assert max(abs(a - b) for a, b in zip(result.logprobs, expected)) < TOLERANCE


class PauseAt:
    """A forward hook that holds the decode worker before its `at`-th forward until `resume` is set."""

    def __init__(self, model: Any, at: int) -> None:
        self.calls, self.at = 0, at
        self.shapes: list[tuple[int, int]] = []  # [rows, tokens] of every forward's input_ids
        self.paused, self.resume = threading.Event(), threading.Event()
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        self.calls += 1
        self.shapes.append(tuple(kwargs["input_ids"].shape))
        if self.calls == self.at:
            self.paused.set()
            assert self.resume.wait(120), "the test never resumed the worker"

    def remove(self) -> None:
        self.handle.remove()


def test_a_request_joins_a_running_batch_leaves_it_early_and_samples_what_it_samples_alone(
        live: tuple[PeftModel, Any], loop: asyncio.AbstractEventLoop) -> None:
    model, tokenizer = live
    # no end-of-turn ids: the long row really runs to max_tokens
    engine = TransformersEngine(model, tokenizer, max_batch_size=8, end_ids=frozenset())
    long = GenerationRequest(prompt_ids=prompt_of(tokenizer, "a long story about the sea and the sky"),
                             max_tokens=60, temperature=1.0, seed=5)
    short = GenerationRequest(prompt_ids=prompt_of(tokenizer, "hi"), n=2, max_tokens=5, temperature=0.8,
                              top_p=0.9, seed=9, top_logprobs=2)
    try:
        alone_long = submit(loop, engine, long).result(120)
        alone_short = submit(loop, engine, short).result(120)
        batches = engine.batches_served

        pause = PauseAt(model, at=4)  # the prefill, then three decode forwards
        try:
            running = submit(loop, engine, long)
            assert pause.paused.wait(120)
            steps_at_join = engine.decode_steps
            joined = submit(loop, engine, short)
            while engine.pending_requests < 1:  # queued while the worker sits at a step boundary
                threading.Event().wait(0.005)
            pause.resume.set()
            joined_short = joined.result(120)
            steps_when_short_done = engine.decode_steps
            joined_long = running.result(120)
        finally:
            pause.remove()
    finally:
        engine.close()

    # after the pause, the newcomers' prefill (2 rows sharing one prompt: 1 row), then decode steps of all three
    assert pause.shapes[3:5] == [(1, 1), (1, len(short.prompt_ids))], pause.shapes
    assert pause.shapes[5] == (3, 1), "the short request did not join the running batch"
    assert engine.batches_served <= batches + 1
    # it left as soon as its 5 tokens were sampled, long before the 60-token row ended
    assert steps_when_short_done - steps_at_join < 30
    assert len(joined_long[0].token_ids) == 60
    # the same tokens as alone (seeds are per row, whatever the batch), and exact logprobs
    assert [r.token_ids for r in joined_short] == [r.token_ids for r in alone_short]
    assert joined_long[0].token_ids == alone_long[0].token_ids
    assert joined_short[0].token_ids != joined_short[1].token_ids
    assert_exact(model, short.prompt_ids, joined_short)
    assert_exact(model, long.prompt_ids, joined_long)
    for a, b in zip(joined_short, alone_short):
        assert [[t for t, _ in step] for step in a.top_logprobs] == [[t for t, _ in step] for step in b.top_logprobs]


def test_rows_of_another_adapter_join_the_running_batch(
        live: tuple[PeftModel, Any], loop: asyncio.AbstractEventLoop, tmp_path: pathlib.Path) -> None:
    model, tokenizer = live
    torch.manual_seed(4)
    other = get_peft_model(load_tiny(tmp_path / "cache")[0], LORA)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    other.save_pretrained(tmp_path / "other")
    engine = TransformersEngine(model, tokenizer, max_batch_size=8, end_ids=frozenset())
    engine.load_adapter("other", str(tmp_path / "other"))
    prompt = prompt_of(tokenizer, "what colour is the sky")
    try:
        batches = engine.batches_served
        pause = PauseAt(model, at=3)
        try:
            live_rows = submit(loop, engine, GenerationRequest(prompt_ids=prompt, n=2, max_tokens=12, seed=1))
            assert pause.paused.wait(120)
            named = submit(loop, engine, GenerationRequest(prompt_ids=prompt, n=2, max_tokens=6, seed=2,
                                                           adapter="other"))
            more_live = submit(loop, engine, GenerationRequest(prompt_ids=prompt[1:], max_tokens=4, seed=3))
            while engine.pending_requests < 2:
                threading.Event().wait(0.005)
            pause.resume.set()
            live_results, named_results, more_results = (f.result(120) for f in (live_rows, named, more_live))
        finally:
            pause.remove()
    finally:
        engine.close()
    # the named adapter's rows and the later live request joined the running batch (one forward for both
    # adapters, peft's adapter_names), each row with its own adapter's logprobs
    assert engine.batches_served == batches + 1
    assert pause.shapes[3] == (2, len(prompt))  # the newcomers' prefill: the named request's prompt and the other
    assert pause.shapes[4] == (5, 1)  # then 2 + 2 + 1 rows decode together
    assert_exact(model, prompt, live_results)
    assert_exact(model, prompt[1:], more_results)
    reference = PeftModel.from_pretrained(load_tiny(tmp_path / "cache")[0], tmp_path / "other").eval()
    assert_exact(reference, prompt, named_results)


# ---- device sampling -------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6, unique=True), st.integers(1, 300),
       st.integers(0, 5))
def test_a_rows_draws_depend_on_its_key_and_step_only(keys: list[int], steps: int, row: int) -> None:
    row = row % len(keys)
    batch = row_uniforms(keys, steps)
    alone = row_uniforms([keys[row]], steps + 7)
    assert torch.equal(batch[row], alone[0, :steps])  # whatever the other rows, however many steps
    assert bool((batch > 0).all()) and bool((batch < 1).all())
    if steps > 1:
        assert len(set(batch[row].tolist())) > 1


def test_sampled_frequencies_follow_the_distribution_and_top_p() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    rows = 6000
    logits = probs.log().repeat(rows, 1)  # [rows, 5]
    uniform = row_uniforms([row_key(7, i) for i in range(rows)], 1)[:, 0]  # [rows]
    assert abs(float(uniform.mean()) - 0.5) < 0.02
    ones = torch.ones(rows)
    drawn = sample_next_tokens(logits, ones, ones, uniform, all_greedy=False, any_top_p=False)
    freq = torch.bincount(drawn, minlength=5).float() / rows
    assert torch.allclose(freq, probs, atol=0.02), freq
    nucleus = sample_next_tokens(logits, ones, torch.full((rows,), 0.7), uniform, all_greedy=False, any_top_p=True)
    freq = torch.bincount(nucleus, minlength=5).float() / rows
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 + 0.25 reaches 0.7: the rest is cut
    assert torch.allclose(freq, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]), atol=0.02), freq
    hot = sample_next_tokens(logits, torch.full((rows,), 2.0), ones, uniform, all_greedy=False, any_top_p=False)
    flat = torch.softmax(probs.log() / 2.0, dim=-1)
    assert torch.allclose(torch.bincount(hot, minlength=5).float() / rows, flat, atol=0.02)
    greedy = sample_next_tokens(logits, torch.zeros(rows), ones, uniform, all_greedy=False, any_top_p=False)
    assert set(greedy.tolist()) == {0}
    # a token of probability zero is never drawn, whatever the uniform
    masked = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf"), 0.0]]).repeat(rows, 1)
    assert set(sample_next_tokens(masked, ones, ones, uniform, all_greedy=False, any_top_p=False).tolist()) \
        == {0, 2, 4}


# ---- merged LoRA -----------------------------------------------------------------------------


def test_merged_lora_samples_the_same_and_leaves_the_trainers_tensors_alone(
        live: tuple[PeftModel, Any], loop: asyncio.AbstractEventLoop) -> None:
    model, tokenizer = live
    prompt = prompt_of(tokenizer, "tell me about the weather")
    request = GenerationRequest(prompt_ids=prompt, n=3, max_tokens=10, seed=21, top_logprobs=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    plain = TransformersEngine(model, tokenizer, merge_lora=False, end_ids=frozenset())
    merged = TransformersEngine(model, tokenizer, merge_lora=True, end_ids=frozenset())
    try:
        unmerged_results = submit(loop, plain, request).result(120)
        merged_results = submit(loop, merged, request).result(120)
        adapted = sum(1 for m in model.modules() if isinstance(m, LoraLinear))
        assert adapted > 0 and merged._merger is not None and merged._merger.layers_merged == adapted
        assert [r.token_ids for r in merged_results] == [r.token_ids for r in unmerged_results]
        for a, b in zip(merged_results, unmerged_results):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOLERANCE
        # a reply may arrive before the worker leaves its batch (and unmerges): under the engine's lock, as a
        # trainer sharing the model reads it, the batch is over
        with merged.model_lock:
            assert_exact(model, prompt, merged_results)
            # back to the trainer's own tensors, bit for bit, nothing left merged
            for name, p in model.named_parameters():
                assert torch.equal(p, before[name]), name
                assert p.requires_grad == grads[name]
            assert not any(getattr(m, "merged_adapters", []) for m in model.modules())

        # an optimizer-like in-place update of the adapter is served at the next request
        with merged.model_lock, torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.mul_(1.5)
        try:
            rebuilds = merged._merger.rebuilds
            updated = submit(loop, merged, request).result(120)
            assert merged._merger.rebuilds == rebuilds + adapted
            with merged.model_lock:
                assert_exact(model, prompt, updated)
            again = submit(loop, merged, request).result(120)
            assert merged._merger.rebuilds == rebuilds + adapted  # unchanged adapter: the merged copies are reused
            assert [r.token_ids for r in again] == [r.token_ids for r in updated]
        finally:
            with merged.model_lock, torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(before[name])
    finally:
        plain.close()
        merged.close()


def test_the_serving_attention_is_switched_in_for_a_batch_and_back(
        live: tuple[PeftModel, Any], loop: asyncio.AbstractEventLoop) -> None:
    from artrl.serve.engines.attention_switch import current_attention

    model, tokenizer = live
    trainer_attention = current_attention(model)
    seen: list[str | None] = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(current_attention(model)))
    request = GenerationRequest(prompt_ids=prompt_of(tokenizer, "a cat sat"), n=2, max_tokens=8, seed=4)
    own = TransformersEngine(model, tokenizer, end_ids=frozenset())
    eager = TransformersEngine(model, tokenizer, end_ids=frozenset(), attn_implementation="eager")
    try:
        reference = submit(loop, own, request).result(120)
        assert set(seen) == {trainer_attention} and trainer_attention != "eager"
        seen.clear()
        switched = submit(loop, eager, request).result(120)
        assert set(seen) == {"eager"}
    finally:
        handle.remove()
        own.close()
        eager.close()
    assert current_attention(model) == trainer_attention
    assert [r.token_ids for r in switched] == [r.token_ids for r in reference]
    assert_exact(model, request.prompt_ids, switched)


def test_static_cache_slots_sample_what_the_dynamic_cache_samples(
        live: tuple[PeftModel, Any], loop: asyncio.AbstractEventLoop) -> None:
    """The static-slot path (run eagerly on CPU) against the dynamic one: same tokens, exact logprobs, rows
    joining into free slots, and a row too long for a slot served by an ordinary batch."""
    model, tokenizer = live
    long_prompt = prompt_of(tokenizer, "the weather today is " * 12)
    requests = [GenerationRequest(prompt_ids=prompt_of(tokenizer, "hello there"), n=3, max_tokens=9, seed=31),
                GenerationRequest(prompt_ids=prompt_of(tokenizer, "name a colour"), max_tokens=4, seed=32,
                                  temperature=0.7, top_p=0.8, top_logprobs=3),
                GenerationRequest(prompt_ids=long_prompt, max_tokens=20, seed=33)]
    assert len(long_prompt) + 20 > 48  # does not fit a 48-column slot

    def serve(engine: TransformersEngine) -> list[list[Any]]:
        pause = PauseAt(model, at=3)  # the first request's batch, two steps in: the others join it
        try:
            first = submit(loop, engine, requests[0])
            assert pause.paused.wait(120)
            rest = [submit(loop, engine, r) for r in requests[1:]]
            while engine.pending_requests < 2:
                threading.Event().wait(0.005)
            pause.resume.set()
            return [f.result(120) for f in [first, *rest]]
        finally:
            pause.remove()

    dynamic = TransformersEngine(model, tokenizer, max_batch_size=4, end_ids=frozenset())
    static = TransformersEngine(model, tokenizer, max_batch_size=4, end_ids=frozenset(), static_cache=True,
                                static_cache_len=48)
    try:
        expected = serve(dynamic)
        batches = static.batches_served
        got = serve(static)
        assert static._static_step is not None and static.cuda_graphs is False
        assert static.batches_served == batches + 2  # the slots' batch, then the long row's own
    finally:
        dynamic.close()
        static.close()
    for request, mine, theirs in zip(requests, got, expected):
        assert [r.token_ids for r in mine] == [r.token_ids for r in theirs]
        assert_exact(model, request.prompt_ids, mine)
    with pytest.raises(ValueError, match="CUDA"):
        TransformersEngine(model, tokenizer, static_cache=True, cuda_graphs=True)


def test_a_model_left_in_train_mode_decodes_in_eval_mode_and_is_left_in_train_mode(
        tmp_path: pathlib.Path, loop: asyncio.AbstractEventLoop) -> None:
    """A trainer may leave the shared model in train mode: a batch runs without dropout (its logprobs are the
    eval-mode forward's) and hands the model back in the modes it found, module by module."""
    base, tokenizer = load_tiny(tmp_path)
    torch.manual_seed(5)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.5, init_lora_weights=False))
    model.train()
    modes = {name: module.training for name, module in model.named_modules()}
    assert all(modes.values())
    prompt = prompt_of(tokenizer, "what is the weather")
    engine = TransformersEngine(model, tokenizer, end_ids=frozenset(), shares_trainer_weights=True)
    try:
        results = submit(loop, engine, GenerationRequest(prompt_ids=prompt, max_tokens=6, seed=2)).result(120)
        with engine.model_lock:  # the worker restores the modes after answering
            assert {name: module.training for name, module in model.named_modules()} == modes
            model.eval()
            try:
                assert_exact(model, prompt, results)
            finally:
                model.train()
    finally:
        engine.close()


def test_a_model_the_engine_has_to_itself_stays_in_eval_mode_with_the_adapters_it_loads(
        tmp_path: pathlib.Path, loop: asyncio.AbstractEventLoop) -> None:
    """An engine that shares its model with no trainer does not walk it around every batch: the model is put in
    eval mode once, a version loaded later comes in eval (peft leaves a frozen adapter so), and
    a caller's `train()` is undone before the next batch. Each batch samples what the eval-mode forward gives."""
    base, tokenizer = load_tiny(tmp_path / "cache")
    torch.manual_seed(5)
    dropout = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.5,
                         init_lora_weights=False)
    model = get_peft_model(base, dropout)
    model.save_pretrained(tmp_path / "v1")
    model.train()
    prompt = prompt_of(tokenizer, "what is the weather")
    engine = TransformersEngine(model, tokenizer, end_ids=frozenset())
    try:
        assert not any(module.training for module in model.modules())
        engine.set_live_weights(str(tmp_path / "v1"), 1)
        assert not any(module.training for module in model.modules()), "a loaded version brought train mode"
        model.train()  # a caller's
        first = submit(loop, engine, GenerationRequest(prompt_ids=prompt, max_tokens=6, seed=2)).result(120)
        assert first[0].policy_version == 1
        with engine.model_lock:
            assert not any(module.training for module in model.modules())
            model.base_model.set_adapter(engine._versions.resolve(None)[0])
            assert_exact(model, prompt, first)
    finally:
        engine.close()
