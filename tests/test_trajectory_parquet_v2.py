"""ART 0.5.23's Parquet trajectory format, version 2: what artrl writes, what it reads, and version 1 files.

The expected layout is written out here from ART 0.5.23's definition (art/utils/trajectory_logging.py): fourteen
columns, `art.trajectory_parquet.version` = "2" in the schema metadata, compact JSON of the group and of the
whole trajectory (fields at their defaults left out), and the query columns beside them.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types.chat.chat_completion import Choice

import artrl as art
from artrl.trajectories import LegacyHistory, PydanticException
from artrl.run import trajectory_logs as tl

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "é"}'}}
USER = {"role": "user", "content": "Find pizza 🍕"}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def choice(text: str | None, tool_calls: list | None = None, **extra) -> Choice:
    message: dict = {"role": "assistant", "content": text}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return Choice.model_validate({"index": 0, "finish_reason": "stop", "message": message,
                                  "logprobs": {"content": [{"token": "a", "logprob": -0.5, "bytes": [97],
                                                            "top_logprobs": []}]}, **extra})


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ART 0.5.23's schema, as its _schema() defines it.
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string()),
                     ("tool_call_id", pa.string()), ("trainable", pa.bool_())])
ART_V2_SCHEMA = pa.schema([
    ("format_version", pa.int16()), ("group_index", pa.int64()), ("trajectory_index", pa.int64()),
    ("group_json", pa.large_string()), ("trajectory_json", pa.large_string()), ("group_metadata", pa.string()),
    ("group_metrics", pa.string()), ("group_logs", pa.list_(pa.string())), ("reward", pa.float64()),
    ("metrics", pa.string()), ("metadata", pa.string()), ("tools", pa.string()), ("logs", pa.list_(pa.string())),
    ("messages", pa.list_(MESSAGE)),
], metadata={b"art.trajectory_parquet.version": b"2"})
ART_V1_SCHEMA = pa.schema([
    ("group_index", pa.int64()), ("group_metadata", pa.string()), ("group_metrics", pa.string()),
    ("group_logs", pa.list_(pa.string())), ("reward", pa.float64()), ("metrics", pa.string()),
    ("metadata", pa.string()), ("tools", pa.string()), ("logs", pa.list_(pa.string())),
    ("messages", pa.list_(MESSAGE)),
])


def groups():
    sampled = choice(None, tool_calls=[TOOL_CALL], token_ids=[5, 6], policy_version=3)
    first = art.Trajectory(
        messages_and_choices=[USER, sampled, {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
                              choice("Done, 完了")],
        tools=TOOLS, reward=0.5, initial_policy_version=3, final_policy_version=4,
        metrics={"turns": 2, "ok": True}, metadata={"id": "s-1", "nested": {"k": [1, 2]}}, logs=["log 日志"],
        additional_histories=[LegacyHistory(messages_and_choices=[USER, choice("sub")])])
    plain = art.Trajectory(messages_and_choices=[USER, {"role": "assistant", "content": "hi"}])  # reward 0.0
    return [art.TrajectoryGroup([first, plain], metadata={"task": "pizza"}, metrics={"judge": 0.25},
                                logs=["group log"]),
            art.TrajectoryGroup([], exceptions=[PydanticException(type="RuntimeError", message="env crashed",
                                                                  traceback="tb")])]


def test_artrl_writes_arts_version_2_layout(tmp_path):
    path = tmp_path / "0001.parquet"
    gs = groups()
    tl.write_trajectory_groups_parquet(gs, path)
    table = pq.read_table(path)
    assert table.schema.equals(ART_V2_SCHEMA, check_metadata=False)
    assert table.schema.metadata[b"art.trajectory_parquet.version"] == b"2"
    assert pq.ParquetFile(path).metadata.row_group(0).column(3).compression == "ZSTD"
    rows = table.to_pylist()
    assert [(r["format_version"], r["group_index"], r["trajectory_index"]) for r in rows] == [
        (2, 0, 0), (2, 0, 1), (2, 1, None)]

    first, plain = gs[0].trajectories
    sampled, done = first.messages_and_choices[1], first.messages_and_choices[3]
    sub_choice = first.additional_histories[0].messages_and_choices[1]
    # the whole trajectory, fields at their defaults left out, the two conversation fields last
    # (tools as the model holds them: validated as OpenAI's tool TypedDict, which orders the keys)
    assert rows[0]["trajectory_json"] == compact({
        "tools": first.tools, "reward": 0.5, "initial_policy_version": 3, "final_policy_version": 4,
        "metrics": {"turns": 2, "ok": True}, "metadata": {"id": "s-1", "nested": {"k": [1, 2]}},
        "logs": ["log 日志"],
        "messages_and_choices": [USER, sampled.model_dump(mode="json"),
                                 {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
                                 done.model_dump(mode="json")],
        "additional_histories": [{"tools": None, "messages_and_choices": [USER, sub_choice.model_dump(mode="json")]}],
    })
    assert '"token_ids":[5,6]' in rows[0]["trajectory_json"] and '"policy_version":3' in rows[0]["trajectory_json"]
    assert rows[1]["trajectory_json"] == compact({"messages_and_choices": [USER, {"role": "assistant",
                                                                                  "content": "hi"}]})
    assert rows[2]["trajectory_json"] is None  # the sentinel of a group without trajectories
    assert rows[0]["group_json"] == rows[1]["group_json"] == compact(
        {"metadata": {"task": "pizza"}, "metrics": {"judge": 0.25}, "logs": ["group log"]})
    assert rows[2]["group_json"] == compact(
        {"exceptions": [{"type": "RuntimeError", "message": "env crashed", "traceback": "tb"}]})

    # the query columns
    assert (rows[0]["group_metadata"], rows[0]["group_metrics"], rows[0]["group_logs"]) == (
        '{"task":"pizza"}', '{"judge":0.25}', ["group log"])
    assert (rows[2]["group_metadata"], rows[2]["group_metrics"], rows[2]["group_logs"]) == (None, None, None)
    assert (rows[0]["reward"], rows[1]["reward"], rows[2]["reward"]) == (0.5, 0.0, None)
    assert rows[0]["metrics"] == '{"turns":2,"ok":true}' and rows[1]["metrics"] is None
    assert rows[0]["metadata"] == '{"id":"s-1","nested":{"k":[1,2]}}' and rows[1]["metadata"] is None
    assert json.loads(rows[0]["tools"]) == TOOLS and rows[0]["tools"] == compact(first.tools)
    assert rows[1]["tools"] is None
    assert rows[0]["logs"] == ["log 日志"] and rows[1]["logs"] is None
    assert rows[0]["messages"] == [
        {"role": "user", "content": "Find pizza 🍕", "tool_calls": None, "tool_call_id": None, "trainable": False},
        # a Choice's tool calls as `Choice.to_dict()` gives them (the OpenAI model's field order), json.dumps
        {"role": "assistant", "content": None, "tool_calls": '[{"id": "call_1", "function": {"arguments": '
         '"{\\"q\\": \\"\\u00e9\\"}", "name": "search"}, "type": "function"}]', "tool_call_id": None,
         "trainable": True},
        {"role": "tool", "content": "ok", "tool_calls": None, "tool_call_id": "call_1", "trainable": False},
        {"role": "assistant", "content": "Done, 完了", "tool_calls": None, "tool_call_id": None, "trainable": True},
    ]
    assert rows[2]["messages"] is None


def test_version_2_round_trips_through_artrls_reader(tmp_path):
    path = tmp_path / "0001.parquet"
    gs = groups()
    tl.write_trajectory_groups_parquet(gs, path)
    back = tl.read_trajectory_groups_parquet(path)
    assert len(back) == 2
    for old, new in zip(gs[0].trajectories, back[0].trajectories, strict=True):
        assert new.model_dump() == old.model_dump()
    restored = back[0].trajectories[0]
    assert isinstance(restored.messages_and_choices[1], Choice)  # sampled turns stay Choices, record and all
    assert restored.messages_and_choices[1].model_extra == {"token_ids": [5, 6], "policy_version": 3}
    assert type(restored.additional_histories[0]) is LegacyHistory
    assert (back[0].metadata, back[0].metrics, back[0].logs) == (gs[0].metadata, gs[0].metrics, gs[0].logs)
    assert back[1].trajectories == [] and back[1].exceptions == gs[1].exceptions


def test_a_file_as_art_writes_it_reads_back(tmp_path):
    """Rows built from ART's definition (not by artrl's writer): a dict-shaped Choice, an unreadable one kept
    as the dict it is, trajectories out of order, an empty group's sentinel."""
    path = tmp_path / "art.parquet"
    ch = choice("yes")
    bad_choice = {"finish_reason": "stop", "index": 0, "message": "not a message"}
    t0 = {"reward": 1.0, "metadata": {"a": 1}, "messages_and_choices": [USER, ch.model_dump(mode="json")],
          "additional_histories": [{"tools": None, "messages_and_choices": [USER]}]}
    t1 = {"messages_and_choices": [USER, bad_choice]}
    common = {"format_version": 2, "group_metadata": None, "group_metrics": None, "group_logs": None,
              "metrics": None, "tools": None, "logs": None, "messages": None}
    rows = [
        {**common, "group_index": 0, "trajectory_index": 1, "group_json": "{}", "trajectory_json": compact(t1),
         "reward": 0.0, "metadata": None},
        {**common, "group_index": 0, "trajectory_index": 0, "group_json": "{}", "trajectory_json": compact(t0),
         "reward": 1.0, "metadata": '{"a":1}'},
        {**common, "group_index": 1, "trajectory_index": None, "group_json": '{"logs":["x"]}',
         "trajectory_json": None, "reward": None, "metadata": None},
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=ART_V2_SCHEMA), path, compression="zstd")
    g0, g1 = tl.read_trajectory_groups_parquet(path)
    a, b = g0.trajectories
    assert (a.reward, a.metadata, b.reward) == (1.0, {"a": 1}, 0.0)
    assert a.messages_and_choices == [USER, ch] and b.messages_and_choices == [USER, bad_choice]
    assert a.additional_histories == [LegacyHistory(messages_and_choices=[USER])]
    assert (g1.trajectories, g1.logs) == ([], ["x"])


