"""LocalBackend: train and serve on this machine (CPU or one GPU), in this process.

The ART-facing facade. `register(model)` opens a training session
(local/session.py: the weights loaded once, the trainer, the inference engine,
the run directory, resume from the latest complete checkpoint) and serves it
through the OpenAI-compatible server on 127.0.0.1 (a free port unless given).
Training and inference share ONE copy of the weights: after `train` returns the
server already answers with the new weights (`name`), while older checkpoints
stay reachable as `name@step`.

Train calls run in a worker thread so the event loop (and the server's own
thread) stay responsive; the user-facing API is async like ART's.

With training workers (`InternalModelConfig.num_workers > 1`, `trainer_gpu_ids`
or `num_nodes > 1`) the session is a `distributed.session.WorkerSession`: this
process serves, torch.distributed workers train (docs/distributed.md).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..trajectories import Trajectory, TrajectoryGroup
from ..types import LocalTrainResult, TrainConfig, TrainSFTConfig
from . import storage
from .session import TrainingSession

if TYPE_CHECKING:
    from ..model import Model, TrainableModel

log = logging.getLogger(__name__)


class LocalBackend:
    """Runs training and inference for registered models on this machine.

    Args:
        path: root of the run directories (`<path>/<project>/models/<name>/`).
        host, port: where the inference server listens (loopback and a free port by default).
            Any non-loopback host requires `api_key`.
        api_key: when set, every server route requires `Authorization: Bearer <api_key>`.
        show_progress: tqdm bars during training.
    """

    def __init__(self, *, path: str = "./.art", host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, show_progress: bool = True) -> None:
        from ..serve.background import is_loopback

        if not is_loopback(host) and not api_key:
            raise ConfigError(
                f"LocalBackend(host={host!r}) would serve the model to every machine that can reach {host!r} "
                "without authentication; pass api_key=... (checked on every route), or keep the default "
                "host='127.0.0.1'.")
        self._path = Path(path)
        self._host = host
        self._port = port
        self._api_key = api_key
        self._runs: dict[str, TrainingSession] = {}
        self._server: Any = None
        self._served: Any = None
        self._lock = threading.Lock()
        self.show_progress = show_progress

    # ------------------------------------------------------------------ lifecycle
    @property
    def path(self) -> Path:
        return self._path

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise ConfigError("the backend's server is not running; register a model first")
        return self._server.base_url

    async def register(self, model: "Model") -> None:
        from ..model import TrainableModel

        storage.run_dir(self._path, model.project, model.name).mkdir(parents=True, exist_ok=True)
        if isinstance(model, TrainableModel):
            await asyncio.to_thread(self._load, model)
            model.inference_base_url = self.base_url
            model.inference_api_key = self._api_key or "artrl-local"
            model.inference_model_name = model.name

    def _ensure_server(self) -> None:
        if self._server is not None:
            return
        from ..serve import ServedModels, create_app, start_server

        self._served = ServedModels(checkpoint_path=self._checkpoint_path)
        self._server = start_server(create_app(self._served, api_key=self._api_key), host=self._host,
                                    port=self._port)
        log.info("inference server listening on %s", self._server.base_url)

    def _checkpoint_path(self, name: str, step: int) -> str | None:
        session = self._runs.get(name)
        return session.checkpoint_path(step) if session is not None else None

    def _load(self, model: "TrainableModel") -> None:
        with self._lock:
            if model.name in self._runs:
                return
            cfg = model.internal_config()
            cfg.check()
            session_type = TrainingSession
            if cfg.distributed:  # training in worker processes (docs/distributed.md)
                from ..distributed.session import WorkerSession

                session_type = WorkerSession
            session = session_type.open(storage.run_dir(self._path, model.project, model.name), name=model.name,
                                        project=model.project, base_model=model.base_model, cfg=cfg)
            self._runs[model.name] = session
            self._ensure_server()
            self._served.add(model.name, session.engine)
            log.info("registered %s/%s (%s) at step %d", model.project, model.name, model.base_model, session.step)

    def close(self) -> None:
        """Stop the server and release the models."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        for session in self._runs.values():
            session.close()
        self._runs.clear()

    async def __aenter__(self) -> "LocalBackend":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def _state(self, model: "Model") -> TrainingSession:
        try:
            return self._runs[model.name]
        except KeyError:
            raise ConfigError(f"model {model.name!r} is not registered with this backend; "
                              "call `await model.register(backend)` first") from None

    # ------------------------------------------------------------------ checkpoints
    async def _get_step(self, model: "Model") -> int:
        return self._state(model).step

    async def _delete_checkpoints(self, model: "Model", best_checkpoint_metric: str = "val/reward",
                                  benchmark_smoothing: float = 1.0) -> list[int]:
        """Delete every checkpoint but the latest and the best by `best_checkpoint_metric`."""
        del benchmark_smoothing
        session = self._state(model)
        return await asyncio.to_thread(session.delete_checkpoints, best_checkpoint_metric)

    # ------------------------------------------------------------------ training
    async def train(self, model: "TrainableModel", trajectory_groups: Iterable[TrajectoryGroup], *,
                    config: TrainConfig | None = None, **kwargs: Any) -> LocalTrainResult:
        """One RL train call; extra keyword arguments are TrainConfig fields (e.g. learning_rate=1e-5)."""
        cfg = _merge(config or TrainConfig(), kwargs)
        groups = list(trajectory_groups)
        return await asyncio.to_thread(self._train_sync, model, "rl", groups, cfg)

    async def _train_model(self, model: "TrainableModel", trajectory_groups: Iterable[TrajectoryGroup],
                           config: TrainConfig, dev_config: dict[str, Any] | None = None) -> LocalTrainResult:
        return await self.train(model, trajectory_groups, config=_merge(config, dev_config or {}))

    async def _train_sft(self, model: "TrainableModel", trajectories: Iterable[Trajectory],
                         config: TrainSFTConfig, dev_config: dict[str, Any] | None = None) -> LocalTrainResult:
        cfg = _merge(config, dev_config or {})
        return await asyncio.to_thread(self._train_sync, model, "sft", list(trajectories), cfg)

    def _train_sync(self, model: "TrainableModel", kind: str, data: list[Any], cfg: Any) -> LocalTrainResult:
        return self._state(model).train(kind, data, cfg, show_progress=self.show_progress)


def _merge(config: Any, extra: dict[str, Any]) -> Any:
    if not extra:
        return config
    allowed = set(type(config).model_fields)
    unknown = sorted(set(extra) - allowed)
    if unknown:
        raise ConfigError(f"unknown {type(config).__name__} fields {unknown}; known fields: {sorted(allowed)}")
    return type(config)(**{**config.model_dump(), **extra})
