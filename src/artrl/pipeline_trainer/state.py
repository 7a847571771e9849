"""A pipelined run's state: what the stages share, and what survives a restart.

The persisted part lives in the model's `state.json` under ART's key
`_pipeline_trainer` (written by `Model.merge_state`, atomically: temp file + rename),
with ART's fields, so a run resumed by ART or by artrl reads the same thing:

    scenario_offset            scenarios pulled from the stream so far (a resumed run skips them)
    total_scenarios_consumed   the same count over the run's life
    training_step              the step the state was written at
    last_eval_step             the last step an eval was scheduled for
    completed_eval_steps       steps whose eval finished

**A scenario counts when it is pulled**, as in ART: the state written before every
train call holds every scenario pulled so far, and every group of that call was
pulled before it, so a resumed run never trains a scenario twice. Scenarios pulled
but not yet trained when the run stopped are not rolled out again (ART's rule too).
Fields are checked on load: a wrong type is a ConfigError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

PIPELINE_STATE_KEY = "_pipeline_trainer"


@dataclass
class PipelineState:
    """Shared by the stages of one `PipelineTrainer.train()` call."""

    policy_version: int = 0  # the newest trained step; rollouts lease it
    next_training_step: int = 0  # the step being trained (= policy_version between calls)
    scenario_offset: int = 0
    total_scenarios_consumed: int = 0
    last_eval_step: int = 0
    completed_eval_steps: set[int] = field(default_factory=set)
    discarded_stale_groups: int = 0
    failed_rollouts: int = 0
    done: bool = False

    def payload(self, training_step: int) -> dict[str, Any]:
        """What is written under PIPELINE_STATE_KEY."""
        return {"scenario_offset": self.scenario_offset, "total_scenarios_consumed": self.total_scenarios_consumed,
                "training_step": training_step, "last_eval_step": self.last_eval_step,
                "completed_eval_steps": sorted(self.completed_eval_steps)}


@dataclass(frozen=True)
class SavedState:
    """The persisted fields, checked."""

    scenario_offset: int = 0
    total_scenarios_consumed: int = 0
    training_step: int | None = None
    last_eval_step: int = 0
    completed_eval_steps: frozenset[int] = frozenset()

    @classmethod
    def from_state_file(cls, state: dict[str, Any] | None) -> "SavedState":
        raw = (state or {}).get(PIPELINE_STATE_KEY) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"state.json[{PIPELINE_STATE_KEY!r}] is a {type(raw).__name__}, not an object; "
                              "remove that key to start the pipeline's bookkeeping over (resume=False ignores it).")

        def count(name: str, default: int | None) -> int | None:
            value = raw.get(name, default)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"state.json[{PIPELINE_STATE_KEY!r}][{name!r}] is {value!r}; expected an int >= 0. "
                                  "Fix or remove it, or pass resume=False.")
            return value

        offset = count("scenario_offset", 0)
        steps = raw.get("completed_eval_steps") or []
        if not isinstance(steps, list) or any(isinstance(s, bool) or not isinstance(s, int) for s in steps):
            raise ConfigError(f"state.json[{PIPELINE_STATE_KEY!r}]['completed_eval_steps'] is {steps!r:.80}; "
                              "expected a list of ints. Fix or remove it, or pass resume=False.")
        return cls(scenario_offset=offset or 0,
                   total_scenarios_consumed=count("total_scenarios_consumed", offset) or 0,
                   training_step=count("training_step", None), last_eval_step=count("last_eval_step", 0) or 0,
                   completed_eval_steps=frozenset(steps))
