"""ART's `art.utils.output_dirs`: where a run's files are, as paths under a LocalBackend's directory.

The layout is artrl's run directory (run/storage.py, which writes it down once), the same as ART's:
`<art_path>/<project>/models/<storage name>/`, with `checkpoints/NNNN/` and `trajectories/<split>/` inside.
A model's storage name is its `run_name` (a TrainableModel's, ART 0.5.23) or else its `name`. As in ART,
every function returns a string ('/'-joined, the root as given) and touches nothing on disk; `art_path=None` is the default LocalBackend
directory ("./.art", what ART's own default comes to for an installed package).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..run import storage

if TYPE_CHECKING:
    from ..model import Model

__all__ = [
    "get_default_art_path", "get_model_dir", "get_models_dir", "get_output_dir_from_model_properties",
    "get_step_checkpoint_dir", "get_trajectories_dir", "get_trajectories_split_dir",
]


def get_default_art_path() -> str:
    from ..local.backend import DEFAULT_PATH

    return DEFAULT_PATH


def _root(art_path: str | None) -> str:
    return get_default_art_path() if art_path is None else art_path


def get_models_dir(project_name: str, art_path: str | None = None) -> str:
    return f"{_root(art_path)}/{project_name}/{storage.MODELS_DIR}"


def get_model_dir(model: "Model", art_path: str | None = None) -> str:
    return get_output_dir_from_model_properties(model.project, model._storage_name(), art_path)


def get_output_dir_from_model_properties(project: str, name: str, art_path: str | None = None) -> str:
    return f"{get_models_dir(project, art_path)}/{name}"


def get_step_checkpoint_dir(model_output_dir: str, step: int) -> str:
    return f"{model_output_dir}/{storage.CHECKPOINTS_DIR}/{storage.step_dir_name(step)}"


def get_trajectories_dir(model_output_dir: str) -> str:
    return f"{model_output_dir}/{storage.TRAJECTORIES_DIR}"


def get_trajectories_split_dir(model_output_dir: str, split: str) -> str:
    return f"{get_trajectories_dir(model_output_dir)}/{split}"
