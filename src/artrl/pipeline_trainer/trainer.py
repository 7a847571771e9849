"""`PipelineTrainer`: rollouts, training and eval overlapped, with bounded staleness (ART 0.5.23's API, and
0.5.18's keywords).

Three stages run as coroutines of one `asyncio.TaskGroup`, linked by queues:

    scenarios --> rollout workers --GroupReady--> training stage --step--> eval stage
                  (num_rollout_workers,            (backend.train, one       (eval_fn on a
                   each under a lease of the        call per batch, then      leased checkpoint)
                   version it started on)           model.log, state, retention)

* A worker pulls a scenario, waits (in pull order) until admission (staleness.py) gives
  it a ticket for a step within the bound of the current policy version, rolls out inside
  `backend.adapter_lease(model, version)` (every turn samples `name@version`), stamps
  `initial_policy_version` / `final_policy_version` on the trajectories and queues
  the group. A rollout that raises is logged and counted, its ticket freed; the
  pipeline goes on.
* The trainer takes `min_batch_size` groups (then whatever else is queued, up to
  `max_batch_size`), drops stale ones (counted: `train/discarded_stale_groups`),
  sets aside groups with no reward spread (logged under split "discarded"; after
  `discard_queue_multiplier * min_batch_size` of them since the last train call it stops:
  "model collapse"), raises if every rollout of a group failed, trains the batch in
  admission order and writes one train row with the pipeline's figures.
* The eval stage runs `eval_fn` on the steps the trainer schedules.

A stop (`request_stop()`, SIGINT, SIGTERM) lets a train call in progress finish, then
ends; rollouts in flight are cancelled. Waits are on events, queues and the stop event
only; timings use the injectable `clock`.

Unlike ART, `LocalBackend` is accepted in every configuration (one CPU machine, one
GPU): ART refuses it outside "dedicated mode" (separate trainer and inference GPUs).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from ..errors import ConfigError
from ..runtime.notices import notice_once
from ..pipeline_tuner.autotune import StepMeasurement
from ..pipeline_tuner.config import PipelineAutotuneConfig, PipelineRuntimeConfig, PipelineTuneSettings
from ..local.adapter_leases import LeaseRegistry
from ..run import storage
from ..trajectories.data import Trajectory, TrajectoryGroup
from .checkpoint_retention import (CHECKPOINT_CREATED_AT_METRIC, CHECKPOINT_EVAL_COMPLETED_METRIC,
                                   CHECKPOINT_SAVED_METRIC, CheckpointRetentionContext, CheckpointRetentionStrategy,
                                   checkpoint_infos, steps_to_delete)
from .messages import EvalStop, GroupReady, ScenariosExhausted
from .options import (admission_bound, group_mean_steps_off_policy, refuse_unbuilt, resolve_pipeline_config,
                      score_metrics, staleness_window)
from .state import PIPELINE_STATE_KEY, PipelineState, SavedState
from .staleness import Admission, StalenessBound, Ticket
from .status import StatusReporter
from .tuning import PipelineTuning, engine_pressure
from .types import ConfigT, EvalFn, RolloutFn, ScenarioT, SingleRolloutFn

log = logging.getLogger("artrl.pipeline_trainer")
IN_TURN_DRAIN_LIMIT_FACTOR = 4.0
IN_TURN_DRAIN_MIN_S = 1.0
"""In turn, a train call waits for the rollouts running at most this factor times the longest rollout seen
(seconds, at least the minimum), then trains beside them (`pipeline_tuner/in_turn_drain_timeouts`)."""
T = TypeVar("T")


def make_group_rollout_fn(single_rollout_fn: SingleRolloutFn, n: int = 4) -> RolloutFn:
    """A `RolloutFn` that runs `single_rollout_fn` n times in parallel; exceptions land in the group's
    `exceptions` (a group whose every rollout failed makes the trainer raise, as in ART)."""

    async def group_rollout(model: Any, scenario: Any, config: Any) -> TrajectoryGroup:
        if n <= 0:
            return TrajectoryGroup([])
        results = await asyncio.gather(*(single_rollout_fn(model, scenario, config) for _ in range(n)),
                                       return_exceptions=True)
        for r in results:  # a cancellation is not a failed rollout
            if isinstance(r, asyncio.CancelledError):
                raise r
        return TrajectoryGroup(results)

    return group_rollout


def _aiter(scenarios: Iterable[T] | AsyncIterator[T]) -> AsyncIterator[T]:
    if hasattr(scenarios, "__anext__"):
        return cast(AsyncIterator[T], scenarios)

    async def gen() -> AsyncIterator[T]:
        for item in scenarios:  # type: ignore[union-attr]
            yield item

    return gen()


def _zero_variance(group: TrajectoryGroup) -> bool:
    rewards = [t.reward for t in group.trajectories]
    return len(rewards) <= 1 or all(abs(r - rewards[0]) <= 1e-12 for r in rewards[1:])


class _Changes:
    """Wakes every waiter when something admission depends on changes (a new policy version, a freed
    ticket, a worker admitted, a stop). `notify()` is synchronous, so it works from any code path."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._event.wait()


class _Batch:
    """What one collection for a train call produced."""

    def __init__(self) -> None:
        self.ready: list[GroupReady] = []
        self.discarded = 0
        self.zero_variance = 0
        self.exhausted = False
        self.stopped = False
        self.collapsed = False


