"""`Backend`: what a model needs from the thing that serves and trains it (ART's `art.Backend`).

ART declares it as a typing Protocol; here it is a base class with the same
methods, so a backend states what it implements (`class MyBackend(art.Backend)`)
and a method it lacks fails with an error naming the backend and the method,
instead of returning None. Type annotations written against ART's
`art.Backend` keep working.

The public methods are `register`, `train` and `close`; the private ones are the
hooks `Model` / `TrainableModel` call (`_get_step`, `_train_model`, `_train_sft`,
`_delete_checkpoint_files`, `_prepare_backend_for_training`, `_model_inference_name`).

The train hooks `_train_model(model, groups, config, dev_config, verbose)` and
`_train_sft(model, trajectories, config, dev_config, verbose)` may speak either of
two protocols; `Model.train` / `train_sft` tell them apart by what the call returns
(model.py, `TrainableModel._train_through_backend`):

* artrl's: `async def` returning a `TrainResult` (`LocalBackend`'s). The model writes
  one train row at `result.step` with `result.metrics`, none if the step did not advance.
* ART's: an async generator (any async iterator) yielding one dict of metrics per
  optimizer step, e.g. `{"loss/train": 0.4, "data/step_num_gradient_steps": 3}`. The
  model averages them as ART does (each key over the steps reporting it; the gradient
  step count must be the same in every dict), adds `time/step_trainer_s`, reads the step
  with `_get_step` and writes one train row there. So a back end written against ART
  plugs in unchanged. Offering `supports_automatic_train_step_metrics()` and
  `automatic_gpu_cost_per_hour_usd(model)` adds ART's automatic `time/step_wall_s` and
  `costs/gpu` to the row, in both protocols.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .trajectories.data import Trajectory, TrajectoryGroup
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
        """One RL step: an awaitable TrainResult (artrl's protocol) or an async iterator of per-optimizer-step
        metric dicts (ART's); see the module docstring."""
        raise self._missing("_train_model")

    def _train_sft(self, model: "TrainableModel", trajectories: Iterable[Trajectory], config: TrainSFTConfig,
                   dev_config: Any, verbose: bool = False) -> Any:
        """One SFT call, in either protocol, as `_train_model`."""
        raise self._missing("_train_sft")
