"""4-bit base weights on a vision-language model and on a mixture-of-experts model (models/quantization.py).

Vision-language: only the language model's projections are 4-bit; the vision tower, its patch merger (the
projector into the language model) and the LM head stay in the model's dtype, LoRA sits on the language model,
and an RL call on image-bearing rollouts trains on exactly the served record. Mixture-of-experts: only the
attention projections are 4-bit (the fused experts and the routers are not nn.Linear layers, and stay in the
model's dtype, which the load says); the routing record is replayed as in full precision.
4-bit computes in float32 here, so the token record holds the 4-bit text model's tolerance (tests/model_kinds.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch

import artrl as art
from artrl.models import moe
from artrl.models.loading import load_model
from artrl.models.quantization import quantized_modules

from model_kinds import colour_rollout, vision_content

FOUR_BIT = {"load_in_4bit": True, "dtype": "float32"}
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
TOLERANCE = 1e-3  # tests/test_token_record.py's, which 4-bit artrl/tiny holds in float32


def _is_4bit(module: Any) -> bool:
    import bitsandbytes as bnb

    return isinstance(module, bnb.nn.Linear4bit)


def _base(name: str) -> str:
    """A peft model's module name without its wrappers ('base_model.model.', '.base_layer')."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def _adapted(model: Any) -> set[str]:
    return {_base(n.split(".lora_")[0]) for n, _ in model.named_parameters() if ".lora_" in n}


def test_a_4bit_vision_language_model_quantises_its_language_model_only():
    model, _ = load_model("artrl/tiny-vl", art.InternalModelConfig(**FOUR_BIT))
    base = model.get_base_model()
    quantized = {_base(n) for n, _ in quantized_modules(model)}
    # every projection of the 4 language-model layers, and nothing else
    assert len(quantized) == 4 * 7 and all(n.startswith("model.language_model.layers.") for n in quantized)
    assert {n.rsplit(".", 1)[-1] for n in quantized} == PROJECTIONS
    tower = [(n, m) for n, m in base.model.visual.named_modules() if isinstance(m, torch.nn.Linear)]
    # the tower's attention and MLP (which has gate/up/down_proj too) and the patch merger's two layers
    assert len(tower) == 2 * 5 + 2 and {"merger.mlp.0", "merger.mlp.2"} <= {n for n, _ in tower}
    assert not any(_is_4bit(m) for _, m in tower), [n for n, m in tower if _is_4bit(m)]
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in base.model.visual.parameters())
    assert type(base.lm_head) is torch.nn.Linear and base.lm_head.weight.dtype == torch.float32
    # the adapter sits on exactly the 4-bit layers: the language model's, never the tower's or the LM head
    assert _adapted(model) == quantized


def test_a_load_that_quantises_the_vision_tower_is_refused(monkeypatch):
    # as a transformers that ignored llm_int8_skip_modules would load it: every nn.Linear quantised
    from artrl.models import loading

    monkeypatch.setattr(loading, "unquantized_modules", lambda config: None)
    with pytest.raises(RuntimeError, match=r"quantised 12 layers that must stay.*model\.visual"):
        load_model("artrl/tiny-vl", art.InternalModelConfig(**FOUR_BIT))


def test_a_4bit_moe_model_quantises_attention_only_and_keeps_experts_and_routers(caplog):
    with caplog.at_level(logging.INFO, logger="artrl.models.quantization"):
        model, _ = load_model("artrl/tiny-moe", art.InternalModelConfig(**FOUR_BIT))
    quantized = {_base(n) for n, _ in quantized_modules(model)}
    assert len(quantized) == 4 * 4 and {n.rsplit(".", 1)[-1] for n in quantized} == {"q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"}
    for _, router in moe.routers(model):  # a plain weight, never quantised: replay reads its logits
        assert not _is_4bit(router) and type(router.weight) is torch.nn.Parameter
        assert router.weight.dtype == torch.float32 and router.weight.dim() == 2
    experts = [p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")]
    assert len(experts) == 4 * 2 and all(p.dim() == 3 and p.dtype == torch.float32 for p in experts)
    # ART's default adapter: the attention projections and the experts' fused parameters
    adapted = _adapted(model)
    assert quantized <= adapted and sum(n.endswith(".mlp.experts") for n in adapted) == 4
    assert any("experts" in r.getMessage() and "stay in float32" in r.getMessage() for r in caplog.records)


async def _rollout(model: art.TrainableModel, client: Any, i: int, image: bool) -> art.Trajectory:
    question = f"Name colour number {i}."
    content = vision_content(question, ["red", "blue"][i % 2], (56, 56 + 28 * (i % 2))) if image else question
    return await colour_rollout(model, client, i, turns=2, content=content)


@pytest.mark.parametrize("base_model", ["artrl/tiny-vl", "artrl/tiny-moe"], ids=["vision", "moe"])
def test_a_4bit_rl_call_trains_on_its_served_record(tmp_path, base_model):
    """Rollouts through the local server on 4-bit weights; the trainer's logprobs of the sampled tokens (with the
    images, and the MoE routing replayed) match the served ones at the 4-bit text model's tolerance; one step
    moves the adapter and nothing else."""
    vision = base_model == "artrl/tiny-vl"

    async def main() -> None:
        model = art.TrainableModel(name="q4", project="q4", base_model=base_model,
                                   _internal_config=art.InternalModelConfig(**FOUR_BIT))
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            trainer = backend._runs["q4"].trainer
            assert len(quantized_modules(trainer.model)) == (28 if vision else 16)
            client = model.openai_client()
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(_rollout(model, client, 3 * g + k, vision) for k in range(3)) for g in range(2)),
                pbar_desc=None)
            sampled = [m for g in groups for t in g for m in t.messages_and_choices if not isinstance(m, dict)]
            if vision:
                assert all(len(c.model_extra["prompt_images"]) == 1 for c in sampled)
            else:
                assert all(moe.RECORD_KEY in c.model_extra for c in sampled)
            before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
            m = result.metrics
            assert m["data/record_turns"] == len(sampled) and m["data/rendered_turns"] == 0
            assert m["train/sampled_logprob_tokens"] == sum(len(c.model_extra["token_ids"]) for c in sampled)
            assert m["train/sampled_logprob_delta_max"] < TOLERANCE, m
            if not vision:  # every recorded token replayed, none routed otherwise by the 4-bit trainer
                assert m["train/routing_record_tokens"] == sum(len(c.model_extra["token_ids"]) for c in sampled)
                assert m["train/routing_mismatch_tokens"] == 0
            assert torch.isfinite(torch.tensor(m["loss/train"]))
            after = dict(trainer.model.named_parameters())
            moved = {n for n, p in after.items() if not torch.equal(p.detach(), before[n])}
            assert moved and all(".lora_" in n for n in moved), sorted(moved - {n for n in moved if ".lora_" in n})
            if vision:
                assert all(".language_model." in n for n in moved)
            else:  # the experts' adapters train too
                assert any(".mlp.experts." in n for n in moved)

    asyncio.run(main())
