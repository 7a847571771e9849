"""Experiment trackers: every history row (and the run's config) mirrored to W&B or TensorBoard.

`Model(report_metrics=[...])` chooses them, as in ART:

* `None` (the default): W&B when `WANDB_API_KEY` is set, else none.
* `["wandb"]`: Weights & Biases. The run is `wandb.init(project=<project>,
  name=<run_name>, id=<run_name>, resume="allow")` (`name` for a model without a run_name),
  like ART's; `training_step` is the x-axis of every section. It needs `WANDB_API_KEY`, or `WANDB_MODE=offline`
  (files only, no account: `wandb sync` uploads them later) or `disabled`.
* `["tensorboard"]`: a local log with no account, `<run dir>/tensorboard/`
  (torch's SummaryWriter; `tensorboard --logdir <run dir>/tensorboard`).
* `[]`: none.

What we simplify, and guarantee: a tracker never stops training. The first
failure of each tracker is logged with its cause (a failure to start it turns
it off for the run; a failed row is skipped and later ones are tried again);
further failures are counted at debug level. Both trackers are optional
installs (`pip install "artrl[wandb]"`, `"artrl[tensorboard]"`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
KNOWN = ("wandb", "tensorboard")
_WANDB_SECTIONS = ("reward", "loss", "throughput", "costs", "time", "data", "train", "val", "test", "discarded")
_OFFLINE_MODES = ("offline", "disabled", "dryrun")
_warned_unknown: set[str] = set()


def wandb_requested(report_metrics: list[str] | None) -> bool:
    """ART's rule: explicit "wandb", or the default (None) with WANDB_API_KEY set."""
    if report_metrics is None:
        return "WANDB_API_KEY" in os.environ
    return "wandb" in report_metrics


def _safe_id(name: str) -> str:
    """A W&B run id from a model name (W&B ids may not hold '/', '\\', '#', '?', '%', ':')."""
    return re.sub(r"[/\\#?%:]", "-", name)


class _Tracker:
    label = "tracker"

    def __init__(self) -> None:
        self.failures = 0
        self.off = False

    def _failed(self, what: str, e: BaseException, *, fatal: bool) -> None:
        self.failures += 1
        if fatal:
            self.off = True
        if self.failures == 1:
            log.warning("%s: %s failed (%s: %s); %s. Training is not affected.", self.label, what, type(e).__name__,
                        e, f"{self.label} logging is off for this run" if fatal else
                        "this row is not in it; later rows are tried again (further failures are counted at debug "
                        "level)")
        else:
            log.debug("%s: %s failed again (%d failures): %s", self.label, what, self.failures, e)


class WandbTracker(_Tracker):
    label = "W&B"

    def __init__(self, project: str, name: str, config: dict[str, Any], user_config: dict[str, Any]) -> None:
        super().__init__()
        self.project, self.name, self.config = project, name, dict(config)
        self.user_config = dict(user_config)
        self.run: Any = None
        self.defined: set[str] = set()
        if "WANDB_API_KEY" not in os.environ and os.environ.get("WANDB_MODE", "").lower() not in _OFFLINE_MODES:
            self.off = True
            log.warning("W&B: report_metrics asks for wandb but WANDB_API_KEY is not set; set it, or set "
                        "WANDB_MODE=offline to keep the run on disk without an account. W&B logging is off.")

    def _start(self) -> Any:
        if self.run is None and not self.off:
            try:
                import wandb

                self.run = wandb.init(project=self.project, name=self.name, id=_safe_id(self.name),
                                      config=self.config or None, resume="allow")
                wandb.define_metric("training_step")
                wandb.define_metric("time/wall_clock_sec")
                for section in _WANDB_SECTIONS:
                    wandb.define_metric(f"{section}/*", step_metric="training_step")
                self.defined = {"training_step", "time/wall_clock_sec"}
                if self.user_config:
                    self.run.config.update(self.user_config)
            except Exception as e:
                self._failed("starting the run", e, fatal=True)
        return self.run

    def log(self, row: dict[str, Any], step: int) -> None:
        del step  # W&B keeps its own monotonic step; `training_step` is the x-axis
        run = self._start()
        if run is None:
            return
        try:
            import wandb

            for key in row:
                if key.startswith("costs/") and key not in self.defined:  # nested cost keys, as ART defines them
                    wandb.define_metric(key, step_metric="training_step")
                    self.defined.add(key)
            run.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        except Exception as e:
            self._failed("logging a row", e, fatal=False)

    def update_config(self, user_config: dict[str, Any]) -> None:
        self.user_config = dict(user_config)
        self.config.update(user_config)
        if self.run is not None:
            try:
                self.run.config.update(self.user_config)
            except Exception as e:
                self._failed("updating the config", e, fatal=False)

    def close(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as e:
                self._failed("finishing the run", e, fatal=False)
            self.run = None


class TensorBoardTracker(_Tracker):
    label = "TensorBoard"

    def __init__(self, log_dir: Path, config: dict[str, Any]) -> None:
        super().__init__()
        self.log_dir, self.config = Path(log_dir), dict(config)
        self.writer: Any = None

    def _start(self) -> Any:
        if self.writer is None and not self.off:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(self.log_dir))
                if self.config:
                    self.writer.add_text("config", f"```\n{json.dumps(self.config, indent=1, default=str)}\n```")
            except Exception as e:
                self._failed("opening the log", e, fatal=True)
        return self.writer

    def log(self, row: dict[str, Any], step: int) -> None:
        writer = self._start()
        if writer is None:
            return
        try:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step",):
                    writer.add_scalar(key, value, global_step=step)
            writer.flush()
        except Exception as e:
            self._failed("logging a row", e, fatal=False)

    def update_config(self, config: dict[str, Any]) -> None:
        self.config.update(config)
        if self.writer is not None:
            self.writer.add_text("config", f"```\n{json.dumps(self.config, indent=1, default=str)}\n```")

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception as e:
                self._failed("closing the log", e, fatal=False)
            self.writer = None


class Trackers:
    """The trackers a model reports to; `log` never raises."""

    def __init__(self, report_metrics: list[str] | None, *, project: str, name: str, run: Path,
                 config: dict[str, Any], user_config: dict[str, Any] | None = None) -> None:
        self.items: list[_Tracker] = []
        for unknown in sorted(set(report_metrics or []) - set(KNOWN)):
            if unknown not in _warned_unknown:
                _warned_unknown.add(unknown)
                log.warning("report_metrics entry %r has no effect here; known trackers: %s", unknown, list(KNOWN))
        if wandb_requested(report_metrics):
            self.items.append(WandbTracker(project, name, config, user_config or {}))
        if report_metrics and "tensorboard" in report_metrics:
            self.items.append(TensorBoardTracker(run / TENSORBOARD_DIR, config))

    def log(self, row: dict[str, Any], step: int) -> None:
        for t in self.items:
            if not t.off:
                t.log(row, step)

    def update_config(self, user_config: dict[str, Any]) -> None:
        """The user's whole (merged) config, as `Model.update_wandb_config` keeps it."""
        for t in self.items:
            if not t.off:
                t.update_config(user_config)

    def wandb_run(self) -> Any:
        for t in self.items:
            if isinstance(t, WandbTracker):
                return t._start()
        return None

    def close(self) -> None:
        for t in self.items:
            t.close()
