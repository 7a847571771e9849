"""The user-facing data model: `Trajectory`, `History`, `TrajectoryGroup`.

Names and fields follow OpenPipe ART, so ART rollout code runs unchanged:

* A `Trajectory` is one episode: `messages_and_choices` (OpenAI chat message
  dicts, and OpenAI `Choice` objects for the turns the policy sampled), a
  scalar `reward`, free-form `metrics` / `metadata` / `logs`, the `tools` the
  agent was offered, and `additional_histories` (other conversations that
  belong to the same episode, e.g. a sub-agent's).
* A `TrajectoryGroup` holds the trajectories that answer the same prompt; RL
  advantages are computed relative to the group. Built from awaitables
  (`TrajectoryGroup(rollout() for _ in range(8))`) it is itself awaitable, and
  `gather_trajectory_groups` runs many such groups concurrently.

What we add to ART's model: validation at construction. A NaN/inf reward, an
unknown role, non-string content, a malformed tool call or an empty group is
refused with a `TrajectoryError` that names the field (and, inside a group,
the trajectory's index), instead of surfacing later as a deep traceback or as
silent training on garbage. The rules for messages, roles and tool calls live
in `chat_format.py`, shared with the tokenizer and the inference server.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable
from typing import Any

import pydantic
from openai.types.chat.chat_completion import Choice

# The validation rules are chat_format's; the old private names stay importable from here.
from .chat_format import VALID_ROLES, Message, MessageOrChoice, message_of  # noqa: F401
from .chat_format import check_content as _check_content  # noqa: F401
from .chat_format import check_item as _check_item  # noqa: F401
from .chat_format import check_messages as _check_messages
from .chat_format import check_tool_calls as _check_tool_calls  # noqa: F401
from .chat_format import check_tools as _check_tools
from .errors import TrajectoryError

MessagesAndChoices = list[MessageOrChoice]
Tools = list[dict[str, Any]]

# --------------------------------------------------------------------------- models


class History(pydantic.BaseModel):
    """Another conversation that belongs to the same episode (ART's `History`)."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: MessagesAndChoices
    tools: Tools | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as e:
            raise TrajectoryError(f"History is malformed: {e}") from None
        self.messages_and_choices = _check_messages(self.messages_and_choices, "History.messages_and_choices")
        _check_tools(self.tools, "History.tools")

    def messages(self) -> list[Message]:
        return [message_of(m) for m in self.messages_and_choices]


class Trajectory(pydantic.BaseModel):
    """One episode of an agent: what it saw, what it sampled, and its reward."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: MessagesAndChoices
    tools: Tools | None = None
    additional_histories: list[History] = []
    reward: float
    metrics: dict[str, float | int | bool] = {}
    metadata: dict[str, Any] = {}
    logs: list[str] = []
    start_time: float = pydantic.Field(default_factory=time.time)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as e:
            fields = ", ".join(".".join(str(p) for p in err["loc"]) for err in e.errors())
            raise TrajectoryError(f"Trajectory is malformed (fields: {fields}): {e}") from None
        self.validate_fields()

    def validate_fields(self) -> None:
        """(Re)check every field; raises TrajectoryError naming the first bad one.

        Called at construction and again by the trainer before tokenizing, because ART-style
        rollouts build a Trajectory first and then append choices and set the reward.
        """
        reward = self.reward
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TrajectoryError(f"Trajectory.reward is {reward!r:.80} ({type(reward).__name__}); set it to a "
                                  "finite number.")
        if not math.isfinite(reward):
            raise TrajectoryError(
                f"Trajectory.reward is {reward}; rewards must be finite numbers. "
                "Give failed episodes a finite (e.g. minimum) reward, or drop them."
            )
        if not isinstance(self.metrics, dict):
            raise TrajectoryError(f"Trajectory.metrics must be a dict, got {type(self.metrics).__name__}.")
        for key, value in self.metrics.items():
            if not isinstance(value, (int, float)):
                raise TrajectoryError(f"Trajectory.metrics[{key!r}] is {value!r:.80}; metrics must be numbers "
                                      "(put other values in metadata).")
            if isinstance(value, float) and not math.isfinite(value):
                raise TrajectoryError(f"Trajectory.metrics[{key!r}] is {value}; metrics must be finite.")
        self.messages_and_choices = _check_messages(self.messages_and_choices, "Trajectory.messages_and_choices")
        _check_tools(self.tools, "Trajectory.tools")
        for k, h in enumerate(self.additional_histories):
            if not isinstance(h, History):
                raise TrajectoryError(f"Trajectory.additional_histories[{k}] has type {type(h).__name__}; "
                                      "expected a History.")
            where = f"Trajectory.additional_histories[{k}]"
            h.messages_and_choices = _check_messages(h.messages_and_choices, f"{where}.messages_and_choices")
            _check_tools(h.tools, f"{where}.tools")

    # ART conveniences ---------------------------------------------------
    def messages(self) -> list[Message]:
        return [message_of(m) for m in self.messages_and_choices]

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> "Trajectory":
        self.metrics.setdefault("duration", time.time() - self.start_time)
        return self

    def histories(self) -> list[History]:
        """The main conversation followed by the additional histories."""
        return [History(messages_and_choices=self.messages_and_choices, tools=self.tools), *self.additional_histories]

    def for_logging(self) -> dict[str, Any]:
        """A JSON-serialisable dict (Choices become dicts) for trajectory logs."""

        def dump(items: MessagesAndChoices) -> list[dict[str, Any]]:
            return [i.model_dump(mode="json") if isinstance(i, Choice) else i for i in items]

        return {
            "reward": self.reward,
            "metrics": self.metrics,
            "metadata": _jsonable(self.metadata),
            "messages_and_choices": dump(self.messages_and_choices),
            "tools": self.tools,
            "additional_histories": [
                {"messages_and_choices": dump(h.messages_and_choices), "tools": h.tools}
                for h in self.additional_histories
            ],
            "logs": self.logs,
        }


def revalidate(traj: Any, where: str) -> None:
    """Check a trajectory again before it is logged or trained on; errors start with `where`.

    Construction-time validation is not enough: ART-style rollouts create the Trajectory
    first, then append the sampled choices and set the reward.
    """
    if not isinstance(traj, Trajectory):
        raise TrajectoryError(f"{where} has type {type(traj).__name__}; expected a Trajectory.")
    try:
        traj.validate_fields()
    except TrajectoryError as e:
        raise TrajectoryError(f"{where}: {e}") from None


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


class TrajectoryGroup(pydantic.BaseModel):
    """Trajectories that answer the same prompt; advantages are relative to the group.

    `TrajectoryGroup(iterable_of_trajectories)` builds a group at once.
    `TrajectoryGroup(iterable_of_awaitables)` returns an awaitable that runs the
    rollouts concurrently and collects failures into `exceptions` (counted and
    reported by `gather_trajectory_groups`).
    """

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory]
    exceptions: list[str] = []

    def __new__(cls, trajectories: Any = None, *, exceptions: list[Any] | None = None, **_: Any):  # type: ignore[misc]
        items = list(trajectories) if trajectories is not None else []
        if items and any(isinstance(t, Awaitable) and not isinstance(t, Trajectory) for t in items):
            from .gather import collect_group

            return collect_group(items, list(exceptions or []))
        obj = super().__new__(cls)
        obj._pending_items = items  # consumed by __init__ (a generator can only be read once)
        return obj

    def __init__(self, trajectories: Any = None, *, exceptions: list[Any] | None = None, **_: Any) -> None:
        items = self.__dict__.pop("_pending_items", None)
        if items is None:
            items = list(trajectories) if trajectories is not None else []
        excs = [_format_exception(e) for e in (exceptions or [])]
        trajs: list[Trajectory] = []
        for i, t in enumerate(items):
            if isinstance(t, BaseException):
                excs.append(_format_exception(t))
            elif isinstance(t, Trajectory):
                trajs.append(t)
            elif isinstance(t, dict):
                try:
                    trajs.append(Trajectory(**t))
                except TrajectoryError as e:
                    raise TrajectoryError(f"TrajectoryGroup.trajectories[{i}]: {e}") from None
            else:
                raise TrajectoryError(
                    f"TrajectoryGroup.trajectories[{i}] has type {type(t).__name__}; expected a Trajectory."
                )
        if not trajs and not excs:
            raise TrajectoryError(
                "TrajectoryGroup.trajectories is empty; a group needs at least one trajectory "
                "(or the exceptions of its failed rollouts)."
            )
        super().__init__(trajectories=trajs, exceptions=excs)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):  # type: ignore[override]
        return iter(self.trajectories)


def _format_exception(e: Any) -> str:
    if isinstance(e, BaseException):
        return f"{type(e).__name__}: {e}"
    return str(e)

