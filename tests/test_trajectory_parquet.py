"""Parquet trajectory logs in ART's format: round trips, other readers, migration, and crash safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pandas as pd
import polars as pl
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import artrl as art
from artrl.run import storage
from artrl.run import trajectory_logs as tl
from artrl.run.migration import (migrate_jsonl_to_parquet, migrate_model_dir, migrate_trajectories_dir,
                                             read_trajectory_groups_jsonl, trajectory_to_dict)

HAS_GROUP_FIELDS = "metadata" in art.TrajectoryGroup.model_fields

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "pizza"}'}}


def tool_trajectory(make_choice=None) -> art.Trajectory:
    sampled = make_choice("Hi! 你好 👋", tool_calls=None) if make_choice else {"role": "assistant", "content": "ok"}
    return art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Use tools. مرحبا"},
            {"role": "user", "content": 'Search for "pizza" 🍕\n\ttabbed'},
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            {"role": "tool", "content": '{"results": ["Pizza Hut"]}', "tool_call_id": "call_1"},
            sampled,
        ],
        tools=[{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}],
        reward=0.75, metrics={"turns": 3, "ok": True}, metadata={"scenario_id": "s-1", "lang": "中文"},
        logs=["日志 one", "two"])


def test_round_trip_keeps_tool_calls_unicode_choices_and_trajectory_fields(tmp_path, make_choice):
    path = tmp_path / "0001.parquet"
    t = tool_trajectory(make_choice)
    tl.write_trajectory_groups_parquet([art.TrajectoryGroup([t, tool_trajectory()])], path)
    (group,) = tl.read_trajectory_groups_parquet(path)
    back = group.trajectories[0]
    assert (back.reward, back.metrics, back.metadata, back.logs, back.tools) == (
        t.reward, t.metrics, t.metadata, t.logs, t.tools)
    msgs = back.messages_and_choices
    assert msgs[2] == {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
    assert msgs[3] == {"role": "tool", "content": '{"results": ["Pizza Hut"]}', "tool_call_id": "call_1"}
    assert msgs[1]["content"] == 'Search for "pizza" 🍕\n\ttabbed'
    assert msgs[4] == t.messages_and_choices[4]  # a sampled turn comes back as its whole Choice (version 2)
    assert msgs[4].logprobs == t.messages_and_choices[4].logprobs
    flags = [m["trainable"] for m in pq.read_table(path).column("messages").to_pylist()[0]]
    assert flags == [False, False, False, False, True]


def test_the_schema_is_arts_version_2_columns(tmp_path):
    path = tmp_path / "x.parquet"
    tl.write_trajectory_groups_parquet([art.TrajectoryGroup([tool_trajectory()])], path)
    table = pq.read_table(path)
    assert tuple(table.column_names) == tl.COLUMNS
    assert table.schema.metadata[b"art.trajectory_parquet.version"] == b"2"
    assert str(table.schema.field("messages").type) == ("list<element: struct<role: string, content: string, "
                                                        "tool_calls: string, tool_call_id: string, trainable: bool>>")
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"


@pytest.mark.skipif(not HAS_GROUP_FIELDS, reason="TrajectoryGroup has no metadata/metrics/logs fields yet")
def test_group_level_fields_round_trip(tmp_path):
    path = tmp_path / "g.parquet"
    group = art.TrajectoryGroup([tool_trajectory(), tool_trajectory()], metadata={"scenario_id": "abc"},
                                metrics={"judge_score": 0.7}, logs=["group log 你好"])
    tl.write_trajectory_groups_parquet([group], path)
    (back,) = tl.read_trajectory_groups_parquet(path)
    assert (back.metadata, back.metrics, back.logs) == (group.metadata, group.metrics, group.logs)


class Group:
    """A group with ART's group-level fields (the writer reads them with getattr defaults)."""

    def __init__(self, trajectories, exceptions=(), **fields):
        self.trajectories, self.exceptions = list(trajectories), list(exceptions)
        self.__dict__.update(fields)


