"""JSONL trajectory logs -> Parquet and ART's JSONL helpers: ART's `art.utils.trajectory_migration`
(artrl.utils.trajectory_migration re-exports this module).

Two JSONL layouts exist in the wild, and both migrate:

* ART's: one *group* per line, `{"trajectories": [trajectory dict, ...]}`.
* artrl's before Parquet (`trajectories/<split>/NNNN.jsonl`): one *trajectory*
  per line (`Trajectory.for_logging()`), non-finite floats spelled "nan"/"inf".
  Those logs did not record which group a trajectory belonged to, so each line
  becomes a group of one.

A migrated file is written next to the JSONL (`NNNN.jsonl` -> `NNNN.parquet`, format version 2)
whole or not at all (temporary file, fsync, rename); when that Parquet file already exists (the same step was
logged again after an upgrade), the JSONL's groups are added to it rather than replacing it (ART replaces it).
Only then is the JSONL deleted (`delete_original`). A torn last line (a crash mid-append) is skipped with a
warning; any other unreadable line fails that file's migration and leaves the JSONL and any Parquet file as
they were.

Migrating is idempotent, and safe to stop at any point: the Parquet file records the SHA-256 of each JSONL
log whose groups it took (`trajectory_logs.migrated_sources`), in the same write as the groups. A JSONL log
already recorded there (kept with `delete_original=False`, or left by a process that died before deleting it)
is not added again: it is counted as skipped, and deleted when `delete_original` is set.

`LocalBackend` runs `auto_migrate_on_register` on every model directory at
`register`, as ART does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..trajectories.history import LegacyHistory
from ..trajectories.data import Trajectory, TrajectoryGroup
from .trajectory_logs import append_trajectory_groups_parquet, migrated_sources

log = logging.getLogger(__name__)

TRAJECTORIES_DIR = "trajectories"
ESTIMATED_COMPRESSION = 25  # what a dry run assumes (ART's figure for trajectory data)


# --------------------------------------------------------------------------- ART's JSONL helpers


def message_or_choice_to_dict(message_or_choice: Any) -> dict[str, Any]:
    """A message or Choice as a plain dict, without logprobs."""
    item = dict(message_or_choice) if isinstance(message_or_choice, dict) else message_or_choice.model_dump(
        mode="json")
    item.pop("logprobs", None)
    return item


def history_to_dict(history: LegacyHistory) -> dict[str, Any]:
    return {"messages_and_choices": [message_or_choice_to_dict(m) for m in history.messages_and_choices],
            "tools": history.tools}


def trajectory_to_dict(trajectory: Trajectory) -> dict[str, Any]:
    return {"reward": trajectory.reward, "metrics": trajectory.metrics, "metadata": trajectory.metadata,
            "messages_and_choices": [message_or_choice_to_dict(m) for m in trajectory.messages_and_choices],
            "tools": trajectory.tools,
            "additional_histories": [history_to_dict(h) for h in trajectory.additional_histories],
            "logs": trajectory.logs}


def trajectory_group_to_dict(trajectory_group: TrajectoryGroup) -> dict[str, Any]:
    return {"trajectories": [trajectory_to_dict(t) for t in trajectory_group.trajectories
                             if isinstance(t, Trajectory)]}


def serialize_trajectory_groups(trajectory_groups: list[TrajectoryGroup]) -> str:
    """ART's JSONL: one group per line."""
    return "\n".join(json.dumps(trajectory_group_to_dict(g)) for g in trajectory_groups)


def dict_to_message_or_choice(d: dict[str, Any]) -> Any:
    """A dict with a `message` as a Choice (the dict itself when it is not a valid one), else the message."""
    import pydantic
    from openai.types.chat.chat_completion import Choice

    if "message" in d:
        try:
            return Choice.model_validate(d)
        except pydantic.ValidationError:
            return d
    return d


def dict_to_history(d: dict[str, Any]) -> LegacyHistory:
    return LegacyHistory(messages_and_choices=[dict_to_message_or_choice(m) for m in d.get("messages_and_choices")
                                               or []], tools=d.get("tools"))


