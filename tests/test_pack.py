"""Packing and planning: properties over random groups (hypothesis), plus the workload targets."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from artrl.commands.bench.workload import load_workload, workload_groups
from artrl.errors import ConfigError, PackingError
from artrl.preprocess.pack import pack, pack_reference
from artrl.preprocess.plan import plan_batches, reference_plan
from artrl.trajectories.sequences import TokenizedSequence
from artrl.train.attention import dense_mask

WORKLOAD = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "workloads" / "seed-like.json"


@st.composite
def groups_strategy(draw):
    n_groups = draw(st.integers(1, 5))
    groups = []
    for g in range(n_groups):
        p = draw(st.integers(0, 12))
        prompt = draw(st.lists(st.integers(5, 50), min_size=p, max_size=p))
        seqs = []
        for t in range(draw(st.integers(1, 4))):
            c = draw(st.integers(1, 15))
            comp = draw(st.lists(st.integers(5, 50), min_size=c, max_size=c))
            mask = [False] * p + draw(st.lists(st.booleans(), min_size=c, max_size=c))
            if not any(mask):
                mask[-1] = True
            seqs.append(TokenizedSequence(token_ids=prompt + comp, trainable_mask=mask,
                                          logprobs=[-0.5 if m else math.nan for m in mask],
                                          advantage=float(t) - 1.5, group_index=g, trajectory_index=t))
        groups.append(seqs)
    return groups


def check_layout(rows, L):
    """Every sequence's tokens, positions, mask and visibility are reproduced exactly."""
    vis = dense_mask(rows.segment_ids, rows.parent_ids)[:, 0]  # [rows, L, L]
    assert rows.input_ids.shape[1] == L
    seen = 0
    for gid, seq in enumerate(rows.sequences):
        r, cols = (rows.sequence_ids == gid).nonzero(as_tuple=True)
        assert r.unique().numel() == 1, "a sequence never spans rows"
        r = int(r[0])
        first = int(cols[0])
        parent = int(rows.parent_ids[r, first])
        prompt_cols = (rows.segment_ids[r] == parent).nonzero().squeeze(-1) if parent != int(
            rows.segment_ids[r, first]) else torch.empty(0, dtype=torch.long)
        all_cols = torch.cat([prompt_cols, cols])
        assert rows.input_ids[r, all_cols].tolist() == seq.token_ids
        assert rows.position_ids[r, all_cols].tolist() == list(range(len(seq)))
        # the trainable mask matches (a token with nothing before it cannot be trained)
        expect_mask = list(seq.trainable_mask)
        if not len(prompt_cols):
            expect_mask[0] = False
        assert rows.trainable_mask[r, all_cols].tolist() == expect_mask
        # each completion slot sees exactly its prompt and its own earlier tokens
        for j, q in enumerate(cols.tolist()):
            visible = vis[r, q].nonzero().squeeze(-1).tolist()
            assert visible == sorted(prompt_cols.tolist() + cols[: j + 1].tolist())
        # prev_index chains through the same sequence
        prev = rows.prev_index[r, all_cols].tolist()
        assert prev[1:] == all_cols[:-1].tolist()
        seen += 1
    assert seen == rows.stats.sequences
    assert rows.stats.real_tokens == int(rows.lengths.sum())
    assert rows.stats.computed_tokens == rows.num_rows * L
    assert 0 <= rows.stats.padding_fraction < 1


@settings(max_examples=60)
@given(groups=groups_strategy(), extra=st.integers(0, 40))
def test_packed_rows_reproduce_every_sequence(groups, extra):
    longest = max(len(s) for g in groups for s in g)
    L = longest + extra
    rows = pack(groups, row_length=L)
    assert rows.stats.dropped == 0
    assert len(rows.sequences) == sum(len(g) for g in groups)
    check_layout(rows, L)
    ref = pack_reference(groups, row_length=L)
    check_layout(ref, L)


@settings(max_examples=30)
@given(groups=groups_strategy())
def test_automatic_row_length_fits_everything(groups):
    rows = pack(groups, max_length=512)
    longest = max(len(s) for g in groups for s in g)
    assert rows.row_length >= longest and rows.row_length % 128 == 0
    check_layout(rows, rows.row_length)


