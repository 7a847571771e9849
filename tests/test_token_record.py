"""Multi-turn agents train on exactly the tokens the server sampled (docs/token-record.md).

Rollouts go through the real local server (LocalBackend) with the `openai` AsyncOpenAI client,
appending `response.choices[0]` directly as ART scripts do and never asking for logprobs. Then
one RL call: `train/sampled_logprob_delta_max` (trainer vs sampled logprob, over every sampled
token, before the first optimizer step) must be at float tolerance. The same rollouts with a
tampered prompt record, or with an earlier message changed and the record dropped (the
foreign-server path), must show a large delta: the measure can fail.

Calls that only measure run with learning_rate=1e-12: AdamW moves each weight by ~1e-12, far
below float32 resolution, so the weights the honest call measures are still the sampling ones.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

import artrl as art
from artrl.chat.format import message_of

from model_kinds import KINDS, vision_content

SYSTEM = {"role": "system", "content": "You add numbers with the add tool."}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
MEASURE_ONLY = 1e-12
TOLERANCE = 1e-3


async def rollout(model: art.TrainableModel, client: Any, task: int, member: int, turns: int,
                  image: bool = False) -> art.Trajectory:
    """An agent loop: the model answers; a tool result follows each call, a user nudge any other answer.
    `image`: the first user message shows an image too (a vision-language model's)."""
    question = f"Add {task} and {task + 1}."
    content = vision_content(question, ["red", "blue"][task % 2], (56, 56 + 28 * task)) if image else question
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": content}]
    trajectory = art.Trajectory(messages_and_choices=list(messages), tools=TOOLS, reward=0.0)
    for turn in range(turns):
        response = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, tools=TOOLS, max_tokens=24, temperature=0.8,
            seed=1000 * task + 100 * member + turn)
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)
        messages.append(json.loads(json.dumps(message_of(choice))))
        replies = [{"role": "tool", "tool_call_id": call.id, "content": str(2 * task + 1 + turn)}
                   for call in choice.message.tool_calls or []] or [{"role": "user", "content": "Use the tool."}]
        messages += replies
        trajectory.messages_and_choices += replies
    return trajectory


def rank_rewards(groups: list[art.TrajectoryGroup]) -> list[art.TrajectoryGroup]:
    """Distinct rewards within each group (the task has no grader; any non-zero advantages will do)."""
    for g in groups:
        for k, t in enumerate(g):
            t.reward = float(k)
    return groups


def other_ends(groups: list[art.TrajectoryGroup], tok: Any) -> int:
    """Turns (not a trajectory's last) that ended with <|endoftext|>: an end-of-turn id of the tiny model
    (sampling stops there), while its template closes turns with <|im_end|>, so the next prompt cannot
    extend that turn's record."""
    other = tok.convert_tokens_to_ids("<|endoftext|>")
    return sum(c.model_extra["token_ids"][-1] == other
               for g in groups for t in g for c in [m for m in t.messages_and_choices if not isinstance(m, dict)][:-1])


def choices(groups: list[art.TrajectoryGroup]) -> list[Any]:
    return [m for g in groups for t in g for m in t.messages_and_choices if not isinstance(m, dict)]


async def measure(model: art.TrainableModel, groups: list[art.TrajectoryGroup]) -> dict[str, float]:
    """One RL call that measures (every row in the first optimizer step) and leaves the weights as they are."""
    result = await model.train(groups, config=art.TrainConfig(learning_rate=MEASURE_ONLY,
                                                              grad_accumulation_sequences=None))
    return result.metrics


def tamper_prompt_records(groups: list[art.TrajectoryGroup]) -> list[art.TrajectoryGroup]:
    """The last turn of each trajectory claims a context it was not sampled from (its middle reversed)."""
    groups = copy.deepcopy(groups)
    for g in groups:
        for t in g:
            last = [m for m in t.messages_and_choices if not isinstance(m, dict)][-1]
            prompt = last.model_extra["prompt_token_ids"]
            a, b = len(prompt) // 4, 3 * len(prompt) // 4
            last.model_extra["prompt_token_ids"] = prompt[:a] + prompt[a:b][::-1] + prompt[b:]
    return groups


def as_foreign_with_an_edited_history(groups: list[art.TrajectoryGroup]) -> list[art.TrajectoryGroup]:
    """A server that returns no prompt ids, and a caller who rewrote the first reply after sampling."""
    groups = copy.deepcopy(groups)
    for g in groups:
        for t in g:
            for m in t.messages_and_choices:
                if not isinstance(m, dict):
                    del m.model_extra["prompt_token_ids"]
            first_reply = next(i for i, m in enumerate(t.messages_and_choices)
                               if isinstance(m, dict) and m["role"] in ("tool", "user") and i > 2)
            t.messages_and_choices[first_reply] = {**t.messages_and_choices[first_reply],
                                                   "content": "Something else entirely, and longer than before."}
    return groups