def test_version_1_files_still_read(tmp_path):
    """ART's ten columns without a version marker (ART before 0.5.23), and artrl's with its two extra columns."""
    tool_calls = json.dumps([TOOL_CALL])
    messages = [{"role": "user", "content": "q", "tool_calls": None, "tool_call_id": None, "trainable": False},
                {"role": "assistant", "content": None, "tool_calls": tool_calls, "tool_call_id": None,
                 "trainable": True}]
    row = {"group_index": 0, "group_metadata": '{"g":1}', "group_metrics": '{"m":0.5}', "group_logs": ["gl"],
           "reward": 0.25, "metrics": '{"turns":1}', "metadata": '{"id":"x"}', "tools": compact(TOOLS),
           "logs": ["l"], "messages": messages}
    arts = tmp_path / "arts.parquet"
    pq.write_table(pa.Table.from_pylist([row, {**row, "group_index": 1, "reward": 1.0}], schema=ART_V1_SCHEMA),
                   arts, compression="zstd")
    assert tl.file_version(arts) == 1
    g0, g1 = tl.read_trajectory_groups_parquet(arts)
    (t,) = g0.trajectories
    assert (t.reward, t.metrics, t.metadata, t.tools, t.logs) == (0.25, {"turns": 1}, {"id": "x"}, TOOLS, ["l"])
    assert t.messages_and_choices == [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]
    assert (g0.metadata, g0.metrics, g0.logs) == ({"g": 1}, {"m": 0.5}, ["gl"]) and g1.trajectories[0].reward == 1.0

    ours = tmp_path / "ours.parquet"  # artrl's version 1: extra columns, a placeholder row for a failed group
    schema = ART_V1_SCHEMA.append(pa.field("additional_histories", pa.string())).append(
        pa.field("group_exceptions", pa.string()))
    histories = compact([{"messages_and_choices": [USER], "tools": None}])
    exceptions = compact([{"type": "RuntimeError", "message": "boom", "traceback": None}])
    pq.write_table(pa.Table.from_pylist([
        {**row, "additional_histories": histories, "group_exceptions": None},
        {"group_index": 1, "reward": None, "messages": None, "group_exceptions": exceptions}], schema=schema), ours)
    h0, h1 = tl.read_trajectory_groups_parquet(ours)
    assert h0.trajectories[0].additional_histories == [LegacyHistory(messages_and_choices=[USER])]
    assert h1.trajectories == [] and [e.message for e in h1.exceptions] == ["boom"]

    # adding groups to a version-1 file rewrites it as version 2, its groups first
    tl.append_trajectory_groups_parquet([art.TrajectoryGroup([art.Trajectory(reward=2.0)])], ours)
    assert tl.file_version(ours) == 2
    assert [[t.reward for t in g.trajectories] for g in tl.read_trajectory_groups_parquet(ours)] == [
        [0.25], [], [2.0]]


