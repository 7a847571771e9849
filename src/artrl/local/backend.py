"""LocalBackend: train and serve on this machine (CPU or one GPU), in this process.

The ART-facing facade. `register(model)` opens a training session
(local/session.py: the weights loaded once, the trainer, the inference engine,
the run directory, resume from the latest complete checkpoint) and serves it
through the OpenAI-compatible server on 127.0.0.1 (a free port unless given).
The run directory is the model's `run_name`'s (ART 0.5.23, which keys its services by (project, run)); the
served name is its `name`. Two runs of one name (two `run_name`s, or two projects) train and serve side by
side on one backend: the first run registered is served as `name`, a further one as `name:<run_name>` (then
`name:<project>:<run_name>`), and `register` sets each model's `inference_model_name` to its own, so each
model's client (`openai_client()`, `get_inference_name()`, `litellm_completion_params()`) reaches its own
run's weights, and `name:<run_name>@step` its checkpoints.
Training and inference share ONE copy of the weights: after `train` returns the
server already answers with the new weights (`name`), while older checkpoints
stay reachable as `name@step`.

Train calls run in a worker thread so the event loop (and the server's own
thread) stay responsive; the user-facing API is async like ART's.

ART's calling conventions, kept: `LocalBackend(in_process=..., path=None,
gpu_cost_per_hour_usd=...)`; `backend.train(model, groups, **kwargs)` takes
every keyword of ART's `LocalBackend.train` (each a `TrainConfig` field, plus
`save_checkpoint` and `verbose`); `close()` works both awaited (ART) and called
plainly, and the backend is a context manager both with `with` and
`async with`. The base model is served under its own name (`base_model`) next
to `name` and `name@step`, with the adapter switched off. ART's S3 backups
(`_experimental_pull_from_s3`, `_experimental_push_to_s3`) raise a ConfigError
that names the run directory to sync instead.

With training workers (`InternalModelConfig.num_workers > 1`, `trainer_gpu_ids`
or `num_nodes > 1`) the session is a `local.worker_session.WorkerSession`: this
process serves, torch.distributed workers train (docs/distributed.md).

With inference replicas (`inference_replicas`, several `inference_gpu_ids`, or
`inference_endpoints`) the model is not served here: its `ReplicaSet`
(replicas/control.py) takes each checkpoint to every replica, `model.inference_base_url`
is their router's, and `get_inference_name()` answers `name@<published step>`
(docs/distributed.md, "Rollouts on several replicas").
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backend import Backend
from ..dev.train import METRIC_LOGGING, PACKED_SEQUENCE_LENGTH, check_metric_logging
from ..errors import ConfigError
from ..metrics_taxonomy import (aggregate_step_metrics, build_training_summary_metrics,
                                summarize_trajectory_groups)
from ..model import collect_step_metrics
from ..runtime.notices import notice_once
from ..trajectories.data import Trajectory, TrajectoryGroup
from ..config.model import InternalModelConfig
from ..types import LocalTrainResult, TrainConfig, TrainSFTConfig
from ..run import storage
from ..models.tiny import TINY_MODEL_NAME
from .adapter_leases import LeaseRegistry, pin_inference_step, pinned_inference_step
from .session import TrainingSession

if TYPE_CHECKING:
    from ..model import Model, TrainableModel

log = logging.getLogger(__name__)


# ART's automatic `costs/gpu` price table (per GPU and hour, by device name); unknown devices get none.
GPU_HOURLY_PRICES_USD = {"H200": 3.0}
DEFAULT_PATH = "./.art"  # ART: <git root of the art package>/.art, i.e. ./.art for an installed package


class _Done:
    """What `close()` returns: already done, and awaitable so ART's `await backend.close()` works."""

    __slots__ = ()

    def __await__(self) -> Any:
        return
        yield  # makes this a generator: awaiting it finishes at once

    def __repr__(self) -> str:
        return "<LocalBackend closed>"


