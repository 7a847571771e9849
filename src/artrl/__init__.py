"""artrl: train LLM agents from experience.

`import artrl as art` runs an OpenPipe ART training loop unchanged; see README.md and
docs/art-compatibility.md (every ART name and its status here).

Importing artrl loads neither torch, transformers nor peft: a module that these names import brings them in
inside the functions that build, load or train a model (`if TYPE_CHECKING:` for annotations). A new public
name is imported here and listed in `__all__`; tests/test_import_cost.py imports every one of them in a fresh
interpreter and fails if torch came with it.
"""

from .models.quantization import quiet_kernels_notice as _quiet_kernels_notice

_quiet_kernels_notice()  # before anything imports bitsandbytes (models/quantization.py says why)

from .runtime.voice import install as _install_voice  # noqa: E402

_install_voice()  # what artrl says reaches stderr in a program that sets up no logging (runtime/voice.py)

from . import dev, rewards, utils  # noqa: E402
from .auto_trajectory import auto_trajectory, capture_auto_trajectory
from .backend import Backend
from .batches import trajectory_group_batches
from .chat import images  # noqa: F401  (artrl.images.data_url, named by docs/models.md before it moved)
from .dev import LoRAConfig
from .errors import (ArtrlError, CheckpointError, ConfigError, LocalServingUnavailableError, NonFiniteError,
                     PackingError, TrainOutOfMemoryError, TrainTooLongError, TrajectoryError, WorkerError)
from .gather import GatherError, gather_trajectories, gather_trajectory_groups
from .local import LocalBackend
from .metrics import (PIPELINE_RL_DASHBOARD_DEFAULT_METRICS, PIPELINE_RL_METRIC_DEFINITIONS,
                      PIPELINE_RL_SCORE_METRICS, MetricDefinition)
from .model import Model, TrainableModel
from .pipeline_tuner import PipelineAutotuneConfig, PipelineRuntimeConfig
from .serverless import ServerlessBackend
from .tokenizer import get_tokenizer
from .train import schedules  # artrl.schedules: learning-rate schedules (train/schedules.py)
from .trajectories import (History, LegacyHistory, Trajectory, TrajectoryGroup, current_trajectory, no_capture,
                           tensorize, tokenize, trajectory, trajectory_group)
from .config.model import InternalModelConfig
from .types import (LocalTrainResult, Messages, MessagesAndChoices, ServerlessTrainResult, Tools, TrainConfig,
                    TrainResult, TrainSFTConfig)
from .utils import choice_from_completion, retry
from .yield_trajectory import capture_yielded_trajectory, yield_trajectory

__version__ = "0.1.0"

#: ART 0.5.23's top-level names for its Megatron back end, which artrl does not have: importing one says so.
_MEGATRON_NAMES = frozenset({"MegatronRuntimeConfig", "MegatronTopologyConfig", "get_megatron_runtime_config",
                             "init_megatron_runtime_config"})


def __getattr__(name: str) -> object:
    if name in _MEGATRON_NAMES:
        raise AttributeError(f"artrl has no {name}: it configures ART's Megatron back end, which artrl does not "
                             "have (LocalBackend trains with transformers + peft; docs/art-compatibility.md)")
    raise AttributeError(f"module 'artrl' has no attribute {name!r}")

__all__ = [
    # ART's names (art/__init__.py)
    "dev", "auto_trajectory", "capture_auto_trajectory", "gather_trajectories", "gather_trajectory_groups",
    "trajectory_group_batches", "Backend", "LocalBackend", "LocalTrainResult", "ServerlessBackend",
    "ServerlessTrainResult", "Messages", "MessagesAndChoices", "Tools", "Model", "TrainableModel", "retry",
    "TrainSFTConfig", "TrainConfig", "TrainResult", "Trajectory", "TrajectoryGroup", "capture_yielded_trajectory",
    "yield_trajectory", "current_trajectory", "no_capture", "trajectory", "trajectory_group",
    "tokenize", "tensorize",
    "LoRAConfig", "PipelineAutotuneConfig", "PipelineRuntimeConfig",
    # ART 0.5.23's additions (art/__init__.py)
    "get_tokenizer", "LocalServingUnavailableError", "MetricDefinition", "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS",
    "PIPELINE_RL_METRIC_DEFINITIONS", "PIPELINE_RL_SCORE_METRICS",
    # artrl's own
    "ArtrlError", "CheckpointError", "ConfigError", "GatherError", "History", "LegacyHistory", "InternalModelConfig",
    "NonFiniteError", "PackingError", "TrainOutOfMemoryError", "TrainTooLongError", "TrajectoryError", "WorkerError", "choice_from_completion", "rewards",
    "schedules", "utils",
]