def test_appending_to_a_version_2_file_numbers_the_new_groups_after_its_own(tmp_path):
    path = tmp_path / "0001.parquet"
    tl.write_trajectory_groups_parquet(groups(), path)
    tl.append_trajectory_groups_parquet([art.TrajectoryGroup([art.Trajectory(reward=3.0)])], path)
    table = pq.read_table(path)
    assert table.schema.metadata[b"art.trajectory_parquet.version"] == b"2"
    assert table.column("group_index").to_pylist() == [0, 0, 1, 2]
    assert [len(g.trajectories) for g in tl.read_trajectory_groups_parquet(path)] == [2, 0, 1]


@pytest.mark.parametrize("metadata, columns, match", [
    ({b"art.trajectory_parquet.version": b"3"}, None, "unsupported trajectory Parquet version 3"),
    ({b"art.trajectory_parquet.version": b"two"}, None, "invalid trajectory Parquet version"),
    ({b"art.trajectory_parquet.version": b"2"}, "v1", "without the format_version column"),
    (None, "json-only", "no format_version column"),
])
def test_files_of_other_versions_or_with_a_broken_marker_are_refused(tmp_path, metadata, columns, match):
    path = tmp_path / "x.parquet"
    if columns == "v1":
        schema = ART_V1_SCHEMA
    elif columns == "json-only":
        schema = pa.schema([("group_index", pa.int64()), ("group_json", pa.large_string())])
    else:
        schema = ART_V2_SCHEMA
    pq.write_table(pa.Table.from_pylist([], schema=schema.with_metadata(metadata)), path)
    with pytest.raises(ValueError, match=match):
        tl.read_trajectory_groups_parquet(path)
