"""`Model` and `TrainableModel`: the user's handle on a served (and trainable) model.

Names and methods follow ART so an ART loop runs unchanged:

    model = art.TrainableModel(name="agent-001", project="demo", base_model="artrl/tiny")
    await model.register(art.LocalBackend())
    client = model.openai_client()
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-5))

Model-level settings (LoRA, dtype, device, attention, inference batch size)
go in `_internal_config=art.InternalModelConfig(...)`; per-call settings
(learning rate, batching, loss) in `TrainConfig` / `TrainSFTConfig`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import pydantic

from .errors import ConfigError
from .trajectories import Trajectory, TrajectoryGroup
from .types import InternalModelConfig, TrainConfig, TrainResult, TrainSFTConfig

log = logging.getLogger(__name__)


class Model(pydantic.BaseModel):
    """A model that serves inference (ART's `Model`); `TrainableModel` can also train."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True, extra="allow")

    name: str
    project: str
    entity: str | None = None
    id: str | None = None
    config: Any = None
    trainable: bool = False
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None

    _backend: Any = pydantic.PrivateAttr(default=None)
    _client: Any = pydantic.PrivateAttr(default=None)

    @pydantic.field_validator("name", "project")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not v or "/" in v or "@" in v or v in (".", ".."):
            raise ValueError(f"{v!r} is not a valid name: use a non-empty name without '/' or '@'")
        return v

    async def register(self, backend: Any) -> None:
        """Attach to a backend: loads/serves the model and resumes from its latest checkpoint."""
        self._backend = backend
        await backend.register(self)

    def backend(self) -> Any:
        if self._backend is None:
            raise ConfigError(f"model {self.name!r} is not registered; call `await model.register(backend)` first")
        return self._backend

    def openai_client(self, **kwargs: Any):
        """An `openai.AsyncOpenAI` client pointed at this model's inference server.

        The same client (and its connection pool) is returned on every call without kwargs,
        so rollouts may call this per request as ART code does.
        """
        from openai import AsyncOpenAI

        if self.inference_base_url is None:
            raise ConfigError(f"model {self.name!r} has no inference server yet; call `await model.register(backend)`")
        key = (self.inference_base_url, self.inference_api_key)
        if not kwargs and self._client is not None and self._client[0] == key:
            return self._client[1]
        kwargs.setdefault("timeout", 600.0)
        client = AsyncOpenAI(base_url=self.inference_base_url, api_key=self.inference_api_key or "artrl", **kwargs)
        if len(kwargs) == 1:  # only the default timeout: cache it
            self._client = (key, client)
        return client

    def get_inference_name(self, step: int | None = None) -> str:
        """`name` (latest weights) or `name@step` (the checkpoint of that step)."""
        base = self.inference_model_name or self.name
        return base if step is None else f"{base}@{step}"

    async def get_step(self) -> int:
        return await self.backend()._get_step(self)

    async def log(self, trajectories: Sequence[Trajectory | TrajectoryGroup] | None = None, split: str = "val",
                  *, metrics: dict[str, float] | None = None, step: int | None = None) -> dict[str, float]:
        """Record averaged metrics (e.g. 'val/reward') in history.jsonl and the trajectories in the run dir."""
        return await self.backend()._log(self, trajectories, split, metrics, step)


class TrainableModel(Model):
    """A model with a LoRA adapter that `train` / `train_sft` update."""

    base_model: str
    trainable: bool = True

    _internal_config: InternalModelConfig | None = pydantic.PrivateAttr(default=None)

    def __init__(self, *, _internal_config: InternalModelConfig | dict[str, Any] | None = None, **data: Any) -> None:
        super().__init__(**data)
        if isinstance(_internal_config, dict):
            _internal_config = InternalModelConfig(**_internal_config)
        self._internal_config = _internal_config

    def internal_config(self) -> InternalModelConfig:
        return self._internal_config or InternalModelConfig()

    async def train(self, trajectory_groups: Iterable[TrajectoryGroup], config: TrainConfig | None = None,
                    _config: dict[str, Any] | None = None, verbose: bool = False) -> TrainResult:
        """One RL step: logs the groups as split 'train', trains, checkpoints, serves the new weights."""
        del verbose
        groups = list(trajectory_groups)
        for i, g in enumerate(groups):
            if not isinstance(g, TrajectoryGroup):
                raise ConfigError(f"trajectory_groups[{i}] is a {type(g).__name__}; expected a TrajectoryGroup. "
                                  "Did you forget to await gather_trajectory_groups?")
        config = config or TrainConfig()
        config.check()  # refuse a bad config before anything is written
        await self.log(groups, split="train")
        result = await self.backend()._train_model(self, groups, config, _config or {})
        return result

    async def train_sft(self, trajectories: Iterable[Trajectory], config: TrainSFTConfig | None = None,
                        _config: dict[str, Any] | None = None, verbose: bool = False) -> TrainResult:
        """Supervised fine-tuning on every assistant turn of the trajectories."""
        del verbose
        return await self.backend()._train_sft(self, list(trajectories), config or TrainSFTConfig(), _config or {})

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Keep the latest checkpoint and the best one by `best_checkpoint_metric`; delete the rest."""
        return await self.backend()._delete_checkpoints(self, best_checkpoint_metric)
