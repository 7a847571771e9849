"""art.utils.sft: learning-rate schedules, streaming a JSONL file, chunking a dataset, training from a file."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

import artrl as art
from artrl.errors import TrajectoryError
from artrl.utils.sft import (create_lr_schedule, create_sft_dataset_iterator, get_file_row_count, iterate_file,
                             train_sft_from_file)


def write_jsonl(path, n: int) -> str:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                             {"role": "assistant", "content": f"{i}"}]}) + "\n")
            if i % 3 == 0:
                f.write("\n")  # blank lines are not rows
    return str(path)


def said(trajectory: art.Trajectory) -> str:
    return trajectory.messages_and_choices[1]["content"]


# --------------------------------------------------------------------------- create_lr_schedule


@given(st.integers(1, 60), st.floats(1e-6, 1e-2), st.sampled_from(["cosine", "linear", "constant"]),
       st.floats(0, 1), st.floats(0, 0.9))
def test_lr_schedule_warms_up_then_decays_to_min_lr(total, peak, method, warmup_share, min_share):
    warmup, min_lr = int(total * warmup_share), peak * min_share
    rates = create_lr_schedule(total, peak, method, warmup, min_lr)
    assert len(rates) == total
    assert all(min_lr - 1e-12 <= r <= peak + 1e-12 for r in rates)
    if warmup:
        assert rates[:warmup] == sorted(rates[:warmup]) and rates[0] > min_lr or peak == min_lr
        assert rates[warmup - 1] == pytest.approx(peak)
    decay = rates[warmup:]
    if decay:
        assert decay[0] == pytest.approx(peak)
        assert decay == sorted(decay, reverse=True)
        if method != "constant" and len(decay) > 1:
            assert decay[-1] == pytest.approx(min_lr)


def test_lr_schedule_edge_cases():
    assert create_lr_schedule(0, 1e-4) == []
    assert create_lr_schedule(1, 1e-4, "cosine") == [1e-4]
    with pytest.raises(ValueError, match="Unknown method"):
        create_lr_schedule(3, 1e-4, "step")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- iterate_file


@given(st.integers(1, 30), st.integers(1, 40), st.integers(1, 3), st.integers(0, 100))
def test_iterate_file_yields_every_row_once_per_epoch(tmp_path_factory, rows, buffer, epochs, seed):
    path = write_jsonl(tmp_path_factory.mktemp("sft") / "data.jsonl", rows)
    out = [said(t) for t in iterate_file(path, epochs=epochs, shuffle_buffer_size=buffer, seed=seed)]
    assert Counter(out) == Counter({str(i): epochs for i in range(rows)})
    again = [said(t) for t in iterate_file(path, epochs=epochs, shuffle_buffer_size=buffer, seed=seed)]
    assert again == out  # deterministic for a seed
    skip = min(len(out), seed % 7)
    assert [said(t) for t in iterate_file(path, epochs=epochs, shuffle_buffer_size=buffer, seed=seed,
                                          initial_skip=skip)] == out[skip:]


def test_iterate_file_refuses_other_files_and_names_a_bad_line(tmp_path):
    with pytest.raises(ValueError, match="Only JSONL files are supported"):
        list(iterate_file(str(tmp_path / "data.json")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{"messages": "not a list"}\n')
    with pytest.raises(TrajectoryError, match=r"bad.jsonl:2 must be a JSON object with a 'messages' list"):
        list(iterate_file(str(bad)))
    bad.write_text("{oops\n")
    with pytest.raises(TrajectoryError, match=r"bad.jsonl:1 is not valid JSON"):
        list(iterate_file(str(bad)))


def test_file_rows_are_reward_less_trajectories_with_tools(tmp_path):
    path = tmp_path / "tools.jsonl"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}], "tools": tools}) + "\n")
    t, = iterate_file(str(path))
    assert t.reward == 0.0 and t.tools == tools and get_file_row_count(str(path)) == 1


# --------------------------------------------------------------------------- create_sft_dataset_iterator


def trajectories(n: int) -> list[art.Trajectory]:
    return [art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                                 {"role": "assistant", "content": str(i)}]) for i in range(n)]


@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 5), st.integers(1, 3))
def test_chunks_cover_each_trajectory_once_per_epoch_with_the_whole_runs_schedule(n, chunk_size, batch_size,
                                                                                  epochs):
    chunks = list(create_sft_dataset_iterator(trajectories(n), chunk_size=chunk_size, epochs=epochs,
                                              batch_size=batch_size, show_progress=False))
    batches = math.ceil(n / batch_size) * epochs
    rates = [r for c in chunks for r in c.config.learning_rate]
    assert rates == create_lr_schedule(batches, 2e-4, "linear", int(batches * 0.1))
    for epoch in range(epochs):
        seen = [said(t) for c in chunks if c.epoch == epoch for t in c.trajectories]
        assert sorted(seen, key=int) == [str(i) for i in range(n)]
    for c in chunks:
        assert len(c.config.learning_rate) == math.ceil(len(c.trajectories) / batch_size)
        assert c.config.batch_size == batch_size and c.step == c.epoch * math.ceil(n / batch_size) + c.epoch_step


def test_resuming_skips_the_chunks_done():
    full = list(create_sft_dataset_iterator(trajectories(20), chunk_size=5, batch_size=2, show_progress=False))
    resumed = list(create_sft_dataset_iterator(trajectories(20), chunk_size=5, batch_size=2, initial_step=5,
                                               show_progress=False))
    assert [c.step for c in full] == [0, 5] and [c.step for c in resumed] == [5]
    assert resumed[0].config.learning_rate == full[1].config.learning_rate
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        list(create_sft_dataset_iterator(trajectories(2), chunk_size=0))


# --------------------------------------------------------------------------- train_sft_from_file


def test_train_sft_from_file_trains_the_model(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", 6)
    model = art.TrainableModel(name="sft", project="p", base_model="artrl/tiny")
    backend = art.LocalBackend(path=str(tmp_path / "runs"), show_progress=False)

    async def main():
        await model.register(backend)
        before = await model.get_step()
        # 6 rows x 2 epochs = 12 trajectories = 6 batches of 2; the linear schedule ends at 0
        await train_sft_from_file(model, path, epochs=2, batch_size=2, peak_lr=1e-4)
        return before, await model.get_step()

    try:
        before, after = asyncio.run(main())
    finally:
        backend.close()
    assert after == before + 1
    history = [json.loads(line) for line in (tmp_path / "runs" / "p" / "models" / "sft" / "history.jsonl").open()]
    assert history[-1]["kind"] == "sft" and history[-1]["data/sequences"] == 12