class PipelineTrainer(Generic[ScenarioT, ConfigT]):
    """Async three-stage pipeline of rollouts, training and eval; see the module docstring.

    The constructor is ART 0.5.23's (names, defaults and checks): workers and batch bounds come from
    `pipeline=PipelineRuntimeConfig(...)`; ART 0.5.18's direct keywords (`num_rollout_workers`, `min_batch_size`,
    `max_batch_size`, `queue_maxsize`) still work, with one deprecation notice each, and so does 0.5.18's
    `packed_sequence_length`. `kl_penalty_coef` > 0 shapes advantages by the sampled logprobs' KL to step 0's
    checkpoint, or `kl_penalty_step_lag` steps back, as ART's (`kl_penalty_source="sample"`). `autotune` takes mode
    "off" only and `rollout_executor` None: the rest is not built here and is refused by name (options.py,
    docs/pipeline.md).
    `max_steps_off_policy` bounds how many steps older than the weights a trained group's policy version may be
    (0: on policy, the synchronous loop; None: no bound); `limit_mean_steps_off_policy` bounds a group's mean.
    artrl adds two keywords: `train_kwargs`, more keywords for every `backend.train` call (TrainConfig fields,
    e.g. the off-policy correction `precalculate_logprobs=True, truncated_importance_sampling=2.0`;
    docs/pipeline.md), and `clock` (seconds, monotonic), for tests."""

    def __init__(self, model: Any, backend: Any, rollout_fn: RolloutFn, scenarios: AsyncIterator[ScenarioT] |
                 Iterable[ScenarioT], config: ConfigT, eval_fn: EvalFn | None = None, *,
                 num_rollout_workers: int | None = None, min_batch_size: int | None = None,
                 max_batch_size: int | None = None, queue_maxsize: int | None = None,
                 pipeline: PipelineRuntimeConfig | None = None, autotune: PipelineAutotuneConfig | None = None,
                 learning_rate: float = 1e-5, loss_fn: str = "cispo", loss_fn_config: dict | None = None,
                 normalize_advantages: bool = True, grad_accumulation_sequences: int | None = None,
                 adam_params: object | None = None, kl_penalty_coef: float = 0.0,
                 kl_penalty_step_lag: int | None = None, max_steps: int | None = None,
                 discard_queue_multiplier: int = 100, max_steps_off_policy: int | None = 4,
                 limit_mean_steps_off_policy: float | None = None,
                 score_reference_groups_per_step: float | None = None,
                 score_reference_rollouts_per_group: float | None = None,
                 log_interval_seconds: float = 60.0, status_ewa_alpha: float = 0.2,
                 total_scenarios: int | None = None, eval_every_n_steps: int = 20, eval_at_start: bool = True,
                 save_checkpoint: bool = True, optimizer_save_interval: int = 5,
                 checkpoint_retention_strategy: CheckpointRetentionStrategy | None = None,
                 checkpoint_retention_interval: int = 1, resume: bool = True, rollout_executor: object | None = None,
                 packed_sequence_length: int | None = None, train_kwargs: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        pipeline, autotune = resolve_pipeline_config(
            pipeline, autotune, num_rollout_workers=num_rollout_workers, min_batch_size=min_batch_size,
            max_batch_size=max_batch_size, queue_maxsize=queue_maxsize)
        checks = [(eval_every_n_steps < 0, "eval_every_n_steps must be >= 0"),
                  (max_steps is not None and max_steps < 0, "max_steps must be >= 0"),
                  (log_interval_seconds <= 0, "log_interval_seconds must be > 0"),
                  (discard_queue_multiplier <= 0, "discard_queue_multiplier must be > 0"),
                  (max_steps_off_policy is not None and max_steps_off_policy < 0, "max_steps_off_policy must be >= 0"),
                  (limit_mean_steps_off_policy is not None and limit_mean_steps_off_policy < 0,
                   "limit_mean_steps_off_policy must be >= 0"),
                  (checkpoint_retention_interval <= 0, "checkpoint_retention_interval must be > 0"),
                  (optimizer_save_interval <= 0, "optimizer_save_interval must be > 0"),
                  (kl_penalty_step_lag is not None and kl_penalty_step_lag < 1, "kl_penalty_step_lag must be >= 1"),
                  (grad_accumulation_sequences is not None and grad_accumulation_sequences < 1,
                   "grad_accumulation_sequences must be >= 1")]
        for failed, message in checks:
            if failed:
                raise ValueError(message)
        refuse_unbuilt(rollout_executor=rollout_executor)
        if packed_sequence_length is not None:
            notice_once("pipeline_trainer.packed_sequence_length",
                        f"PipelineTrainer(packed_sequence_length={packed_sequence_length}) is ART 0.5.18's keyword "
                        "(gone in ART 0.5.23); it is still honoured: each train call packs rows of that length.")
        self.model, self.backend, self.rollout_fn = model, backend, rollout_fn
        self.config, self.eval_fn = config, eval_fn
        self.pipeline, self.autotune = pipeline, autotune
        self.num_rollout_workers = pipeline.num_rollout_workers
        self.min_batch_size = pipeline.min_batch_size
        self.max_batch_size = pipeline.max_batch_size if pipeline.max_batch_size is not None \
            else 10 * pipeline.min_batch_size
        self.target_groups_per_step = self.max_batch_size
        self.max_steps_off_policy = max_steps_off_policy
        self.limit_mean_steps_off_policy = limit_mean_steps_off_policy
        self.queue_maxsize = pipeline.queue_maxsize
        self.learning_rate, self.loss_fn, self.loss_fn_config = learning_rate, loss_fn, loss_fn_config
        self.normalize_advantages, self.adam_params = normalize_advantages, adam_params
        self.grad_accumulation_sequences = grad_accumulation_sequences
        self.kl_penalty_coef, self.kl_penalty_step_lag = kl_penalty_coef, kl_penalty_step_lag
        self.optimizer_save_interval = optimizer_save_interval
        self.score_reference_groups_per_step = score_reference_groups_per_step \
            if score_reference_groups_per_step is not None else pipeline.score_reference_groups_per_step
        self.score_reference_rollouts_per_group = score_reference_rollouts_per_group \
            if score_reference_rollouts_per_group is not None else pipeline.score_reference_rollouts_per_group
        self.packed_sequence_length, self.max_steps = packed_sequence_length, max_steps
        self.discard_queue_multiplier = discard_queue_multiplier
        self.eval_every_n_steps, self.eval_at_start = eval_every_n_steps, eval_at_start
        self.save_checkpoint = save_checkpoint
        self.checkpoint_retention_strategy = checkpoint_retention_strategy
        self.checkpoint_retention_interval = checkpoint_retention_interval
        self.resume = resume
        self.train_kwargs = dict(train_kwargs or {})
        own = {"learning_rate", "loss_fn", "loss_fn_config", "normalize_advantages", "adam_params",
               "packed_sequence_length", "save_checkpoint", "grad_accumulation_sequences"}
        if kl_penalty_coef > 0.0:  # the penalty's own keys come from kl_penalty_coef / kl_penalty_step_lag then
            own |= {"kl_penalty_coef", "kl_penalty_source", "kl_penalty_reference_step", "kl_penalty_step_lag",
                    "kl_ref_adapter_path"}
        reserved = sorted(set(self.train_kwargs) & own)
        if reserved:
            raise ValueError(f"train_kwargs={reserved} are PipelineTrainer's own arguments; pass them as such")
        self.clock = clock
        self.bound = StalenessBound(admission_bound(max_steps_off_policy, limit_mean_steps_off_policy))
        self.state = PipelineState()
        self._scenarios = _aiter(scenarios)
        self._scenario_lock = asyncio.Lock()
        self._discard_queue: list[TrajectoryGroup] = []
        self._discard_queue_limit = discard_queue_multiplier * self.min_batch_size
        self._collapse_triggered = False
        self._leases = LeaseRegistry()  # steps rollouts and evals use now: retention never deletes them
        self._scheduled_eval_steps: set[int] = set()
        self._stop = asyncio.Event()
        self._changes = _Changes()
        self._waiting: list[int] = []  # pulled scenarios waiting for admission (a heap of their indices)
        self._admission: Admission | None = None
        self._queue: asyncio.Queue[GroupReady | ScenariosExhausted] | None = None  # unbounded: _queue_limit()
        self._worker_group: asyncio.TaskGroup | None = None
        self._live_workers: set[int] = set()
        self._next_worker_id = 0
        self._scenarios_exhausted = False
        # the in-turn schedule (the tuner's, tuning.py): no rollout runs while a train call does
        self._in_turn = False
        self._training_now = False
        self._running_rollouts: set[int] = set()  # tickets (seq) of the rollouts running now
        self._overdue_rollouts: set[int] = set()  # of those, the ones a train call already waited for in vain
        self._put_wait_s = 0.0
        self._pressure_samples: list[float] = []
        self._longest_rollout_s = 0.0
        self._in_turn_drain_timeouts = 0
        self._tuning = PipelineTuning(autotune) if autotune.mode != "off" else None
        self._eval_queue: asyncio.Queue[int | EvalStop] | None = None
        self._status = StatusReporter(get_scenario_offset=lambda: self.state.scenario_offset,
                                      log_interval_seconds=log_interval_seconds, status_ewa_alpha=status_ewa_alpha,
                                      total_scenarios=total_scenarios, num_workers=self.num_rollout_workers,
                                      clock=clock)
        self._log_interval = log_interval_seconds
        self._validate_backend_support()

    # ------------------------------------------------------------------ checks
    def _validate_backend_support(self) -> None:
        """ART's checks for LocalBackend (loss and optimizer options), without ART's dedicated-mode refusal."""
        from ..local.backend import LocalBackend

        if not isinstance(self.backend, LocalBackend):
            return
        if self.loss_fn not in ("cispo", "ppo"):
            raise ConfigError(f"PipelineTrainer(loss_fn={self.loss_fn!r}) with LocalBackend: loss_fn must be "
                              "'cispo' or 'ppo', as in ART.")
        if self.loss_fn_config is not None:
            raise ConfigError("PipelineTrainer with LocalBackend requires loss_fn_config=None, as in ART.")
        if self.adam_params is not None:
            raise ConfigError("PipelineTrainer with LocalBackend requires adam_params=None, as in ART; AdamW's "
                              "settings are InternalModelConfig's (adam_beta1, adam_beta2, adam_epsilon).")

    # ------------------------------------------------------------------ run
    async def train(self, *, handle_signals: bool = True) -> None:
        """Run the pipeline until the scenarios end, `max_steps` steps are trained, a stop is requested or
        the model collapses."""
        start_step = await self.model.get_step()
        saved = SavedState.from_state_file(self.model.read_state()) if self.resume else SavedState()
        if saved.training_step is not None and saved.training_step != start_step:
            log.warning("the pipeline state was written at step %d but the model is at step %d; resuming from "
                        "step %d with scenario offset %d", saved.training_step, start_step, start_step,
                        saved.scenario_offset)
        self.state = PipelineState(policy_version=start_step, next_training_step=start_step,
                                   total_scenarios_consumed=saved.total_scenarios_consumed,
                                   last_eval_step=saved.last_eval_step,
                                   completed_eval_steps=set(saved.completed_eval_steps))
        if saved.scenario_offset:
            self.state.scenario_offset = await self._skip_scenarios(saved.scenario_offset)
            self.state.total_scenarios_consumed = max(self.state.total_scenarios_consumed, self.state.scenario_offset)
        self._stop = asyncio.Event()
        self._changes = _Changes()
        self._waiting = []
        self._admission = None
        self._live_workers, self._next_worker_id, self._scenarios_exhausted = set(), 0, False
        self._training_now, self._put_wait_s = False, 0.0
        self._running_rollouts, self._overdue_rollouts = set(), set()
        self._pressure_samples = []
        if self._tuning is not None:
            self.apply_pipeline_settings(self._tuning.start(self, start_step))
            self._in_turn = self._tuning.schedule == "in_turn"
        self._admission = Admission(self.bound, self.min_batch_size, start_step)
        self._queue = asyncio.Queue()
        self._eval_queue = asyncio.Queue()
        if self.eval_fn is not None and self.eval_at_start:
            self._schedule_eval(start_step)
            self._persist(start_step)
        self._status.start(initial_step=start_step)
        restore = self._install_signal_handlers() if handle_signals else (lambda: None)
        try:
            async with asyncio.TaskGroup() as tg:
                rollouts = tg.create_task(self._rollout_stage(), name="rollout_stage")
                tg.create_task(self._eval_stage(self._eval_queue), name="eval_stage")
                status = tg.create_task(self._status_loop(), name="status_loop")
                try:
                    await self._training_stage(start_step)
                finally:
                    rollouts.cancel()  # rollouts in flight are not needed any more
                    status.cancel()
                    self._eval_queue.put_nowait(EvalStop())  # queued evals still run
            # evals that ended after the last step's retention held their checkpoints; apply the strategy once
            # more now that nothing is leased, so the run leaves what its strategy keeps
            await self._run_checkpoint_retention(self.state.next_training_step, final=True)
        finally:
            restore()
            self._status.flush()
            self._status.close()

    def apply_pipeline_settings(self, settings: PipelineTuneSettings) -> None:
        """Run with these workers, batch bounds and queue size from now on (ART's; the tuner's way in). Fewer
        workers: the extra ones stop after their current rollout; a lower `min_batch_size` admits fewer groups per
        step from the next open step on."""
        self.num_rollout_workers = settings.num_rollout_workers
        self.min_batch_size, self.max_batch_size = settings.min_batch_size, settings.max_batch_size
        self.target_groups_per_step = settings.target_groups_per_step
        self.queue_maxsize = settings.queue_maxsize
        self._discard_queue_limit = self.discard_queue_multiplier * self.min_batch_size
        if self._admission is not None:
            self._admission.set_groups_per_step(self.min_batch_size)
        self._status.set_num_workers(self.num_rollout_workers)
        self._reconcile_workers()
        self._changes.notify()

    def _queue_limit(self) -> int:
        window = staleness_window(self.max_steps_off_policy, self.limit_mean_steps_off_policy)
        return self.queue_maxsize or max(1, window * self.target_groups_per_step)

    def request_stop(self) -> None:
        """Stop cleanly: a train call in progress finishes, nothing new starts."""
        if self.state.done:
            return
        self.state.done = True
        self._stop.set()
        self._changes.notify()

    def _install_signal_handlers(self) -> Callable[[], None]:
        loop = asyncio.get_running_loop()
        installed: list[tuple[signal.Signals, Any]] = []  # (signal, the handler before ours)

        def on_signal(sig: signal.Signals) -> None:
            if not self.state.done:
                log.warning("%s received: stopping after the current step", sig.name)
            self.request_stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                before = signal.getsignal(sig)
                loop.add_signal_handler(sig, on_signal, sig)
                installed.append((sig, before))
            except (NotImplementedError, RuntimeError, ValueError):
                continue  # not the main thread, or no signal support: request_stop() still works

        def restore() -> None:
            # the loop's removal sets SIGINT to Python's default and SIGTERM to SIG_DFL; put back what the process
            # had (a SIGINT ignored under nohup or a background job stays ignored; a caller's own handler returns)
            for sig, before in installed:
                loop.remove_signal_handler(sig)
                if before is not None:
                    signal.signal(sig, before)
        return restore

    # ------------------------------------------------------------------ scenarios
    async def _skip_scenarios(self, count: int) -> int:
        skipped = 0
        while skipped < count:
            try:
                await anext(self._scenarios)
            except StopAsyncIteration:
                log.warning("the scenarios ended after %d of the %d already pulled in the resumed run", skipped,
                            count)
                break
            skipped += 1
        return skipped

    async def _pull(self) -> tuple[int, Any] | None:
        """The next scenario and its index in the stream; None when they are used up."""
        async with self._scenario_lock:
            if self.state.done:
                return None
            try:
                scenario = await anext(self._scenarios)
            except StopAsyncIteration:
                self._scenarios_exhausted = True
                return None
            index = self.state.scenario_offset
            self.state.scenario_offset += 1
            self.state.total_scenarios_consumed += 1
            heapq.heappush(self._waiting, index)  # waiting for admission from now on, in pull order
            return index, scenario

    # ------------------------------------------------------------------ leases
    @asynccontextmanager
    async def _adapter_lease(self, step: int) -> AsyncIterator[None]:
        async with self._leases.hold(step):
            lease = getattr(self.backend, "adapter_lease", None)
            if lease is None:
                yield
                return
            async with lease(self.model, step):
                yield

    # ------------------------------------------------------------------ rollout stage
    async def _rollout_stage(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                self._worker_group = tg
                self._reconcile_workers()
        finally:
            self._worker_group = None
        assert self._queue is not None
        self._queue.put_nowait(ScenariosExhausted())

    def _reconcile_workers(self) -> None:
        """Start workers up to `num_rollout_workers` (those above it stop themselves, `_retire`)."""
        tg = self._worker_group
        if tg is None:
            return
        while len(self._live_workers) < self.num_rollout_workers and not self.state.done \
                and not self._scenarios_exhausted:
            worker_id = self._next_worker_id
            self._next_worker_id += 1
            self._live_workers.add(worker_id)
            tg.create_task(self._rollout_worker(worker_id), name=f"rollout_worker_{worker_id}")

    def _retire(self, worker_id: int) -> bool:
        """Whether this worker stops (there are more than `num_rollout_workers`); synchronous, so two workers
        never both see the same surplus."""
        if len(self._live_workers) > self.num_rollout_workers:
            self._live_workers.discard(worker_id)
            return True
        return False

    async def _admit(self, index: int) -> Ticket | None:
        """Wait until scenario `index` is the first waiting one and admission has a ticket within the bound
        of the current policy version; the ticket, or None on a stop."""
        assert self._admission is not None
        admission = self._admission
        try:
            await self._changes.wait_for(lambda: self.state.done or (
                self._waiting[0] == index and admission.may_admit(self.state.policy_version)))
        finally:
            self._waiting.remove(index)
            heapq.heapify(self._waiting)
            self._changes.notify()  # the next waiting scenario may be admitted now
        return None if self.state.done else admission.admit()

    def _release(self, ticket: Ticket) -> None:
        """A dropped group's ticket: its slot goes to the next waiting scenario."""
        assert self._admission is not None
        self._admission.release(ticket)
        self._changes.notify()

    async def _rollout_worker(self, worker_id: int) -> None:
        try:
            await self._rollout_loop(worker_id)
        finally:
            self._live_workers.discard(worker_id)

    @property
    def _output_queue(self) -> asyncio.Queue[GroupReady | ScenariosExhausted] | None:
        """ART's name for the queue the rollout workers fill (`_queue`); setting it lets one worker run alone."""
        return self._queue

    @_output_queue.setter
    def _output_queue(self, queue: asyncio.Queue[GroupReady | ScenariosExhausted] | None) -> None:
        self._queue = queue

    async def _rollout_loop(self, worker_id: int) -> None:
        assert self._queue is not None
        if self._admission is None:  # a worker run on its own, outside `train` (ART's tests do): admit from now
            self._admission = Admission(self.bound, self.min_batch_size, self.state.policy_version)
        while not self.state.done:
            if self._retire(worker_id):
                return
            pulled = await self._pull()
            if pulled is None:
                return
            index, scenario = pulled
            waited_from = self.clock()
            ticket = await self._admit(index)
            if ticket is None:
                return
            self._status.note_rollout_started()
            queued = errored = False
            try:
                # in turn: a rollout starts only while no train call runs (the trainer waits for those running)
                await self._changes.wait_for(lambda: self.state.done or not (self._in_turn and self._training_now))
                idle_s = self.clock() - waited_from
                version = self.state.policy_version
                token = self.model.activate_metrics_context("train")
                started = self.clock()
                self._running_rollouts.add(ticket.seq)
                try:
                    # imported here: the affinity headers are the serving package's, which `import artrl` leaves out
                    from ..client.affinity import new_session

                    new_session()  # this worker runs rollout after rollout: each one is placed anew on replicas
                    async with self._adapter_lease(version):
                        group = await self.rollout_fn(self.model, scenario, self.config)
                finally:
                    token.var.reset(token)
                    self._running_rollouts.discard(ticket.seq)
                    self._overdue_rollouts.discard(ticket.seq)
                    self._sample_engine_pressure()
                    self._changes.notify()
                rollout_s = self.clock() - started
                self._longest_rollout_s = max(self._longest_rollout_s, rollout_s)
                if not isinstance(group, TrajectoryGroup):
                    raise TypeError(f"rollout_fn returned a {type(group).__name__}, not a TrajectoryGroup")
                self._apply_scenario_metadata(group, scenario)
                for t in group.trajectories:
                    if t.initial_policy_version is None:
                        t.initial_policy_version = version
                    if t.final_policy_version is None:
                        t.final_policy_version = self.state.policy_version
                put_from = self.clock()
                await self._changes.wait_for(lambda: self.state.done or self._queue.qsize() < self._queue_limit())
                self._put_wait_s += self.clock() - put_from
                if self.state.done:
                    return
                self._queue.put_nowait(GroupReady(group, ticket, index, version, rollout_s, idle_s))
                queued = True
                self._status.note_group_enqueued(group)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                errored = True
                self.state.failed_rollouts += 1
                log.warning("worker %d: rollout of scenario %d failed (%s.%s): %r%s", worker_id, index,
                            type(exc).__module__, type(exc).__name__, exc, _scenario_context(scenario))
            finally:
                if not queued:
                    self._release(ticket)
                self._status.note_rollout_finished(errored=errored)

    # ------------------------------------------------------------------ training stage
    async def _next(self) -> GroupReady | ScenariosExhausted | None:
        """The next message, or None once a stop is requested (whichever comes first)."""
        assert self._queue is not None
        if self._stop.is_set():
            return None
        get = asyncio.ensure_future(self._queue.get())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (get, stop):
                if not task.done():
                    task.cancel()
            await asyncio.gather(get, stop, return_exceptions=True)
        if get.done() and not get.cancelled():
            return get.result()
        return None

    def _take(self, msg: GroupReady, step: int, batch: _Batch) -> None:
        """Accept, discard (stale) or set aside (no reward spread) one group for the call from `step`."""
        assert self._admission is not None
        self._status.note_group_dequeued(msg.group)
        self._changes.notify()  # a queue slot is free
        group = msg.group
        if not group.trajectories and group.exceptions:
            first = group.exceptions[0]
            raise RuntimeError(f"All {len(group.exceptions)} rollouts in group failed (scenario "
                               f"{msg.scenario_index}). First exception ({first.type}): {first.message}")
        mean_off = group_mean_steps_off_policy(step, group)
        if self.bound.is_stale(msg.initial_version, step) or (
                self.limit_mean_steps_off_policy is not None and mean_off is not None
                and mean_off > self.limit_mean_steps_off_policy):
            batch.discarded += 1
            self._release(msg.ticket)
            return
        if _zero_variance(group):
            batch.zero_variance += 1
            self._release(msg.ticket)
            self._discard_queue.append(group)
            self._status.note_zero_variance_discarded(1)
            if len(self._discard_queue) >= self._discard_queue_limit:
                self._trigger_collapse()
                batch.collapsed = True
            return
        batch.ready.append(msg)

    async def _collect(self, step: int) -> _Batch:
        assert self._queue is not None
        batch = _Batch()
        while len(batch.ready) < self.min_batch_size and not batch.collapsed:
            msg = await self._next()
            if msg is None:
                batch.stopped = True
                return batch
            if isinstance(msg, ScenariosExhausted):
                batch.exhausted = True
                return batch
            self._take(msg, step, batch)
        while len(batch.ready) < self.max_batch_size and not batch.collapsed and not self._queue.empty():
            msg = self._queue.get_nowait()
            if isinstance(msg, ScenariosExhausted):
                batch.exhausted = True
                break
            self._take(msg, step, batch)
        return batch

    async def _training_stage(self, start_step: int) -> None:
        current = start_step
        stop_at = current + self.max_steps if self.max_steps is not None else None
        try:
            while stop_at is None or current < stop_at:
                step_started = self.clock()
                batch = await self._collect(current)
                trainer_idle_s = self.clock() - step_started
                self.state.discarded_stale_groups += batch.discarded
                self._status.note_stale(batch.discarded)
                if batch.collapsed or batch.stopped or not batch.ready:
                    break
                current = await self._train_step(current, batch, step_started, trainer_idle_s)
                if batch.exhausted or self._stop.is_set():
                    break
        finally:
            self.state.done = True
            self._stop.set()
            self._persist(current)
            self._changes.notify()

    async def _train_step(self, current: int, batch: _Batch, step_started: float, trainer_idle_s: float) -> int:
        ready = sorted(batch.ready, key=lambda m: m.ticket.seq)  # admission order: the synchronous loop's order
        groups = [m.group for m in ready]
        off_policy = [current - m.initial_version for m in ready]
        expected = current + 1
        eval_step = self._should_eval(expected)
        self.state.next_training_step = expected
        # every group of this call was pulled before this write, so a resumed run never trains one again
        self._persist(current)
        self._status.note_training_start(len(groups))
        kwargs: dict[str, Any] = {**self.train_kwargs, "learning_rate": self.learning_rate, "loss_fn": self.loss_fn,
                                  "loss_fn_config": self.loss_fn_config,
                                  "normalize_advantages": self.normalize_advantages,
                                  "save_checkpoint": self.save_checkpoint and eval_step,
                                  "adam_params": self.adam_params}
        if self.grad_accumulation_sequences is not None:
            kwargs["grad_accumulation_sequences"] = self.grad_accumulation_sequences
        if self.packed_sequence_length is not None:
            kwargs["packed_sequence_length"] = self.packed_sequence_length
        if self.kl_penalty_coef > 0.0:
            # ART's pipeline KL: advantages shaped by the sampled logprobs' KL to a reference checkpoint, the base
            # run's first (step 0) or the one kl_penalty_step_lag steps back (kept from retention meanwhile)
            kwargs.update(kl_penalty_coef=self.kl_penalty_coef, kl_penalty_source="sample",
                          kl_penalty_reference_step=self.kl_reference_step(current))
        drain_s = await self._close_rollouts_for_training()
        call_started = self.clock()
        try:
            result = await self.backend.train(self.model, groups, **kwargs)
        finally:
            trainer_s = self.clock() - call_started
            self._training_now = False
            self._changes.notify()  # in turn: rollouts go on
            self._status.note_training_end()
        step = int(result.step)
        self.state.policy_version = step
        self.state.next_training_step = step
        self._changes.notify()  # rollouts meant for the next steps may start
        self._log_checkpoint_saved(result)
        await self._prune_model_adapters(step)
        await self._run_checkpoint_retention(step)
        step_s = self.clock() - step_started
        self._status.note_training_batch(groups, step=step, step_seconds=step_s)
        metrics: dict[str, float] = {
            "discarded_stale_groups": float(self.state.discarded_stale_groups),
            # ART's figure: counted from the step this call produced, so 1 when on policy
            "steps_off_policy": sum(off_policy) / len(off_policy) + (step - current),
            # artrl's own: counted from the weights the gradient was taken at (0 on policy, <= the bound)
            "staleness": sum(off_policy) / len(off_policy),
            "staleness_max": float(max(off_policy)),
            "time/step_wall_s": step_s,
            # ART 0.5.23's names; then 0.5.18's, kept for dashboards that read them
            "time/step_trainer_idle_s": trainer_idle_s,
            "time/step_backend_train_s": trainer_s,
            "throughput/step_trainer_idle_s": trainer_idle_s,
            "time/step_trainer_s": trainer_s,
            # ART 0.5.23's names for the same figures (the 0.5.18 names above stay)
            "time/step_collect_batch_s": trainer_idle_s,
            "time/step_trainer_idle_s": trainer_idle_s,
            "time/step_backend_train_s": trainer_s,
            "discarded/step/stale_groups": float(batch.discarded),
            "discarded/cum/stale_groups": float(self.state.discarded_stale_groups),
            **self._settings_metrics(),
        }
        actor_s = sum(m.rollout_s for m in ready)
        actor_idle_s = sum(m.actor_idle_s for m in ready)
        metrics["time/step_rollout_s"] = actor_s
        metrics["time/step_rollout_idle_s"] = actor_idle_s
        if actor_s > 0:
            metrics["time/step_actor_s"] = actor_s
        if actor_idle_s > 0:
            metrics["throughput/step_actor_idle_s"] = actor_idle_s
        metrics.update(score_metrics(current, groups, step_seconds=step_s, result_metrics=dict(result.metrics),
                                     reference_groups=self.score_reference_groups_per_step,
                                     reference_rollouts=self.score_reference_rollouts_per_group))
        metrics.update({k: v for k, v in result.metrics.items() if k not in metrics})
        metrics["queue/put_wait_s"] = self._put_wait_s
        self._sample_engine_pressure()
        if self._tuning is not None:
            pressures, self._pressure_samples = self._pressure_samples, []
            measured = StepMeasurement(
                step=step, t_s=self.clock(), wall_s=step_s, collect_s=trainer_idle_s, train_s=trainer_s,
                rollout_s=actor_s, groups=len(groups), stale_groups=batch.discarded,
                zero_variance_groups=batch.zero_variance, put_wait_s=self._put_wait_s,
                inference_pressure=sum(pressures) / len(pressures) if pressures else None,
                schedule="in_turn" if self._in_turn else "overlap")
            if self._in_turn:
                metrics["time/step_in_turn_drain_s"] = drain_s
                metrics["pipeline_tuner/in_turn_drain_timeouts"] = float(self._in_turn_drain_timeouts)
            metrics.update(self._tuning.on_step(self, measured))
            self._in_turn = self._tuning.schedule == "in_turn"
        self._put_wait_s = 0.0
        await self.model.log(groups, split="train", step=step, metrics=metrics)
        if self._discard_queue:
            await self.model.log(self._discard_queue[:50], split="discarded", step=step)
            self._discard_queue.clear()
        if eval_step:
            self._schedule_eval(step)
        self._persist(step)
        return step

    async def _close_rollouts_for_training(self) -> float:
        """In turn: no rollout starts from now until the train call ends, and the call waits for those running
        (their groups go to the queue); the seconds waited. Overlapped: nothing (0)."""
        if not self._in_turn:
            return 0.0
        started = self.clock()
        self._training_now = True
        self._changes.notify()
        # a rollout that hangs (a tool that never answers) must not hang training: wait at most a few times the
        # longest rollout seen, then train beside what still runs (counted)
        limit = IN_TURN_DRAIN_LIMIT_FACTOR * max(self._longest_rollout_s, IN_TURN_DRAIN_MIN_S)
        try:
            async with asyncio.timeout(limit):
                await self._changes.wait_for(lambda: self._running_rollouts <= self._overdue_rollouts
                                             or self._stop.is_set())
        except TimeoutError:
            self._in_turn_drain_timeouts += 1
            overdue = self._running_rollouts - self._overdue_rollouts
            self._overdue_rollouts |= overdue  # waited for once; later calls do not wait for them again
            log.warning("in turn: %d rollout(s) still running after %.1f s (%.0fx the longest rollout so far); this "
                        "train call runs beside them", len(overdue), limit, IN_TURN_DRAIN_LIMIT_FACTOR)
        return self.clock() - started

    def _sample_engine_pressure(self) -> None:
        """One sample of the serving engine's queue pressure (requests queued / its batch size) for the tuner,
        taken when a rollout ends and when a step ends; nothing when the engine does not say (tuning.py)."""
        if self._tuning is not None:
            value = engine_pressure(self.backend, self.model)
            if value is not None:
                self._pressure_samples.append(value)

    def _settings_metrics(self) -> dict[str, float]:
        """ART 0.5.23's `pipeline_settings/...` figures: the runtime config this step ran under."""
        return {"pipeline_settings/num_rollout_workers": float(self.num_rollout_workers),
                "pipeline_settings/min_batch_size": float(self.min_batch_size),
                "pipeline_settings/max_batch_size": float(self.max_batch_size),
                "pipeline_settings/target_groups_per_step": float(self.target_groups_per_step),
                "pipeline_settings/queue_maxsize": float(self._queue_limit())}

    # ------------------------------------------------------------------ collapse
    def _trigger_collapse(self) -> None:
        if self._collapse_triggered:
            return
        self._collapse_triggered = True
        self.state.done = True
        self._stop.set()
        log.error("MODEL COLLAPSE DETECTED - training stopped: %d trajectory groups since the last train step had no "
                  "reward spread (every rollout of the group scored the same), so the policy may have collapsed. Lower "
                  "the learning rate, check that the reward varies and the prompts are diverse, or use smaller "
                  "batches. To relax this failsafe raise discard_queue_multiplier (now %d; it stops after %d * "
                  "min_batch_size = %d such groups).", self._discard_queue_limit, self.discard_queue_multiplier,
                  self.discard_queue_multiplier, self._discard_queue_limit)

    # ------------------------------------------------------------------ eval stage
    def _should_eval(self, step: int) -> bool:
        return (self.eval_fn is not None and self.eval_every_n_steps > 0
                and step - self.state.last_eval_step >= self.eval_every_n_steps)

    def _schedule_eval(self, step: int) -> None:
        assert self._eval_queue is not None
        self._scheduled_eval_steps.add(step)
        self.state.last_eval_step = step
        self._eval_queue.put_nowait(step)

    async def _eval_stage(self, queue: "asyncio.Queue[int | EvalStop]") -> None:
        while True:
            item = await queue.get()
            if isinstance(item, EvalStop):
                return
            await self._run_eval(item)

    async def _run_eval(self, step: int) -> None:
        assert self.eval_fn is not None
        self._status.note_val_started(step)
        reward: float | None = None
        completed = False
        started = self.clock()
        try:
            token = self.model.activate_metrics_context("eval")
            try:
                async with self._adapter_lease(step):
                    result = await self.eval_fn(self.model, step, self.config)
            finally:
                token.var.reset(token)
            elapsed = self.clock() - started
            splits = result if isinstance(result, dict) else {"val": result}
            timing: dict[str, float] | None = {"time/step_eval_s": elapsed}
            for split, items in splits.items():
                groups = _eval_groups(items)
                trajectories = [t for g in groups for t in g.trajectories]
                if split == "val" and trajectories:
                    reward = sum(t.reward for t in trajectories) / len(trajectories)
                if groups:
                    await self.model.log(groups, split=split, step=step, metrics=timing)
                    timing = None
            if timing is not None:
                await self.model.log(None, split="val", step=step, metrics=timing)
            self._checkpoint_row(step, {CHECKPOINT_EVAL_COMPLETED_METRIC: 1.0})
            completed = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("eval at step %d failed (%s): %r", step, type(exc).__name__, exc)
        finally:
            self._scheduled_eval_steps.discard(step)
            if completed:
                self.state.completed_eval_steps.add(step)
                self._persist(self.state.next_training_step)
            self._status.note_val_finished(step, reward)

    async def _status_loop(self) -> None:
        """One status line every log_interval_seconds (a timer; cancelled when training ends)."""
        while True:
            self._status.log_if_due()
            await asyncio.sleep(self._log_interval)

    # ------------------------------------------------------------------ state, history, checkpoints
    def _persist(self, training_step: int) -> None:
        self.model.merge_state({PIPELINE_STATE_KEY: self.state.payload(training_step)})

    def _run_dir(self) -> Path:
        return Path(self.model._get_output_dir())

    def _checkpoint_row(self, step: int, metrics: dict[str, float]) -> None:
        """ART's checkpoint rows in history.jsonl (`checkpoint/...` keys, no split prefix)."""
        row: dict[str, Any] = {k: v for k, v in metrics.items() if v == v}
        history = getattr(self.model, "_run_history", None)
        started = history().started if callable(history) else time.time()
        row.update({"training_step": step, "time/wall_clock_sec": time.time() - started, "step": step,
                    "split": "checkpoint", "recorded_at": datetime.now().isoformat()})
        self._run_dir().mkdir(parents=True, exist_ok=True)
        storage.append_jsonl(self._run_dir() / storage.HISTORY_FILE, row)

    def _log_checkpoint_saved(self, result: Any) -> None:
        step = int(result.step)
        given = getattr(result, "checkpoint_path", None)
        path = Path(given) if isinstance(given, str) and given else storage.checkpoint_dir(self._run_dir(), step)
        if path.exists():
            self._checkpoint_row(step, {CHECKPOINT_SAVED_METRIC: 1.0,
                                        CHECKPOINT_CREATED_AT_METRIC: path.stat().st_ctime})

    async def _prune_model_adapters(self, step: int) -> None:
        prune = getattr(self.backend, "prune_model_adapters", None)
        if prune is None:
            return
        # ART's retention window; with no bound at all only the newest, but leased versions always stay (backend)
        window = self.max_steps_off_policy if self.max_steps_off_policy is not None else (
            math.ceil(self.limit_mean_steps_off_policy) if self.limit_mean_steps_off_policy is not None else 0)
        await prune(self.model, retain_steps=set(range(max(0, step - window), step + 1)))

    def kl_reference_step(self, current_step: int) -> int:
        """The KL reference checkpoint of a call from `current_step` (ART's): 0, or `kl_penalty_step_lag` back."""
        if self.kl_penalty_step_lag is None:
            return 0
        return max(0, current_step - self.kl_penalty_step_lag)

    def protected_steps(self, current_step: int) -> set[int]:
        """Checkpoints retention never deletes: the current step, leased steps, steps with an eval scheduled, and
        with a KL penalty the reference steps the next calls read (step 0, or the lag's window)."""
        kl: set[int] = set()
        if self.kl_penalty_coef > 0.0:
            kl = {0} if self.kl_penalty_step_lag is None else set(range(self.kl_reference_step(current_step),
                                                                         current_step + 1))
        return {current_step} | self._leases.active_steps() | self._scheduled_eval_steps | kl

    async def _run_checkpoint_retention(self, step: int, final: bool = False) -> None:
        strategy = self.checkpoint_retention_strategy
        if strategy is None or (step % self.checkpoint_retention_interval and not final):
            return
        infos = checkpoint_infos(self._run_dir(), self.state.completed_eval_steps)
        protected = self.protected_steps(step)
        eligible = [c for c in infos if c.step not in protected]
        if not eligible:
            return
        delete = steps_to_delete(CheckpointRetentionContext(current_step=step, checkpoints=eligible), strategy)
        if delete:
            keep = sorted({c.step for c in infos} - delete)
            await self.backend._delete_checkpoint_files(self.model, keep)

    # ------------------------------------------------------------------ scenario metadata
    @staticmethod
    def _apply_scenario_metadata(group: TrajectoryGroup, scenario: Any) -> None:
        """ART: a scenario's scalar `metadata` goes on the group (`scenario_id`, other keys as `scenario_<key>`)."""
        metadata = scenario.get("metadata") if isinstance(scenario, dict) else None
        if not isinstance(metadata, dict):
            return
        for key, value in metadata.items():
            if isinstance(key, str) and (value is None or isinstance(value, (str, int, float, bool))):
                group.metadata["scenario_id" if key == "scenario_id" else f"scenario_{key}"] = value


def _scenario_context(scenario: Any) -> str:
    metadata = scenario.get("metadata") if isinstance(scenario, dict) else None
    if not isinstance(metadata, dict):
        return ""
    fields = [f"{k}={metadata[k]!r}" for k in ("scenario_id", "epoch", "scenario_index") if k in metadata]
    return f" [{' '.join(fields)}]" if fields else ""


def _eval_groups(items: list[Trajectory | TrajectoryGroup]) -> list[TrajectoryGroup]:
    groups = [i for i in items or [] if isinstance(i, TrajectoryGroup)]
    loose = [i for i in items or [] if not isinstance(i, TrajectoryGroup)]
    return groups + ([TrajectoryGroup(loose)] if loose else [])
