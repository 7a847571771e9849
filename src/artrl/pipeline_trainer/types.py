"""The function types a `PipelineTrainer` takes (ART 0.5.18's names).

* `RolloutFn(model, scenario, config) -> TrajectoryGroup`: one group for one scenario.
* `SingleRolloutFn(model, scenario, config) -> Trajectory`: one trajectory; `make_group_rollout_fn`
  runs it n times in parallel to make a `RolloutFn`.
* `EvalFn(model, step, config) -> trajectories or groups` (a list, logged as split "val", or a dict
  `{split: list}`), run on checkpoint `step`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from ..trajectories.data import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from ..model import TrainableModel

ScenarioT = TypeVar("ScenarioT", bound=dict)
ConfigT = TypeVar("ConfigT")
ScalarMetadataValue = float | int | str | bool | None

RolloutFn = Callable[["TrainableModel", ScenarioT, ConfigT], Awaitable[TrajectoryGroup]]
SingleRolloutFn = Callable[["TrainableModel", ScenarioT, ConfigT], Awaitable[Trajectory]]
EvalFn = Callable[
    ["TrainableModel", int, ConfigT],
    Awaitable[list[Trajectory | TrajectoryGroup] | dict[str, list[Trajectory | TrajectoryGroup]]],
]
