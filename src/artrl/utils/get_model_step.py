"""`get_model_step`: a model's latest step read from its run directory, without a backend (ART's).

Reads `<art_path>/<project>/models/<run_name>/checkpoints/` (`name` for a model
without a run_name): the highest step with a complete checkpoint, 0 when there is
none. (ART counts every numbered directory; a directory without its COMPLETE marker
is a write that never finished, not a step.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..run import storage


def get_step_from_dir(output_dir: str) -> int:
    """The latest complete checkpoint's step in a model's run directory (0 when none)."""
    return storage.latest_checkpoint(Path(output_dir)) or 0


def get_model_step(model: Any, art_path: str) -> int:
    storage_name = model._storage_name() if hasattr(model, "_storage_name") else model.name
    return get_step_from_dir(str(storage.run_dir(art_path, model.project, storage_name)))