def test_group_level_fields_and_exceptions_are_written_and_read_by_polars_pandas_and_duckdb(tmp_path):
    path = tmp_path / "0003.parquet"
    groups = [Group([tool_trajectory(), tool_trajectory()], metadata={"scenario_id": "abc", "hard": True},
                    metrics={"judge_score": 0.7}, logs=["group log 你好"]),
              Group([], exceptions=["RuntimeError: env crashed"], metadata={"scenario_id": "def"}),
              Group([tool_trajectory()], exceptions=["TimeoutError: slow"])]
    tl.write_trajectory_groups_parquet(groups, path)

    df = pl.read_parquet(path)
    assert df["group_index"].to_list() == [0, 0, 1, 2]  # one row per trajectory; one for the empty group
    assert json.loads(df["group_metadata"][0]) == {"scenario_id": "abc", "hard": True}
    assert json.loads(df["group_metrics"][0]) == {"judge_score": 0.7} and df["group_logs"][0].to_list() == [
        "group log 你好"]
    assert df["reward"][2] is None and df["messages"][2] is None  # the sentinel row
    assert df["trajectory_index"].to_list() == [0, 1, None, 0]
    assert json.loads(df["group_json"][2])["exceptions"][0]["message"] == "RuntimeError: env crashed"

    pdf = pd.read_parquet(path)
    assert list(pdf["reward"].dropna()) == [0.75, 0.75, 0.75]
    assert pdf["messages"][0][2]["tool_calls"] == json.dumps([TOOL_CALL])

    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect(":memory:")
    # ART's reader query; its rows come back as tuples per message struct
    got = con.execute(f"SELECT group_index, reward, len(messages) FROM '{path}' WHERE reward IS NOT NULL "
                      "ORDER BY group_index").fetchall()
    assert got == [(0, 0.75, 5), (0, 0.75, 5), (2, 0.75, 5)]

    back = tl.read_trajectory_groups_parquet(path)
    assert [len(g.trajectories) for g in back] == [2, 0, 1]  # the exceptions-only group is restored
    assert [["env crashed" in str(e) for e in g.exceptions] for g in back] == [[], [True], [False]]


@settings(max_examples=40)
@given(texts=st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=4),
       rewards=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=3))
def test_any_text_and_reward_round_trip(tmp_path_factory, texts, rewards):
    path = tmp_path_factory.mktemp("prop") / "p.parquet"
    trajs = [art.Trajectory(messages_and_choices=[{"role": "user", "content": t} for t in texts], reward=r)
             for r in rewards]
    tl.write_trajectory_groups_parquet([art.TrajectoryGroup(trajs)], path)
    (g,) = tl.read_trajectory_groups_parquet(path)
    assert [t.reward for t in g.trajectories] == rewards
    assert [[m["content"] for m in t.messages_and_choices] for t in g.trajectories] == [texts] * len(rewards)


def test_a_write_that_fails_midway_leaves_the_previous_file(tmp_path):
    path = tmp_path / "0001.parquet"
    tl.write_trajectory_groups_parquet([art.TrajectoryGroup([tool_trajectory()])], path)
    before = path.read_bytes()

    class Boom:
        trajectories = [tool_trajectory()]
        exceptions = ()

        @property
        def metadata(self):
            raise KeyboardInterrupt  # stands in for a crash while the rows are built

    with pytest.raises(KeyboardInterrupt):
        tl.append_trajectory_groups_parquet([Boom()], path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["0001.parquet"]


# --------------------------------------------------------------------------- migration


def test_our_earlier_jsonl_logs_and_arts_migrate_to_parquet(tmp_path):
    t = tool_trajectory()
    run = tmp_path / "run"
    ours = run / "trajectories" / "val" / "0002.jsonl"
    ours.parent.mkdir(parents=True)
    for _ in range(2):
        # the line our JSONL logs held (messages_and_choices, Choices dumped), one trajectory per line
        storage.append_jsonl(ours, storage.json_safe(trajectory_to_dict(t)))
    with open(ours, "a") as fh:
        fh.write('{"reward": 0.5, "mess')  # a torn last line: a crash mid-append
    arts = run / "trajectories" / "train" / "0001.jsonl"
    arts.parent.mkdir(parents=True)
    arts.write_text(json.dumps({"trajectories": [trajectory_to_dict(t), trajectory_to_dict(t)]}) + "\n")
    unmigrated = read_trajectory_groups_jsonl(ours)  # old logs stay readable as they are
    assert [[t.reward for t in g.trajectories] for g in unmigrated] == [[0.75], [0.75]]
    assert [len(g.trajectories) for g in read_trajectory_groups_jsonl(arts)] == [2]
    result = migrate_model_dir(run)
    assert (result.files_migrated, result.errors) == (2, [])
    assert not ours.exists() and not arts.exists()
    val = tl.read_trajectory_groups_parquet(ours.with_suffix(".parquet"))
    assert [len(g.trajectories) for g in val] == [1, 1]  # our JSONL did not record groups: one group per line
    assert val[0].trajectories[0].messages_and_choices[2]["tool_calls"] == [TOOL_CALL]
    train = tl.read_trajectory_groups_parquet(arts.with_suffix(".parquet"))
    assert [len(g.trajectories) for g in train] == [2] and train[0].trajectories[0].metadata == t.metadata


def test_migration_keeps_an_existing_parquet_log_and_refuses_corrupt_files(tmp_path):
    d = tmp_path / "trajectories" / "val"
    d.mkdir(parents=True)
    tl.write_trajectory_groups_parquet([art.TrajectoryGroup([tool_trajectory()])], d / "0001.parquet")
    (d / "0001.jsonl").write_text(json.dumps(trajectory_to_dict(tool_trajectory())) + "\n")
    (d / "0002.jsonl").write_text("not json{{{\n" + json.dumps(trajectory_to_dict(tool_trajectory())) + "\n")
    result = migrate_trajectories_dir(tmp_path / "trajectories")
    assert result.files_migrated == 1 and len(result.errors) == 1 and "line 1" in result.errors[0]
    assert len(tl.read_trajectory_groups_parquet(d / "0001.parquet")) == 2  # appended, not replaced
    assert (d / "0002.jsonl").exists() and not (d / "0002.parquet").exists()
    dry = migrate_jsonl_to_parquet(d / "0002.jsonl", dry_run=True)
    assert dry.files_migrated == 1 and (d / "0002.jsonl").exists()


def test_register_migrates_the_runs_jsonl_logs(tmp_path):
    import asyncio

    class Backend:
        path = tmp_path

        async def register(self, model):
            pass

    model = art.Model(name="m", project="p")
    old = storage.run_dir(tmp_path, "p", "m") / "trajectories" / "val" / "0000.jsonl"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps(tool_trajectory().for_logging()) + "\n")
    asyncio.run(model.register(Backend()))
    assert not old.exists() and len(tl.read_trajectory_groups_parquet(old.with_suffix(".parquet"))) == 1


