"""`Model` and `TrainableModel`: the user's handle on a served (and trainable) model.

Names and methods follow ART so an ART loop runs unchanged:

    model = art.TrainableModel(name="agent-001", project="demo", base_model="artrl/tiny")
    await model.register(art.LocalBackend())
    client = model.openai_client()
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-5))

Model-level settings (dtype, device, attention, inference batch size) go in
`_internal_config=art.InternalModelConfig(...)`, the LoRA adapter in ART 0.5.23's
`lora_config=art.LoRAConfig(...)` (config/lora.py); per-call settings (learning
rate, batching, loss) in `TrainConfig` / `TrainSFTConfig`.

As in ART 0.5.23, a trainable model's `run_name` is its durable lineage: the run
directory `base_path/<project>/models/<run_name>/` (checkpoints, history,
trajectories, state), the W&B / TensorBoard run; `name` is only what it is served
as. Without `run_name` (ART 0.5.18's programs) it is `name`, and so is the run
directory.

A model logs by itself, as in ART: `model.log(...)` writes under its run
directory (run/history.py) whether or not it is registered, and a prompted model
(`art.Model(name="openai/gpt-4o", ...)`) logs its evaluations the same way. `report_metrics` mirrors every history row
to W&B or TensorBoard (run/tracking.py).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import AsyncIterator, Iterable
from contextvars import Token
from pathlib import Path
from typing import Any

import pydantic

from .dev.train import sft_metric_logging
from .errors import ConfigError
from .run import storage
from .run.history import RunHistory, best_logged_step, normalize_trajectory_groups
from .metrics import MetricsBuilder
from .metrics_taxonomy import aggregate_step_metrics
from .trajectories.data import Trajectory, TrajectoryGroup
from .config.model import InternalModelConfig
from .types import TrainConfig, TrainResult, TrainSFTConfig

log = logging.getLogger(__name__)

OPENAI_CLIENT_TIMEOUT_S = 1200.0
"""Request timeout of `Model.openai_client()` (ART's: 1200 s, 5 s to connect)."""
OPENAI_CONNECT_TIMEOUT_S = 5.0
"""Connect timeout of `Model.openai_client()` (ART's)."""


# The train hooks' protocol as the model speaks it (backend.py): artrl's awaitable TrainResult, or ART's async
# iterator of per-optimizer-step metric dicts.


def is_metric_stream(produced: Any) -> bool:
    """True when a hook returned ART's per-optimizer-step metric stream (an async iterator)."""
    return hasattr(produced, "__aiter__")


async def collect_step_metrics(stream: AsyncIterator[dict[str, float]], hook: str) -> tuple[list[dict], float]:
    """Every metric dict the stream yields, and the seconds it took; a non-dict item is a TypeError naming it."""
    started = time.monotonic()
    samples: list[dict[str, float]] = []
    async for item in stream:
        if not isinstance(item, dict):
            raise TypeError(f"{hook} yielded a {type(item).__name__} (item {len(samples)}); ART's hook protocol "
                            "yields one dict of metrics per optimizer step, e.g. {'loss/train': 0.5}")
        samples.append(item)
    return samples, time.monotonic() - started


def _close(produced: Any) -> None:
    close = getattr(produced, "close", None)  # a coroutine never awaited: no "never awaited" warning
    if callable(close):
        close()


def _no_cost(_prompt_tokens: int | None, _completion_tokens: int | None, _cost_context: str) -> dict[str, float]:
    """ART's default cost calculator: no cost."""
    return {}


class Model(pydantic.BaseModel):
    """A model that serves inference (ART's `Model`); `TrainableModel` can also train.

    A prompted model is any OpenAI-compatible endpoint:
    `Model(name="openai/gpt-4o", project="p", inference_base_url=..., inference_api_key=...)`.
    """

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True, extra="allow")

    name: str
    project: str
    entity: str | None = None
    id: str | None = None
    run_id: str | None = None
    config: Any = None
    trainable: bool = False
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None
    base_path: str = pydantic.Field(".art", description="Root of the run directories (`<base_path>/<project>/"
                                    "models/<run_name or name>/`); `register` sets it to the backend's.")
    report_metrics: list[str] | None = pydantic.Field(
        None, description="Trackers that mirror every history row: 'wandb', 'tensorboard'. None: W&B when "
        "WANDB_API_KEY is set (ART's default); []: none.")

    _backend: Any = pydantic.PrivateAttr(default=None)
    _clients: Any = pydantic.PrivateAttr(default=None)
    _history: Any = pydantic.PrivateAttr(default=None)
    _wandb_config: dict[str, Any] = pydantic.PrivateAttr(default_factory=dict)

    @pydantic.field_validator("project")
    @classmethod
    def _valid_project(cls, v: str) -> str:
        if not v or "/" in v or "\\" in v or v in (".", ".."):
            raise ValueError(f"project {v!r} is not a valid name: use a non-empty name without '/'")
        return v

    @pydantic.field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        parts = v.split("/") if v else [""]
        if any(p in ("", ".", "..") for p in parts) or "\\" in v:
            raise ValueError(f"model name {v!r} is not valid: use a non-empty name whose '/'-separated parts "
                             "are not empty, '.' or '..' (e.g. 'agent-001' or 'openai/gpt-4o')")
        return v

    async def register(self, backend: Any) -> None:
        """Attach to a backend: loads/serves the model and resumes from its latest checkpoint.

        The model then logs where the backend keeps its runs (`base_path`), and JSONL trajectory
        logs of earlier versions in its run directory are migrated to Parquet.
        """
        from .run.migration import auto_migrate_on_register

        self._attach(backend)
        await backend.register(self)
        auto_migrate_on_register(self._run_dir())

    def _attach(self, backend: Any) -> None:
        path = getattr(backend, "path", None)
        if path is not None:
            self.base_path = str(path)
        self._backend = backend

    def backend(self) -> Any:
        if self._backend is None:
            raise ConfigError(f"model {self.name!r} is not registered; call `await model.register(backend)` first")
        return self._backend

    def openai_client(self, **kwargs: Any):
        """An `openai.AsyncOpenAI` client pointed at this model's inference server.

        Without kwargs the client is cached, so rollouts may call this per request as ART code does: for a
        local server, inside a running event loop, one client per loop on the SDK's aiohttp transport
        (closed when that loop ends); otherwise one client on the SDK's default httpx transport
        (client/openai.py). With kwargs, a new client on the default transport each call. Every request
        carries its rollout's `X-Session-ID` (one per asyncio task), which keeps a rollout's turns on one inference
        replica behind a router (client/affinity.py).
        """
        if self.inference_base_url is None:
            if self.trainable:
                raise ConfigError(f"model {self.name!r} has no inference server yet; call "
                                  "`await model.register(backend)`")
            raise ConfigError(f"prompted model {self.name!r} needs inference_base_url (and inference_api_key) "
                              "to make an OpenAI client")
        base_url, api_key = self.inference_base_url, self.inference_api_key or "artrl"
        if kwargs:
            from openai import AsyncOpenAI, DefaultAsyncHttpxClient, Timeout

            from .client.affinity import event_hooks

            kwargs.setdefault("timeout", Timeout(OPENAI_CLIENT_TIMEOUT_S, connect=OPENAI_CONNECT_TIMEOUT_S))
            kwargs.setdefault("http_client", DefaultAsyncHttpxClient(event_hooks=event_hooks()))
            return AsyncOpenAI(base_url=base_url, api_key=api_key, **kwargs)
        if self._clients is None:
            from .client.openai import OpenAIClients

            self._clients = OpenAIClients()
        return self._clients.get(base_url, api_key, (OPENAI_CLIENT_TIMEOUT_S, OPENAI_CONNECT_TIMEOUT_S))

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Parameters for `litellm.completion` (ART's): model name (`hosted_vllm/` for trainable models),
        base_url, api_key, temperature 1. `step` names a checkpoint (`name@step`)."""
        name = self.get_inference_name(step)
        return {"model": f"hosted_vllm/{name}" if self.trainable else name, "base_url": self.inference_base_url,
                "api_key": self.inference_api_key, "temperature": 1}

    def get_inference_name(self, step: int | None = None) -> str:
        """The name to send to the inference endpoint: the backend's choice where it has one (ART's
        `_model_inference_name`), else `inference_model_name or name`, with `@step` for a checkpoint."""
        backend_name = getattr(self._backend, "_model_inference_name", None)
        if callable(backend_name):
            return backend_name(self, step=step)
        base = self.inference_model_name or self.name
        return base if step is None else f"{base}@{step}"

    async def get_step(self) -> int:
        """The latest training step; 0 for a prompted model."""
        if not self.trainable:
            return 0
        return await self.backend()._get_step(self)

    # ------------------------------------------------------------------ run directory and state
    def _storage_name(self) -> str:
        """The name of the run directory and the tracked run (ART's): `name` here, `run_name` for a trainable
        model."""
        return self.name

    def _run_dir(self) -> Path:
        return storage.run_dir(self.base_path, self.project, self._storage_name())

    def _get_output_dir(self) -> str:
        return str(self._run_dir())

    def overwrite_state(self, state: dict[str, Any]) -> None:
        """Replace `state.json` in the run directory (atomically). Prefer `merge_state`."""
        storage.write_json_atomic(self._run_dir() / storage.STATE_FILE, state)

    def write_state(self, state: dict[str, Any]) -> None:
        """Deprecated in ART: use `overwrite_state()` or `merge_state()`."""
        warnings.warn("write_state() is deprecated. Use overwrite_state() or merge_state() instead.",
                      DeprecationWarning, stacklevel=2)
        self.overwrite_state(state)

    def merge_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Deep-merge `state` into `state.json` and return the result."""
        return storage.merge_state(self._run_dir(), state)

    def read_state(self) -> dict[str, Any] | None:
        """`state.json` of the run directory, or None."""
        return storage.read_state(self._run_dir())

    # ------------------------------------------------------------------ logging and tracking
    def _run_history(self) -> RunHistory:
        run = self._run_dir()
        if self._history is None or self._history.run != run:
            from .run.tracking import Trackers

            if self._history is not None and self._history.trackers is not None:
                self._history.trackers.close()
            trackers = Trackers(self.report_metrics, project=self.project, name=self._storage_name(), run=run,
                                config=self._tracking_config(), user_config=self._wandb_config)
            self._history = RunHistory(run, trackers=trackers)
        return self._history

    def _tracking_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"model": self.name, "project": self.project, "trainable": self.trainable}
        if self._storage_name() != self.name:
            config["run_name"] = self._storage_name()
        if getattr(self, "lora_config", None):
            config["lora_config"] = dict(self.lora_config)
        if getattr(self, "base_model", None):
            config["base_model"] = self.base_model
        internal = getattr(self, "_internal_config", None)
        if internal is not None:  # ours, or a plain dict set the way ART's own tests do
            dump_internal = getattr(internal, "model_dump", None)
            config["internal_config"] = dump_internal(mode="json") if callable(dump_internal) else internal
        if self.config is not None:
            dump = getattr(self.config, "model_dump", None)
            config["config"] = dump(mode="json") if callable(dump) else self.config
        return {**config, **self._wandb_config}

    def update_wandb_config(self, config: dict[str, Any]) -> None:
        """Merge `config` into the tracked run's config (W&B's run config; TensorBoard's 'config' text).

        A key already set to another value is refused (W&B run configs are immutable, as in ART).
        """
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict[str, Any], got {type(config).__name__}")

        def merge(old: dict[str, Any], new: dict[str, Any], path: str = "") -> dict[str, Any]:
            out = dict(old)
            for k, v in new.items():
                where = f"{path}.{k}" if path else k
                if k in out and isinstance(out[k], dict) and isinstance(v, dict):
                    out[k] = merge(out[k], v, where)
                elif k in out and out[k] != v:
                    raise ValueError(f"W&B config is immutable once set. Conflicting value for {where!r}: "
                                     f"{out[k]!r}, then {v!r}.")
                else:
                    out[k] = v
            return out

        self._wandb_config = merge(self._wandb_config, config)
        if self._history is not None and self._history.trackers is not None:
            self._history.trackers.update_config(self._wandb_config)

    def _get_wandb_run(self) -> Any:
        """The W&B run this model reports to (started on first use), or None."""
        return self._run_history().trackers.wandb_run()

    def finish_tracking(self) -> None:
        """Finish the W&B run and close the TensorBoard log (they also close at interpreter exit)."""
        if self._history is not None and self._history.trackers is not None:
            self._history.trackers.close()

    def metrics_builder(self, cost_context: str | None = None) -> MetricsBuilder:
        """The model's metrics builder (ART's): metrics added to it land in the next history row."""
        history = self._run_history()
        history.load_state()
        return history.builder if cost_context is None else history.builder.for_cost_context(cost_context)

    def activate_metrics_context(self, cost_context: str) -> Token[MetricsBuilder]:
        """Make this model's builder the active one (RULER records its judge's cost there)."""
        return self.metrics_builder(cost_context).activate()

    async def _current_step(self) -> int:
        if not self.trainable:
            return 0
        if self._backend is not None:
            return await self.get_step()
        return storage.latest_checkpoint(self._run_dir()) or 0  # not registered: the run's latest checkpoint

    def _log_metrics(self, metrics: dict[str, float], split: str, step: int) -> dict[str, Any]:
        """ART's low-level row writer: `metrics` routed by ART's rule (a known section keeps its name, other
        keys get `<split>/`) into one history row at `step`, mirrored to the trackers; returns the row."""
        history = self._run_history()
        row = history.write_row(dict(metrics), split, step)
        if history.trackers is not None:
            history.trackers.log(row, step)
        return row

    async def log(self, trajectories: Iterable[Trajectory | BaseException] | Iterable[TrajectoryGroup] | None = None,
                  split: str = "val", *, metrics: dict[str, float] | None = None,
                  step: int | None = None) -> dict[str, Any]:
        """Log trajectories and/or metrics: one history row, and the groups as `trajectories/<split>/NNNN.parquet`.

        `trajectories`: TrajectoryGroups, or Trajectories (exceptions among them are counted) logged
        as one group; any iterable, read once. `step` defaults to the current step (0 for a
        prompted model; the latest checkpoint on disk for a trainable model not yet registered).
        Works without a backend. Returns the row written ({} when there was nothing to log).
        """
        return await self._log(trajectories, split, metrics, step)

    async def _log(self, trajectories: Any, split: str, metrics: dict[str, float] | None, step: int | None,
                   extra: dict[str, Any] | None = None, validated: bool = False) -> dict[str, Any]:
        groups = None if trajectories is None else normalize_trajectory_groups(trajectories)
        if step is None:
            step = await self._current_step()
        return await self._run_history().log(groups, split, metrics, step, extra=extra, backend=self._backend,
                                                 model=self, validated=validated)