async def check_record(model: art.TrainableModel, groups: list[art.TrajectoryGroup]) -> dict[str, float]:
    sampled = choices(groups)
    assert all(c.logprobs is not None and c.model_extra.get("prompt_token_ids") for c in sampled), \
        "the server returns logprobs and the prompt record on every choice, asked or not"

    tampered = await measure(model, tamper_prompt_records(groups))
    assert tampered["train/sampled_logprob_delta_max"] > 0.05, tampered  # the measure sees a wrong context
    foreign = await measure(model, as_foreign_with_an_edited_history(groups))
    assert foreign["data/rendered_turns"] == len(sampled) and foreign["data/record_turns"] == 0
    assert foreign["train/sampled_logprob_delta_max"] > 0.05, foreign

    honest = (await model.train(groups, config=art.TrainConfig(learning_rate=1e-4,
                                                               grad_accumulation_sequences=None))).metrics
    assert honest["data/record_turns"] == len(sampled) and honest["data/rendered_turns"] == 0
    assert honest["data/turns_missing_logprobs"] == 0
    # every sampled token of every turn is measured, and each is at float tolerance
    assert honest["train/sampled_logprob_tokens"] == sum(len(c.model_extra["token_ids"]) for c in sampled)
    assert honest["train/sampled_logprob_delta_max"] < TOLERANCE, honest
    return honest


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_multi_turn_rollouts_train_on_exactly_their_record(tmp_path, tok, kind):
    base_model, config = KINDS[kind]

    async def main() -> None:
        model = art.TrainableModel(name="agent", project="record", base_model=base_model,
                                   _internal_config=art.InternalModelConfig(**config))
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            client = model.openai_client()
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, client, task, member, turns=3, image=kind.startswith("vision"))
                                     for member in range(3)) for task in (1, 2)),
                pbar_desc=None)
            rank_rewards(groups)
            assert all(len([m for m in t.messages_and_choices if not isinstance(m, dict)]) == 3
                       for g in groups for t in g)
            if kind.startswith("vision"):  # every turn's record names the first message's image: its hash and grid
                grids = {tuple(c.model_extra["prompt_images"][0]["grid_thw"]) for c in choices(groups)}
                assert all(len(c.model_extra["prompt_images"]) == 1 for c in choices(groups))
                assert grids == {(1, 6, 4), (1, 8, 4)}, grids  # (time, height, width) patches of 56 x 84 and 56 x 112
            honest = await check_record(model, groups)
            # the tiny template renders earlier turns unchanged: a trajectory is one sequence, unless a turn
            # ended with <|endoftext|> (an end-of-turn id, where the template closes turns with <|im_end|>)
            assert honest["data/record_splits"] == other_ends(groups, tok)
            assert honest["data/sequences"] == 6 + honest["data/record_splits"]
            del backend

    asyncio.run(main())


def test_tool_calling_rollouts_train_on_exactly_their_record(tmp_path, tok):
    """Taught to call `add` first (a short SFT), the model's sampled turns carry real tool calls."""

    async def main() -> None:
        model = art.TrainableModel(name="agent", project="tools", base_model="artrl/tiny")
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            lesson = art.Trajectory(messages_and_choices=[SYSTEM, {"role": "user", "content": "Add 1 and 2."},
                                                          {"role": "assistant", "content": CALL}],
                                    tools=TOOLS, reward=0.0)
            await model.train_sft([lesson] * 30, config=art.TrainSFTConfig(learning_rate=1e-2, batch_size=1))
            client = model.openai_client()
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, client, task, member, turns=4) for member in range(3)) for task in (1, 2)),
                pbar_desc=None)
            rank_rewards(groups)
            with_calls = []
            for g in groups:
                for t in g:
                    items = t.messages_and_choices
                    sampled = [i for i, m in enumerate(items) if not isinstance(m, dict)]
                    assert len(sampled) == 4
                    # a tool call answered by a tool result, between sampled turns
                    with_calls.append(any(items[i].message.tool_calls and items[i + 1]["role"] == "tool"
                                          for i in sampled[:-1]))
            # sampled at temperature 0.8, a turn may also come out as a malformed call (left as text): most
            # trajectories, and some of every group, hold real calls whatever the draws
            assert sum(with_calls) >= 2 * len(with_calls) // 3 and any(with_calls[:3]) and any(with_calls[3:])
            honest = await check_record(model, groups)
            assert honest["data/record_splits"] == other_ends(groups, tok)  # tool calls chain too
            del backend

    asyncio.run(main())


def test_the_measure_is_a_max_over_the_first_optimizer_steps_micro_batches(tiny_path, make_choice):
    import torch

    from artrl.train.call import run_call
    from artrl.models.loading import load_model
    from artrl.train.rl import prepare_rl
    from artrl.train.trainer import Trainer

    model, tok = load_model(str(tiny_path), art.InternalModelConfig(seed=0))
    trainer = Trainer(model, tok)
    # make_choice's logprobs are random, so every token has its own large delta
    groups = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[
        {"role": "user", "content": f"q{g}"}, make_choice("an answer" + " and some more words" * (t + g + 4))], reward=float(t))
        for t in range(3)]) for g in range(2)]
    call = prepare_rl(trainer.build_context(), groups, art.TrainConfig(learning_rate=MEASURE_ONLY, per_device_train_batch_size=1,
                                                       grad_accumulation_sequences=2, row_length=64))
    first = call.plan.steps[0]
    assert len(first.micro_batches) == 2 and len(call.plan.steps) >= 2
    per_micro_batch = []
    for mb in first.micro_batches:
        tb = trainer.forward_tokens(call.packed.select(mb.rows, mb.width), grad=False)
        per_micro_batch.append((tb.logprobs - tb.old_logprobs).abs())  # every token carries a sampled logprob
    steps, summary = run_call(trainer, call, show_progress=False)
    every = torch.cat(per_micro_batch)
    assert steps[0]["sampled_logprob_delta_max"] == pytest.approx(float(every.max()), abs=1e-5)
    assert steps[0]["sampled_logprob_delta_mean"] == pytest.approx(float(every.mean()), abs=1e-5)
    assert steps[0]["sampled_logprob_tokens"] == every.numel()
    assert all("sampled_logprob_delta_max" not in s for s in steps[1:])  # later steps ran updated weights
    maxima = [float(d.max()) for d in per_micro_batch]
    assert summary["sampled_logprob_delta_max"] == steps[0]["sampled_logprob_delta_max"] == pytest.approx(
        max(maxima), abs=1e-5) and min(maxima) < max(maxima)  # a max, not an average of micro-batch maxima
