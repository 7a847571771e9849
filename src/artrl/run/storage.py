"""The run directory: layout, atomic writes, checkpoints, history.

Layout (written down once, here):

    <path>/<project>/models/<run_name>/     (a trainable model's run_name, ART 0.5.23; else its name)
        model.json                      base model and settings of the run
        history.jsonl                   one JSON line per log call (history.py says what a row holds)
        state.json                      Model.read_state()/merge_state() and the metrics' running totals
        checkpoints/0003/               one directory per step
            adapter_model.safetensors   LoRA weights (peft format)
            adapter_config.json
            optimizer.pt                AdamW state and the trainer's own RNG state
            trainer_state.json          step, optimizer steps, base model, the step's history line
            COMPLETE                    written last; a directory without it is not a checkpoint
        trajectories/<split>/0003.parquet  trajectory groups logged at a step, in ART's Parquet format
                                        (run/trajectory_logs.py); earlier .jsonl logs are migrated

Crash safety: a checkpoint is written into `checkpoints/.tmp-*`, every file is
fsynced, the COMPLETE marker goes in last, and the directory is renamed into
place (atomic on POSIX), so a reader sees a whole checkpoint or none.
JSON and Parquet files are written to a temporary file, fsynced and renamed. JSONL lines are
appended with one write and fsynced; a torn last line (a crash mid-append) is
skipped with a warning when read, never parsed as data.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from ..runtime.fs import fsync_dir, fsync_tree, write_atomic
from ..errors import CheckpointError

log = logging.getLogger(__name__)

MODELS_DIR = "models"
MODEL_FILE = "model.json"
HISTORY_FILE = "history.jsonl"
CHECKPOINTS_DIR = "checkpoints"
TRAJECTORIES_DIR = "trajectories"
TRAJECTORY_LOG_SUFFIX = ".parquet"
STATE_FILE = "state.json"
COMPLETE_MARKER = "COMPLETE"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp-"


def run_dir(path: str | Path, project: str, name: str) -> Path:
    return Path(path) / project / MODELS_DIR / name


def step_dir_name(step: int) -> str:
    return f"{step:04d}"


def trajectory_log_path(run: Path, split: str, step: int) -> Path:
    """`trajectories/<split>/NNNN.parquet` of a run directory."""
    if not split or "/" in split or split in (".", ".."):
        raise ValueError(f"split {split!r} cannot name a directory; use a plain name such as 'val'")
    return Path(run) / TRAJECTORIES_DIR / split / f"{step_dir_name(step)}{TRAJECTORY_LOG_SUFFIX}"


def read_state(run: Path) -> dict[str, Any] | None:
    """The run's state.json (None when absent); an unreadable file is an error that names it."""
    path = Path(run) / STATE_FILE
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); restore it or delete it to start its state afresh") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a JSON object; delete it to start afresh")
    return state


def merge_state(run: Path, updates: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `updates` into state.json (atomically rewritten); returns the merged state."""

    def merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for k, v in new.items():
            out[k] = merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
        return out

    merged = merge(read_state(run) or {}, updates)
    write_json_atomic(Path(run) / STATE_FILE, merged)
    return merged


def write_json_atomic(path: Path, data: Any) -> None:
    """Publish `data` as the JSON file `path` whole or not at all (`_fs.write_atomic`)."""

    def write(tmp: Path) -> None:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))

    write_atomic(path, write, prefix=TMP_PREFIX)


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats spelled as strings ("nan", "inf", "-inf"): strict JSON for logs."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write, then fsync.

    If the file ends in a torn line (a crash mid-append), a newline is written
    first so the new record starts on a line of its own.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True, allow_nan=False) + "\n"
    with open(path, "ab+") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() > 0:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                line = "\n" + line
        fh.write(line.encode())
        fh.flush()
        os.fsync(fh.fileno())


def scan_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """(every complete JSON object line of `path`, 1-based numbers of torn or corrupt lines)."""
    if not path.exists():
        return [], []
    out: list[dict[str, Any]] = []
    bad: list[int] = []
    with open(path, "rb") as fh:
        for i, raw in enumerate(fh):
            text = raw.decode("utf-8", errors="replace").strip()
            if not text:
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                bad.append(i + 1)
                continue
            if isinstance(rec, dict):
                out.append(rec)
            else:
                bad.append(i + 1)
    return out, bad


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of `path`; torn or corrupt lines are skipped and reported."""
    records, bad = scan_jsonl(path)
    for n in bad:
        log.warning("%s line %d is torn or corrupt (a crash mid-write?); skipped", path, n)
    return records


# --------------------------------------------------------------------------- checkpoints


def checkpoint_dir(run: Path, step: int) -> Path:
    return run / CHECKPOINTS_DIR / step_dir_name(step)


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def list_checkpoints(run: Path) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    root = run / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        if p.name.isdigit() and p.is_dir():
            if is_complete(p):
                steps.append(int(p.name))
            else:
                log.warning("checkpoint directory %s has no %s marker; ignored", p, COMPLETE_MARKER)
    return sorted(steps)


def latest_checkpoint(run: Path) -> int | None:
    steps = list_checkpoints(run)
    return steps[-1] if steps else None


def write_checkpoint(run: Path, step: int, write_files: Any, marker: dict[str, Any]) -> Path:
    """Create checkpoints/<step> atomically; `write_files(tmp_dir)` writes its contents."""
    root = run / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(run, step)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_files(tmp)
        with open(tmp / COMPLETE_MARKER, "w") as fh:
            json.dump({**marker, "step": step, "written_at": time.time()}, fh)
        fsync_tree(tmp)
        if final.exists():
            # an older directory of the same step (incomplete, or being replaced): move it aside first
            aside = root / f"{TMP_PREFIX}old-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            os.rename(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_marker(path: Path) -> dict[str, Any]:
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
        if not isinstance(marker, dict):
            raise ValueError(f"expected a JSON object, got {type(marker).__name__}")
        return marker
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable {COMPLETE_MARKER} marker ({e}). Delete that "
                              "directory to resume from the previous checkpoint.") from None


def clean_temporaries(run: Path) -> int:
    """Remove what a crash left mid-write: `.tmp-*` checkpoint directories, JSON and trajectory log files."""
    n = 0
    logs = run / TRAJECTORIES_DIR
    splits = [p for p in logs.iterdir() if p.is_dir()] if logs.is_dir() else []
    for root in (run / CHECKPOINTS_DIR, run, *splits):
        if not root.is_dir():
            continue
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                n += 1
    return n


def delete_checkpoint(run: Path, step: int) -> None:
    path = checkpoint_dir(run, step)
    if not path.exists():
        return
    # rename first so a crash mid-delete never leaves a half-deleted dir that still looks complete
    aside = path.parent / f"{TMP_PREFIX}del-{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)
