"""The user-facing data model: `Trajectory` and `TrajectoryGroup` (ART's, field for field; the conversation types
`LegacyHistory` and `History` are history.py's).

Names, fields, defaults and methods follow OpenPipe ART, so ART rollout code runs unchanged:

* A `Trajectory` is one episode: `messages_and_choices` (OpenAI chat message
  dicts, and OpenAI `Choice` objects for the turns the policy sampled), a
  scalar `reward` (0.0 until set), free-form `metrics` / `metadata` / `logs`,
  the `tools` the agent was offered, `additional_histories` (other
  conversations of the same episode, e.g. a sub-agent's) and the policy
  versions it was sampled with.
* A `TrajectoryGroup` holds the trajectories that answer the same prompt; RL
  advantages are computed relative to the group. Built from awaitables
  (`TrajectoryGroup(rollout() for _ in range(8))`) it is itself awaitable: the
  rollouts run concurrently, report to the open gather (gather_context.py), and
  failures land in `exceptions` (ART's `PydanticException`: type, message, traceback).

Construction is lenient, as in ART: a rollout builds an empty `Trajectory()` first,
then appends choices and sets the reward. What protects training is checked where
the data is used: `revalidate` runs before a trajectory is logged or tokenized and
refuses a NaN/inf reward, an unknown role, non-string content or a malformed tool
call with a `TrajectoryError` that names the group, the trajectory and the field.
Construction still refuses what pydantic cannot read (e.g. `reward="high"`) and a
group member that is not a trajectory, with the same clear errors.
The rules for messages, roles and tool calls live in `chat/format.py`, shared
with the tokenizer and the inference server.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import time
import traceback
from collections.abc import AsyncGenerator, Awaitable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import pydantic
from openai.types.chat.chat_completion import Choice

from ..errors import TrajectoryError
from ..types import Messages, MessagesAndChoices, Tools
from . import branches
from .capture import clients as capture_http, core as capture
from .exchanges import TrajectoryExchanges, exchange_policy_token_spans, exchange_policy_versions
from .gather_context import GatherContext, cancel_and_wait, get_gather_context, record_metrics
from .history import LegacyHistory, check_conversation, construct, get_messages, record_histories
from .token_record import POLICY_TOKEN_SPANS_FIELD, POLICY_VERSION_FIELD
from .tokens import prepare, select_exchanges, tokenize_group, tokenize_trajectory

log = logging.getLogger(__name__)

# ART 0.5.23: any value, nested dicts and lists included (0.5.18 allowed scalars only). The Parquet log stores
# metadata as JSON text (a value JSON cannot write is written as its str()).
MetadataValue = Any

# --------------------------------------------------------------------------- models


class PydanticException(pydantic.BaseModel):
    """A failed rollout's exception kept as data (ART's `PydanticException`)."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, error: BaseException) -> "PydanticException":
        return cls(type=str(type(error)), message=str(error),
                   traceback="".join(traceback.format_exception(type(error), error, error.__traceback__)))


