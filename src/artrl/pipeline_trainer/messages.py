"""What the rollout stage sends the training stage (explicit messages, never a bare None).

* `GroupReady`: a finished group with its ticket (admission), the scenario's index in the
  scenario stream, the policy version it started on and its timings.
* `ScenariosExhausted`: every worker has finished and the scenarios are used up; the trainer
  trains what it holds and stops.

A failed rollout sends nothing: its worker frees the ticket and counts the failure itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..trajectories.data import TrajectoryGroup
from .staleness import Ticket


@dataclass
class GroupReady:
    group: TrajectoryGroup
    ticket: Ticket
    scenario_index: int
    initial_version: int
    rollout_s: float
    actor_idle_s: float


@dataclass(frozen=True)
class ScenariosExhausted:
    pass


@dataclass(frozen=True)
class EvalStop:
    """Sent to the eval stage when training has ended: run what is queued, then return."""


Message = GroupReady | ScenariosExhausted
