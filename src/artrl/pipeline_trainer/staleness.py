"""The staleness rule of a pipelined run, and admission: which rollouts may start, and which groups may train.

Words, as ART's: the *policy version* of a rollout is the step of the checkpoint it
samples from (its lease); a train call *from* step `s` computes its gradient at the
weights of step `s` and produces step `s + 1`. A group that started on version `v` and
is trained from step `s` is `s - v` steps stale (0: on policy; artrl's `train/staleness`).
ART's history figure `train/steps_off_policy`, kept with ART's meaning, counts from the
step the call produces, one more (docs/pipeline.md).

**The rule** (`StalenessBound`, pure, table-tested): a group is stale at step `s` when
`v < s - max_steps_off_policy`; stale groups are never trained, only counted. This is
the guarantee, checked when the trainer takes a group.

**Admission** (`Admission`) saves the work that would be thrown away, and makes
`max_steps_off_policy=0` the synchronous loop. Pulled scenarios wait in pull order;
the first of them gets a ticket naming the step it is meant to be trained from, its
*target*: the earliest step that has fewer than `groups_per_step` live tickets, and
only once the policy version is at least `target - max_steps_off_policy` (`may_admit`);
then its rollout starts. A ticket is live until its group is dropped (the rollout
failed, the group was stale or had no reward spread), which frees the slot for the
next scenario. So at most `(bound + 1) * groups_per_step`
groups are in the making at once, and with bound 0 the groups of step `s` are
exactly the next `groups_per_step` scenarios, all sampled from version `s`.

    groups_per_step=2, bound=1, version 0 (start):
    scenario  0  1  2  3  4  5
    target    0  0  1  1  2  2
    may start now?  yes yes yes yes no(needs version 1) no

After a resume the targets start again at the resumed step, so a restarted run
admits the same `(bound + 1) * groups_per_step` groups, never a flood.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessBound:
    """`max_steps_off_policy` as a rule; `step` is always the step a train call starts from. None: no bound (ART
    0.5.23's `max_steps_off_policy=None`; `limit_mean_steps_off_policy` may still bound a group's mean)."""

    max_steps_off_policy: int | None

    def __post_init__(self) -> None:
        if self.max_steps_off_policy is not None and self.max_steps_off_policy < 0:
            raise ValueError(f"max_steps_off_policy={self.max_steps_off_policy}; it must be >= 0")

    def min_fresh_version(self, step: int) -> int | None:
        """The oldest policy version a group trained from `step` may have started on (None: any)."""
        return None if self.max_steps_off_policy is None else step - self.max_steps_off_policy

    def is_stale(self, version: int, step: int) -> bool:
        oldest = self.min_fresh_version(step)
        return oldest is not None and version < oldest

    def may_start(self, target_step: int, policy_version: int) -> bool:
        """Whether a rollout meant for `target_step` may start on `policy_version` (it would not be stale)."""
        oldest = self.min_fresh_version(target_step)
        return oldest is None or policy_version >= oldest


@dataclass(frozen=True)
class Ticket:
    """One admitted scenario: its order of admission (`seq`, the batch order) and its target step."""

    seq: int
    target: int


class Admission:
    """Tickets for scenarios; see the module docstring. Synchronous bookkeeping, no waiting here."""

    def __init__(self, bound: StalenessBound, groups_per_step: int, start_step: int) -> None:
        if groups_per_step <= 0:
            raise ValueError(f"groups_per_step={groups_per_step}; it must be > 0")
        self.bound = bound
        self.groups_per_step = groups_per_step
        self._live: Counter[int] = Counter()
        self._first_open = start_step
        self._seq = 0

    def admit(self) -> Ticket:
        target = self._first_open
        self._live[target] += 1
        while self._live[self._first_open] >= self.groups_per_step:
            self._first_open += 1
        ticket = Ticket(self._seq, target)
        self._seq += 1
        return ticket

    def set_groups_per_step(self, groups_per_step: int) -> None:
        """Admit `groups_per_step` per step from the first open step on (the tuner's `min_batch_size`); steps
        already full stay as they are."""
        if groups_per_step <= 0:
            raise ValueError(f"groups_per_step={groups_per_step}; it must be > 0")
        self.groups_per_step = groups_per_step
        while self._live[self._first_open] >= self.groups_per_step:
            self._first_open += 1

    def release(self, ticket: Ticket) -> None:
        """The ticket's group was dropped: its slot goes to the next scenario."""
        if self._live[ticket.target] <= 0:
            raise RuntimeError(f"ticket {ticket} released, but target step {ticket.target} has no live ticket: more "
                               "tickets released than admitted")
        self._live[ticket.target] -= 1
        self._first_open = min(self._first_open, ticket.target)

    def may_start(self, ticket: Ticket, policy_version: int) -> bool:
        return self.bound.may_start(ticket.target, policy_version)

    def may_admit(self, policy_version: int) -> bool:
        """Whether the next ticket (`admit()`) may start on `policy_version`. Tickets are issued only then, so a
        slot freed by a dropped group goes to the next scenario even while later scenarios already wait."""
        return self.bound.may_start(self._first_open, policy_version)

    def live(self, target: int) -> int:
        return self._live[target]