def choice_policy_version(item: Any) -> int | None:
    """The policy version (training step) that sampled `item`, as artrl's server records it on each choice;
    None for a message, or a choice from a server that does not say."""
    if isinstance(item, Choice):
        value = (item.model_extra or {}).get(POLICY_VERSION_FIELD)
    elif isinstance(item, dict):
        value = item.get(POLICY_VERSION_FIELD)
    else:
        value = getattr(item, POLICY_VERSION_FIELD, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def sampled_policy_versions(trajectory: Any) -> list[int]:
    """The policy version of every sampled turn of `trajectory` that records one, in order (its
    `additional_histories` after its own turns). A pipelined trainer reads a trajectory's staleness here:
    the first and last of them are its `initial_policy_version` and `final_policy_version`."""
    exchanges = getattr(trajectory, "exchanges", None)
    if exchanges:
        return exchange_policy_versions(exchanges)
    histories = [trajectory.messages_and_choices,
                 *(h.messages_and_choices for h in getattr(trajectory, "additional_histories", []))]
    versions = [choice_policy_version(item) for items in histories for item in items]
    return [v for v in versions if v is not None]


def policy_token_counts(trajectory: Any) -> dict[int, int] | None:
    """Sampled tokens of `trajectory` per policy version that sampled them, read from the `policy_token_spans` of
    its turns (recorded with in-flight adapter updates); None when no turn records spans. A pipelined trainer
    weights its staleness figures by these (pipeline_trainer/options.py)."""
    exchanges = getattr(trajectory, "exchanges", None)
    if exchanges:
        found = exchange_policy_token_spans(exchanges)
    else:
        histories = [trajectory.messages_and_choices,
                     *(h.messages_and_choices for h in getattr(trajectory, "additional_histories", []))]
        found = []
        for item in (item for items in histories for item in items):
            extra = (item.model_extra or {}) if isinstance(item, Choice) else item if isinstance(item, dict) else {}
            if isinstance(extra.get(POLICY_TOKEN_SPANS_FIELD), list) and extra[POLICY_TOKEN_SPANS_FIELD]:
                found.append(extra[POLICY_TOKEN_SPANS_FIELD])
    if not found:
        return None
    counts: dict[int, int] = {}
    for spans in found:
        for span in spans:
            version = span.get("policy_version") if isinstance(span, dict) else None
            if isinstance(version, int) and not isinstance(version, bool):
                counts[version] = counts.get(version, 0) + int(span["end_token"]) - int(span["start_token"])
    return counts or None


# --------------------------------------------------------------------------- conversations (ART's prefix rule)


class _Tokenizes:
    """ART's `tokenize()` / `tensorize()` of a Trajectory and a TrajectoryGroup: `art.tokenize([self], ...)[0]`
    (tokens.py), and that as torch tensors."""

    def tokenize(self, *, multi_history: bool = False, reconcile_text_equivalent_tokenizations: bool = False,
                 model: str | None = None, base_model: str | None = None, tokenizer: Any = None,
                 chat_template: str | None = None, chat_template_kwargs: Mapping[str, object] | None = None) -> Any:
        """This item as training sees it: a `TokenizedTrajectory` (with `multi_history=True` a
        `TokenizedMultiHistoryTrajectory`), or a group's `TokenizedTrajectoryGroup`."""
        tok, end_ids, label = prepare(model, base_model, tokenizer, chat_template, chat_template_kwargs)
        return self._tokenized(tok, end_ids, label, model, multi_history, reconcile_text_equivalent_tokenizations)

    def tensorize(self, *, multi_history: bool = False, reconcile_text_equivalent_tokenizations: bool = False,
                  model: str | None = None, base_model: str | None = None, tokenizer: Any = None,
                  chat_template: str | None = None, chat_template_kwargs: Mapping[str, object] | None = None,
                  device: Any = None) -> Any:
        """`tokenize()`, as torch tensors on `device` (a `TensorizedTrajectory`,
        `TensorizedMultiHistoryTrajectory` or `TensorizedTrajectoryGroup`)."""
        return self.tokenize(multi_history=multi_history,
                             reconcile_text_equivalent_tokenizations=reconcile_text_equivalent_tokenizations,
                             model=model, base_model=base_model, tokenizer=tokenizer, chat_template=chat_template,
                             chat_template_kwargs=chat_template_kwargs).tensorize(device=device)


class Trajectory(_Tokenizes, pydantic.BaseModel):
    """One episode of an agent: what it saw, what it sampled, and its reward.

    It holds either `exchanges` (what a capture scope recorded: `with art.Trajectory() as t:`,
    scopes.py) or legacy histories (`messages_and_choices`, `tools`, `additional_histories`),
    never both (ART 0.5.23's rule; refused with a TrajectoryError at construction and before use).
    """

    exchanges: TrajectoryExchanges = pydantic.Field(default_factory=TrajectoryExchanges)
    messages_and_choices: MessagesAndChoices = []
    tools: Tools | None = None
    additional_histories: list[LegacyHistory] = []
    reward: float = 0.0
    initial_policy_version: int | None = None
    final_policy_version: int | None = None
    metrics: dict[str, float | int | bool] = {}
    metadata: dict[str, MetadataValue] = {}
    logs: list[str] = []
    start_time: datetime = pydantic.Field(default_factory=datetime.now, exclude=True)

    def __init__(self, **data: Any) -> None:
        construct(super().__init__, type(self), data)

    @pydantic.model_validator(mode="after")
    def _one_representation(self) -> "Trajectory":
        self._check_one_representation()
        return self

    def _check_one_representation(self) -> None:
        if self.exchanges and (self.messages_and_choices or self.tools is not None or self.additional_histories):
            raise ValueError("a Trajectory holds either exchanges (captured by `with art.Trajectory() as t:`) or "
                             "legacy histories (messages_and_choices, tools, additional_histories), never both; "
                             f"this one has {sum(len(v) for _, v in self.exchanges)} exchanges and "
                             f"{len(self.messages_and_choices)} messages_and_choices, tools "
                             f"{'set' if self.tools is not None else 'None'}, "
                             f"{len(self.additional_histories)} additional_histories. Put them in two trajectories.")

    # ART 0.5.23's capture scope ---------------------------------------
    def __enter__(self) -> "Trajectory":
        """Open a capture scope: requests the agent makes to a model in this context are recorded into `exchanges`."""
        capture_http.open_scope(capture.TrajectoryScope(self))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        scope = capture.current_scope()
        if scope is None or scope.trajectory is not self:
            raise RuntimeError("Trajectory capture scopes must exit in stack order: this trajectory is not the "
                               "innermost open scope of this context.")
        capture_http.close_scope(scope)
        self.finish()

    def validate_fields(self) -> None:
        """Check every field before the trajectory is used; raises TrajectoryError naming the first bad one.

        Called by `revalidate` (before logging and tokenizing), not at construction:
        ART-style rollouts build a Trajectory first and then append choices and set the reward.
        Dict-shaped choices become `Choice` objects and message objects become dicts here.
        """
        if not isinstance(self.exchanges, TrajectoryExchanges):
            raise TrajectoryError(f"Trajectory.exchanges has type {type(self.exchanges).__name__}; expected "
                                  "TrajectoryExchanges.")
        try:
            self._check_one_representation()
        except ValueError as e:
            raise TrajectoryError(str(e)) from None
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
        check_conversation(self, "Trajectory")
        for k, h in enumerate(self.additional_histories):
            if not isinstance(h, LegacyHistory):
                raise TrajectoryError(f"Trajectory.additional_histories[{k}] has type {type(h).__name__}; "
                                      "expected a LegacyHistory (messages_and_choices, tools).")
            check_conversation(h, f"Trajectory.additional_histories[{k}]")

    # ART's methods -----------------------------------------------------
    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> "Trajectory":
        """Set `metrics["duration"]` to the seconds since `start_time`."""
        self.metrics["duration"] = (datetime.now() - self.start_time).total_seconds()
        return self

    @asynccontextmanager
    async def track_duration(self, metric_name: str) -> AsyncGenerator[None, None]:
        """Add the seconds spent inside the block to `metrics[f"{metric_name}_duration"]`."""
        start = time.monotonic()
        try:
            yield
        finally:
            key = f"{metric_name}_duration"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.monotonic() - start

    def __str__(self) -> str:
        return f"Trajectory(reward={self.reward}, metrics={self.metrics}, metadata={self.metadata})"

    # ART 0.5.23's protocol-native histories (histories.py). `model` selects exchanges by model name (exact, else
    # a shell pattern); reconcile_text_equivalent_tokenizations=True merges text-equal turns (histories.py).
    def chat_completions_history(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.chat_completions_history(self, model, reconcile_text_equivalent_tokenizations)

    def chat_completions_histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.chat_completions_histories(self, model, reconcile_text_equivalent_tokenizations)

    def anthropic_messages_history(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.anthropic_messages_history(self, model, reconcile_text_equivalent_tokenizations)

    def anthropic_messages_histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.anthropic_messages_histories(self, model, reconcile_text_equivalent_tokenizations)

    def responses_history(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.responses_history(self, model, reconcile_text_equivalent_tokenizations)

    def responses_histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.responses_histories(self, model, reconcile_text_equivalent_tokenizations)

    def completions_token_history(self, *, model: str | None = None) -> Any:
        return branches.completions_token_history(self, model)

    def completions_token_histories(self, *, model: str | None = None) -> Any:
        return branches.completions_token_histories(self, model)

    def completions_string_history(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.completions_string_history(self, model, reconcile_text_equivalent_tokenizations)

    def completions_string_histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.completions_string_histories(self, model, reconcile_text_equivalent_tokenizations)

    def history(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.trajectory_history(self, model, reconcile_text_equivalent_tokenizations)

    def histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return branches.trajectory_histories(self, model, reconcile_text_equivalent_tokenizations)

    def messages(self) -> Messages:
        """The chat messages of the conversation. For captured exchanges (ART's rule): the one history
        `history()` gives, as Chat Completions messages, so Responses and Anthropic Messages exchanges convert
        too; a ValueError for several protocols, models or branches, and for Completions (no chat messages)."""
        if self.exchanges:
            return branches.trajectory_messages(self)
        return get_messages(self.messages_and_choices)

    def conversations(self, model: str | None = None, where: str = "trajectory",
                      reconcile: tuple[Any, frozenset[int]] | None = None) -> list[tuple[LegacyHistory, str]]:
        """The conversations training reads, each with a name for errors: its exchanges of `model` (all for None)
        filed into conversations (history.record_histories; `reconcile`: the tokenizer's encode and end-of-turn
        ids, ART's reconcile_text_equivalent_tokenizations), else its own messages and its additional histories."""
        if self.exchanges:
            return record_histories(select_exchanges(self.exchanges, model), where, reconcile)
        own = LegacyHistory(messages_and_choices=self.messages_and_choices, tools=self.tools)
        return [(own, where), *((h, f"{where}, additional_histories[{k}]")
                                for k, h in enumerate(self.additional_histories))]

    def _tokenized(self, tokenizer: Any, end_ids: frozenset[int], label: str, model: str | None,
                   multi_history: bool, reconcile: bool) -> Any:
        return tokenize_trajectory(self, tokenizer, end_ids, label, model, multi_history, "trajectory", reconcile)

    def for_logging(self) -> dict[str, Any]:
        """A plain dict for console or file logs; each message says whether it was sampled (`trainable`).
        A trajectory of exchanges is its JSON dump (as ART's)."""
        if self.exchanges:
            return self.model_dump(mode="json", exclude={"start_time"})
        messages = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice):
                messages.append({**item.message.to_dict(), "trainable": True})
            else:
                message = item.model_dump(exclude_none=True) if isinstance(item, pydantic.BaseModel) else dict(item)
                messages.append({**message, "trainable": False})
        return {
            "reward": self.reward,
            "initial_policy_version": self.initial_policy_version,
            "final_policy_version": self.final_policy_version,
            "metrics": self.metrics,
            "metadata": self.metadata,
            "messages": messages,
            "tools": self.tools,
            "logs": self.logs,
        }


def revalidate(traj: Any, where: str) -> None:
    """Check a trajectory before it is logged or trained on; errors start with `where`."""
    if not isinstance(traj, Trajectory):
        raise TrajectoryError(f"{where} has type {type(traj).__name__}; expected a Trajectory.")
    try:
        traj.validate_fields()
    except TrajectoryError as e:
        raise TrajectoryError(f"{where}: {e}") from None


# --------------------------------------------------------------------------- groups


class TrajectoryGroup(_Tokenizes, pydantic.BaseModel):
    """Trajectories that answer the same prompt; advantages are relative to the group.

    `TrajectoryGroup(trajectories)` builds a group at once; exceptions among the
    items (failed rollouts) go to `exceptions`. A group may be empty: training
    skips it and counts it (`data/groups_skipped_empty`).
    `TrajectoryGroup(awaitables)` returns an awaitable that runs the rollouts
    concurrently (inside `gather_trajectory_groups`: under its concurrency limit
    and exception budget) and gives the group, trajectories in the order given.
    `copy.copy` copies the lists and dicts (not the trajectories); `copy.deepcopy`
    copies everything.
    """

    trajectories: list[Trajectory]
    exceptions: list[PydanticException] = []
    metadata: dict[str, MetadataValue] = {}
    metrics: dict[str, float | int | bool] = {}
    logs: list[str] = []

    _built: bool = pydantic.PrivateAttr(default=False)

    def __new__(cls, trajectories: Iterable[Any] | None = None, *, exceptions: Iterable[Any] = (),
                metadata: dict[str, MetadataValue] | None = None, metrics: dict[str, float | int | bool] | None = None,
                logs: list[str] | None = None) -> Any:
        items = list(trajectories) if trajectories is not None else []
        if any(_is_pending(item) for item in items):
            return PendingGroup(cls, items, list(exceptions), metadata, metrics, logs)
        group = super().__new__(cls)
        group._build(items, list(exceptions), metadata, metrics, logs)
        return group

    def __init__(self, trajectories: Iterable[Any] | None = None, *, exceptions: Iterable[Any] = (),
                 metadata: dict[str, MetadataValue] | None = None, metrics: dict[str, float | int | bool] | None = None,
                 logs: list[str] | None = None) -> None:
        # __new__ has built the group already: it had to read `trajectories` (maybe a generator,
        # readable once) to see whether they are awaitables.
        if not self._built:
            self._build(list(trajectories or []), list(exceptions), metadata, metrics, logs)

    def _build(self, items: list[Any], exceptions: list[Any], metadata: dict[str, Any] | None,
               metrics: dict[str, Any] | None, logs: list[str] | None) -> None:
        trajectories: list[Trajectory] = []
        failures: list[PydanticException] = []
        for i, item in enumerate(items):
            if isinstance(item, Trajectory):
                trajectories.append(item)
            elif isinstance(item, BaseException):
                failures.append(PydanticException.from_exception(item))
            elif isinstance(item, dict):
                try:
                    trajectories.append(Trajectory(**item))
                except TrajectoryError as e:
                    raise TrajectoryError(f"TrajectoryGroup.trajectories[{i}]: {e}") from None
            else:
                raise TrajectoryError(f"TrajectoryGroup.trajectories[{i}] has type {type(item).__name__}; expected "
                                      "a Trajectory (or the exception of a failed rollout).")
        failures += [_exception_record(e, i) for i, e in enumerate(exceptions)]
        try:
            super().__init__(trajectories=trajectories, exceptions=failures,
                             metadata=metadata if metadata is not None else {},
                             metrics=metrics if metrics is not None else {}, logs=logs if logs is not None else [])
        except pydantic.ValidationError as e:
            fields = ", ".join(".".join(str(p) for p in err["loc"]) for err in e.errors())
            raise TrajectoryError(f"TrajectoryGroup is malformed (fields: {fields}): {e}") from None
        self._built = True

    def log(self, message: str) -> None:
        self.logs.append(message)

    def _tokenized(self, tokenizer: Any, end_ids: frozenset[int], label: str, model: str | None,
                   multi_history: bool, reconcile: bool) -> Any:
        return tokenize_group(self, tokenizer, end_ids, label, model, multi_history, "group", reconcile)

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __copy__(self) -> "TrajectoryGroup":
        """New lists and dicts holding the same trajectories and exceptions (ART's copy)."""
        group = type(self)(self.trajectories[:], metadata=self.metadata.copy(), metrics=self.metrics.copy(),
                           logs=self.logs[:])
        group.exceptions = self.exceptions[:]
        return group

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> "TrajectoryGroup":
        memo = {} if memo is None else memo
        if id(self) in memo:
            return memo[id(self)]
        group = type(self)([])
        memo[id(self)] = group  # before copying the members, so a cycle back to the group resolves
        group.trajectories = copy.deepcopy(self.trajectories, memo)
        group.exceptions = copy.deepcopy(self.exceptions, memo)
        group.metadata = copy.deepcopy(self.metadata, memo)
        group.metrics = copy.deepcopy(self.metrics, memo)
        group.logs = copy.deepcopy(self.logs, memo)
        return group


def _exception_record(error: Any, index: int) -> PydanticException:
    if isinstance(error, PydanticException):
        return error
    if isinstance(error, BaseException):
        return PydanticException.from_exception(error)
    if isinstance(error, dict):
        try:
            return PydanticException.model_validate(error)
        except pydantic.ValidationError as e:
            raise TrajectoryError(f"TrajectoryGroup.exceptions[{index}] is malformed: {e}") from None
    raise TrajectoryError(f"TrajectoryGroup.exceptions[{index}] has type {type(error).__name__}; expected an "
                          "exception (or a PydanticException).")


def _is_pending(item: Any) -> bool:
    return isinstance(item, Awaitable) and not isinstance(item, (Trajectory, BaseException))


class PendingGroup:
    """What `TrajectoryGroup(awaitables)` returns: await it for the group.

    `_num_trajectories` tells the gather's progress bar how many rollouts to expect (ART's name).
    """

    def __init__(self, cls: type[TrajectoryGroup], items: list[Any], exceptions: list[Any],
                 metadata: dict[str, Any] | None, metrics: dict[str, Any] | None, logs: list[str] | None) -> None:
        self._cls = cls
        self._items = items
        self._exceptions = exceptions
        self._fields = {"metadata": metadata, "metrics": metrics, "logs": logs}
        self._num_trajectories = len(items)

    def __await__(self):
        return self._collect().__await__()

    def close(self) -> None:
        """Close the rollout coroutines of a group that will never be awaited (e.g. a skipped batch)."""
        for item in self._items:
            if inspect.iscoroutine(item):
                item.close()

    async def _collect(self) -> TrajectoryGroup:
        context = get_gather_context()
        results: list[Trajectory | None] = [None] * len(self._items)
        exceptions = list(self._exceptions)
        index: dict[asyncio.Future[Any], int] = {}
        for i, item in enumerate(self._items):
            if _is_pending(item):
                index[asyncio.ensure_future(_run_rollout(item, context))] = i
            elif isinstance(item, BaseException):
                exceptions.append(item)
            else:
                results[i] = item
        pending = set(index)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.exception()  # retrieved now, even if a failure below stops the loop
                for task in sorted(done, key=index.__getitem__):
                    try:
                        trajectory = task.result()
                        if not isinstance(trajectory, Trajectory):
                            raise TypeError(f"rollout {index[task]} returned {type(trajectory).__name__}; a rollout "
                                            "must return a Trajectory")
                    except Exception as e:  # noqa: BLE001 - kept in the group and counted against max_exceptions
                        log.debug("rollout %d failed", index[task], exc_info=True)
                        exceptions.append(e)
                        if context.record_exception(e):
                            raise
                        continue
                    results[index[task]] = trajectory
                    record_metrics(context, trajectory)
                    context.update_pbar(n=1)
        finally:
            await cancel_and_wait(pending)
        return self._cls([t for t in results if t is not None], exceptions=exceptions, **self._fields)


async def _run_rollout(rollout: Awaitable[Any], context: GatherContext) -> Any:
    if context.semaphore is None:
        return await rollout
    async with context.semaphore:
        return await rollout