class LocalBackend(Backend):
    """Runs training and inference for registered models on this machine.

    Args:
        in_process: ART runs its model service in a child process unless this is True; artrl always runs
            in this process (one copy of the weights for training and serving), so either value is accepted
            (False with a notice).
        path: root of the run directories (`<path>/<project>/models/<run_name>/`, `run_name` being `name` when a
            model has none); None: "./.art" (ART's default).
        gpu_cost_per_hour_usd: per-GPU hourly price behind `automatic_gpu_cost_per_hour_usd` (ART's automatic
            `costs/gpu` metric); None: detected from the GPU name (H200: $3), none on CPU or unknown GPUs.
        host, port: where the inference server listens (loopback and a free port by default).
            Any non-loopback host requires `api_key`.
        api_key: every server route requires `Authorization: Bearer <api_key>`. None: a random key made for
            this backend, checked the same way; `model.inference_api_key` and `model.openai_client()` carry it.
        show_progress: tqdm bars during training.
        unknown_fields: what the server does with a request field its route does not take: "refuse" (a 400 in
            the route's error shape naming it) or "warn" (served, with a bounded warning; for clients that send
            vendor extras). docs/reliability.md.
    """

    def __init__(self, *, in_process: bool | None = None, path: str | None = None,
                 gpu_cost_per_hour_usd: float | None = None, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, show_progress: bool = True, unknown_fields: str = "refuse") -> None:
        from ..serve.http.background import is_loopback
        from ..serve.http.body_policy import UNKNOWN_FIELDS_MODES

        if not is_loopback(host) and not api_key:
            raise ConfigError(
                f"LocalBackend(host={host!r}) would serve the model to every machine that can reach {host!r} "
                "without authentication; pass api_key=... (checked on every route), or keep the default "
                "host='127.0.0.1'.")
        if unknown_fields not in UNKNOWN_FIELDS_MODES:
            raise ConfigError(f"LocalBackend(unknown_fields={unknown_fields!r}); give one of {UNKNOWN_FIELDS_MODES}: "
                              "'refuse' answers a request field its route does not take with a 400 naming it, "
                              "'warn' serves it with a bounded warning (docs/reliability.md).")
        if in_process is False:
            notice_once("LocalBackend.in_process", "LocalBackend(in_process=False): artrl trains and serves in this "
                        "process (one copy of the weights); there is no child process to move the model to.")
        if gpu_cost_per_hour_usd is not None and not (gpu_cost_per_hour_usd >= 0):
            raise ConfigError(f"LocalBackend(gpu_cost_per_hour_usd={gpu_cost_per_hour_usd}); give a price >= 0 in "
                              "US dollars per GPU and hour, or None to detect it.")
        self._in_process = True
        self._path = Path(path if path is not None else DEFAULT_PATH)
        self._gpu_cost_per_hour_usd = float(gpu_cost_per_hour_usd) if gpu_cost_per_hour_usd is not None else None
        self._host = host
        self._port = port
        self._unknown_fields = unknown_fields
        # the key the server checks; the one a client learns (model.inference_api_key) is always this one
        self._api_key = api_key or f"artrl-{secrets.token_urlsafe(18)}"
        self._runs: dict[str, TrainingSession] = {}  # served name -> the session of its run
        self._served_names: dict[Path, str] = {}  # run directory -> the name its model is served as
        self._engine_args: dict[str, Any] = {}  # from _openai_client_config (ART), under each model's own
        self._server: Any = None
        self._served: Any = None
        self._lock = threading.Lock()
        self._leases: dict[Path, LeaseRegistry] = {}  # run directory -> steps leased by rollouts and evals now
        self._replicas: dict[str, Any] = {}  # served name -> its ReplicaSet, for a model served by replicas
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

        run = _run_dir(self._path, model)
        created = [d for d in (run, *run.parents) if not d.exists()]  # deepest first
        run.mkdir(parents=True, exist_ok=True)
        if isinstance(model, TrainableModel):
            try:
                await asyncio.to_thread(self._load, model)
            except BaseException:
                for d in created:  # a failed load leaves nothing behind (the session wrote nothing either)
                    if d.is_dir() and not any(d.iterdir()):
                        d.rmdir()
                raise
            served = self._served_names[run]
            replicas = self._replicas.get(served)
            model.inference_base_url = replicas.base_url if replicas is not None else self.base_url
            model.inference_api_key = self._api_key
            model.inference_model_name = served

    async def _prepare_backend_for_training(self, model: "TrainableModel",
                                            config: dict[str, Any] | None = None) -> tuple[str, str]:
        """ART's hook behind `model.register(backend, _openai_client_config=...)`: (base_url, api_key).

        `server_args.host` / `port` / `api_key` apply when the server is not running yet; `engine_args` reach
        vLLM when it serves the model (the model's own `engine_args` win); every other key of ART's
        `OpenAIServerConfig` is noticed once (artrl's one server serves every model).
        """
        self._apply_server_config(config or {})
        await self.register(model)
        return str(model.inference_base_url), self._api_key

    def _apply_server_config(self, config: dict[str, Any]) -> None:
        server_args = dict(config.get("server_args") or {})
        for key in ("host", "port", "api_key"):
            if key not in server_args or server_args[key] is None:
                continue
            value = server_args.pop(key)
            if self._server is not None:
                if value != getattr(self, f"_{key}") and not (key == "port" and self._port == 0):
                    notice_once(f"server_args.{key}.running", f"_openai_client_config server_args.{key}={value!r} "
                                f"has no effect: the backend's server already runs on {self._server.base_url}.")
                continue
            setattr(self, f"_{key}", value)
        for key, value in server_args.items():
            notice_once(f"server_args.{key}", f"_openai_client_config server_args.{key}={value!r:.80} has no effect in "
                        "artrl: it configures ART's vLLM server; artrl's server always returns token ids and "
                        "logprobs and parses tool calls itself.")
        # vLLM engine arguments: they join the model's own engine_args (which win) for the models registered
        # from now on; the built-in engine notices them when it opens (serve/engines/factory.py)
        self._engine_args.update(config.get("engine_args") or {})
        if "log_file" in config:
            notice_once("openai_server.log_file", "_openai_client_config log_file has no effect in artrl: the "
                        "server logs through Python logging (logger 'artrl.serve').")

    # ------------------------------------------------------------------ costs (ART's automatic train metrics)
    def supports_automatic_train_step_metrics(self) -> bool:
        return True

    def automatic_gpu_cost_per_hour_usd(self, model: "Model") -> float | None:
        """Dollars per hour of the GPUs this model runs on (ART: behind the automatic `costs/gpu` metric)."""
        session = self._session(model)
        if session is None or session.trainer.device.type != "cuda":
            return None  # not registered here, or on a CPU: no GPU to pay for (as in ART)
        if self._gpu_cost_per_hour_usd is not None:
            return self._gpu_cost_per_hour_usd  # one device trains and serves
        import torch

        name = torch.cuda.get_device_name(session.trainer.device).upper()
        return next((price for gpu, price in GPU_HOURLY_PRICES_USD.items() if gpu in name), None)

    def _ensure_server(self) -> None:
        if self._server is not None:
            return
        from ..serve import ServedModels, create_app, start_server

        self._served = ServedModels(checkpoint_path=self._checkpoint_path)
        self._server = start_server(create_app(self._served, api_key=self._api_key,
                                               unknown_fields=self._unknown_fields), host=self._host,
                                    port=self._port)
        log.info("inference server listening on %s", self._server.base_url)

    def _checkpoint_path(self, name: str, step: int) -> str | None:
        session = self._runs.get(name)
        return session.checkpoint_path(step) if session is not None else None

    def _served_name(self, model: "Model") -> str | None:
        """The name `model`'s run is served as here (None: not registered)."""
        return self._served_names.get(_run_dir(self._path, model))

    def _session(self, model: "Model") -> TrainingSession | None:
        name = self._served_name(model)
        return self._runs.get(name) if name is not None else None

    def _free_name(self, model: "Model") -> str:
        """The served name of a run registered now: `name`, else (another run of that name is served here)
        `name:<run_name>`, else `name:<project>:<run_name>`."""
        run = model._storage_name()
        for name in (model.name, f"{model.name}:{run}", f"{model.name}:{model.project}:{run}"):
            if name not in self._runs:
                return name
        raise ConfigError(f"model {model.name!r} of run {run!r} in project {model.project!r}: every name it could be "
                          f"served as is taken here ({model.name!r}, {model.name + ':' + run!r}, ...); give it "
                          "another `name`.")

    def _load(self, model: "TrainableModel") -> None:
        with self._lock:
            run = _run_dir(self._path, model)
            if run in self._served_names:  # the same run again (a second handle on it): fine
                return
            served = self._free_name(model)
            cfg = _internal_config(model)
            cfg.check()
            if self._engine_args:
                cfg = cfg.model_copy(update={"engine_args": {**self._engine_args, **cfg.engine_args}})
            # what the base model is, decided once for the trainer, the engine, the workers and the replicas: its
            # source checked (fast, with the remedy), its files found, its config read, its precision settled
            from ..models.resolved import resolve_base_model  # torch: loaded at register, not at import

            resolved = resolve_base_model(model.base_model, cfg)
            cfg = resolved.cfg
            session_type = TrainingSession
            if cfg.distributed:  # training in worker processes (docs/distributed.md)
                from .worker_session import WorkerSession

                session_type = WorkerSession
            replicas = self._start_replicas(model, cfg, run, served) if cfg.replicated else None
            try:
                session = session_type.open(run, name=model.name, project=model.project, base_model=model.base_model,
                                            cfg=cfg, engine=replicas, resolved=resolved)
            except BaseException:
                if replicas is not None:
                    replicas.close()
                raise
            self._runs[served] = session
            self._served_names[run] = served
            if replicas is not None:  # inference on replicas behind their router (docs/distributed.md)
                self._replicas[served] = replicas
            else:
                self._ensure_server()
                self._served.add(served, session.engine)
                self._served.add_base(model.base_model, session.engine)
            log.info("registered %s/%s (%s) at step %d%s", model.project, model._storage_name(), model.base_model,
                     session.step, "" if served == model.name else f", served as {served!r} (another run of "
                     f"{model.name!r} is served here as {model.name!r})")
            if model.base_model == TINY_MODEL_NAME and session.step == 0:
                log.info("%s is untrained (random weights, gibberish answers): RL can only reinforce what it says by "
                         "chance, so a reward it never earns by luck stays flat. To teach it a task, warm it up with "
                         "train_sft first (examples/sft_then_rl.py, `artrl demo`), or use a real model "
                         "(docs/getting-started.md).", TINY_MODEL_NAME)

    def _start_replicas(self, model: "TrainableModel", cfg: InternalModelConfig, run: Path, served: str) -> Any:
        """The model's inference replicas and their router, started (replicas/control.py); they load the base model
        while the session loads the trainer's."""
        from ..replicas.control import ReplicaSet

        leases = self.leases(model)
        return ReplicaSet(name=served, base_model=model.base_model, cfg=cfg, run=run, api_key=self._api_key,
                          host=self._host, leased=leases.active_steps).start()

    def replicas(self, model: "Model") -> Any:
        """The `ReplicaSet` serving `model` (replicas/control.py), or None when it is served in this process."""
        name = self._served_name(model)
        return self._replicas.get(name) if name is not None else None

    def close(self) -> _Done:
        """Stop generation, the server and release the models; works awaited (ART) or called plainly.

        The work is done when `close()` is called, even from async code without `await` (the returned
        object is then simply dropped); `await backend.close()` waits for nothing more. Idempotent.
        """
        for session in self._runs.values():
            session.close()  # generation in flight fails now, so the server has nothing to wait for
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._runs.clear()
        self._served_names.clear()
        self._replicas.clear()
        return _Done()

    def __enter__(self) -> "LocalBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "LocalBackend":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def _state(self, model: "Model") -> TrainingSession:
        session = self._session(model)
        if session is None:
            raise ConfigError(f"model {model.name!r} (run directory {_run_dir(self._path, model)}) is not registered "
                              "with this backend; call `await model.register(backend)` first")
        return session

    # ------------------------------------------------------------------ checkpoints
    def _model_inference_name(self, model: "Model", step: int | None = None) -> str:
        """`name` (the live weights: the latest step's) or `name@step` (that checkpoint).

        ART's LocalBackend answers `name@<latest step>` when no step is given. Both names are served here;
        `name` is returned because it is the same weights without loading the latest checkpoint a second
        time as its own adapter (docs/art-compatibility.md)."""
        base = self._served_name(model) or model.inference_model_name or model.name
        if step is None:
            step = pinned_inference_step(base)  # inside adapter_lease(model, step): that checkpoint
        replicas = self._replicas.get(base)
        if step is None and replicas is not None:
            step = replicas.published  # on replicas: the step every replica holds (replicas/control.py, rule 2)
        return base if step is None else f"{base}@{step}"

    # ------------------------------------------------------------------ leases (ART 0.5.18, PipelineTrainer)
    def leases(self, model: "Model") -> LeaseRegistry:
        """The registry of `model`'s steps leased now (created on first use)."""
        return self._leases.setdefault(_run_dir(self._path, model), LeaseRegistry())

    @contextlib.asynccontextmanager
    async def adapter_lease(self, model: "Model", step: int) -> AsyncIterator[None]:
        """ART's `adapter_lease`: inside it, this asyncio context's `model.get_inference_name()` is
        `name@step`, so every turn of a rollout samples from checkpoint `step` while the trainer writes newer
        ones; the step counts as leased (`leases(model).active_steps()`) until the block ends. With in-flight
        updates (`rollout_weight_update_mode="in_flight_lora"`) the name stays `name`, the live weights, as ART's
        stays its live slot: each new version reaches the rollout's running sequences (docs/pipeline.md)."""
        session = self._session(model)
        served = self._served_name(model) or model.name
        in_flight = session is not None and session.cfg.in_flight_lora
        pin = contextlib.nullcontext() if in_flight else pin_inference_step(served, step)
        async with pin, self.leases(model).hold(step):
            replicas = self._replicas.get(served)
            if replicas is not None and step not in replicas.versions:  # pruned earlier: loaded everywhere again
                path = self._state(model).checkpoint_path(step)
                if path is not None:
                    await asyncio.to_thread(replicas.ensure_loaded, step, path)
            yield

    async def prune_model_adapters(self, model: "Model", *, retain_steps: Iterable[int]) -> set[int]:
        """ART's `prune_model_adapters`: let the server free the checkpoint adapters of `model` it loaded
        for steps outside `retain_steps` and outside every active lease. Checkpoint files are never deleted
        here (that is `_delete_checkpoint_files`). Returns the steps kept. `ServedModels.prune` may wait for
        the decode worker's next step boundary, so it runs off the event loop."""
        retain = set(retain_steps) | self.leases(model).active_steps()
        served = self._served_name(model) or model.inference_model_name or model.name
        replicas = self._replicas.get(served)
        if replicas is not None:  # unloaded on every replica (replicas/control.py, rule 4)
            await asyncio.to_thread(replicas.prune, retain)
        elif self._served is not None:
            await asyncio.to_thread(self._served.prune, served, retain)
        return retain

    async def _delete_checkpoint_files(self, model: "TrainableModel", steps_to_keep: list[int]) -> None:
        """ART's hook: delete the model's checkpoints except `steps_to_keep` (the latest always stays)."""
        session = self._state(model)
        await asyncio.to_thread(session.delete_checkpoint_files, list(steps_to_keep))

    async def _get_step(self, model: "Model") -> int:
        return self._state(model).step

    async def _delete_checkpoints(self, model: "Model", best_checkpoint_metric: str = "val/reward",
                                  benchmark_smoothing: float = 1.0) -> list[int]:
        """Delete every checkpoint but the latest and the best by `best_checkpoint_metric`."""
        del benchmark_smoothing
        session = self._state(model)
        return await asyncio.to_thread(session.delete_checkpoints, best_checkpoint_metric)

    # ------------------------------------------------------------------ S3 backups (ART's, not available)
    async def _experimental_pull_from_s3(self, model: "Model", **kwargs: Any) -> None:
        """ART syncs a run directory from S3 with the aws CLI; here: a ConfigError saying what to do instead."""
        raise _no_s3("_experimental_pull_from_s3", self._path, model, kwargs)

    async def _experimental_push_to_s3(self, model: "Model", **kwargs: Any) -> None:
        """ART syncs a run directory to S3 with the aws CLI; here: a ConfigError saying what to do instead."""
        raise _no_s3("_experimental_push_to_s3", self._path, model, kwargs)

    # ------------------------------------------------------------------ training
    async def train(self, model: "TrainableModel", trajectory_groups: Iterable[TrajectoryGroup], *,
                    config: TrainConfig | None = None, loss_fn: str | None = None,
                    loss_fn_config: dict[str, Any] | None = None, normalize_advantages: bool = True,
                    adam_params: object | None = None, packed_sequence_length: int | None = None,
                    save_checkpoint: bool = True, verbose: bool = False, **kwargs: Any) -> LocalTrainResult:
        """One RL train call (ART's `backend.train`); returns the new step, its metrics and checkpoint.

        Keyword arguments are `TrainConfig` fields, which include every keyword of ART's
        `LocalBackend.train`: learning_rate, kl_penalty_coef, kl_penalty_reference_step, kl_ref_adapter_path,
        ppo, epsilon, epsilon_high, advantage_balance, scale_rewards, importance_sampling_level,
        max_negative_advantage_importance_sampling_weight, mask_prob_ratio, kimi_k2_tau,
        precalculate_logprobs, allow_training_without_logprobs, plot_tensors, truncated_importance_sampling,
        scale_learning_rate_by_reward_std_dev, logprob_calculation_chunk_size,
        num_trajectories_learning_rate_multiplier_power; and artrl's own (groups_per_optimizer_step, beta, batching).
        ART 0.5.18's keywords (`art_train_overrides`): `loss_fn` "cispo" or "ppo" (TrainConfig.loss),
        `normalize_advantages=False` turns `scale_rewards` off (ART's alias), `packed_sequence_length` is the
        packed row length (TrainConfig.row_length, at most the model's max_length); `loss_fn_config` and
        `adam_params` must be None, as in ART's LocalBackend (ConfigError otherwise).
        `save_checkpoint` and `verbose` mean what they mean in ART (TrainingSession.train). As in ART, the
        groups are not logged and no history row is written (call `model.log(...)`, as in ART).
        When `_train_model` is replaced by an async generator of per-step metrics (ART's hook protocol, on the
        instance or in a subclass), this iterates it as ART's `LocalBackend.train` does (backend.py).
        """
        groups = list(trajectory_groups)
        kwargs.update(art_train_overrides(loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                                          normalize_advantages=normalize_advantages, adam_params=adam_params,
                                          packed_sequence_length=packed_sequence_length,
                                          max_length=_internal_config(model).max_length))
        if inspect.isasyncgenfunction(self._train_model):  # replaced by a hook on ART's protocol (backend.py)
            cfg = InternalModelConfig().call_config(config or TrainConfig(), kwargs)
            run = _run_dir(self._path, model)
            return await backend_train_result(self, model, groups, cfg, dict(kwargs), verbose,
                                              (lambda step: storage.checkpoint_dir(run, step))
                                              if save_checkpoint else None)
        return await self._train(model, "rl", groups, config or TrainConfig(), kwargs,
                                 verbose=verbose, save_checkpoint=save_checkpoint, history_row=False)

    async def _train_model(self, model: "TrainableModel", trajectory_groups: Iterable[TrajectoryGroup],
                           config: TrainConfig, dev_config: dict[str, Any] | None = None,
                           verbose: bool = False) -> LocalTrainResult:
        """`model.train(groups, config=..., _config=art.dev.TrainConfig(...))`: `_config` keys override `config`
        (ART's `packed_sequence_length` is the row length, checked as backend.train checks it); model.train writes
        the step's history row."""
        overrides = dict(dev_config or {})
        if PACKED_SEQUENCE_LENGTH in overrides:
            overrides.update(art_train_overrides(
                loss_fn=None, loss_fn_config=None, normalize_advantages=True, adam_params=None,
                packed_sequence_length=overrides.pop(PACKED_SEQUENCE_LENGTH), max_length=_internal_config(model).max_length))
        return await self._train(model, "rl", list(trajectory_groups), config, overrides, verbose=verbose,
                                 history_row=True)

    async def _train_sft(self, model: "TrainableModel", trajectories: Iterable[Trajectory],
                         config: TrainSFTConfig, dev_config: dict[str, Any] | None = None,
                         verbose: bool = False) -> LocalTrainResult:
        """`model.train_sft(...)` (ART's hook): `_config` keys override `config`, but for ART's `metric_logging`,
        whose `enabled` (train_sft's log_metrics) says whether the caller writes the step's history row."""
        overrides = dict(dev_config or {})
        logging_config = check_metric_logging(overrides.pop(METRIC_LOGGING, None) or {})
        return await self._train(model, "sft", list(trajectories), config, overrides, verbose=verbose,
                                 history_row=logging_config.get("enabled", True))

    def _train(self, model: "TrainableModel", kind: str, data: list[Any], config: TrainConfig | TrainSFTConfig,
               overrides: dict[str, Any], *, verbose: bool, history_row: bool,
               save_checkpoint: bool = True) -> Awaitable[LocalTrainResult]:
        """Every train call enters here: its config is built and checked once (`InternalModelConfig.call_config`,
        raising before anything runs), then the returned awaitable runs the session's call in a worker thread.
        `history_row`: the caller writes the step's history row (model.train / train_sft), so the checkpoint
        carries that row's trainer part for a crash in between."""
        session = self._state(model)
        cfg = session.cfg.call_config(config, overrides)
        return asyncio.to_thread(session.train, kind, data, cfg, show_progress=self.show_progress, verbose=verbose,
                                 save_checkpoint=save_checkpoint, history_row=history_row)


