"""Trajectory logs as Parquet, in ART 0.5.23's format (version 2): ART's `art.utils.trajectory_logging`
(artrl.utils.trajectory_logging re-exports this module).

A file is written ZSTD-compressed with ART 0.5.23's fourteen columns, in ART's order and types, and
the version in the schema's metadata (`art.trajectory_parquet.version` = `2`), so ART's own reader
(and duckdb, polars, pandas) read our files and ours reads ART's. One row per trajectory; a group
with no trajectories is one sentinel row (`trajectory_index`, `trajectory_json` null).

| column           | type                 | content                                                    |
|------------------|----------------------|------------------------------------------------------------|
| format_version   | int16                | 2                                                          |
| group_index      | int64                | the group's position in the file                           |
| trajectory_index | int64 or null        | the trajectory's position in its group (null: sentinel)    |
| group_json       | large_string (JSON)  | the group without its trajectories (authoritative)         |
| trajectory_json  | large_string (JSON)  | the whole trajectory (authoritative)                       |
| group_metadata   | string (JSON) / null | TrajectoryGroup.metadata, when not empty                   |
| group_metrics    | string (JSON) / null | TrajectoryGroup.metrics, when not empty                    |
| group_logs       | list<string> / null  | TrajectoryGroup.logs, when not empty                       |
| reward           | float64 / null       | Trajectory.reward                                          |
| metrics          | string (JSON) / null | Trajectory.metrics, when not empty                         |
| metadata         | string (JSON) / null | Trajectory.metadata, when not empty                        |
| tools            | string (JSON) / null | Trajectory.tools, when not empty                           |
| logs             | list<string> / null  | Trajectory.logs, when not empty                            |
| messages         | list<struct<role, content, tool_calls (JSON), tool_call_id, trainable>> / null | the main conversation, one struct per message; `trainable` marks sampled turns (Choices); null for a trajectory of captured exchanges, or one whose content is not text |

The JSON columns are compact (`,` and `:` without spaces, non-ASCII kept). `group_json` and
`trajectory_json` are the pydantic JSON dumps ART makes: fields equal to their defaults are left out
(a group with nothing but trajectories is `{}`), a trajectory's `start_time` is not kept, its
`messages_and_choices` and `additional_histories` come last, a sampled turn is its whole OpenAI
`Choice` (logprobs and the server's token record included), and captured exchanges are kept whole
(request, response, times). The materialised columns after them are for queries; readers rebuild
from the two JSON columns.

Reading takes version 2 and version 1, the format artrl and ART before 0.5.23 wrote (ART's ten
columns from `group_index` to `messages`, no version marker; artrl's files add
`additional_histories` and `group_exceptions` after them). A version-1 file keeps what those columns
hold: a sampled turn reads back as an assistant message dict. A file of another version, or one whose
marker and columns disagree, is refused with a ValueError, as ART's reader does.

Where artrl differs from ART's writer: a metadata value that JSON cannot write is written as its
`str()` (ART raises), and appending to a step's file keeps its groups (ART replaces the file). A
version-1 file appended to is rewritten as version 2.

Files are written whole or not at all (temporary file, fsync, rename).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
from openai.types.chat.chat_completion import Choice

from ..runtime.fs import write_atomic
from ..trajectories.history import LegacyHistory
from ..trajectories.data import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)

COMPRESSION = "zstd"
FORMAT_VERSION = 2
#: The schema metadata key that carries the format version (absent in version 1).
VERSION_METADATA_KEY = b"art.trajectory_parquet.version"
#: artrl's schema metadata key: the SHA-256 digests (a JSON list) of the JSONL logs whose groups a file holds
#: (run/migration.py), so that migrating one twice, or again after a crash, never adds its groups twice.
MIGRATED_METADATA_KEY = b"artrl.migrated_jsonl_sha256"
COLUMNS = ("format_version", "group_index", "trajectory_index", "group_json", "trajectory_json", "group_metadata",
           "group_metrics", "group_logs", "reward", "metrics", "metadata", "tools", "logs", "messages")
#: Version 1: ART's ten columns, then the two that artrl's version-1 files added.
V1_ART_COLUMNS = ("group_index", "group_metadata", "group_metrics", "group_logs", "reward", "metrics", "metadata",
                  "tools", "logs", "messages")
V1_EXTRA_COLUMNS = ("additional_histories", "group_exceptions")
#: A field of ART's Choice that the log leaves out (ART's MoE routing replay record).
MOE_ROUTING_KEY = "art_moe_routing"
_CHOICE_KEYS = frozenset({"finish_reason", "index", "message"})
_ANY = pydantic.TypeAdapter(Any)


def _message_type() -> Any:
    import pyarrow as pa

    return pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string()),
                      ("tool_call_id", pa.string()), ("trainable", pa.bool_())])


def schema() -> Any:
    """The version-2 schema: ART 0.5.23's fourteen columns and the version in the metadata."""
    import pyarrow as pa

    return pa.schema([
        ("format_version", pa.int16()), ("group_index", pa.int64()), ("trajectory_index", pa.int64()),
        ("group_json", pa.large_string()), ("trajectory_json", pa.large_string()),
        ("group_metadata", pa.string()), ("group_metrics", pa.string()), ("group_logs", pa.list_(pa.string())),
        ("reward", pa.float64()), ("metrics", pa.string()), ("metadata", pa.string()), ("tools", pa.string()),
        ("logs", pa.list_(pa.string())), ("messages", pa.list_(_message_type())),
    ], metadata={VERSION_METADATA_KEY: str(FORMAT_VERSION).encode()})


