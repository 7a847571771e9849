"""Trajectory logs as Parquet, in ART's format (`art.utils.trajectory_logging`).

One row per trajectory, ZSTD-compressed, with ART 0.5.x's ten columns in
ART's order and types, so ART's own reader (and duckdb, polars, pandas) read
our files:

| column          | type                       | content                                        |
|-----------------|----------------------------|------------------------------------------------|
| group_index     | int64                      | the group's position in the logged list        |
| group_metadata  | string (JSON) or null      | TrajectoryGroup.metadata                       |
| group_metrics   | string (JSON) or null      | TrajectoryGroup.metrics                        |
| group_logs      | list<string> or null       | TrajectoryGroup.logs                           |
| reward          | float64                    | Trajectory.reward                              |
| metrics         | string (JSON) or null      | Trajectory.metrics                             |
| metadata        | string (JSON) or null      | Trajectory.metadata                            |
| tools           | string (JSON) or null      | Trajectory.tools                               |
| logs            | list<string> or null       | Trajectory.logs                                |
| messages        | list<struct<role, content, tool_calls (JSON), tool_call_id, trainable>> | one per message; `trainable` marks sampled turns (Choices) |

Two columns of ours follow ART's (ART's reader ignores them):
`additional_histories` (JSON, as ART's JSONL migration writes it) and
`group_exceptions` (JSON list of {type, message, traceback}). A group with no
trajectories is kept as one placeholder row whose `reward` and `messages`
are null (ART's reader skips such rows; ours restores the group).

A trajectory of captured exchanges (`with art.Trajectory() as t:`) is logged as the conversations
its exchanges file into (wire_records.py): the first as `messages` and `tools`, the others as
`additional_histories`; read back, it is a trajectory of those histories (the exchanges
themselves, with their requests and raw responses, are not kept).

What a log does not keep: a sampled turn's logprobs and token ids (ART's
format has no place for them), and content given as a list of text parts,
which is stored as its joined text. Read back, a sampled turn is an assistant
message dict, as with ART.

Files are written whole or not at all (temporary file, fsync, rename).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._fs import write_atomic
from ..errors import TrajectoryError
from ..trajectories import LegacyHistory, Trajectory, TrajectoryGroup
from ..wire_records import record_histories

log = logging.getLogger(__name__)

COMPRESSION = "zstd"
ART_COLUMNS = ("group_index", "group_metadata", "group_metrics", "group_logs", "reward", "metrics", "metadata",
               "tools", "logs", "messages")
EXTRA_COLUMNS = ("additional_histories", "group_exceptions")


def schema() -> Any:
    """The Parquet schema: ART's ten columns, then ours."""
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string()),
                         ("tool_call_id", pa.string()), ("trainable", pa.bool_())])
    return pa.schema([
        ("group_index", pa.int64()), ("group_metadata", pa.string()), ("group_metrics", pa.string()),
        ("group_logs", pa.list_(pa.string())), ("reward", pa.float64()), ("metrics", pa.string()),
        ("metadata", pa.string()), ("tools", pa.string()), ("logs", pa.list_(pa.string())),
        ("messages", pa.list_(message)), ("additional_histories", pa.string()), ("group_exceptions", pa.string()),
    ])


# --------------------------------------------------------------------------- writing


def _json_or_none(value: Any) -> str | None:
    return json.dumps(value, ensure_ascii=False, default=str) if value else None


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _as_dict(item: Any) -> dict[str, Any]:
    if isinstance(item, dict):
        return item
    if hasattr(item, "model_dump"):
        return item.model_dump(mode="json", exclude_none=False)
    raise TypeError(f"a message must be a dict or a Choice, got {type(item).__name__}")


def flatten_message(item: Any) -> dict[str, Any]:
    """A message dict or a Choice as one `messages` struct (a Choice is an assistant turn, trainable)."""
    msg = _as_dict(item)
    trainable = "finish_reason" in msg and "message" in msg and "role" not in msg
    if trainable:
        msg = _as_dict(msg.get("message") or {})
    tool_calls = msg.get("tool_calls")
    if tool_calls:
        tool_calls = [_as_dict(tc) for tc in tool_calls]
    return {"role": msg.get("role"), "content": _text(msg.get("content")),
            "tool_calls": json.dumps(tool_calls, ensure_ascii=False) if tool_calls else None,
            "tool_call_id": None if trainable else msg.get("tool_call_id"), "trainable": trainable}