class TrainableModel(Model):
    """A model with a LoRA adapter that `train` / `train_sft` update.

    `run_name` (ART 0.5.23) names the run directory and the tracked run; two models with one `name` and two
    run names are two runs. `lora_config` (ART's `art.LoRAConfig`) shapes the adapter (config/lora.py).
    """

    base_model: str
    trainable: bool = True
    run_name: str | None = pydantic.Field(
        None, description="ART 0.5.23: the run's durable name: run directory `<base_path>/<project>/models/"
        "<run_name>/` (checkpoints, history, trajectories, state) and W&B / TensorBoard run. `name` stays what the "
        "model is served as. None: `name` (ART 0.5.18's layout); read back, it is then `name`.")
    lora_config: dict[str, Any] | None = pydantic.Field(
        None, description="ART 0.5.23's `art.LoRAConfig(...)`: rank, alpha, dropout, target_modules, ... of the "
        "adapter that trains, is saved and is served (config/lora.py says what each key does; a key artrl cannot "
        "honour is a ConfigError). None: artrl's defaults (rank 8, alpha 16).")

    _internal_config: InternalModelConfig | None = pydantic.PrivateAttr(default=None)
    _cost_calculator: Any = pydantic.PrivateAttr(default=None)

    def __init__(self, *, _internal_config: InternalModelConfig | dict[str, Any] | None = None, **data: Any) -> None:
        from .config.lora import apply_lora_config, lora_config_updates

        lora_config_updates(data.get("lora_config"))  # ConfigError naming a bad key, before pydantic's own checks
        super().__init__(**data)
        if isinstance(_internal_config, dict):
            _internal_config = InternalModelConfig(**_internal_config)
        self._internal_config = _internal_config
        if self.run_name is None:
            self.run_name = self.name
        # refused keys and clashes with _internal_config are errors now; register applies it again (backend)
        apply_lora_config(self.internal_config(), self.lora_config)

    def _storage_name(self) -> str:
        return self.run_name or self.name

    @property
    def cost_calculator(self) -> Any:
        """ART's per-call cost hook, `(prompt_tokens, completion_tokens, cost_context) -> {metric: dollars}`;
        by default one that reports no cost (ART's no-op calculator)."""
        return self._cost_calculator if self._cost_calculator is not None else _no_cost

    def set_cost_calculator(self, calculator: Any) -> None:
        """Set the cost hook (None: back to the no-op one), as ART's `set_cost_calculator`."""
        self._cost_calculator = calculator

    def internal_config(self) -> InternalModelConfig:
        return self._internal_config or InternalModelConfig()

    async def register(self, backend: Any, _openai_client_config: dict[str, Any] | None = None) -> None:
        """Attach to a backend, as `Model.register`; ART's `_openai_client_config` (`art.dev.OpenAIServerConfig`)
        goes to the backend's `_prepare_backend_for_training` hook, which serves the model with it
        (LocalBackend: `server_args.host` / `port` / `api_key` apply, other keys are noticed once)."""
        if _openai_client_config is None:
            await super().register(backend)
            return
        from .run.migration import auto_migrate_on_register

        self._attach(backend)
        # the hook registers the model and starts serving it, so the server settings apply before it listens
        self.inference_base_url, self.inference_api_key = await backend._prepare_backend_for_training(
            self, _openai_client_config)
        auto_migrate_on_register(self._run_dir())

    @pydantic.field_validator("name")
    @classmethod
    def _served_name(cls, v: str) -> str:
        if "/" in v or "@" in v:
            raise ValueError(f"trainable model name {v!r} may not contain '/' or '@': it is served as "
                             "'<name>' and '<name>@<step>' and names the run directory. Use e.g. 'agent-001'.")
        return v

    @pydantic.field_validator("run_name")
    @classmethod
    def _valid_run_name(cls, v: str | None) -> str | None:
        # '@' is allowed: a run name is never served (the served names are `name` and `name@step`)
        if v is not None and (v in ("", ".", "..") or "/" in v or "\\" in v):
            raise ValueError(f"run_name {v!r} is not valid: it names the run directory "
                             "(<base_path>/<project>/models/<run_name>/); use a non-empty name without '/' or '\\', "
                             "not '.' or '..' (e.g. 'agent-001-run-2').")
        return v

    async def train(self, trajectory_groups: Iterable[TrajectoryGroup], config: TrainConfig | None = None,
                    _config: dict[str, Any] | None = None, verbose: bool = False) -> TrainResult:
        """One RL step: trains, checkpoints, serves the new weights, then logs ONE 'train' row.

        As in ART, the row is written at the new step: the groups' averages (`train/reward`, ...),
        the trainer's metrics (`loss/train`, ...) and the groups as `trajectories/train/NNNN.parquet`.
        The backend's `_train_model` may speak artrl's hook protocol or ART's (backend.py).
        """
        groups = list(trajectory_groups)
        for i, g in enumerate(groups):
            if not isinstance(g, TrajectoryGroup):
                raise ConfigError(f"trajectory_groups[{i}] is a {type(g).__name__}; expected a TrajectoryGroup. "
                                  "Did you forget to await gather_trajectory_groups?")
        # the backend builds and checks the config, and validates every trajectory while tokenizing, before
        # anything is trained or written; the row logged below takes the groups as validated
        config = config or TrainConfig()
        return await self._train_through_backend("rl", groups, config, _config or {}, verbose)

    async def train_sft(self, trajectories: Iterable[Trajectory], config: TrainSFTConfig | None = None,
                        _config: dict[str, Any] | None = None, verbose: bool = False,
                        log_metrics: bool = True) -> TrainResult | None:
        """Supervised fine-tuning on the assistant turns of the trajectories (`config.assistant_turns`); logs one
        'train' row, or none with `log_metrics=False` (ART 0.5.23).

        As in ART, the backend's hook gets `_config["metric_logging"] = {"enabled": log_metrics}`.
        None only from a backend on ART's hook protocol whose `_train_sft` yielded nothing (backend.py).
        """
        dev_config = {**(_config or {}), "metric_logging": sft_metric_logging(_config, log_metrics)}
        return await self._train_through_backend("sft", list(trajectories), config or TrainSFTConfig(), dev_config,
                                                 verbose, log_row=log_metrics)

    async def _train_through_backend(self, kind: str, data: list[Any], config: Any, dev_config: dict[str, Any],
                                     verbose: bool, log_row: bool = True) -> TrainResult | None:
        """Run the backend's RL (`kind="rl"`, data = groups) or SFT hook in whichever protocol it speaks
        (backend.py), write the train row (unless `log_row` is False: ART's `train_sft(log_metrics=False)`), and
        return the result."""
        backend = self.backend()
        hook_name = "_train_model" if kind == "rl" else "_train_sft"
        produced = getattr(backend, hook_name)(self, data, config, dev_config, verbose)
        groups = data if kind == "rl" else None
        if not is_metric_stream(produced):
            try:  # a coroutine has not started yet: the step before it is read first
                before = await self.get_step()
            except BaseException:
                _close(produced)
                raise
            result = await produced
            if log_row:
                await self._log_train_row(groups, result, before, kind)
            return result
        samples, seconds = await collect_step_metrics(produced, f"{type(backend).__name__}.{hook_name}")
        if kind == "sft" and not samples:
            log.warning("%s: %s.%s yielded no metrics, so no train row is written (as in ART)", self.name,
                        type(backend).__name__, hook_name)
            return None
        metrics = aggregate_step_metrics(samples, seconds, kind)
        step = await self.get_step()
        if log_row:
            await self._log(groups, "train", metrics, step, extra={"kind": kind})
        return TrainResult(step=step, metrics=metrics)

    async def _log_train_row(self, groups: list[TrajectoryGroup] | None, result: TrainResult, before: int,
                             kind: str) -> None:
        if result.step == before:
            log.warning("%s: the %s call did not advance the step (still %d), so it writes no train row",
                        self.name, kind.upper(), before)
            return
        await self._log(groups, "train", result.metrics, result.step, extra={"kind": kind}, validated=True)

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Keep the latest checkpoint and the best one by `best_checkpoint_metric`; delete the rest.

        The best step is the one whose logged rows have the highest mean of the metric (ART's rule). Returns
        the deleted steps (ART returns None). A backend without artrl's `_delete_checkpoints` gets ART's
        call: `_delete_checkpoint_files(model, [latest, best])`.
        """
        backend = self.backend()
        own = getattr(backend, "_delete_checkpoints", None)
        if callable(own):
            return await own(self, best_checkpoint_metric)
        keep = [await self.get_step()]
        best = best_logged_step(self._run_dir(), best_checkpoint_metric)
        if best is not None:
            keep.append(best)
        await backend._delete_checkpoint_files(self, keep)
        return []