# --------------------------------------------------------------------------- writing


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _jsonable(value: Any) -> Any:
    """`value` as JSON data, as pydantic's JSON mode writes it; what it cannot write becomes its str()."""
    return _ANY.dump_python(value, mode="json", fallback=str)


def _choice_data(item: Any) -> dict[str, Any] | None:
    """A sampled turn as its whole Choice's JSON (without ART's MoE routing field); None for a message."""
    if isinstance(item, Choice):
        return item.model_dump(mode="json", exclude={MOE_ROUTING_KEY}, fallback=str)
    if isinstance(item, Mapping) and _CHOICE_KEYS <= item.keys():
        try:
            return Choice.model_validate(dict(item)).model_dump(mode="json", exclude={MOE_ROUTING_KEY},
                                                                fallback=str)
        except pydantic.ValidationError:
            return None
    if type(item).__name__ == "Choices" and type(item).__module__.startswith("litellm"):
        raw = item.model_dump(mode="json")
        return Choice.model_validate(raw).model_dump(mode="json", exclude={MOE_ROUTING_KEY}, fallback=str)
    return None


def _items_data(items: list[Any]) -> list[Any]:
    return [choice if (choice := _choice_data(item)) is not None else _jsonable(item) for item in items]


def _history_data(history: LegacyHistory) -> dict[str, Any]:
    data: dict[str, Any] = {"tools": _jsonable(history.tools)}
    if history.messages_and_choices:
        data["messages_and_choices"] = _items_data(history.messages_and_choices)
    return data


def _exchanges_data(exchanges: Any) -> dict[str, Any]:
    """Captured exchanges as ART dumps them: protocols without exchanges left out; each exchange's times,
    request and response (chat completions whole, responses as sent, the others without default fields)."""
    data: dict[str, Any] = {}
    for name in ("chat_completions", "completions", "responses", "messages"):
        out = []
        for exchange in getattr(exchanges, name):
            response = exchange.response
            if name == "chat_completions":
                response_data = response.model_dump(mode="json", exclude={"choices": {"__all__": {MOE_ROUTING_KEY}}},
                                                    fallback=str)
            elif name == "responses":
                response_data = response.model_dump(mode="json", exclude_unset=True, fallback=str)
            else:
                response_data = response.model_dump(mode="json", exclude_defaults=True, fallback=str)
            out.append({"start_time": _jsonable(exchange.start_time), "end_time": _jsonable(exchange.end_time),
                        "request": _jsonable(exchange.request), "response": response_data})
        if out:
            data[name] = out
    return data


