"""A training session: one registered trainable model on this machine.

It owns the weights (a peft model loaded once), the trainer, the inference
engine (serve/engines/factory.py picks it; the built-in one decodes a copy of the
trainer's model that shares its frozen base tensors, made before the trainer
applies its kernels), the run directory and the step counter:

* `TrainingSession.open` takes the base model as the backend resolved it once
  (models/resolved.py: its name checked in seconds, not transformers' minute of
  retries; its files, config and precision) and checks
  that the run directory belongs to this base model, loads the base model with
  a fresh LoRA adapter, computes the end-of-turn ids once for the trainer and
  the engine, then (only once the load succeeded: a failed load writes nothing)
  records the base model in model.json, removes what an interrupted write left
  behind, and resumes from the latest complete checkpoint (or writes checkpoint
  0), which the engine then serves as the live weights.
* `train` prepares one RL or SFT call (train/prepare.py: tokenized, validated,
  packed and planned, once) and runs it inside the engine's `training()` (the
  built-in engine holds nothing there: it keeps answering requests from the
  versions it holds; vLLM may sleep), advances the step, writes the checkpoint,
  and hands it to the engine (`set_live_weights`: the next policy version, which
  rows joining a batch from then on sample from). The step's history row is not written here: model.train
  / train_sft write it after the call returns, as ART does, and backend.train
  writes none. For the former the checkpoint carries the row's trainer part, so
  a crash between the checkpoint and the row loses nothing: `open` appends it
  when history.jsonl lacks it. A call with nothing to train on advances the
  step too (ART's semantics: the loop's step keeps moving), with the unchanged
  weights; only a call whose every optimizer step was non-finite leaves the step
  where it was.
* `delete_checkpoints` keeps the latest and the best checkpoint.

With training workers (worker_session.py) the same session keeps the
weights for serving only; its subclass ships each prepared call to the workers
and serves each new checkpoint. `train` is written once for both: the call is
prepared here, runs (`_run`), the step is refused or advanced by the same rules,
and the checkpoint is written (`_write`) or the call's result dropped
(`_discard`).

It knows nothing of HTTP or of ART's calling conventions: the server and the
ART-facing facade are local/backend.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, NonFiniteError, TrajectoryError
from ..metrics_taxonomy import trainer_metrics
from ..runtime.notices import notice_once
from ..runtime.once_per_run import OncePerRun
from ..config.model import InternalModelConfig
from ..types import LocalTrainResult, TrainConfig, TrainSFTConfig
from ..run import checkpoint, history, storage

log = logging.getLogger(__name__)


@dataclass
class CallOutcome:
    """What a train call did before anything was written."""

    empty: bool  # nothing to train on: the step advances with the same weights (ART)
    line: str  # the call's summary line
    steps: list[dict[str, float]]  # metrics per optimizer step
    summary: dict[str, float]  # the call's metrics and data figures


class TrainingSession:
    """See the module docstring. Build with `TrainingSession.open(...)`."""

    def __init__(self, name: str, run: Path, base_model: str, cfg: InternalModelConfig, trainer: Any,
                 engine: Any) -> None:
        self.name = name
        self.run = run
        self.base_model = base_model
        self.cfg = cfg
        self.trainer = trainer
        self.engine = engine
        self.step = 0
        self.history_record: dict[str, Any] | None = None  # the latest checkpoint's own history line
        self._warned_no_metric: set[str] = set()  # delete_checkpoints' metrics already warned about
        self._rate_read = False  # the first call's learning rate was read (train/rate_advice.py)
        self._say = OncePerRun(log)  # per-step housekeeping: INFO once, then DEBUG

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, run: Path, *, name: str, project: str, base_model: str,
             cfg: InternalModelConfig, engine: Any = None, resolved: Any = None) -> "TrainingSession":
        """`resolved`: `base_model` as the backend resolved it (models/resolved.py), else resolved here under `cfg`."""
        from ..chat.format import end_of_turn_ids
        from ..models.loading import load_vision
        from ..models.resolved import resolve_base_model
        from ..runtime.threads import training_threads
        from ..train.trainer import Trainer

        # in seconds, with the way out (never the network for artrl's names); a cached model whose hub does not
        # answer loads from its cached directory, so nothing below waits on the network
        resolved = resolved if resolved is not None else resolve_base_model(base_model, cfg)
        _check_run_owner(run, base_model)
        training_threads()  # read before this session's decode worker sets its own count (artrl/runtime/threads.py)
        peft_model, tok = cls._load_weights(resolved)
        # one definition of what ends a turn, for the trainer and the engine alike
        end_ids = end_of_turn_ids(tok, peft_model)
        # a vision-language model's image processing (models/vision.py), for the server and the trainer alike
        vision = load_vision(resolved, tok, peft_model.config, cfg)
        if vision is not None and cfg.distributed:
            raise ConfigError(f"{base_model} is a vision-language model, and training workers (num_workers, "
                              "trainer_gpu_ids, train_in_worker, num_nodes) do not run its vision tower yet; train "
                              "it in this process (the defaults).")
        # the engine first: the built-in one copies the model's modules before the trainer applies its kernels.
        # `engine` given: inference runs elsewhere (replicas/control.py's ReplicaSet), which takes the checkpoints
        if engine is None:
            engine = cls._open_engine(peft_model, tok, end_ids, cfg, resolved, vision)
        try:
            trainer = Trainer(peft_model, tok, cfg, end_ids=end_ids, vision=vision)
        except BaseException:
            engine.close()
            raise
        session = cls(name, run, base_model, cfg, trainer, engine)
        try:
            # written only once the model has loaded: a name that failed to load must not claim the run
            # directory, or correcting base_model would be refused as "belongs to another base model"
            run.mkdir(parents=True, exist_ok=True)
            storage.write_json_atomic(run / storage.MODEL_FILE, {"name": name, "project": project,
                                                                 "base_model": base_model, "config": cfg.model_dump()})
            removed = storage.clean_temporaries(run)
            if removed:
                log.warning("removed %d temporary files or checkpoint directories left by an interrupted write",
                            removed)
            latest = storage.latest_checkpoint(run)
            if latest is None:
                path = checkpoint.save(trainer, run, 0, base_model, None)  # a new run's untrained weights
            else:
                restored = checkpoint.restore(trainer, run, latest, base_model)
                trainer.optimizer_steps = restored.optimizer_steps
                session.step, session.history_record = restored.step, restored.history_record
                path = storage.checkpoint_dir(run, latest)
            engine.set_live_weights(str(path), session.step)
            session._recover_history()
        except BaseException:
            engine.close()
            raise
        return session

    @classmethod
    def _open_engine(cls, model: Any, tokenizer: Any, end_ids: frozenset[int], cfg: InternalModelConfig,
                     resolved: Any, vision: Any = None) -> Any:
        """The inference engine `cfg.inference_engine` names (serve/engines/factory.py), with the trainer's end ids.

        The built-in one decodes a copy of `model` sharing its frozen tensors (`serve_copy`): the trainer (here,
        or the workers' copy restored into `model`) never shares a module with the decode thread."""
        from ..serve.engines.factory import open_engine, resolve_engine_kind
        from ..models.moe import is_moe
        from ..models.quantization import quantization_of

        on_disk = not resolved.random
        device = next(model.parameters()).device
        # in-flight adapter updates are the built-in engine's (InternalModelConfig refuses them with 'vllm')
        requested = "builtin" if cfg.in_flight_lora else cfg.inference_engine
        kind = resolve_engine_kind(requested, device.type, weights_on_disk=on_disk, vision=vision is not None,
                                   quantized_moe=is_moe(model.config) and quantization_of(model) == "4bit")
        return open_engine(kind, tokenizer=tokenizer, end_ids=end_ids, cfg=cfg, model=model,
                           serve_copy=kind == "builtin",
                           base_model_path=resolved.path if on_disk else None, vision=vision)

    @classmethod
    def _load_weights(cls, resolved: Any) -> tuple[Any, Any]:
        """(peft model, tokenizer) this session trains and serves, from the resolved base model."""
        from ..models.loading import load_model

        return load_model(resolved)

    def _recover_history(self) -> None:
        """Re-append the latest checkpoint's train row if a crash kept it out of history.jsonl."""
        history.restore_train_row(self.run, self.history_record)

    def close(self) -> None:
        self.engine.close()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_path(self, step: int) -> str | None:
        path = storage.checkpoint_dir(self.run, step)
        return str(path) if storage.is_complete(path) else None

    def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Delete every checkpoint but the latest, the one in use, and the best by `best_checkpoint_metric`."""
        steps = storage.list_checkpoints(self.run)
        if len(steps) <= 1:
            return []
        keep = {steps[-1]}
        if self.step in steps:
            keep.add(self.step)  # the weights this process runs on, whatever newer directories appeared
        best = history.best_logged_step(self.run, best_checkpoint_metric, steps)
        if best is not None:
            keep.add(best)
        elif best_checkpoint_metric not in self._warned_no_metric:  # once per run: a loop calls this every step
            self._warned_no_metric.add(best_checkpoint_metric)
            log.warning("no logged step has %r (log it with model.log(..., split='val')); keeping only the latest "
                        "checkpoint (%d now) until one does; this is said once per run", best_checkpoint_metric,
                        steps[-1])
        return self.delete_checkpoint_files(sorted(keep))

    def delete_checkpoint_files(self, steps_to_keep: list[int]) -> list[int]:
        """Delete every complete checkpoint not in `steps_to_keep` (ART's `_delete_checkpoint_files`).

        The latest checkpoint and the one this process runs on are kept whatever the list says: they are
        what a restart and the server resume from."""
        steps = storage.list_checkpoints(self.run)
        keep = set(steps_to_keep) | ({steps[-1]} if steps else set()) | {self.step}
        deleted = [s for s in steps if s not in keep]
        for s in deleted:
            storage.delete_checkpoint(self.run, s)
        if deleted:
            self._say("deleted", "deleted checkpoints %s of %s; kept %s", deleted, self.name,
                      sorted(keep & set(steps)))
        return deleted

    # ------------------------------------------------------------------ training
    def train(self, kind: str, data: list[Any], cfg: TrainConfig | TrainSFTConfig, *, show_progress: bool = True,
              verbose: bool = False, save_checkpoint: bool = True, history_row: bool = False) -> LocalTrainResult:
        """One RL ("rl", data = groups) or SFT ("sft", data = trajectories) call; see the module docstring.

        `cfg` comes built and checked (`InternalModelConfig.call_config`). `history_row`: the caller writes
        the step's history row (model.train / train_sft do, backend.train does not).
        A call with nothing to train on (every group of equal rewards, empty, or dropped) still advances the
        step and writes a checkpoint of the unchanged weights, as ART does, so a loop's step keeps moving;
        it logs that nothing was trained and its metrics count what was skipped.
        `save_checkpoint=False` (ART's keyword) only leaves `checkpoint_path` out of the result, as ART's
        LocalBackend does: the checkpoint is the step, so it is always written.
        """
        from ..train.prepare import prepare_call
        from ..train.rate_advice import advise_learning_rate

        if not self._rate_read:  # the first call only: a schedule's tail is low by design
            self._rate_read = True
            advise_learning_rate(self.base_model, kind, cfg.learning_rate)
        started = time.monotonic()
        with self._training():
            ref = self._reference_adapter(cfg) if isinstance(cfg, TrainConfig) else None
            # the version this call trains, from which each sequence's policy age is counted (train/rl.py)
            ctx = dataclasses.replace(self._build_context(), policy_version=self.step)
            call = prepare_call(kind, ctx, data, cfg, ref_adapter=ref)
            if isinstance(cfg, TrainConfig) and cfg.plot_tensors and call.packed is not None:
                from .plot_tensors import plot_packed

                log.info("plotted the packed tensors of %s step %d to %s", self.name, self.step + 1,
                         plot_packed(call.packed, self.run))
            out = self._run(call, show_progress=show_progress, verbose=verbose)
            if out.steps and int(out.summary.get("skipped_nonfinite_steps", 0)) == len(out.steps):
                self._discard()
                raise NonFiniteError(
                    f"{self.name}: all {len(out.steps)} optimizer steps of this {kind} call had a non-finite loss "
                    f"or gradient and were refused; the step did not advance (still {self.step}) and no checkpoint "
                    "was written. Usual causes: a diverged adapter (NaN/inf weights) or too high a learning rate; "
                    "lower learning_rate, or resume from an earlier checkpoint (delete the later ones).")
            step = self.step + 1
            metrics = trainer_metrics(out.summary, kind)
            metrics["time/step_backend_train_s"] = time.monotonic() - started  # ART 0.5.23: the call, tokenizing on
            # the row model.train / train_sft write after this returns (run/history.py), as in ART: its trainer
            # part rides in the checkpoint, so a crash before that write loses nothing (_recover_history)
            record = {"step": step, "split": "train", "kind": kind, **history.finite_values(metrics)} \
                if history_row else None
            path = self._write(step, record)
            self.step, self.history_record = step, record
            self.engine.set_live_weights(str(path), step)
        if out.empty:
            log.warning("%s step %d: nothing was trained%s (%s); the step advanced with the same weights, as in ART",
                        self.name, self.step, _why_nothing(kind, data), out.line)
        if metrics.get("train/skipped_nonfinite_steps"):
            log.error("%s step %d: %d of %d optimizer steps had a non-finite loss or gradient and were refused "
                      "(train/skipped_nonfinite_steps); the weights did not take them", self.name, self.step,
                      int(metrics["train/skipped_nonfinite_steps"]), len(out.steps))
        if not save_checkpoint:
            notice_once("train.save_checkpoint", "backend.train(save_checkpoint=False): the checkpoint is written "
                        "anyway (the step is its checkpoint, as in ART's LocalBackend); only the result's "
                        "checkpoint_path is None, as in ART.")
        return LocalTrainResult(step=self.step, metrics=metrics,
                                checkpoint_path=str(path) if save_checkpoint else None)

    @contextlib.contextmanager
    def _training(self) -> Iterator[None]:
        """Held for a whole call: the engine's `training()` (nothing for the built-in engine, which decodes its
        own copy; vLLM may sleep)."""
        with self.engine.training():
            yield

    def _build_context(self) -> Any:
        """What the trainer that runs the calls is (train/trainer.py's BuildContext)."""
        return self.trainer.build_context()

    def _run(self, call: Any, *, show_progress: bool, verbose: bool) -> CallOutcome:
        """Run a prepared call on this process's trainer."""
        from ..train.call import run_call

        steps, summary = run_call(self.trainer, call, show_progress=show_progress,
                                  desc=f"{call.kind} step {self.step + 1}", verbose=verbose)
        return CallOutcome(call.empty, call.line(), steps, summary)

    def _discard(self) -> None:
        """The call's result is not kept (nothing to do here: a refused step changed no weights)."""

    def _write(self, step: int, record: dict[str, Any] | None) -> Path:
        """Checkpoint `step`, with the trainer part of its history row (None: nobody writes one) inside."""
        return checkpoint.save(self.trainer, self.run, step, self.base_model, record)

    def _reference_adapter(self, cfg: TrainConfig) -> str | None:
        """The loaded adapter that kl_ref_adapter_path / kl_penalty_reference_step name (None: the base model)."""
        named = cfg.kl_ref_adapter_path is not None or cfg.kl_penalty_reference_step is not None \
            or cfg.kl_penalty_step_lag is not None
        if not named:
            return None
        if not cfg.needs_reference():
            notice_once("train.kl_reference_unused", "kl_ref_adapter_path / kl_penalty_reference_step / "
                        "kl_penalty_step_lag name a KL reference, but neither kl_penalty_coef nor beta is > 0, so no "
                        "reference is computed (as in ART).")
            return None
        if cfg.kl_ref_adapter_path is not None:
            path, what = Path(cfg.kl_ref_adapter_path), f"kl_ref_adapter_path={cfg.kl_ref_adapter_path!r}"
        else:
            # ART's moving reference (PipelineTrainer): the checkpoint `lag` steps before the current step
            step = cfg.kl_penalty_reference_step if cfg.kl_penalty_step_lag is None \
                else max(0, self.step - cfg.kl_penalty_step_lag)
            what = f"kl_penalty_reference_step={step}" if cfg.kl_penalty_step_lag is None \
                else f"kl_penalty_step_lag={cfg.kl_penalty_step_lag} (reference step {step})"
            found = self.checkpoint_path(step) if step is not None else None
            if found is None:
                raise ConfigError(
                    f"{what}: {self.name} has no complete checkpoint of that step "
                    f"(checkpoints: {storage.list_checkpoints(self.run)}); name an existing step, or use "
                    "kl_ref_adapter_path.")
            path = Path(found)
        name = "kl_ref_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        try:
            self.trainer.load_reference_adapter(name, str(path))
        except Exception as e:  # a missing, truncated or mismatched adapter directory
            raise CheckpointError(f"{what}: the LoRA adapter in {path} cannot be loaded as the KL reference "
                                  f"({type(e).__name__}: {str(e)[:300]}). Point it at a saved adapter "
                                  "directory of this base model.") from e
        return name



def _check_run_owner(run: Path, base_model: str) -> None:
    """Refuse a run directory that records another base model (or cannot say which)."""
    meta_path = run / storage.MODEL_FILE
    if not meta_path.exists():
        return
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{meta_path} is unreadable ({type(e).__name__}: {e}); it records the run's base model. "
            f"Restore it, or delete the run directory {run} to start over.") from e
    if meta.get("base_model") != base_model:
        raise CheckpointError(
            f"run directory {run} belongs to base model {meta.get('base_model')!r}, not "
            f"{base_model!r}. Use another model name or project, or delete the directory.")


def _why_nothing(kind: str, data: list[Any]) -> str:
    """A call that trained nothing, in a user's words: every group tied, at which rewards; "" when not that."""
    if kind != "rl":
        return ""
    if not data:  # ART skips and advances too; its 2048 example gets here when RULER drops every group
        return (": model.train was given an empty list of trajectory groups. Pass the groups your rollouts "
                "gathered (each with 2+ rollouts of one prompt); a judge called with swallow_exceptions=True "
                "drops the groups it could not score, which can leave none")
    tied: dict[float, int] = {}
    for group in data:
        rewards = {float(t.reward) for t in getattr(group, "trajectories", [])}
        if len(rewards) > 1:
            return ""
        if rewards:
            (reward,) = rewards
            tied[reward] = tied.get(reward, 0) + 1
    if not tied:
        return ""
    at = ", ".join(f"{r:g} in {n} group{'s' if n > 1 else ''}" for r, n in sorted(tied.items()))
    return (f": every rollout in each group had the same reward ({at}), and RL learns only from the differences "
            "between rollouts of one group. Was the reward set (trajectory.reward = ...)?")
