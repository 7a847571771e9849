"""artrl: train LLM agents from experience.

`import artrl as art` runs an OpenPipe ART training loop unchanged; see README.md.
"""

from . import dev, rewards, schedules
from .errors import (ArtrlError, CheckpointError, ConfigError, NonFiniteError, PackingError,
                     TrajectoryError)
from .gather import GatherError, gather_trajectory_groups
from .local import LocalBackend
from .model import Model, TrainableModel
from .trajectories import History, Trajectory, TrajectoryGroup
from .types import InternalModelConfig, TrainConfig, TrainResult, TrainSFTConfig
from .utils import choice_from_completion

__version__ = "0.1.0"

__all__ = [
    "ArtrlError", "CheckpointError", "ConfigError", "GatherError", "History", "InternalModelConfig",
    "LocalBackend", "Model", "NonFiniteError", "PackingError", "TrainConfig", "TrainResult", "TrainSFTConfig",
    "TrainableModel", "Trajectory", "TrajectoryError", "TrajectoryGroup", "choice_from_completion", "dev",
    "gather_trajectory_groups", "rewards", "schedules",
]