def trajectory_data(trajectory: Trajectory) -> dict[str, Any]:
    """The `trajectory_json` of a trajectory: ART's JSON dump, fields at their defaults left out."""
    data: dict[str, Any] = {}
    if trajectory.exchanges:
        data["exchanges"] = _exchanges_data(trajectory.exchanges)
    if trajectory.tools is not None:
        data["tools"] = _jsonable(trajectory.tools)
    if trajectory.reward != 0.0:
        data["reward"] = float(trajectory.reward)
    for name in ("initial_policy_version", "final_policy_version"):
        if getattr(trajectory, name) is not None:
            data[name] = getattr(trajectory, name)
    for name in ("metrics", "metadata", "logs"):
        if getattr(trajectory, name):
            data[name] = _jsonable(getattr(trajectory, name))
    if trajectory.messages_and_choices:
        data["messages_and_choices"] = _items_data(trajectory.messages_and_choices)
    if trajectory.additional_histories:
        data["additional_histories"] = [_history_data(h) for h in trajectory.additional_histories]
    return data


def _exception_data(e: Any) -> dict[str, str]:
    if isinstance(e, BaseException):
        from ..trajectories.data import PydanticException

        return PydanticException.from_exception(e).model_dump()
    if isinstance(e, str):
        return {"type": "", "message": e, "traceback": ""}
    return {"type": str(getattr(e, "type", "") or ""), "message": str(getattr(e, "message", e) or ""),
            "traceback": str(getattr(e, "traceback", "") or "")}


def group_data(group: Any) -> dict[str, Any]:
    """The `group_json` of a group: its fields but the trajectories, those at their defaults left out.

    Groups without `exceptions`, `metadata`, `metrics` or `logs` attributes write them as absent."""
    data: dict[str, Any] = {}
    exceptions = [_exception_data(e) for e in getattr(group, "exceptions", None) or []]
    if exceptions:
        data["exceptions"] = exceptions
    for name in ("metadata", "metrics", "logs"):
        value = getattr(group, name, None)
        if value:
            data[name] = _jsonable(value)
    return data


def flatten_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message dict, or a Choice's dict, as one `messages` struct (a Choice is a trainable assistant turn)."""
    if "finish_reason" in message:
        inner = message.get("message", {})
        if not isinstance(inner, Mapping):
            inner = {}
        tool_calls = inner.get("tool_calls")
        return {"role": inner.get("role"), "content": inner.get("content"),
                "tool_calls": json.dumps(tool_calls) if tool_calls else None, "tool_call_id": None,
                "trainable": True}
    tool_calls = message.get("tool_calls")
    return {"role": message.get("role"), "content": message.get("content"),
            "tool_calls": json.dumps(tool_calls) if tool_calls else None,
            "tool_call_id": message.get("tool_call_id"), "trainable": False}


def messages_column(trajectory: Trajectory) -> list[dict[str, Any]] | None:
    """The `messages` of a trajectory's main conversation; None (null) where a message is not a dict or
    Choice, its content is not text, or the trajectory holds captured exchanges."""
    if trajectory.exchanges:
        return None
    out = []
    for item in trajectory.messages_and_choices:
        if isinstance(item, Choice):
            message: Any = item.to_dict()
        elif isinstance(item, Mapping):
            message = item
        elif type(item).__name__ == "Choices" and type(item).__module__.startswith("litellm"):
            inner = item.message
            message = {"finish_reason": item.finish_reason, "index": item.index,
                       "message": inner.to_dict() if hasattr(inner, "to_dict") else inner}
        else:
            return None
        try:
            flat = flatten_message(message)
        except (TypeError, ValueError):
            return None
        if flat["content"] is not None and not isinstance(flat["content"], str):
            return None
        out.append(flat)
    return out


