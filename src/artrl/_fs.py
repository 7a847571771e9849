"""Durable-write helpers shared by the built-in model cache and run storage.

A directory is published by writing it under a temporary name, flushing every
file and the directory entries (`fsync_tree`), then renaming it into place and
flushing the parent (`fsync_dir`): a crash leaves either the old state or the
complete new one, never empty or half-written files under the final name.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (renames, new files). A no-op where directories cannot be opened."""
    if os.name != "posix":
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """Flush every file under `path`, then every directory, so a crash cannot publish empty files."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(Path(root) / name, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(root)
