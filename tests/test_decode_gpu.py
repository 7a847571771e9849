"""The built-in engine's GPU switches give what the plain path gives (needs CUDA; skipped without it).

`random:qwen3-0.6b` (the real shape, random weights, no download) with a LoRA adapter whose B
matrices are non-zero, so the adapter changes every logit. In float32 the switches (merged
LoRA, sdpa decode attention) change rounding only, so the sampled tokens are the same and
the logprobs agree to float tolerance; in bfloat16 each switch's logprobs still match an
unbatched forward of what it sampled to bfloat16 tolerance.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace as dataclass_replace
from typing import Any

import pytest
import torch

from artrl.serve import GenerationRequest, TransformersEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODEL = "random:qwen3-0.6b"


def _model(dtype: str) -> tuple[Any, Any]:
    from artrl.models.loading import add_lora, load_base_model
    from artrl.config.model import InternalModelConfig

    cfg = InternalModelConfig(device="cuda", dtype=dtype)
    model, tokenizer = load_base_model(MODEL, cfg)
    model = add_lora(model, cfg)
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator, device="cuda", dtype=p.dtype) * 0.02)
    return model.eval(), tokenizer


def _requests(tokenizer: Any) -> list[GenerationRequest]:
    prompts = ["Tell me about the weather.", "What is 2 + 3?", "Name three colours, please, in order."]
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    return [GenerationRequest(prompt_ids=ids[0], max_tokens=12, temperature=0.0),
            GenerationRequest(prompt_ids=ids[1], n=3, max_tokens=12, temperature=1.0, seed=7),
            GenerationRequest(prompt_ids=ids[2], max_tokens=12, temperature=0.8, top_p=0.9, seed=8)]


def _serve(model: Any, tokenizer: Any, *, merge_lora: bool, attn: str | None, **switches: Any) -> list[list[Any]]:
    engine = TransformersEngine(model, tokenizer, merge_lora=merge_lora, attn_implementation=attn,
                                end_ids=frozenset(), **switches)

    async def all_at_once() -> list[list[Any]]:
        return list(await asyncio.gather(*(engine.generate(r) for r in _requests(tokenizer))))

    try:
        return asyncio.run(all_at_once())
    finally:
        engine.close()


def _recompute(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0].float().log_softmax(-1)  # [seq, vocab]
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens), device="cuda")
    return logprobs[positions, torch.tensor(tokens, device="cuda")].tolist()


@pytest.fixture(scope="module")
def fp32() -> tuple[Any, Any]:
    return _model("float32")


@pytest.mark.parametrize(("merge_lora", "attn", "switches"), [
    (True, None, {}), (False, "sdpa", {}), (True, "sdpa", {}),
    (True, "sdpa", {"static_cache": True, "cuda_graphs": False, "static_cache_len": 256}),
    (True, "sdpa", {"static_cache": True, "cuda_graphs": True, "static_cache_len": 256}),
    (False, "sdpa", {"static_cache": True, "cuda_graphs": True, "static_cache_len": 256}),
])
def test_switches_sample_what_the_plain_path_samples(fp32: tuple[Any, Any], merge_lora: bool,
                                                     attn: str | None, switches: dict[str, Any]) -> None:
    model, tokenizer = fp32
    plain = _serve(model, tokenizer, merge_lora=False, attn=None)
    switched = _serve(model, tokenizer, merge_lora=merge_lora, attn=attn, **switches)
    for a, b in zip(itertools.chain(*plain), itertools.chain(*switched)):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def test_bf16_switches_report_the_logprobs_of_what_they_sampled() -> None:
    model, tokenizer = _model("bfloat16")
    results = _serve(model, tokenizer, merge_lora=True, attn="sdpa", static_cache=True, cuda_graphs=True)
    for request, sequences in zip(_requests(tokenizer), results):
        for result in sequences:
            expected = _recompute(model, request.prompt_ids, result.token_ids)
            assert max(abs(a - b) for a, b in zip(result.logprobs, expected)) < 0.1
    # the trainer's tensors are its own again
    assert not any(getattr(m, "merged_adapters", []) for m in model.modules())


def test_versions_in_mixed_batches_sample_alike_with_every_switch(fp32: tuple[Any, Any], tmp_path: Any) -> None:
    """A serving copy holding two policy versions and the base: each request alone and all in one mixed batch,
    plain and with merged LoRA + static slots + CUDA graphs, sample the same; the trainer's tensors stay."""
    from artrl.serve.engines.base import BASE_WEIGHTS

    model, tokenizer = fp32
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    paths = []
    for step in (1, 2):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.5)
        paths.append(str(tmp_path / f"{step:04d}"))
        model.save_pretrained(paths[-1])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(before[name])
    requests = [dataclass_replace(r, adapter=a) for r, a in zip(_requests(tokenizer), ["m@1", None, BASE_WEIGHTS])]

    def serve(**switches: Any) -> tuple[list[list[Any]], list[list[Any]]]:
        engine = TransformersEngine(model, tokenizer, end_ids=frozenset(), serve_copy=True, **switches)
        try:
            engine.set_live_weights(paths[0], 1)
            engine.load_adapter("m@1", paths[0])
            engine.set_live_weights(paths[1], 2)
            alone = [asyncio.run(engine.generate(r)) for r in requests]

            async def together() -> list[list[Any]]:
                return list(await asyncio.gather(*(engine.generate(r) for r in requests)))

            return alone, asyncio.run(together())
        finally:
            engine.close()

    plain_alone, plain_mixed = serve(merge_lora=False, attn_implementation="sdpa")
    fast_alone, fast_mixed = serve(merge_lora=True, attn_implementation="sdpa", static_cache=True,
                                   cuda_graphs=True, static_cache_len=256)
    for run in (plain_mixed, fast_alone, fast_mixed):
        for a, b in zip(itertools.chain(*plain_alone), itertools.chain(*run)):
            assert a.token_ids == b.token_ids and a.policy_version == b.policy_version
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
    assert [r[0].policy_version for r in plain_mixed] == [1, 2, None]
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