# --------------------------------------------------------------------------- a real crash

WRITER = textwrap.dedent('''
    import asyncio, sys
    import artrl as art

    root = sys.argv[1]
    model = art.Model(name="m", project="p", base_path=root, report_metrics=[])
    big = "lorem ipsum " * 400
    groups = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": big + str(i)}],
                                                  reward=float(i)) for i in range(8)]) for _ in range(40)]

    async def main():
        step = 0
        while True:
            await model.log(groups, split="val", step=step)
            print(step, flush=True)
            step += 1

    asyncio.run(main())
''')


@pytest.mark.slow
def test_sigkill_while_writing_leaves_every_earlier_steps_log_readable(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = storage.run_dir(tmp_path, "p", "m")
    mid_write = 0
    for trial in range(3):
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, env=env,
                                text=True)
        done = []
        while len(done) < 2 + trial:  # a few complete steps first
            line = proc.stdout.readline()
            assert line, f"the writer died on its own: {proc.wait()}"
            done.append(int(line))
        logs = run / "trajectories" / "val"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # then kill it while a log is being written (its temporary exists)
            if any(p.name.startswith(storage.TMP_PREFIX) for p in logs.iterdir()):
                break
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        mid_write += any(p.name.startswith(storage.TMP_PREFIX) for p in logs.iterdir())
        finals = sorted(p for p in logs.iterdir() if not p.name.startswith(storage.TMP_PREFIX))
        for p in finals:  # every file under a final name is whole
            groups = tl.read_trajectory_groups_parquet(p)
            assert len(groups) % 40 == 0 and all(len(g.trajectories) == 8 for g in groups), p
        written = {int(p.stem) for p in finals}
        assert set(done) <= written, (done, written)
        storage.clean_temporaries(run)  # what register does; the next trial starts clean
        assert all(not p.name.startswith(storage.TMP_PREFIX) for p in logs.iterdir())
    assert mid_write >= 1, "no kill landed inside a write; the test did not test what it says"


@pytest.mark.parametrize("art_path, home", [("artrl.utils.trajectory_logging", "artrl.run.trajectory_logs"),
                                            ("artrl.utils.trajectory_migration", "artrl.run.migration")])
def test_arts_utils_paths_give_every_public_name_of_the_run_modules(art_path, home):
    # ART's programs import these from art.utils; the code lives beside the run directory (run/)
    import importlib
    alias, module = importlib.import_module(art_path), importlib.import_module(home)
    public = {n for n, v in vars(module).items() if not n.startswith("_") and getattr(v, "__module__", home) == home
              and not isinstance(v, type(importlib))}
    public -= {"annotations", "log"}
    assert public and public <= set(alias.__all__)
    assert all(getattr(alias, n) is getattr(module, n) for n in alias.__all__)
