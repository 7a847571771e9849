"""LocalBackend: train and serve on this machine (CPU or one GPU), in this process.

`register(model)` loads the base model once with a fresh LoRA adapter, resumes
from the latest complete checkpoint (or writes checkpoint 0), and serves it
through the OpenAI-compatible server on 127.0.0.1 (a free port unless given).
Training and inference share ONE copy of the weights: the trainer and the
inference engine hold the same peft model and take turns through its lock, so
after `train` returns the server already answers with the new weights (`name`),
while older checkpoints stay reachable as `name@step`.

Train calls run in a worker thread so the event loop (and the server's own
thread) stay responsive; the user-facing API is async like ART's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, ConfigError, NonFiniteError
from ..metrics_taxonomy import trainer_metrics
from ..trajectories import Trajectory, TrajectoryGroup
from ..types import InternalModelConfig, TrainConfig, TrainResult, TrainSFTConfig
from . import history, storage

if TYPE_CHECKING:
    from ..model import Model, TrainableModel

log = logging.getLogger(__name__)


@dataclass
class _Run:
    model_name: str
    run: Path
    base_model: str
    cfg: InternalModelConfig
    trainer: Any
    engine: Any
    step: int
    history_record: dict[str, Any] | None = None  # the latest checkpoint's own history line


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
        self._runs: dict[str, _Run] = {}
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
        run = self._runs.get(name)
        if run is None:
            return None
        path = storage.checkpoint_dir(run.run, step)
        return str(path) if storage.is_complete(path) else None

    def _load(self, model: "TrainableModel") -> None:
        from ..serve import TransformersEngine
        from ..train.trainer import Trainer
        from ..train.modeling import load_model

        with self._lock:
            if model.name in self._runs:
                return
            run = storage.run_dir(self._path, model.project, model.name)
            cfg = model.internal_config()
            meta_path = run / storage.MODEL_FILE
            if meta_path.exists():
                try:
                    meta = json.loads(meta_path.read_text())
                    if not isinstance(meta, dict):
                        raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
                except (OSError, ValueError) as e:
                    raise CheckpointError(
                        f"{meta_path} is unreadable ({type(e).__name__}: {e}); it records the run's base model. "
                        f"Restore it, or delete the run directory {run} to start over.") from None
                if meta.get("base_model") != model.base_model:
                    raise CheckpointError(
                        f"run directory {run} belongs to base model {meta.get('base_model')!r}, not "
                        f"{model.base_model!r}. Use another model name or project, or delete the directory.")
            storage.write_json_atomic(meta_path, {"name": model.name, "project": model.project,
                                                  "base_model": model.base_model, "config": cfg.model_dump()})
            removed = storage.clean_temporaries(run)
            if removed:
                log.warning("removed %d temporary files or checkpoint directories left by an interrupted write",
                            removed)
            peft_model, tok = load_model(model.base_model, cfg)
            on_cpu = next(peft_model.parameters()).device.type == "cpu"
            engine = TransformersEngine(peft_model, tok, max_batch_size=cfg.inference_max_batch_size,
                                        max_model_len=cfg.max_length,
                                        num_threads=cfg.inference_cpu_threads if on_cpu else None)
            trainer = Trainer(peft_model, tok, cfg, model_lock=engine.model_lock)
            state = _Run(model.name, run, model.base_model, cfg, trainer, engine, 0)
            latest = storage.latest_checkpoint(run)
            if latest is None:
                self._save(state)
            else:
                self._restore(state, latest)
            self._recover_history(state)
            self._runs[model.name] = state
            self._ensure_server()
            self._served.add(model.name, engine)
            log.info("registered %s/%s (%s) at step %d", model.project, model.name, model.base_model, state.step)

    def close(self) -> None:
        """Stop the server and release the models."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        for r in self._runs.values():
            r.engine.close()
        self._runs.clear()

    async def __aenter__(self) -> "LocalBackend":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def _state(self, model: "Model") -> _Run:
        try:
            return self._runs[model.name]
        except KeyError:
            raise ConfigError(f"model {model.name!r} is not registered with this backend; "
                              "call `await model.register(backend)` first") from None

    # ------------------------------------------------------------------ checkpoints
    def _save(self, state: _Run, history_record: dict[str, Any] | None = None) -> Path:
        """Write checkpoint `state.step`: adapter, optimizer, RNG states, and the step's history line.

        The history line travels inside the checkpoint so that a crash between writing the
        checkpoint and appending the line to history.jsonl loses nothing (`_recover_history`).
        """
        trainer = state.trainer

        def write(tmp: Path) -> None:
            trainer.model.save_pretrained(str(tmp), selected_adapters=["default"])
            torch.save({"optimizer": trainer.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                        "python_rng": random.getstate()}, tmp / storage.OPTIMIZER_FILE)
            with open(tmp / storage.TRAINER_STATE_FILE, "w") as fh:
                json.dump({"step": state.step, "optimizer_steps": trainer.optimizer_steps,
                           "base_model": state.base_model, "history_record": history_record}, fh)

        with trainer.model_lock:
            return storage.write_checkpoint(state.run, state.step, write, {"base_model": state.base_model})

    def _restore(self, state: _Run, step: int) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = storage.checkpoint_dir(state.run, step)
        marker = storage.read_marker(path)
        if marker.get("base_model") != state.base_model:
            raise CheckpointError(
                f"checkpoint {path} was trained from base model {marker.get('base_model')!r}, but this run uses "
                f"{state.base_model!r}. Register with the original base model, or use a new model name.")
        try:
            weights = load_file(str(path / storage.ADAPTER_WEIGHTS_FILE))
            # weights_only: a checkpoint directory is data, never code (no arbitrary unpickling)
            opt = torch.load(path / storage.OPTIMIZER_FILE, weights_only=True)
            trainer_state = json.loads((path / storage.TRAINER_STATE_FILE).read_text())
            if not isinstance(opt, dict) or not {"optimizer", "torch_rng", "python_rng"} <= set(opt):
                raise ValueError(f"{storage.OPTIMIZER_FILE} lacks the optimizer or RNG state")
            if not isinstance(trainer_state, dict):
                raise ValueError(f"{storage.TRAINER_STATE_FILE} is not a JSON object")
            with state.trainer.model_lock:
                result = set_peft_model_state_dict(state.trainer.model, weights, adapter_name="default")
        except Exception as e:  # SafetensorError, UnpicklingError, EOFError, ...: all mean the same here
            raise CheckpointError(
                f"checkpoint {path} is corrupted, incomplete or from another LoRA configuration "
                f"({type(e).__name__}: {str(e)[:300]}). Delete that directory to resume from the previous "
                "checkpoint.") from None
        unexpected = getattr(result, "unexpected_keys", []) or []
        missing = [k for k in getattr(result, "missing_keys", []) or [] if ".lora_" in k and ".default." in k]
        if unexpected or missing:
            bad = unexpected or missing
            raise CheckpointError(
                f"checkpoint {path} has adapter weights that do not match this model ({len(unexpected)} "
                f"unexpected, {len(missing)} missing, e.g. {bad[0]!r}): was it trained with another LoRA "
                "configuration, or is its adapter file damaged? Delete that directory to resume from the "
                "previous checkpoint.")
        with state.trainer.model_lock:
            try:
                state.trainer.optimizer.load_state_dict(opt["optimizer"])
            except (ValueError, KeyError, RuntimeError) as e:
                raise CheckpointError(f"checkpoint {path} has optimizer state that does not fit this model "
                                      f"({e}); was it trained with another LoRA configuration?") from None
            torch.set_rng_state(opt["torch_rng"])
            if opt.get("cuda_rng") is not None and torch.cuda.is_available() \
                    and len(opt["cuda_rng"]) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(opt["cuda_rng"])
            random.setstate(opt["python_rng"])
        state.trainer.optimizer_steps = int(trainer_state.get("optimizer_steps", 0))
        state.history_record = trainer_state.get("history_record")
        state.step = step
        log.info("resumed %s from checkpoint %s", state.model_name, path)

    def _recover_history(self, state: _Run) -> None:
        """Re-append the latest checkpoint's train row if a crash kept it out of history.jsonl."""
        history.restore_train_row(state.run, state.history_record)

    async def _get_step(self, model: "Model") -> int:
        return self._state(model).step

    async def _delete_checkpoints(self, model: "Model", best_checkpoint_metric: str = "val/reward",
                                  benchmark_smoothing: float = 1.0) -> list[int]:
        """Delete every checkpoint but the latest and the best by `best_checkpoint_metric`."""
        del benchmark_smoothing
        state = self._state(model)
        steps = storage.list_checkpoints(state.run)
        if len(steps) <= 1:
            return []
        keep = {steps[-1]}
        if state.step in steps:
            keep.add(state.step)  # the weights this process runs on, whatever newer directories appeared
        scores: dict[int, float] = {}
        for rec in storage.read_jsonl(state.run / storage.HISTORY_FILE):
            v = rec.get(best_checkpoint_metric)
            if isinstance(v, (int, float)) and math.isfinite(v) and rec.get("step") in steps:
                scores[int(rec["step"])] = float(v)
        if scores:
            keep.add(max(scores, key=lambda s: (scores[s], s)))
        else:
            log.warning("no logged step has %r (log it with model.log(..., split='val')); keeping only the latest "
                        "checkpoint %d", best_checkpoint_metric, steps[-1])
        deleted = [s for s in steps if s not in keep]
        for s in deleted:
            storage.delete_checkpoint(state.run, s)
        if deleted:
            log.info("deleted checkpoints %s of %s; kept %s", deleted, model.name, sorted(keep))
        return deleted

    # ------------------------------------------------------------------ training
    async def train(self, model: "TrainableModel", trajectory_groups: Iterable[TrajectoryGroup], *,
                    config: TrainConfig | None = None, **kwargs: Any) -> TrainResult:
        """One RL train call; extra keyword arguments are TrainConfig fields (e.g. learning_rate=1e-5)."""
        cfg = _merge(config or TrainConfig(), kwargs)
        groups = list(trajectory_groups)
        return await asyncio.to_thread(self._train_sync, model, "rl", groups, cfg)

    async def _train_model(self, model: "TrainableModel", trajectory_groups: Iterable[TrajectoryGroup],
                           config: TrainConfig, dev_config: dict[str, Any] | None = None) -> TrainResult:
        return await self.train(model, trajectory_groups, config=_merge(config, dev_config or {}))

    async def _train_sft(self, model: "TrainableModel", trajectories: Iterable[Trajectory],
                         config: TrainSFTConfig, dev_config: dict[str, Any] | None = None) -> TrainResult:
        cfg = _merge(config, dev_config or {})
        return await asyncio.to_thread(self._train_sync, model, "sft", list(trajectories), cfg)

    def _train_sync(self, model: "TrainableModel", kind: str, data: list[Any], cfg: Any) -> TrainResult:
        from ..train.call import run_call
        from ..train.rl import prepare_rl
        from ..train.sft import prepare_sft

        state = self._state(model)
        with state.trainer.model_lock:
            call = prepare_rl(state.trainer, data, cfg) if kind == "rl" else prepare_sft(state.trainer, data, cfg)
            steps, summary = run_call(state.trainer, call, show_progress=self.show_progress,
                                      desc=f"{kind} step {state.step + 1}")
            if call.empty:
                log.warning("%s: %s; the step did not advance", model.name, call.summary())
                return TrainResult(step=state.step, metrics=summary, checkpoint_path=None)
            if steps and int(summary.get("skipped_nonfinite_steps", 0)) == len(steps):
                raise NonFiniteError(
                    f"{model.name}: all {len(steps)} optimizer steps of this {kind} call had a non-finite loss or "
                    f"gradient and were refused; the step did not advance (still {state.step}) and no checkpoint "
                    "was written. Usual causes: a diverged adapter (NaN/inf weights) or too high a learning rate; "
                    "lower learning_rate, or resume from an earlier checkpoint (delete the later ones).")
            state.step += 1
            metrics = trainer_metrics(summary, kind)
            record = {"step": state.step, "split": "train", "kind": kind, **_finite(metrics)}
            path = self._save(state, record)
        if metrics.get("train/skipped_nonfinite_steps"):
            log.error("%s step %d: %d of %d optimizer steps had a non-finite loss or gradient and were refused "
                      "(train/skipped_nonfinite_steps); the weights did not take them", model.name, state.step,
                      int(metrics["train/skipped_nonfinite_steps"]), len(steps))
        return TrainResult(step=state.step, metrics=metrics, checkpoint_path=str(path))


def _merge(config: Any, extra: dict[str, Any]) -> Any:
    if not extra:
        return config
    allowed = set(type(config).model_fields)
    unknown = sorted(set(extra) - allowed)
    if unknown:
        raise ConfigError(f"unknown {type(config).__name__} fields {unknown}; known fields: {sorted(allowed)}")
    return type(config)(**{**config.model_dump(), **extra})


def _finite(d: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and math.isfinite(v)}
