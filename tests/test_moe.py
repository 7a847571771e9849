"""Mixture-of-experts models (models/moe.py, train/routing.py): experts per routed token, LoRA on the experts,
the routing record and its replay, router health."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest
import torch

import artrl as art
from artrl.chat.format import message_of
from artrl.models import moe
from artrl.models.loading import load_model
from artrl.models.memory_plan import ModelShape
from artrl.models.shapes import random_config
from model_kinds import colour_rollout

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tiny_moe():
    model, tok = load_model("artrl/tiny-moe", art.InternalModelConfig())
    return model, tok


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_experts_are_computed_per_routed_token_as_the_dense_reference(tiny_moe, implementation):
    from torch.utils.flop_counter import FlopCounterMode

    block = tiny_moe[0].get_base_model().model.layers[1].mlp
    experts = block.experts.get_base_layer() if hasattr(block.experts, "get_base_layer") else block.experts
    experts.config._experts_implementation = implementation
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, experts.hidden_dim, generator=gen)  # [T, H]
    try:
        with torch.no_grad():
            _, weights, index = block.gate(hidden)  # [T, k] each
            with FlopCounterMode(display=False) as counter:
                routed = experts(hidden, index, weights)
            want = moe.dense_experts_forward(experts, hidden, index, weights)
    finally:
        experts.config._experts_implementation = moe.EXPERTS_IMPLEMENTATION
    torch.testing.assert_close(routed, want, rtol=1e-5, atol=1e-6)
    # the work of top_k experts per token, never of every expert (8 experts, 2 per token: a quarter)
    per_token_expert = 2 * 3 * experts.hidden_dim * experts.intermediate_dim
    if counter.get_total_flops():  # grouped_mm's kernel may be invisible to the counter
        assert counter.get_total_flops() <= 37 * 2 * per_token_expert * 1.01


def test_lora_reaches_the_experts_under_arts_names(tiny_moe):
    model, _ = tiny_moe
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".experts." in n and "lora_A" in n for n in trained)  # ART's default adds the experts
    assert any(".q_proj.lora_A" in n for n in trained) and not any("mlp.gate." in n for n in trained)
    base = model.get_base_model()
    assert moe.lora_targets(base, ["q_proj", "experts"]) == (["q_proj"], list(moe.EXPERT_PARAMETERS))
    assert moe.lora_targets(base, ["q_proj", "v_proj"]) == (["q_proj", "v_proj"], None)
    with pytest.raises(art.ConfigError, match="lora_dropout=0.1 with LoRA on the experts.*Set lora_dropout=0"):
        load_model("artrl/tiny-moe", art.InternalModelConfig(lora_dropout=0.1))
    load_model("artrl/tiny-moe", art.InternalModelConfig(lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))


def test_plans_and_flops_count_the_experts_a_token_runs():
    from artrl.commands.bench.flops import ModelShape as FlopShape

    shape = ModelShape.of(random_config("random:qwen3-30b-a3b"))
    total = shape.linear_weights() + shape.expert_weights() + shape.other_weights()
    assert total == pytest.approx(30.5e9, rel=0.01)  # Qwen3-30B-A3B: 30.5B parameters
    assert shape.active_weights() + shape.other_weights() == pytest.approx(3.3e9, rel=0.02)  # 3.3B active
    model, _ = load_model("artrl/tiny-moe", art.InternalModelConfig())
    flops = FlopShape.of(model)
    config = model.get_base_model().config
    experts = config.num_hidden_layers * config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size
    dense = FlopShape.of(load_model("artrl/tiny", art.InternalModelConfig())[0])
    attention = dense.non_embedding_params - dense.layers * 3 * 128 * 384 - dense.layers * 2 * 128 - 128
    assert flops.non_embedding_params < attention + experts * 2 / 8 + 10_000


def test_the_routing_record_round_trips_and_a_malformed_one_is_refused():
    ids = torch.randint(-1, 128, (5, 48, 8), dtype=torch.int16)
    record = moe.encode_routing(ids)
    assert json.loads(json.dumps(record)) == record and torch.equal(moe.decode_routing(record), ids)
    for bad in ({"shape": [5, 48, 8], "int16": "AAAA"}, {"shape": [5, 48], "int16": record["int16"]},
                {"int16": record["int16"]}, {"shape": [5, 48, 8], "int16": "not base64!"},
                {**record, moe.PROMPT_LAST_KEY: "AAAA"}):
        with pytest.raises(ValueError, match="malformed routed_experts record"):
            moe.decode_routing(bad)
    # the prompt's last position rides along in its own field: a record without it (an older server's) reads as
    # before, and a reader of the old fields only reads the new record unchanged
    last = torch.randint(0, 128, (48, 8), dtype=torch.int16)
    both = moe.encode_routing(ids, last)
    assert {k: v for k, v in both.items() if k != moe.PROMPT_LAST_KEY} == record
    got, got_last = moe.decode_routing_with_prompt(json.loads(json.dumps(both)))
    assert torch.equal(got, ids) and torch.equal(got_last, last) and torch.equal(moe.decode_routing(both), ids)
    assert moe.decode_routing_with_prompt(record)[1] is None


async def _rollout(model: art.TrainableModel, client: Any, i: int, turns: int = 3) -> art.Trajectory:
    return await colour_rollout(model, client, i, turns)


def _choices(groups):
    return [m for g in groups for t in g for m in t.messages_and_choices if not isinstance(m, dict)]


def _tampered(groups, every: int = 3) -> tuple[list[art.TrajectoryGroup], int]:
    """Every `every`-th recorded token (not a turn's last, which has no record) claims experts its router did not
    pick in the last MoE layer (the ids shifted by one: another set). The last layer's choice for a token changes
    no other token's routing, so exactly those tokens differ from the trainer's own choice. Returns the groups and
    how many tokens were changed."""
    groups = copy.deepcopy(groups)
    changed = 0
    for choice in _choices(groups):
        record = moe.decode_routing(choice.model_extra[moe.RECORD_KEY]).clone()
        rows = list(range(0, record.shape[0] - 1, every))
        record[rows, -1] = (record[rows, -1] + 1) % 8
        changed += len(rows)
        choice.model_extra[moe.RECORD_KEY] = moe.encode_routing(record)
    return groups, changed


@pytest.mark.parametrize("weights", [{}, {"load_in_4bit": True, "dtype": "float32"}], ids=["full", "4bit"])
def test_sampled_routing_is_recorded_replayed_and_its_mismatches_counted(tmp_path, weights):
    """Through the local server: each sampled token's experts come back with the record; training replays them
    (delta at float tolerance, no mismatch); a record that claims other experts for some tokens is counted token
    for token and, replayed, moves the logprobs, where routing freely does not. The same on 4-bit weights
    (attention 4-bit; experts and routers whole: models/quantization.py)."""

    async def main() -> None:
        model = art.TrainableModel(name="moe", project="record", base_model="artrl/tiny-moe",
                                   _internal_config=art.InternalModelConfig(**weights))
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            client = model.openai_client()
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(_rollout(model, client, 4 * g + k) for k in range(4)) for g in range(2)),
                pbar_desc=None)
            sampled = _choices(groups)
            assert len(sampled) == 8 * 3
            for choice in sampled:
                record = moe.decode_routing(choice.model_extra[moe.RECORD_KEY])
                n = len(choice.model_extra["token_ids"])
                assert record.shape == (n, 4, 2)  # 4 MoE layers, top-2
                assert (record[:-1] >= 0).all() and (record[-1] == -1).all()  # the last token is never fed back
                last = moe.decode_routing_with_prompt(choice.model_extra[moe.RECORD_KEY])[1]
                assert last is not None and last.shape == (4, 2) and (last >= 0).all()  # the prompt's last position

            async def measure(data, replay: bool) -> dict[str, float]:
                config = art.TrainConfig(learning_rate=1e-12, moe_routing_replay=replay)
                return (await model.train(data, config=config)).metrics

            honest = await measure(groups, replay=True)
            recorded = sum(len(c.model_extra["token_ids"]) for c in sampled)  # all fed back but the last, and
            # each turn's last prompt position
            assert honest["train/routing_record_tokens"] == recorded
            assert honest["train/routing_mismatch_tokens"] == 0
            assert honest["train/sampled_logprob_delta_max"] < TOLERANCE
            assert honest["train/sampled_logprob_delta_max_without_replay"] < TOLERANCE
            assert {"train/router_aux_loss", "train/router_expert_load_max", "train/router_expert_load_max_l3"} \
                <= set(honest)

            wrong, changed = _tampered(groups)
            replayed = await measure(wrong, replay=True)
            free = await measure(wrong, replay=False)
            assert changed > 10 and replayed["train/routing_mismatch_tokens"] == changed
            assert free["train/routing_mismatch_tokens"] == changed  # counted whether or not it is replayed
            assert replayed["train/sampled_logprob_delta_max"] > 0.05  # replay forced the claimed experts
            assert replayed["train/sampled_logprob_delta_max_without_replay"] < TOLERANCE
            assert free["train/sampled_logprob_delta_max"] < TOLERANCE  # routing freely ignores the record
            assert "train/sampled_logprob_delta_max_without_replay" not in free

    asyncio.run(main())


def test_arts_megatron_bundle_keys_are_accepted_with_a_notice(caplog):
    import logging

    from artrl.runtime import notices

    notices.forget()
    with caplog.at_level(logging.WARNING, logger="artrl.notices"):
        config = art.TrainConfig(moe_routing_replay_path="/tmp/bundle", moe_routing_replay_strict=False)
        config.notice_ignored()
    lines = [r.getMessage() for r in caplog.records]
    assert any("moe_routing_replay_path" in line and "no effect" in line for line in lines)
    notices.forget()


def test_the_vllm_engines_record_lines_up_with_the_tokens_the_trainer_replays(tiny_moe):
    """vLLM returns the experts of each token it fed in after the prompt (`routed_experts_prompt_start` at the
    prompt's end); the engine turns that into the record (`moe.record_of_fed_tokens`). Simulated here from one
    forward of the tiny MoE model: replayed at the sampled tokens' own positions, as the packer places a record,
    the record matches the trainer's own routing on every fed token; a record off by one position, or one that
    claims other experts for some tokens, is counted token for token."""
    from artrl.serve.engines.vllm_engine import _routing_record
    from artrl.train.routing import RoutingReplay

    model, _ = tiny_moe
    generator = torch.Generator().manual_seed(0)
    prompt, n = 9, 7
    ids = torch.randint(5, model.config.vocab_size, (1, prompt + n), generator=generator)  # [1, T]
    recorder = moe.RoutingRecorder(model)
    with torch.no_grad():
        model(input_ids=ids)
    recorder.remove()
    routed = recorder.latest.permute(1, 0, 2)  # [T, layers, top_k]: every position's experts as fed in

    class Output:  # what vLLM's CompletionOutput carries for an MoE model: the fed sampled tokens only
        routed_experts = routed[prompt:prompt + n - 1].numpy()

    record = _routing_record(Output(), n)
    assert record.shape == (n, 4, 2) and (record[-1] == -1).all() and (record[:-1] >= 0).all()

    def mismatches(record: torch.Tensor) -> tuple[int, int]:
        forced = torch.full((prompt + n, *record.shape[1:]), -1, dtype=torch.int16)  # [T, layers, top_k]
        forced[prompt:prompt + n] = record  # sampled token i sits at position prompt + i
        replay = RoutingReplay(model)
        with replay.installed(), replay.replaying(forced, apply=False), torch.no_grad():
            model(input_ids=ids)
        return replay.counts.replayed, replay.counts.rerouted

    assert mismatches(record) == (n - 1, 0)
    shifted = moe.record_of_fed_tokens(routed[prompt - 1:prompt + n - 1], n)  # one position early
    assert mismatches(shifted)[1] > 0
    tampered = record.clone()
    tampered[[0, 3], -1] = (tampered[[0, 3], -1] + 1) % 8  # other experts in the last layer for two tokens
    assert mismatches(tampered) == (n - 1, 2)


def _with_prompt_last(choice: Any, change) -> None:
    """Rewrite `choice`'s record of its prompt's last position with `change(ids)` ([layers, top_k])."""
    ids, last = moe.decode_routing_with_prompt(choice.model_extra[moe.RECORD_KEY])
    choice.model_extra[moe.RECORD_KEY] = moe.encode_routing(ids, change(last.clone()))


def test_the_first_sampled_token_is_scored_with_the_prompts_last_position_replayed(tmp_path):
    """The first sampled token of a turn is predicted at its prompt's last position: the engine records that
    position's experts from the prefill and the trainer replays them there. A record claiming other experts for
    that position (last MoE layer: no other position sees it) moves exactly that turn's first token's logprob.
    Completions of one prompt do not share that slot: one trajectory's claim moves its own first token only."""
    from artrl.preprocess.pack import pack
    from artrl.trajectories.tokenization import tokenize_groups

    async def rollout(model, client, k: int) -> art.Trajectory:  # one prompt for the group: a shared prompt
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
        trajectory = art.Trajectory(messages_and_choices=list(messages), reward=float(k))
        for turn in range(2):
            response = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                            max_tokens=6, temperature=1.0, seed=10 * k + turn)
            choice = response.choices[0]
            trajectory.messages_and_choices.append(choice)
            messages += [json.loads(json.dumps(message_of(choice))), {"role": "user", "content": "Another?"}]
            trajectory.messages_and_choices.append(messages[-1])
        return trajectory

    async def main() -> None:
        model = art.TrainableModel(name="moe", project="first", base_model="artrl/tiny-moe")
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            client = model.openai_client()
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(model, client, k) for k in range(3))], pbar_desc=None)
            trainer = backend._runs["moe"].trainer

            def scored(groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                """(the trainer's replayed logprobs, the sampled ones, which are a turn's first sampled token)"""
                tok = tokenize_groups(groups, trainer.tokenizer, scale_rewards=False)
                packed = pack(tok.groups, max_length=trainer.max_length)
                mb = packed.select(range(packed.num_rows))
                with trainer.routed(mb, replay=True):
                    tb = trainer.forward_tokens(mb, grad=False)
                sel = mb.trainable_mask
                b, t = sel.nonzero(as_tuple=True)
                first = ~sel[b, mb.prev_index[b, t]]  # the slot before it holds a prompt token
                return tb.logprobs, tb.old_logprobs, first

            honest, sampled, first = scored(groups)
            assert int(first.sum()) == 3 * 2  # every turn's first token
            assert float((honest - sampled).abs().max()) < TOLERANCE

            def moved(change, trajectories=range(3)) -> torch.Tensor:
                wrong = copy.deepcopy(groups)
                for k in trajectories:
                    for item in wrong[0].trajectories[k].messages_and_choices:
                        if not isinstance(item, dict):
                            _with_prompt_last(item, change)
                lp, _, again = scored(wrong)
                assert torch.equal(again, first)  # the same layout
                return (lp - honest).abs()

            def other_experts(last: torch.Tensor) -> torch.Tensor:
                last[-1] = (last[-1] + 1) % 8
                return last

            delta = moved(other_experts)
            assert float(delta[first].min()) > 1e-3  # every first token moved
            assert float(delta[~first].max()) < 1e-5  # and nothing else
            one = moved(other_experts, trajectories=[1])  # one completion's claim: its own first tokens only
            assert int((one > 1e-3).sum()) == 2 and float(one[one <= 1e-3].max()) < 1e-5
            assert float(moved(lambda last: last).max()) < 1e-5  # the record as sampled changes nothing

            older = copy.deepcopy(groups)  # an older server's records, without the prompt's last position: they
            for choice in _choices(older):  # train as before, the first sampled token routing freely
                del choice.model_extra[moe.RECORD_KEY][moe.PROMPT_LAST_KEY]
            lp, sampled_lp, first_free = scored(older)
            assert int(first_free.sum()) == 3 * 2 and float((lp - sampled_lp).abs().max()) < TOLERANCE

    asyncio.run(main())


def test_the_engine_records_each_prompts_last_position_from_a_batched_prefill(tiny_moe):
    """Prompts of different lengths prefilled together (left-padded) and n samples of one prompt: each result's
    record of its prompt's last position is the experts a lone forward of that prompt picks there."""
    from artrl.serve import TransformersEngine
    from artrl.serve.engines.base import GenerationRequest

    model, tokenizer = tiny_moe
    prompts = [[5 + i for i in range(n)] for n in (3, 11, 7)]
    engine = TransformersEngine(model, tokenizer, max_batch_size=8, end_ids=frozenset())

    async def main() -> list[Any]:
        return await asyncio.gather(*(engine.generate(GenerationRequest(prompt_ids=p, n=2, max_tokens=3, seed=i))
                                      for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(main())
    finally:
        engine.close()
    recorder = moe.RoutingRecorder(model)
    try:
        for prompt, samples in zip(prompts, results):
            with torch.no_grad():
                model(input_ids=torch.tensor([prompt]))
            alone = recorder.latest[:, -1, :]  # [layers, top_k] at the prompt's last position
            for result in samples:
                assert result.prompt_routed_experts is not None and result.routed_experts is not None
                assert torch.equal(result.prompt_routed_experts, alone)
    finally:
        recorder.remove()