def rows_of(trajectory_groups: list[Any], first_group_index: int = 0) -> list[dict[str, Any]]:
    """One row per trajectory (a sentinel row for a group without any), in the schema's columns."""
    rows: list[dict[str, Any]] = []
    for gi, group in enumerate(trajectory_groups, start=first_group_index):
        gdata = group_data(group)
        common = {"format_version": FORMAT_VERSION, "group_index": gi, "group_json": _compact_json(gdata),
                  "group_metadata": _compact_json(gdata["metadata"]) if gdata.get("metadata") else None,
                  "group_metrics": _compact_json(gdata["metrics"]) if gdata.get("metrics") else None,
                  "group_logs": gdata.get("logs") or None}
        if not group.trajectories:
            rows.append({**common, "trajectory_index": None, "trajectory_json": None, "reward": None,
                         "metrics": None, "metadata": None, "tools": None, "logs": None, "messages": None})
            continue
        for ti, trajectory in enumerate(group.trajectories):
            tdata = trajectory_data(trajectory)
            rows.append({**common, "trajectory_index": ti, "trajectory_json": _compact_json(tdata),
                         "reward": float(trajectory.reward),
                         "metrics": _compact_json(tdata["metrics"]) if tdata.get("metrics") else None,
                         "metadata": _compact_json(tdata["metadata"]) if tdata.get("metadata") else None,
                         "tools": _compact_json(tdata["tools"]) if tdata.get("tools") else None,
                         "logs": tdata.get("logs") or None, "messages": messages_column(trajectory)})
    return rows


def _table(rows: list[dict[str, Any]], migrated: list[str] | None = None) -> Any:
    import pyarrow as pa

    table = pa.Table.from_pylist(rows, schema=schema())
    if migrated:
        table = table.replace_schema_metadata({**table.schema.metadata,
                                               MIGRATED_METADATA_KEY: json.dumps(migrated).encode()})
    return table


def _write_table(table: Any, path: str | Path) -> None:
    import pyarrow.parquet as pq

    write_atomic(path, lambda tmp: pq.write_table(table, tmp, compression=COMPRESSION))


def write_trajectory_groups_parquet(trajectory_groups: list[Any], path: str | Path) -> None:
    """Write the groups to `path` (replacing it) as one version-2 Parquet file, atomically."""
    _write_table(_table(rows_of(list(trajectory_groups))), path)


def migrated_sources(path: str | Path) -> list[str]:
    """The SHA-256 digests of the JSONL logs whose groups the Parquet file at `path` holds (none: [])."""
    import pyarrow.parquet as pq

    raw = (pq.read_schema(path).metadata or {}).get(MIGRATED_METADATA_KEY)
    return [str(d) for d in json.loads(raw)] if raw else []


