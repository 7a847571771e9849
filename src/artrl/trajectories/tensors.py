"""ART 0.5.23's `art.trajectories.tensors`: tokenized trajectories as torch tensors.

`Tokenized*.tensorize(device=...)` (tokens.py) builds these: int64 `tokens`, float32 `logprobs` (NaN where not
sampled) and int32 `flags` (`TokenFlag` bits), one entry per token. torch is imported by `tensorize`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class Conversation(Protocol):
    """What a tokenized sequence keeps of the conversation it came from (a `LegacyHistory`, history.py)."""

    messages_and_choices: list[Any]
    tools: list[Any] | None

    def messages(self) -> list[Any]: ...


class TrajectoryFields:
    """`reward`, `metrics` and `metadata` of a tokenized or tensorized trajectory: its trajectory's."""

    trajectory: Any  # the Trajectory (data.py)

    @property
    def reward(self) -> float:
        return self.trajectory.reward

    @reward.setter
    def reward(self, value: float) -> None:
        self.trajectory.reward = value

    @property
    def metrics(self) -> dict[str, Any]:
        return self.trajectory.metrics

    @property
    def metadata(self) -> dict[str, Any]:
        return self.trajectory.metadata


@dataclass
class TensorizedHistory:
    history: Conversation  # a LegacyHistory (history.py)
    model: str
    tokens: "torch.Tensor"  # [n] int64
    logprobs: "torch.Tensor"  # [n] float32, NaN where not sampled
    flags: "torch.Tensor"  # [n] int32, TokenFlag bits


@dataclass
class TensorizedTrajectory(TensorizedHistory, TrajectoryFields):
    trajectory: Any  # the Trajectory (data.py)


@dataclass
class TensorizedMultiHistoryTrajectory(TrajectoryFields):
    trajectory: Any  # the Trajectory (data.py)
    histories: list[TensorizedHistory]


@dataclass
class TensorizedTrajectoryGroup:
    trajectory_group: Any  # the TrajectoryGroup (data.py)
    trajectories: list[Any]
