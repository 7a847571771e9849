"""`StatusReporter`: the pipeline's one status line, written through logging (ART 0.5.18's name and hooks).

The stages call its `note_*` hooks as work moves (rollouts started and finished,
groups queued, trained, stale, set aside, evals); `log_if_due()` writes one line at
most every `log_interval_seconds`, e.g.

    pipeline step 12 | scenarios 96/200 | rolling out 8 | queued 3 | training 4 | trained 44 | stale 2 |
    zero-var 5 | errored 1 | reward(ewa) 0.412 | s/step(ewa) 3.1 | val 0.380 @ step 10
    [| tuner online: in turn (overlap 0.93x) | workers 8 | batch 7-8 | step 11 hold: ...]

Logger: `artrl.pipeline_trainer`. ART also draws it as a tqdm line on a terminal; here it
is a log line only (a progress bar and a concurrent log would fight for the terminal).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from ..trajectories.data import TrajectoryGroup

log = logging.getLogger("artrl.pipeline_trainer")


def _zero_variance(group: TrajectoryGroup) -> bool:
    rewards = [t.reward for t in group.trajectories]
    return len(rewards) <= 1 or all(abs(r - rewards[0]) <= 1e-12 for r in rewards[1:])


def _std(group: TrajectoryGroup) -> float | None:
    rewards = [t.reward for t in group.trajectories]
    if len(rewards) < 2:
        return None
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


class StatusReporter:
    """Counts what the pipeline does and logs one status line now and then; see the module docstring."""

    def __init__(self, *, get_scenario_offset: Callable[[], int], log_interval_seconds: float = 60.0,
                 status_ewa_alpha: float = 0.2, total_scenarios: int | None = None, num_workers: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if log_interval_seconds <= 0:
            raise ValueError(f"log_interval_seconds={log_interval_seconds}; it must be > 0")
        if not 0 < status_ewa_alpha <= 1:
            raise ValueError(f"status_ewa_alpha={status_ewa_alpha}; it must be in (0, 1]")
        if total_scenarios is not None and total_scenarios < 0:
            raise ValueError(f"total_scenarios={total_scenarios}; it must be >= 0")
        if num_workers <= 0:
            raise ValueError(f"num_workers={num_workers}; it must be > 0")
        self._get_scenario_offset = get_scenario_offset
        self._interval = log_interval_seconds
        self._alpha = status_ewa_alpha
        self._total = total_scenarios
        self._num_workers = num_workers
        self._clock = clock
        self.current_step: int | None = None
        self.rolling_out = self.queued = self.training = 0
        self.trained = self.stale = self.zero_var = self.errored = 0
        self.reward_ewa: float | None = None
        self.seconds_ewa: float | None = None
        self.std_ewa: float | None = None
        self.val_step: int | None = None
        self.val_reward: float | None = None
        self.val_running: int | None = None
        self._started = False
        self._last_log = 0.0
        self.tuner: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, initial_step: int | None = None) -> None:
        if self._started:
            return
        self._started = True
        if initial_step is not None:
            self.current_step = initial_step
        self._last_log = self._clock() - self._interval  # the first log_if_due() logs

    def close(self) -> None:
        self._started = False

    def flush(self) -> None:
        self.log_if_due(force=True)

    def set_step(self, step: int) -> None:
        self.current_step = step

    def log_if_due(self, *, force: bool = False) -> None:
        if not self._started:
            return
        now = self._clock()
        if not force and now - self._last_log < self._interval:
            return
        self._last_log = now
        log.info("%s", self.line())

    # ------------------------------------------------------------------ hooks
    def set_num_workers(self, num_workers: int) -> None:
        self._num_workers = max(1, num_workers)

    def note_tuner(self, text: str) -> None:
        """The tuner's state and last decision, shown at the end of the line."""
        self.tuner = text

    def note_rollout_started(self) -> None:
        self.rolling_out += 1

    def note_rollout_finished(self, *, errored: bool) -> None:
        self.rolling_out = max(0, self.rolling_out - 1)
        self.errored += int(errored)

    def note_group_enqueued(self, _group: TrajectoryGroup) -> None:
        self.queued += 1

    def note_group_dequeued(self, _group: TrajectoryGroup) -> None:
        self.queued = max(0, self.queued - 1)

    def note_stale(self, count: int) -> None:
        self.stale += max(0, count)

    def note_zero_variance_discarded(self, count: int) -> None:
        self.zero_var += max(0, count)

    def note_training_start(self, group_count: int) -> None:
        self.training = group_count

    def note_training_end(self) -> None:
        self.training = 0

    def note_training_batch(self, batch: list[TrajectoryGroup], *, step: int, step_seconds: float) -> None:
        self.current_step = step
        zero = sum(_zero_variance(g) for g in batch)
        self.trained += len(batch) - zero
        self.zero_var += zero
        rewards = [t.reward for g in batch for t in g.trajectories]
        if rewards:
            self.reward_ewa = self._ewa(self.reward_ewa, sum(rewards) / len(rewards))
        stds = [s for s in map(_std, batch) if s is not None]
        if stds:
            self.std_ewa = self._ewa(self.std_ewa, sum(stds) / len(stds))
        self.seconds_ewa = self._ewa(self.seconds_ewa, step_seconds)

    def note_val_started(self, step: int) -> None:
        self.val_running = step

    def note_val_finished(self, step: int, reward: float | None) -> None:
        self.val_running = None
        if reward is not None:
            self.val_step, self.val_reward = step, reward

    # ------------------------------------------------------------------ the line
    def _ewa(self, previous: float | None, value: float) -> float:
        return value if previous is None else self._alpha * value + (1 - self._alpha) * previous

    def line(self) -> str:
        offset = self._get_scenario_offset()
        scenarios = f"{offset}/{self._total}" if self._total is not None else str(offset)
        parts = [f"pipeline step {self.current_step if self.current_step is not None else '-'}",
                 f"scenarios {scenarios}", f"rolling out {self.rolling_out}/{self._num_workers}",
                 f"queued {self.queued}", f"training {self.training}", f"trained {self.trained}",
                 f"stale {self.stale}", f"zero-var {self.zero_var}", f"errored {self.errored}"]
        if self.reward_ewa is not None:
            parts.append(f"reward(ewa) {self.reward_ewa:.3f}")
        if self.std_ewa is not None:
            parts.append(f"reward std(ewa) {self.std_ewa:.3f}")
        if self.seconds_ewa is not None:
            parts.append(f"s/step(ewa) {self.seconds_ewa:.1f}")
        if self.val_reward is not None:
            parts.append(f"val {self.val_reward:.3f} @ step {self.val_step}")
        if self.val_running is not None:
            parts.append(f"eval running @ step {self.val_running}")
        if self.tuner is not None:
            parts.append(self.tuner)
        return " | ".join(parts)
