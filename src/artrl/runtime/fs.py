"""Durable-write helpers shared by the built-in model cache and run storage.

A directory is published by writing it under a temporary name, flushing every
file and the directory entries (`fsync_tree`), then renaming it into place and
flushing the parent (`fsync_dir`): a crash leaves either the old state or the
complete new one, never empty or half-written files under the final name.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
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


def write_atomic(path: str | os.PathLike[str], write: Callable[[Path], None], *, prefix: str = ".tmp-") -> None:
    """Publish a file whole or not at all: `write(tmp)` fills a temporary file beside `path`,
    which is fsynced and renamed over `path` (then the directory entry is flushed).

    A crash leaves the previous `path` (or none) plus, at worst, a `prefix`-named temporary
    that a reader never mistakes for the file (run storage removes them on register).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