async def backend_train_result(backend: Any, model: "TrainableModel", groups: list[TrajectoryGroup], config: Any,
                               dev_config: dict[str, Any], verbose: bool, checkpoint_dir: Any) -> Any:
    """ART's `LocalBackend.train` over an ART-protocol `_train_model`: the aggregated metrics with the groups'
    data counts, the step the backend reports, and `checkpoint_dir(step)` when that directory exists."""
    hook = f"{type(backend).__name__}._train_model"
    samples, seconds = await collect_step_metrics(backend._train_model(model, groups, config, dev_config, verbose),
                                                  hook)
    metrics = aggregate_step_metrics(samples, seconds, "rl")
    summary = build_training_summary_metrics(summarize_trajectory_groups(groups), include_trainable_groups=True)
    metrics.update({k: v for k, v in summary.items() if k not in metrics})
    step = await backend._get_step(model)
    path = checkpoint_dir(step) if checkpoint_dir is not None else None
    return LocalTrainResult(step=step, metrics=metrics,
                            checkpoint_path=str(path) if path is not None and path.exists() else None)


def art_train_overrides(*, loss_fn: str | None, loss_fn_config: dict[str, Any] | None, normalize_advantages: bool,
                        adam_params: object | None, packed_sequence_length: int | None,
                        max_length: int | None) -> dict[str, Any]:
    """ART 0.5.18's `LocalBackend.train` keywords as TrainConfig fields; refuses what ART's LocalBackend refuses.

    ART: `loss_fn` "cispo" (the default) or "ppo" is its `ppo` flag; `normalize_advantages=False` sets
    `scale_rewards=False` (centre the group's rewards, do not divide by their std); `loss_fn_config` and
    `adam_params` are for other backends and raise; `packed_sequence_length` is the packed row length and may
    not exceed the model's maximum length. ART also asks it to be a multiple of its logprob chunk size, a
    constraint of its own kernels that artrl's chunked logprobs do not have (docs/art-compatibility.md)."""
    out: dict[str, Any] = {}
    if loss_fn is not None:
        if loss_fn not in ("cispo", "ppo"):
            raise ConfigError(f"backend.train(loss_fn={loss_fn!r}): LocalBackend supports loss_fn='cispo' (the "
                              "default) or 'ppo', as ART's LocalBackend does (TrainConfig.loss='gspo' is artrl's own).")
        out["loss"] = loss_fn
    if loss_fn_config is not None:
        raise ConfigError(f"backend.train(loss_fn_config={loss_fn_config!r:.120}): LocalBackend requires "
                          "loss_fn_config=None, as ART's does; set the loss's options as keywords (epsilon, "
                          "epsilon_high, importance_sampling_level, ...).")
    if adam_params is not None:
        raise ConfigError(f"backend.train(adam_params={adam_params!r:.120}): LocalBackend requires adam_params=None, "
                          "as ART's does; set learning_rate per call, and AdamW's betas / epsilon / weight decay in "
                          "InternalModelConfig (adam_beta1, adam_beta2, adam_epsilon, weight_decay).")
    if not normalize_advantages:
        out["scale_rewards"] = False
    if packed_sequence_length is not None:
        if isinstance(packed_sequence_length, bool) or not isinstance(packed_sequence_length, int) \
                or packed_sequence_length < 16:
            raise ConfigError(f"backend.train(packed_sequence_length={packed_sequence_length!r}): give the packed "
                              "row length in tokens, an int >= 16 (or None to choose it automatically).")
        if max_length is not None and packed_sequence_length > max_length:
            raise ConfigError(f"packed_sequence_length ({packed_sequence_length}) exceeds the model's max_length "
                              f"({max_length}); lower it, or raise InternalModelConfig.max_length.")
        out["row_length"] = packed_sequence_length
    return out