def _logged_items(d: dict[str, Any]) -> list[Any]:
    """A trajectory dict's messages and choices; `Trajectory.for_logging()` lines hold `messages` instead, a
    sampled turn as its assistant message marked `trainable` (it migrates as that message)."""
    if "messages_and_choices" in d or "messages" not in d:
        return [dict_to_message_or_choice(m) for m in d["messages_and_choices"]]
    return [{k: v for k, v in m.items() if k != "trainable"} for m in d["messages"]]


def dict_to_trajectory(d: dict[str, Any]) -> Trajectory:
    return Trajectory(messages_and_choices=_logged_items(d),
                      reward=_float(d["reward"]), metrics=d.get("metrics") or {}, metadata=d.get("metadata") or {},
                      logs=d.get("logs") or [], tools=d.get("tools"),
                      additional_histories=[dict_to_history(h) for h in d.get("additional_histories") or []])


def dict_to_trajectory_group(d: dict[str, Any]) -> TrajectoryGroup:
    return TrajectoryGroup([dict_to_trajectory(t) for t in d["trajectories"]], metadata=d.get("metadata") or {},
                           metrics=d.get("metrics") or {}, logs=d.get("logs") or [])


def deserialize_trajectory_groups(serialized: str) -> list[TrajectoryGroup]:
    """Groups from ART's JSONL (or, failing JSON, the older YAML layout ART also reads)."""
    try:
        loaded = [json.loads(line) for line in serialized.strip().split("\n") if line]
    except json.JSONDecodeError as e:
        try:
            import yaml
        except ImportError:
            raise ValueError("the text is not JSONL, and reading ART's older YAML logs needs pyyaml "
                             "(pip install pyyaml)") from e
        loaded = yaml.safe_load(serialized)
    return [dict_to_trajectory_group(g) for g in loaded]


def read_trajectory_groups_jsonl(path: Path | str) -> list[TrajectoryGroup]:
    """The groups of a JSONL trajectory log of either layout, without migrating it.

    A torn last line is skipped with a warning; a trajectory whose reward is not finite
    (our old logs spelled it "nan") cannot be a Trajectory and is refused with its line's error.
    """
    return [dict_to_trajectory_group(g) for g in _group_dicts(Path(path))]


# --------------------------------------------------------------------------- migration


@dataclass
class MigrationResult:
    """What a migration did: files migrated or skipped, sizes before and after, errors."""

    files_migrated: int = 0
    files_skipped: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def compression_ratio(self) -> float:
        return self.bytes_before / self.bytes_after if self.bytes_after else 0.0

    @property
    def space_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def __add__(self, other: "MigrationResult") -> "MigrationResult":
        return MigrationResult(self.files_migrated + other.files_migrated, self.files_skipped + other.files_skipped,
                               self.bytes_before + other.bytes_before, self.bytes_after + other.bytes_after,
                               self.errors + other.errors)


def _float(value: Any) -> float:
    if isinstance(value, str):  # our JSONL spelled non-finite numbers as strings
        return float(value)
    return float(value) if value is not None else math.nan


def _group_dicts(path: Path) -> list[dict[str, Any]]:
    """The file's groups as dicts (our trajectory-per-line layout: one group per line)."""
    lines = [(n, raw) for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if raw.strip()]
    groups: list[dict[str, Any]] = []
    for i, (n, raw) in enumerate(lines):
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict):
                raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
        except ValueError as e:
            if i == len(lines) - 1 and i > 0:
                log.warning("%s line %d is torn (a crash mid-append?); skipped", path, n)
                continue
            raise ValueError(f"line {n} is not a JSON object ({e})") from e
        groups.append(rec if "trajectories" in rec else {"trajectories": [rec]})
    return groups