def append_trajectory_groups_parquet(trajectory_groups: list[Any], path: str | Path, *,
                                     source_sha256: str | None = None) -> None:
    """Add the groups to the file at `path` (created if absent), numbering them after its groups.

    ART overwrites a step's file when the same split is logged twice at one step; we keep both.
    A version-1 file is read and rewritten as version 2, its groups first. `source_sha256`: the digest of the
    JSONL log the groups come from, added to those the file records (`migrated_sources`); one write does both.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    groups = list(trajectory_groups)
    path = Path(path)
    sources = migrated_sources(path) if path.exists() else []
    if source_sha256 is not None and source_sha256 not in sources:
        sources.append(source_sha256)
    if not path.exists() or file_version(path) != FORMAT_VERSION:
        old_groups = read_trajectory_groups_parquet(path) if path.exists() else []
        return _write_table(_table(rows_of(old_groups + groups), sources), path)
    old = pq.read_table(path)
    indices = [i for i in old.column("group_index").to_pylist() if i is not None]
    new = _table(rows_of(groups, max(indices) + 1 if indices else 0), sources)
    _write_table(pa.concat_tables([old.select(list(COLUMNS)).cast(new.schema), new]), path)


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
    from ..trajectories import data as tmod

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


def _v1_trajectory(row: dict[str, Any]) -> Trajectory:
    histories = [LegacyHistory(messages_and_choices=h.get("messages_and_choices") or [], tools=h.get("tools"))
                 for h in _load_json(row.get("additional_histories"), [])]
    return Trajectory(messages_and_choices=[unflatten_message(m) for m in row.get("messages") or []],
                      reward=row["reward"] if row.get("reward") is not None else 0.0,
                      metrics=_load_json(row.get("metrics"), {}), metadata=_load_json(row.get("metadata"), {}),
                      tools=_load_json(row.get("tools"), None), logs=list(row.get("logs") or []),
                      additional_histories=histories)


def _read_v1(rows: list[dict[str, Any]]) -> list[TrajectoryGroup]:
    groups: dict[int, dict[str, Any]] = {}
    for row in rows:
        gi = int(row.get("group_index") or 0)
        g = groups.get(gi)
        if g is None:
            g = groups[gi] = {"trajectories": [], "metadata": _load_json(row.get("group_metadata"), {}),
                              "metrics": _load_json(row.get("group_metrics"), {}),
                              "logs": [str(x) for x in row.get("group_logs") or []],
                              "exceptions": _load_json(row.get("group_exceptions"), [])}
        if row.get("reward") is None and row.get("messages") is None:
            continue  # the placeholder row of a group without trajectories
        g["trajectories"].append(_v1_trajectory(row))
    out = [_make_group(g["trajectories"], g) for _, g in sorted(groups.items())]
    return [g for g in out if g is not None]


def _json_object(payload: Any, column: str) -> dict[str, Any]:
    if not isinstance(payload, (str, bytes, bytearray)):
        raise ValueError(f"trajectory Parquet column {column} must hold JSON text, got {type(payload).__name__}")
    try:
        value = json.loads(payload)
    except ValueError as e:
        raise ValueError(f"trajectory Parquet column {column} holds invalid JSON ({str(payload)[:60]!r}...)") from e
    if not isinstance(value, dict):
        raise ValueError(f"trajectory Parquet column {column} must hold a JSON object, got {type(value).__name__}")
    return value


def _restore_items(items: Any, where: str) -> list[Any]:
    if not isinstance(items, list):
        raise ValueError(f"trajectory Parquet {where} must be a list, got {type(items).__name__}")
    out = []
    for item in items:
        if isinstance(item, dict) and _CHOICE_KEYS <= item.keys():
            try:
                item = Choice.model_validate(item)
            except pydantic.ValidationError:
                pass  # kept as the dict it was written as (ART's reader does the same)
        out.append(item)
    return out


def _restore_trajectory(payload: Any) -> Trajectory:
    data = _json_object(payload, "trajectory_json")
    data["messages_and_choices"] = _restore_items(data.get("messages_and_choices", []), "messages_and_choices")
    histories = data.get("additional_histories", [])
    if not isinstance(histories, list):
        raise ValueError("trajectory Parquet additional_histories must be a list")
    restored = []
    for h in histories:
        if not isinstance(h, dict):
            raise ValueError("trajectory Parquet additional_histories must hold JSON objects")
        restored.append(LegacyHistory(**{**h, "messages_and_choices": _restore_items(
            h.get("messages_and_choices", []), "additional_histories messages_and_choices")}))
    data["additional_histories"] = restored
    return Trajectory(**data)


def _index(value: Any, column: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"trajectory Parquet {column} must be an integer, got {value!r}")
    return value


def _read_v2(rows: list[dict[str, Any]]) -> list[TrajectoryGroup]:
    by_group: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported trajectory Parquet version {row.get('format_version')!r} in a row "
                             f"(this reader reads {FORMAT_VERSION} and 1)")
        by_group.setdefault(_index(row.get("group_index"), "group_index"), []).append(row)
    if sorted(by_group) != list(range(len(by_group))):
        raise ValueError(f"trajectory Parquet group indexes are not 0..{len(by_group) - 1}: {sorted(by_group)}")
    out: list[TrajectoryGroup] = []
    for gi in range(len(by_group)):
        group_rows = by_group[gi]
        payloads = {row.get("group_json") for row in group_rows}
        if len(payloads) != 1:
            raise ValueError(f"trajectory Parquet group {gi} has rows with different group_json")
        gdata = _json_object(payloads.pop(), "group_json")
        if "trajectories" in gdata:
            raise ValueError(f"trajectory Parquet group {gi}: group_json must not hold the trajectories")
        indexed: list[tuple[int, Trajectory]] = []
        sentinels = 0
        for row in group_rows:
            if row.get("trajectory_index") is None:
                if row.get("trajectory_json") is not None:
                    raise ValueError(f"trajectory Parquet group {gi}: a sentinel row holds a trajectory")
                sentinels += 1
                continue
            indexed.append((_index(row["trajectory_index"], "trajectory_index"),
                            _restore_trajectory(row.get("trajectory_json"))))
        indexed.sort(key=lambda item: item[0])
        if [i for i, _ in indexed] != list(range(len(indexed))):
            raise ValueError(f"trajectory Parquet group {gi} has duplicate or missing trajectory indexes: "
                             f"{[i for i, _ in indexed]}")
        if (indexed and sentinels) or (not indexed and sentinels != 1):
            raise ValueError(f"trajectory Parquet group {gi} has {len(indexed)} trajectories and {sentinels} "
                             "sentinel rows (a group has trajectories or exactly one sentinel)")
        group = _make_group([t for _, t in indexed], {
            "metadata": gdata.get("metadata") or {}, "metrics": gdata.get("metrics") or {},
            "logs": list(gdata.get("logs") or []), "exceptions": gdata.get("exceptions") or []})
        if group is not None:
            out.append(group)
    return out


def file_version(path: str | Path) -> int:
    """The format version of a trajectory Parquet file (2, or 1 for files without a marker).

    Refuses, as ART's reader does, a version other than 1 or 2, a marker without the `format_version`
    column (or the reverse, in a file with rows), and JSON columns without the version column."""
    import pyarrow.parquet as pq

    file_schema = pq.read_schema(path)
    raw = (file_schema.metadata or {}).get(VERSION_METADATA_KEY)
    try:
        version = int(raw) if raw is not None else None
    except ValueError as e:
        raise ValueError(f"{path}: invalid trajectory Parquet version metadata {raw!r}") from e
    if version not in (None, FORMAT_VERSION):
        raise ValueError(f"{path}: unsupported trajectory Parquet version {version} (this reader reads "
                         f"{FORMAT_VERSION} and 1)")
    has_column = "format_version" in file_schema.names
    if version == FORMAT_VERSION and not has_column:
        raise ValueError(f"{path}: a version-{FORMAT_VERSION} trajectory Parquet file without the format_version "
                         "column")
    if {"group_json", "trajectory_json"} & set(file_schema.names) and not has_column:
        raise ValueError(f"{path}: trajectory Parquet with group_json/trajectory_json but no format_version column")
    if has_column and version is None and not pq.read_metadata(path).num_rows:
        raise ValueError(f"{path}: an empty trajectory Parquet file with a format_version column but no version "
                         "metadata")
    return FORMAT_VERSION if has_column else 1


def read_trajectory_groups_parquet(path: str | Path) -> list[TrajectoryGroup]:
    """The groups of a Parquet trajectory log (version 2 or 1; ours or ART's), in logged order."""
    import pyarrow.parquet as pq

    version = file_version(path)
    rows = pq.read_table(path).to_pylist()
    if not rows:
        return []
    return _read_v2(rows) if version == FORMAT_VERSION else _read_v1(rows)