def _exception_record(e: Any) -> dict[str, Any]:
    if isinstance(e, BaseException):
        return {"type": type(e).__name__, "message": str(e), "traceback": None}
    if isinstance(e, str):
        return {"type": None, "message": e, "traceback": None}
    return {"type": getattr(e, "type", None), "message": str(getattr(e, "message", e)),
            "traceback": getattr(e, "traceback", None)}


def _histories(hs: list[LegacyHistory]) -> str | None:
    return _json_or_none([{"messages_and_choices": [_as_dict(m) for m in h.messages_and_choices],
                           "tools": h.tools} for h in hs])


def _conversations(t: Trajectory) -> tuple[list[Any], Any, list[LegacyHistory]]:
    """(main conversation, its tools, the other conversations) of a trajectory; for captured exchanges, the
    conversations they file into (wire_records.py), the first as the main one."""
    if not t.exchanges:
        return t.messages_and_choices, t.tools, list(t.additional_histories)
    try:
        histories = [h for h, _ in record_histories(t.exchanges)]
    except TrajectoryError as e:
        log.warning("a trajectory's exchanges are logged without their messages: %s", e)
        return [], None, []
    if not histories:
        return [], None, []
    return histories[0].messages_and_choices, histories[0].tools, histories[1:]


def rows_of(trajectory_groups: list[Any], first_group_index: int = 0) -> list[dict[str, Any]]:
    """One row per trajectory (a placeholder row for a group without any), in the schema's columns.

    Group-level fields are read with `getattr` defaults, so groups without `metadata`,
    `metrics` or `logs` attributes log them as null.
    """
    rows: list[dict[str, Any]] = []
    for gi, group in enumerate(trajectory_groups, start=first_group_index):
        group_fields = {
            "group_index": gi,
            "group_metadata": _json_or_none(getattr(group, "metadata", None)),
            "group_metrics": _json_or_none(getattr(group, "metrics", None)),
            "group_logs": list(getattr(group, "logs", None) or []) or None,
            "group_exceptions": _json_or_none([_exception_record(e) for e in getattr(group, "exceptions", [])]),
        }
        trajectories = [t for t in group.trajectories if isinstance(t, Trajectory)]
        if not trajectories:
            rows.append({**group_fields, "reward": None, "metrics": None, "metadata": None, "tools": None,
                         "logs": None, "messages": None, "additional_histories": None})
        for t in trajectories:
            items, tools, others = _conversations(t)
            rows.append({**group_fields, "reward": float(t.reward), "metrics": _json_or_none(t.metrics),
                         "metadata": _json_or_none(t.metadata), "tools": _json_or_none(tools),
                         "logs": list(t.logs) or None,
                         "messages": [flatten_message(m) for m in items],
                         "additional_histories": _histories(others)})
    return rows


def _table(rows: list[dict[str, Any]]) -> Any:
    import pyarrow as pa

    return pa.Table.from_pylist(rows, schema=schema())


def _write_table(table: Any, path: str | Path) -> None:
    import pyarrow.parquet as pq

    write_atomic(path, lambda tmp: pq.write_table(table, tmp, compression=COMPRESSION))


def write_trajectory_groups_parquet(trajectory_groups: list[Any], path: str | Path) -> None:
    """Write the groups to `path` (replacing it) as one ZSTD Parquet file, atomically."""
    _write_table(_table(rows_of(list(trajectory_groups))), path)


def append_trajectory_groups_parquet(trajectory_groups: list[Any], path: str | Path) -> None:
    """Add the groups to the file at `path` (created if absent), numbering them after its groups.

    ART overwrites a step's file when the same split is logged twice at one step; we keep both.
    """
    groups = list(trajectory_groups)
    append_rows(lambda first: rows_of(groups, first), path)