def _no_s3(method: str, path: Path, model: "Model", kwargs: dict[str, Any]) -> ConfigError:
    bucket = kwargs.get("s3_bucket") or "$BACKUP_BUCKET"
    return ConfigError(
        f"backend.{method}(...) (ART: sync the run directory with s3://{bucket} through the aws CLI) is not "
        f"available in artrl. Remove the call, or sync {_run_dir(path, model)} "
        "yourself (e.g. `aws s3 sync`); a run resumes from the latest complete checkpoint found there.")


def _run_dir(path: Path, model: "Model") -> Path:
    """The model's run directory under `path`: `<path>/<project>/models/<run_name>/` (ART 0.5.23's storage name;
    `name` for a model without a run_name)."""
    return storage.run_dir(path, model.project, model._storage_name())


def _internal_config(model: "TrainableModel") -> InternalModelConfig:
    """The model's config as artrl's typed one, with its `lora_config` applied (config/lora.py): None, artrl's flat
    dict, or ART's nested dict (set on the model in any of ART's ways, including
    `object.__setattr__(model, "_internal_config", {...})`)."""
    from ..config.lora import apply_lora_config

    return apply_lora_config(_typed_internal_config(model), getattr(model, "lora_config", None))


def _typed_internal_config(model: "TrainableModel") -> InternalModelConfig:
    cfg = model.internal_config()
    if isinstance(cfg, InternalModelConfig):
        return cfg
    if cfg is None:
        return InternalModelConfig()
    if isinstance(cfg, dict):
        return InternalModelConfig(**cfg)
    raise ConfigError(f"model {model.name!r} has _internal_config of type {type(cfg).__name__}; pass an "
                      "artrl.InternalModelConfig or a dict (artrl's flat keys or ART's art.dev.InternalModelConfig).")
