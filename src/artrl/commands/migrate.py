"""`artrl migrate PATH`: ART's `art migrate`, trajectory logs from JSONL to Parquet.

    artrl migrate .art/my-project/models/agent-001        a model (run) directory
    artrl migrate .art/my-project --dry-run               every model of a project: what would be migrated
    artrl migrate .art/my-project/models/agent-001/trajectories --keep-jsonl --verbose

PATH is told apart as ART tells it: a directory with `trajectories/` is a model directory; one named
`trajectories`, or with `<split>/<digits>....jsonl` files, is a trajectories directory; one with `models/` is a
project. Each `trajectories/<split>/NNNN.jsonl` becomes `NNNN.parquet` beside it (run/migration.py: written
whole or not at all, added to a Parquet file the step already has, the JSONL deleted only after, unless
`--keep-jsonl`). Running it twice, or again after it was stopped, migrates nothing twice. The exit status is 1
when a file could not be migrated (its JSONL is kept), or when PATH is none of the three.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..run import storage
from ..run.migration import MigrationResult, migrate_model_dir, migrate_trajectories_dir

MAX_ERRORS_SHOWN = 10


def add_arguments(p: Any) -> None:
    p.add_argument("path", type=Path, help="a model directory, a project directory, or a trajectories directory")
    p.add_argument("-n", "--dry-run", action="store_true", help="say what would be migrated, change nothing")
    p.add_argument("--keep-jsonl", action="store_true", help="keep each JSONL file after its Parquet file is written")
    p.add_argument("-v", "--verbose", dest="list_files", action="store_true", help="print each file as it goes")


def path_kind(path: Path) -> str | None:
    """"model", "trajectories" or "project" (ART's order of checks), or None."""
    if (path / storage.TRAJECTORIES_DIR).exists():
        return "model"
    if path.name == storage.TRAJECTORIES_DIR or any(path.glob("*/[0-9]*.jsonl")):
        return "trajectories"
    if (path / storage.MODELS_DIR).exists():
        return "project"
    return None


def migrate_path(path: Path, kind: str, *, dry_run: bool, keep_jsonl: bool, list_files: bool) -> MigrationResult:
    def show(indent: str):
        return (lambda f: print(f"{indent}{f}")) if list_files else None

    options = {"delete_originals": not keep_jsonl, "dry_run": dry_run}
    if kind == "model":
        return migrate_model_dir(path, progress_callback=show("  "), **options)
    if kind == "trajectories":
        return migrate_trajectories_dir(path, progress_callback=show("  "), **options)
    result = MigrationResult()
    for model_dir in sorted(p for p in (path / storage.MODELS_DIR).iterdir() if p.is_dir()):
        if list_files:
            print(f"Processing model: {model_dir.name}")
        result = result + migrate_model_dir(model_dir, progress_callback=show("    "), **options)
    return result


def main(args: Any) -> int:
    path: Path = args.path
    if not path.exists():
        print(f"artrl: error: path does not exist: {path}", file=sys.stderr)
        return 1
    kind = path_kind(path)
    if kind is None:
        print(f"artrl: error: cannot tell what {path} is: expected a model directory (with "
              f"{storage.TRAJECTORIES_DIR}/), a project directory (with {storage.MODELS_DIR}/) or a "
              f"{storage.TRAJECTORIES_DIR} directory", file=sys.stderr)
        return 1
    print(f"Migrating {kind} directory: {path}")
    result = migrate_path(path, kind, dry_run=args.dry_run, keep_jsonl=args.keep_jsonl, list_files=args.list_files)
    mb = 1024 * 1024
    if args.dry_run:
        print(f"\n[DRY RUN] Would migrate {result.files_migrated} files")
        if result.files_skipped:
            print(f"Would skip {result.files_skipped} files (already in their Parquet file)")
        if result.bytes_before > 0:
            print(f"  Estimated space savings: {result.space_saved / mb:.1f} MB")
    else:
        print(f"\nMigrated {result.files_migrated} files")
        if result.files_skipped:
            print(f"Skipped {result.files_skipped} files (already in their Parquet file)")
        if result.bytes_before > 0 and result.bytes_after > 0:
            print(f"Space saved: {result.space_saved / mb:.1f} MB ({result.compression_ratio:.1f}x compression)")
    if result.errors:
        print(f"\nErrors ({len(result.errors)}):", file=sys.stderr)
        for error in result.errors[:MAX_ERRORS_SHOWN]:
            print(f"  {error}", file=sys.stderr)
        if len(result.errors) > MAX_ERRORS_SHOWN:
            print(f"  ... and {len(result.errors) - MAX_ERRORS_SHOWN} more errors", file=sys.stderr)
        return 1
    return 0