def seq(n, trainable_from=1, g=0, t=0):
    return TokenizedSequence(token_ids=list(range(10, 10 + n)), trainable_mask=[i >= trainable_from for i in range(n)],
                             logprobs=[-1.0] * n, group_index=g, trajectory_index=t)


def test_too_long_policies():
    groups = [[seq(10), seq(40, trainable_from=5, t=1)]]
    with pytest.raises(PackingError, match="group 0, trajectory 1 has 40 tokens, more than the row length 32"):
        pack(groups, row_length=32, on_too_long="error")
    dropped = pack(groups, row_length=32, on_too_long="drop")
    assert dropped.stats.dropped == 1 and len(dropped.sequences) == 1
    cut = pack(groups, row_length=32, on_too_long="truncate")
    assert cut.stats.truncated == 1 and sorted(len(s) for s in cut.sequences) == [10, 32]
    # truncation that leaves no trainable token drops instead
    late = pack([[seq(10), seq(40, trainable_from=35, t=1)]], row_length=32, on_too_long="truncate")
    assert late.stats.dropped == 1 and late.stats.truncated == 0


def test_group_prompt_is_stored_once_per_row():
    prompt = list(range(100, 130))
    groups = [[TokenizedSequence(token_ids=prompt + [t] * 5, trainable_mask=[False] * 30 + [True] * 5,
                                 logprobs=[-1.0] * 35) for t in range(4)]]
    rows = pack(groups, row_length=64)
    assert rows.num_rows == 1 and int(rows.lengths[0]) == 30 + 4 * 5


def test_plan_honours_batch_size_token_budget_and_steps():
    groups = [[seq(20 + i, g=i)] for i in range(10)]
    rows = pack(groups, row_length=32, share_prompts=False)
    assert rows.num_rows == 10
    plan = plan_batches(rows, per_device_train_batch_size=3, grad_accumulation_sequences=4)
    assert [len(s.rows) for s in plan.steps] == [4, 4, 2]
    assert [[len(mb.rows) for mb in s.micro_batches] for s in plan.steps] == [[3, 1], [3, 1], [2]]
    assert sum(s.trainable_tokens for s in plan.steps) == int(rows.trainable_mask.sum())
    budget = plan_batches(rows, max_tokens_per_microbatch=90, grad_accumulation_sequences=None)
    assert len(budget.steps) == 1
    assert all(mb.tokens <= 90 for mb in budget.steps[0].micro_batches)
    with pytest.raises(ConfigError, match="max_tokens_per_microbatch=16"):
        plan_batches(rows, max_tokens_per_microbatch=16)
    ref = reference_plan(rows)
    assert len(ref.steps) == 10 and all(mb.width == 32 for s in ref.steps for mb in s.micro_batches)


def test_seed_like_workload_targets():
    groups = workload_groups(load_workload(WORKLOAD))
    ref = pack_reference(groups)
    assert (ref.num_rows, ref.row_length, ref.stats.computed_tokens) == (88, 6144, 540672)
    assert round(ref.stats.padding_fraction, 2) == 0.22 and ref.stats.unique_tokens == 317340
    fixed = pack(groups, row_length=6144)
    assert fixed.num_rows <= 78
    auto = pack(groups, max_length=32768)
    assert auto.stats.computed_tokens <= 0.75 * ref.stats.computed_tokens
    assert auto.stats.padding_fraction < 0.05


@pytest.mark.parametrize("shape, line", [
    ([[1]], "1 micro-batch of 1 row; 1 optimizer step"),
    ([[1], [1]], "2 micro-batches of 1 row; 2 optimizer steps"),
    ([[2]], "1 micro-batch of 2 rows; 1 optimizer step"),
    ([[2, 1]], "2 micro-batches of <=2 rows; 1 optimizer step"),
])
def test_the_plan_line_speaks_plain_english(shape, line):
    """No "1 micro-batches of <=1 rows": singular where one, "<=" only where micro-batches may differ."""
    from artrl.preprocess.plan import BatchPlan, MicroBatch, OptimizerStep

    plan = BatchPlan(steps=[OptimizerStep([MicroBatch(list(range(n)), 8) for n in step], 8, 1) for step in shape])
    assert plan.describe() == line
