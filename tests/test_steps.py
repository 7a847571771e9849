"""Optimizer steps are defined by data: what a call learns does not depend on how it was packed.

* build_call (preprocess/build.py) cuts steps from the data before packing: the
  steps' data is the same whatever the row length, prompt sharing or
  micro-batching, and a row never mixes two steps.
* Through the public API, the same groups trained on fresh copies of a model
  with different layouts give the same adapter update.
* `grad_accumulation_sequences` keeps its packing-dependent meaning (rows per step).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import artrl as art
from artrl.preprocess.build import build_call, split_units
from artrl.trajectories.sequences import TokenizedSequence
from artrl.models.tree_attention import TreeLayout

from model_kinds import KINDS, vision_content


def _seq(n_prompt: int, n_completion: int, gi: int, ti: int, prompt_token: int) -> TokenizedSequence:
    ids = [prompt_token] * n_prompt + [100 + ti + k for k in range(n_completion)]
    mask = [False] * n_prompt + [True] * n_completion
    return TokenizedSequence(token_ids=ids, trainable_mask=mask, logprobs=[-1.0] * len(ids), advantage=float(ti),
                             group_index=gi, trajectory_index=ti)


def _groups(shape: list[tuple[int, list[int]]]) -> list[list[TokenizedSequence]]:
    return [[_seq(p, c, g, t, 7 + g) for t, c in enumerate(comps)] for g, (p, comps) in enumerate(shape)]


group_shapes = st.lists(st.tuples(st.integers(1, 40), st.lists(st.integers(1, 30), min_size=1, max_size=5)),
                        min_size=1, max_size=7)


def _step_sequences(built) -> list[list[tuple[int, int]]]:
    """Per plan step, the (group, trajectory) of every sequence it trains on."""
    out = []
    for step in built.plan.steps:
        sids = built.packed.sequence_ids[step.rows].unique()
        out.append(sorted((built.packed.sequences[int(s)].group_index, built.packed.sequences[int(s)].trajectory_index)
                          for s in sids if s >= 0))
    return out


@settings(max_examples=40)
@given(shape=group_shapes, per_step=st.one_of(st.none(), st.integers(1, 4)), row_length=st.sampled_from([None, 96, 128]),
       share=st.booleans(), per_device=st.integers(1, 3))
def test_steps_hold_the_same_data_whatever_the_layout(shape, per_step, row_length, share, per_device):
    groups = _groups(shape)
    reference = build_call(groups, units_per_step=per_step, max_length=512)
    other = build_call(groups, units_per_step=per_step, row_length=row_length, share_prompts=share,
                       per_device_train_batch_size=per_device, max_length=512)
    assert _step_sequences(other) == _step_sequences(reference)
    want = [sorted((g, t) for g in idx for t in range(len(groups[g]))) for idx in split_units(len(groups), per_step)]
    assert _step_sequences(reference) == want
    assert other.step_units == [list(idx) for idx in split_units(len(groups), per_step)]
    # a row belongs to exactly one step, and each step's trainable-token count is its data's
    rows = [r for s in other.plan.steps for r in s.rows]
    assert sorted(rows) == list(range(other.packed.num_rows))
    for step, idx in zip(other.plan.steps, other.step_units):
        assert step.trainable_tokens == sum(sum(s.trainable_mask) for g in idx for s in groups[g])
    # the carried tree layout is the one the per-slot ids describe
    assert TreeLayout.from_ids(other.packed.segment_ids, other.packed.parent_ids).rows == other.packed.nodes


def test_a_step_whose_data_was_all_dropped_disappears_with_its_learning_rate():
    groups = _groups([(4, [3, 3]), (200, [50]), (4, [2])])  # the middle group is too long for 128
    built = build_call(groups, units_per_step=1, row_length=128, max_length=512)
    assert built.kept_steps == [0, 2] and built.step_units == [[0], [2]]
    assert built.stats.dropped == 1 and len(built.plan.steps) == 2


def test_rows_per_step_keeps_the_packing_dependent_meaning():
    groups = _groups([(10, [20] * 4)] * 6)
    wide = build_call(groups, rows_per_step=1, row_length=512, max_length=512)
    narrow = build_call(groups, rows_per_step=1, row_length=128, max_length=512)
    assert len(wide.plan.steps) == wide.packed.num_rows < len(narrow.plan.steps) == narrow.packed.num_rows
    assert sorted({u for s in narrow.step_units for u in s}) == list(range(6))


# --------------------------------------------------------------------------- through the public API


LAYOUTS = {
    "automatic": {},
    "row_length=128": {"row_length": 128},
    "share_prompts=False": {"share_prompts": False},
    "per_device_train_batch_size=3": {"per_device_train_batch_size": 3, "row_length": 128},
    "max_tokens_per_microbatch=300": {"max_tokens_per_microbatch": 300, "row_length": 128},
    # the budget bounds the automatic row length (128 here without it); every trajectory fits 64 tokens
    "max_tokens_per_microbatch=64": {"max_tokens_per_microbatch": 64},
}


def _groups_api(make_choice, images: bool = False) -> list[art.TrajectoryGroup]:
    """Five groups of four. `images`: each user message shows an image too, one per group of one size per group,
    except that the last two trajectories of groups 1 and 3 show another image of the same size (same token ids,
    other pixels: they share the text before it, not the image)."""
    groups = []
    for g in range(5):
        question = f"What is {g} plus {g + 1}?" + ("" if images else " Explain briefly.")  # images: every row <= 64
        trajs = []
        for t in range(4):
            colour = ["red", "green", "blue", "yellow"][(g + (t >= 2 and g % 2)) % 4]
            content = vision_content(question, colour, (56 + 28 * (g % 2), 56)) if images else question
            prompt = [{"role": "system", "content": "You answer arithmetic questions."},
                      {"role": "user", "content": content}]
            trajs.append(art.Trajectory(messages_and_choices=prompt + [make_choice(f"It is {2 * g + 1}." + " yes" * (t + g))],
                                        reward=float(t % 2) + 0.1 * t))
        groups.append(art.TrajectoryGroup(trajs))
    return groups


def _update(path, groups, kind="dense", **config) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    base_model, fields = KINDS[kind]

    async def main():
        backend = art.LocalBackend(path=str(path), show_progress=False)
        model = art.TrainableModel(name="m", project="p", base_model=base_model,
                                   _internal_config=art.InternalModelConfig(max_length=128, **fields))
        await model.register(backend)
        trainer = backend._runs["m"].trainer
        before = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3, **config))
        after = get_peft_model_state_dict(trainer.model)
        backend.close()
        return {k: after[k] - before[k] for k in before}, result

    return asyncio.run(main())


@pytest.mark.parametrize("kind,steps", [("dense", {}), ("dense", {"groups_per_optimizer_step": 2}), ("4bit", {}),
                                        ("moe", {}), ("vision", {})],
                         ids=["one-step", "groups_per_optimizer_step=2", "4bit", "moe", "vision"])
def test_the_same_groups_give_the_same_update_whatever_the_layout(tmp_path, make_choice, kind, steps):
    groups = _groups_api(make_choice, images=kind == "vision")
    updates, results = {}, {}
    for name, layout in LAYOUTS.items():
        updates[name], results[name] = _update(tmp_path / name.replace("=", "-"), groups, kind, **steps, **layout)
    n_steps = {r.metrics["data/step_num_gradient_steps"] for r in results.values()}
    assert n_steps == ({1.0} if not steps else {3.0})
    rows = {r.metrics["data/rows"] for r in results.values()}
    assert len(rows) > 1, "the layouts should really differ"
    assert results["automatic"].metrics["data/row_length"] > 64 == results["max_tokens_per_microbatch=64"].metrics[
        "data/row_length"]
    assert all(r.metrics["data/dropped"] == r.metrics["data/truncated"] == 0 for r in results.values())
    ref = updates["automatic"]
    norm = torch.sqrt(sum((v.float() ** 2).sum() for v in ref.values()))
    assert norm > 0
    for name, upd in updates.items():
        diff = torch.sqrt(sum(((upd[k] - ref[k]).float() ** 2).sum() for k in ref))
        assert float(diff / norm) < 1e-3, f"{name}: relative difference {float(diff / norm):.2e}"