def migrate_jsonl_to_parquet(jsonl_path: Path | str, delete_original: bool = True,
                             dry_run: bool = False) -> MigrationResult:
    """Migrate one JSONL trajectory log to `<same name>.parquet` (see the module docstring)."""
    jsonl_path = Path(jsonl_path)
    result = MigrationResult()
    if not jsonl_path.exists():
        result.errors.append(f"file not found: {jsonl_path}")
        return result
    if jsonl_path.suffix != ".jsonl":
        result.files_skipped += 1
        return result
    parquet_path = jsonl_path.with_suffix(".parquet")
    try:
        digest = hashlib.sha256(jsonl_path.read_bytes()).hexdigest()
        done = parquet_path.exists() and digest in migrated_sources(parquet_path)
    except Exception as e:  # an unreadable file, or a Parquet file that is not one
        result.errors.append(f"error migrating {jsonl_path}: {e}")
        return result
    if done:  # its groups are in the Parquet file already: a second run, or one that stopped before deleting
        result.files_skipped += 1
        if delete_original and not dry_run:
            jsonl_path.unlink()
        return result
    result.bytes_before = jsonl_path.stat().st_size
    if dry_run:
        result.files_migrated = 1
        result.bytes_after = result.bytes_before // ESTIMATED_COMPRESSION
        return result
    try:
        groups = [dict_to_trajectory_group(g) for g in _group_dicts(jsonl_path)]
        # an existing Parquet file of the same step keeps its groups; the JSONL's are added after them
        append_trajectory_groups_parquet(groups, parquet_path, source_sha256=digest)
    except Exception as e:  # one bad file must not stop a directory's migration
        result.errors.append(f"error migrating {jsonl_path}: {e}")
        return result
    result.bytes_after = parquet_path.stat().st_size
    result.files_migrated = 1
    if delete_original:
        jsonl_path.unlink()
    return result


def migrate_trajectories_dir(trajectories_dir: Path | str, delete_originals: bool = True, dry_run: bool = False,
                             progress_callback: Callable[[str], None] | None = None) -> MigrationResult:
    """Migrate every `*.jsonl` under a trajectories directory (all splits)."""
    trajectories_dir = Path(trajectories_dir)
    result = MigrationResult()
    if not trajectories_dir.exists():
        result.errors.append(f"directory not found: {trajectories_dir}")
        return result
    for path in sorted(trajectories_dir.rglob("*.jsonl")):
        if progress_callback:
            progress_callback(str(path))
        result = result + migrate_jsonl_to_parquet(path, delete_original=delete_originals, dry_run=dry_run)
    return result


def migrate_model_dir(model_dir: Path | str, delete_originals: bool = True, dry_run: bool = False,
                      progress_callback: Callable[[str], None] | None = None) -> MigrationResult:
    """Migrate a model (run) directory's `trajectories/`; nothing to do when it has none."""
    trajectories_dir = Path(model_dir) / TRAJECTORIES_DIR
    if not trajectories_dir.exists():
        return MigrationResult()
    return migrate_trajectories_dir(trajectories_dir, delete_originals, dry_run, progress_callback)


def migrate_all_models(art_path: Path | str, project_name: str, delete_originals: bool = True,
                       dry_run: bool = False, progress_callback: Callable[[str], None] | None = None
                       ) -> MigrationResult:
    """Migrate every model directory of `<art_path>/<project>/models/`."""
    models_dir = Path(art_path) / project_name / "models"
    result = MigrationResult()
    if not models_dir.exists():
        result.errors.append(f"models directory not found: {models_dir}")
        return result
    for model_dir in sorted(p for p in models_dir.iterdir() if p.is_dir()):
        if progress_callback:
            progress_callback(f"processing model: {model_dir.name}")
        result = result + migrate_model_dir(model_dir, delete_originals, dry_run, progress_callback)
    return result


def auto_migrate_on_register(model_dir: Path | str) -> MigrationResult:
    """Migrate (and delete) a model directory's JSONL trajectory logs; logs what it did."""
    result = migrate_model_dir(model_dir, delete_originals=True, dry_run=False)
    if result.files_migrated:
        log.info("migrated %d JSONL trajectory logs of %s to Parquet (%.1f MB saved)", result.files_migrated,
                 model_dir, result.space_saved / 1e6)
    for error in result.errors:
        log.warning("trajectory log migration: %s; the JSONL file is kept", error)
    return result
