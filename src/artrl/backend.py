"""`Backend`: what a model needs from the thing that serves and trains it (ART's `art.Backend`).

ART declares it as a typing Protocol; here it is a base class with the same
methods, so a backend states what it implements (`class MyBackend(art.Backend)`)
and a method it lacks fails with an error naming the backend and the method,
instead of returning None. Type annotations written against ART's
`art.Backend` keep working.

The public methods are `register`, `train` and `close`; the private ones are the
hooks `Model` / `TrainableModel` call (`_get_step`, `_train_model`, `_train_sft`,
`_delete_checkpoint_files`, `_prepare_backend_for_training`, `_model_inference_name`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .trajectories import Trajectory, TrajectoryGroup
from .types import TrainConfig, TrainResult, TrainSFTConfig

if TYPE_CHECKING:
    from .model import Model, TrainableModel


class Backend:
    """Serves and trains models; subclass it and implement the methods your models use."""

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} does not implement Backend.{method}; a backend that "
                                   f"serves or trains models must define {method}.")

    def _model_inference_name(self, model: "Model", step: int | None = None) -> str:
        """The name the inference server knows the model (at `step`) by."""
        raise self._missing("_model_inference_name")

    async def close(self) -> None:
        """Stop serving and free what the backend holds."""
        raise self._missing("close")

    async def register(self, model: "Model") -> None:
        """Make `model` servable (and trainable): load it, resume from its latest checkpoint."""
        raise self._missing("register")

    async def _get_step(self, model: "TrainableModel") -> int:
        raise self._missing("_get_step")

    async def _delete_checkpoint_files(self, model: "TrainableModel", steps_to_keep: list[int]) -> None:
        raise self._missing("_delete_checkpoint_files")

    async def _prepare_backend_for_training(self, model: "TrainableModel", config: Any) -> tuple[str, str]:
        """Start serving `model` for training; returns (base_url, api_key)."""
        raise self._missing("_prepare_backend_for_training")

    async def train(self, model: "TrainableModel", trajectory_groups: Iterable[TrajectoryGroup],
                    **kwargs: Any) -> TrainResult:
        """One RL training call on the groups."""
        raise self._missing("train")

    def _train_model(self, model: "TrainableModel", trajectory_groups: list[TrajectoryGroup], config: TrainConfig,
                     dev_config: Any, verbose: bool = False) -> Any:
        raise self._missing("_train_model")

    def _train_sft(self, model: "TrainableModel", trajectories: Iterable[Trajectory], config: TrainSFTConfig,
                   dev_config: Any, verbose: bool = False) -> Any:
        raise self._missing("_train_sft")
