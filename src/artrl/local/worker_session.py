"""A training session whose train calls run on a group of worker processes (docs/distributed.md).

The same session as session.py (run directory, step counter, checkpoints,
the served weights), with three differences:

* its model is loaded for serving only, on `inference_gpu_ids[0]` when given
  (the workers train their own sharded copy); the engine serves each complete
  checkpoint as a policy version (`set_live_weights`), exactly as in one process,
  and inference keeps answering during a train call;
* a call is prepared here, as in one process (tokenized, packed, planned once),
  and the prepared call goes to the `WorkerGroup` (distributed/group.py): the
  workers train, the session decides as in one process (empty call, all steps
  non-finite), and rank 0 writes the checkpoint;
* a failed group (`WorkerError`) is restarted by the next call, from the latest
  complete checkpoint: what a killed writer left is removed first, and a
  checkpoint that was completed but never confirmed is adopted (served, and its
  history line recovered).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..distributed.group import WorkerGroup
from ..errors import ConfigError
from ..run import checkpoint, storage
from ..config.model import InternalModelConfig
from ..types import TrainConfig
from .session import CallOutcome, TrainingSession

log = logging.getLogger(__name__)


def serving_config(cfg: InternalModelConfig) -> InternalModelConfig:
    """The served model's settings: `inference_gpu_ids` names its GPU."""
    if cfg.inference_gpu_ids:
        return cfg.model_copy(update={"device": f"cuda:{cfg.inference_gpu_ids[0]}"})
    return cfg


class WorkerSession(TrainingSession):
    """See the module docstring. Build with `WorkerSession.open(...)`; `close()` stops the workers."""

    workers: WorkerGroup
    _calls: threading.Lock

    @classmethod
    def open(cls, run: Path, *, name: str, project: str, base_model: str,
             cfg: InternalModelConfig, engine: Any = None, resolved: Any = None) -> "WorkerSession":
        session = super().open(run, name=name, project=project, base_model=base_model, cfg=cfg, engine=engine,
                               resolved=resolved)
        assert isinstance(session, WorkerSession)
        session.workers = WorkerGroup(run, cfg, name=f"{project}-{name}")
        session._calls = threading.Lock()
        try:
            session.workers.start()
        except BaseException:
            session.workers.close()
            session.engine.close()
            raise
        return session

    @classmethod
    def _load_weights(cls, resolved: Any) -> tuple[Any, Any]:
        """The served copy, on the device `inference_gpu_ids` names (the workers load their own)."""
        import dataclasses

        from ..models.loading import load_model
        from ..models.resolved import resolve_device

        serving = serving_config(resolved.cfg)
        device = resolve_device(serving)
        if device.type != resolved.device.type:  # another kind of device: its precision is decided anew
            return load_model(resolved.source, serving)
        return load_model(dataclasses.replace(resolved, cfg=serving, device=device))

    def close(self) -> None:
        try:
            self.workers.close()
        finally:
            super().close()

    # ------------------------------------------------------------------ one call
    @contextlib.contextmanager
    def _training(self) -> Iterator[None]:
        # one call at a time on the workers; the served weights change only in the engine's set_live_weights,
        # so inference goes on meanwhile. A failed group restarts first: the call is prepared with the step
        # and optimizer step count of the checkpoint it resumes from
        with self._calls:
            if not self.workers.running:
                self._restart_workers()
            yield

    def _reference_adapter(self, cfg: TrainConfig) -> str | None:
        if cfg.needs_reference() and (cfg.kl_ref_adapter_path is not None or cfg.kl_penalty_reference_step is not None
                                      or cfg.kl_penalty_step_lag is not None):
            raise ConfigError(
                "kl_ref_adapter_path / kl_penalty_reference_step / kl_penalty_step_lag (a checkpoint as the KL "
                "reference) is not "
                "supported with training workers yet; the workers use the base model (adapter off) as the "
                "reference. Drop the option, or train in one process (num_workers=1).")
        return super()._reference_adapter(cfg)

    def _build_context(self) -> Any:
        """The workers' trainer, as this process sees it: the same model and tokenizer, their device type."""
        return dataclasses.replace(self.trainer.build_context(), device_type=self.workers.device_type)

    def _run(self, call: Any, *, show_progress: bool, verbose: bool) -> CallOutcome:
        """Ship the prepared call to every rank (no rank prepares it again) and wait for rank 0's figures."""
        log.info("%s", call.line())
        trained = self.workers.train(call, desc=f"{call.kind} step {self.step + 1}", progress=show_progress)
        self.trainer.optimizer_steps = trained.optimizer_steps  # what the next call's SFT shuffle mixes in
        return CallOutcome(trained.empty, call.line(), trained.steps, trained.summary)

    def _discard(self) -> None:
        self.workers.commit(None)

    def _write(self, step: int, record: dict[str, Any] | None) -> Path:
        path = self.workers.commit(step, record)
        assert path is not None
        return path

    # ------------------------------------------------------------------ helpers

    def _restart_workers(self) -> None:
        """After a failure: drop what a killed writer left, adopt the latest complete checkpoint, start anew."""
        removed = storage.clean_temporaries(self.run)
        if removed:
            log.warning("removed %d temporary files or checkpoint directories left by a failed worker", removed)
        latest = storage.latest_checkpoint(self.run)
        if latest is not None and latest != self.step:
            restored = checkpoint.restore(self.trainer, self.run, latest, self.base_model)
            self.step, self.history_record = restored.step, restored.history_record
            self.trainer.optimizer_steps = restored.optimizer_steps
            self.engine.set_live_weights(str(storage.checkpoint_dir(self.run, latest)), self.step)
            self._recover_history()
        self.workers.start()