def append_rows(make_rows: Callable[[int], list[dict[str, Any]]], path: str | Path) -> None:
    """Rewrite `path` atomically with its rows followed by `make_rows(first free group index)`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        return _write_table(_table(make_rows(0)), path)
    old = _conform(pq.read_table(path))
    indices = [i for i in old.column("group_index").to_pylist() if i is not None]
    new = _table(make_rows(max(indices) + 1 if indices else 0))
    _write_table(pa.concat_tables([old, new]), path)


def _conform(table: Any) -> Any:
    """A table read from disk in our schema (files written by ART lack our two columns)."""
    import pyarrow as pa

    target = schema()
    for name in target.names:
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(table.num_rows, type=target.field(name).type))
    return table.select(target.names).cast(target)


# --------------------------------------------------------------------------- reading


def _load_json(payload: Any, default: Any) -> Any:
    if payload is None or payload == "":
        return default
    if isinstance(payload, (dict, list)):
        return payload
    try:
        return json.loads(payload)
    except (TypeError, ValueError):
        log.warning("unreadable JSON field in a trajectory log (%r...); read as empty", str(payload)[:60])
        return default


def unflatten_message(msg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": msg["role"], "content": msg.get("content")}
    if msg.get("tool_calls"):
        out["tool_calls"] = json.loads(msg["tool_calls"])
    if msg.get("tool_call_id"):
        out["tool_call_id"] = msg["tool_call_id"]
    return out


def _exceptions(records: list[dict[str, Any]]) -> list[Any]:
    """Exceptions in the shape this TrajectoryGroup keeps (ART's PydanticException where it exists)."""
    from .. import trajectories as tmod

    shaped = getattr(tmod, "PydanticException", None)
    out: list[Any] = []
    for r in records:
        if shaped is not None:
            out.append(shaped(type=r.get("type") or "", message=r.get("message") or "",
                              traceback=r.get("traceback") or ""))
        else:
            out.append(f"{r['type']}: {r['message']}" if r.get("type") else str(r.get("message")))
    return out


_warned_group_fields = False


def _make_group(trajectories: list[Trajectory], fields: dict[str, Any]) -> TrajectoryGroup | None:
    global _warned_group_fields
    known = TrajectoryGroup.model_fields
    extra = {k: fields[k] for k in ("metadata", "metrics", "logs") if k in known}
    lost = [k for k in ("metadata", "metrics", "logs") if k not in known and fields[k]]
    if lost and not _warned_group_fields:
        _warned_group_fields = True
        log.warning("this TrajectoryGroup class has no %s field(s); the logged group %s are not restored",
                    "/".join(lost), "/".join(lost))
    exceptions = _exceptions(fields["exceptions"])
    try:
        group = TrajectoryGroup(trajectories, **extra)
    except ValueError as e:  # a class that wants the failures of a group without trajectories up front
        if not exceptions:
            log.warning("a logged group with no trajectories and no exceptions could not be rebuilt (%s); "
                        "skipped", e)
            return None
        group = TrajectoryGroup(trajectories, exceptions=exceptions, **extra)
    if exceptions:
        group.exceptions = exceptions
    return group


def _trajectory(row: dict[str, Any]) -> Trajectory:
    histories = [LegacyHistory(messages_and_choices=h.get("messages_and_choices") or [], tools=h.get("tools"))
                 for h in _load_json(row.get("additional_histories"), [])]
    return Trajectory(messages_and_choices=[unflatten_message(m) for m in row.get("messages") or []],
                      reward=row["reward"] if row.get("reward") is not None else 0.0,
                      metrics=_load_json(row.get("metrics"), {}), metadata=_load_json(row.get("metadata"), {}),
                      tools=_load_json(row.get("tools"), None), logs=list(row.get("logs") or []),
                      additional_histories=histories)


def read_trajectory_groups_parquet(path: str | Path) -> list[TrajectoryGroup]:
    """The groups of a Parquet trajectory log (ours or ART's), in logged order."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    groups: dict[int, dict[str, Any]] = {}
    for row in table.to_pylist():
        gi = int(row.get("group_index") or 0)
        g = groups.get(gi)
        if g is None:
            g = groups[gi] = {"trajectories": [], "metadata": _load_json(row.get("group_metadata"), {}),
                              "metrics": _load_json(row.get("group_metrics"), {}),
                              "logs": [str(x) for x in row.get("group_logs") or []],
                              "exceptions": _load_json(row.get("group_exceptions"), [])}
        if row.get("reward") is None and row.get("messages") is None:
            continue  # the placeholder row of a group without trajectories
        g["trajectories"].append(_trajectory(row))
    out = [_make_group(g["trajectories"], g) for _, g in sorted(groups.items())]
    return [g for g in out if g is not None]
