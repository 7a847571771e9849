"""The user-facing data model: `Trajectory`, `TrajectoryGroup`, `LegacyHistory`, `History` (ART's, field for field).

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
import warnings
from collections.abc import AsyncGenerator, Awaitable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import pydantic
from openai.types.chat.chat_completion import Choice

from .capture import core as capture, clients as capture_http
from ..chat.format import check_messages, check_tools
from ..errors import TrajectoryError
from .exchanges import (ChatCompletionsExchange, CompletionsExchange, MessagesExchange,  # noqa: F401 - ART's
                        ResponsesExchange, TrajectoryExchanges, exchange_policy_token_spans,
                        exchange_policy_versions)  # art.trajectories names
from .gather_context import GatherContext, cancel_and_wait, get_gather_context, record_metrics
from ..types import Messages, MessagesAndChoices, Tools

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


#: The field of a sampled choice, set by artrl's server, naming the policy version (training step) that
#: sampled it (docs/token-record.md).
POLICY_VERSION_FIELD = "policy_version"


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


#: ART's field of a sampled choice with in-flight adapter updates (`rollout_weight_update_mode="in_flight_lora"`):
#: `[{start_token, end_token, policy_version, ...}, ...]`, the version that sampled each run of its tokens.
POLICY_TOKEN_SPANS_FIELD = "policy_token_spans"


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


def get_messages(messages_and_choices: MessagesAndChoices) -> Messages:
    """The chat messages of a conversation, as ART gives them to a chat template.

    A Choice becomes its assistant message (`content` "" when absent, `tool_calls` when
    present); a message whose `content` is None gets "".
    """
    messages: Messages = []
    for item in messages_and_choices:
        if isinstance(item, Choice):
            message: dict[str, Any] = {"role": "assistant", "content": item.message.content or ""}
            if item.message.tool_calls:
                message["tool_calls"] = [call.model_dump(mode="json") for call in item.message.tool_calls]
            messages.append(message)  # type: ignore[arg-type]
        else:
            message = dict(item)
            if message.get("content") is None:
                message["content"] = ""
            messages.append(message)  # type: ignore[arg-type]
    return messages


class LegacyHistory(pydantic.BaseModel):
    """Another conversation that belongs to the same episode, as messages and sampled choices.

    ART 0.5.23's `LegacyHistory`, the element type of `Trajectory.additional_histories`; ART 0.5.18
    called it `History` (that spelling still builds one, see `History`).
    """

    messages_and_choices: MessagesAndChoices
    tools: Tools | None = None

    def __init__(self, **data: Any) -> None:
        _construct(super().__init__, type(self), data)

    def messages(self) -> Messages:
        return get_messages(self.messages_and_choices)

    def as_chat_completions_history(self, *, model: str | None = None) -> Any:
        """This conversation as a `ChatCompletionsHistory` of `model` (its messages, no sources)."""
        return _protocol_histories().legacy_as_chat_completions_history(self, model=model)

    def tokenize(self, *, model: str, base_model: str | None = None, tokenizer: Any = None,
                 chat_template: str | None = None, chat_template_kwargs: Mapping[str, object] | None = None) -> Any:
        """This conversation's one token sequence (a `TokenizedHistory` named `model`), as `art.tokenize` makes it:
        sampled turns on their token record, turns without one rendered (tokens.py)."""
        return _protocol_histories().tokenize_legacy_history(self, model=model, base_model=base_model,
                                                             tokenizer=tokenizer, chat_template=chat_template,
                                                             chat_template_kwargs=chat_template_kwargs)

    def tensorize(self, *, model: str, base_model: str | None = None, tokenizer: Any = None,
                  chat_template: str | None = None, chat_template_kwargs: Mapping[str, object] | None = None,
                  device: Any = None) -> Any:
        """`tokenize()`, as torch tensors on `device` (a `TensorizedHistory`)."""
        return self.tokenize(model=model, base_model=base_model, tokenizer=tokenizer, chat_template=chat_template,
                             chat_template_kwargs=chat_template_kwargs).tensorize(device=device)


_warned_legacy_history = False


def _is_legacy_history_data(data: Any) -> bool:
    return isinstance(data, dict) and "messages_and_choices" in data and "model" not in data


def _legacy_history_notice() -> None:
    global _warned_legacy_history
    if not _warned_legacy_history:
        _warned_legacy_history = True
        warnings.warn("History(messages_and_choices=..., tools=...) is ART 0.5.18's spelling; it builds a "
                      "LegacyHistory, ART 0.5.23's name for it (History is now the base of the protocol-native "
                      "histories, with a `model` field).", DeprecationWarning, stacklevel=3)


class History(pydantic.BaseModel):
    """ART 0.5.23's `History`: the base of the protocol-native views of one tokenizable sequence.

    It holds the `model` the sequence was sampled from (extra fields are refused, as in ART).
    ART 0.5.18's `History` was the conversation that is now `LegacyHistory`; built with that
    version's keywords (`History(messages_and_choices=..., tools=...)`, or `History.model_validate`
    of such a dict) it returns a `LegacyHistory`, with one DeprecationWarning per process, so
    0.5.18 programs keep running. Such an object is not an instance of `History` (as in 0.5.23).
    """

    model_config = pydantic.ConfigDict(extra="forbid")

    model: str | None

    def __new__(cls, *args: Any, **data: Any) -> Any:
        if cls is History and not args and _is_legacy_history_data(data):
            _legacy_history_notice()
            return LegacyHistory(**data)
        return super().__new__(cls)

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if cls is History and _is_legacy_history_data(obj):
            _legacy_history_notice()
            return LegacyHistory.model_validate(obj, *args, **kwargs)
        return super().model_validate(obj, *args, **kwargs)

    def as_chat_completions_history(self) -> Any:
        raise ValueError(f"{type(self).__name__} cannot be represented as Chat Completions")

    def tokenize(self, *, base_model: str | None = None, tokenizer: Any = None, chat_template: str | None = None,
                 chat_template_kwargs: Mapping[str, object] | None = None) -> Any:
        """This history's one token sequence (a `TokenizedHistory`), as `art.tokenize` makes it: the exchanges
        its sources cite are trained on their token record (histories.py)."""
        return _protocol_histories().tokenize_history(self, base_model=base_model, tokenizer=tokenizer,
                                                      chat_template=chat_template,
                                                      chat_template_kwargs=chat_template_kwargs)

    def tensorize(self, *, base_model: str | None = None, tokenizer: Any = None, chat_template: str | None = None,
                  chat_template_kwargs: Mapping[str, object] | None = None, device: Any = None) -> Any:
        """`tokenize()`, as torch tensors on `device` (a `TensorizedHistory`)."""
        return self.tokenize(base_model=base_model, tokenizer=tokenizer, chat_template=chat_template,
                             chat_template_kwargs=chat_template_kwargs).tensorize(device=device)


# --------------------------------------------------------------------------- conversations (ART's prefix rule)


def _normal(value: Any) -> Any:
    """A message without the keys that say nothing (None values, empty tool_calls); content None -> ""."""
    if isinstance(value, dict):
        out = {k: _normal(v) for k, v in value.items() if v is not None and not (k == "tool_calls" and v == [])}
        if "role" in out:
            out.setdefault("content", "")
        return out
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def continues(history: Trajectory | LegacyHistory, messages: list[Any], tools: Any) -> bool:
    """Whether a request with `messages` and `tools` continues `history` (its messages so far begin them)."""
    so_far = history.messages()
    if len(so_far) > len(messages):
        return False
    try:
        same = _normal(so_far) == _normal([dict(m) for m in messages[:len(so_far)]])
    except (TypeError, ValueError):
        return False
    return same and (history.tools == tools or (not so_far and history.tools is None))


def file_turn(main: Trajectory | LegacyHistory, others: list[LegacyHistory], messages: list[Any], tools: Any,
              choice: Choice) -> None:
    """Append a chat turn (its request's new messages, then the sampled choice) to the conversation it continues:
    `main` first, else the first of `others`, else a new LegacyHistory appended to `others`."""
    history: Trajectory | LegacyHistory = main
    k = -1
    while not continues(history, messages, tools):
        k += 1
        if k == len(others):
            history = LegacyHistory(messages_and_choices=[])
            others.append(history)
            break
        history = others[k]
    history.messages_and_choices.extend(messages[len(history.messages_and_choices):])
    history.messages_and_choices.append(choice)
    history.tools = tools



class _Tokenizes:
    """ART's `tokenize()` / `tensorize()` of a Trajectory and a TrajectoryGroup: `art.tokenize([self], ...)[0]`
    (tokens.py), and that as torch tensors."""

    def tokenize(self, *, multi_history: bool = False, reconcile_text_equivalent_tokenizations: bool = False,
                 model: str | None = None, base_model: str | None = None, tokenizer: Any = None,
                 chat_template: str | None = None, chat_template_kwargs: Mapping[str, object] | None = None) -> Any:
        """This item as training sees it: a `TokenizedTrajectory` (with `multi_history=True` a
        `TokenizedMultiHistoryTrajectory`), or a group's `TokenizedTrajectoryGroup`."""
        return _protocol_histories().tokenize_item(
            self, multi_history=multi_history, reconcile=reconcile_text_equivalent_tokenizations, model=model,
            base_model=base_model, tokenizer=tokenizer, chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs)

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
        _construct(super().__init__, type(self), data)

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
        self.messages_and_choices = check_messages(self.messages_and_choices, "Trajectory.messages_and_choices")
        check_tools(self.tools, "Trajectory.tools")
        for k, h in enumerate(self.additional_histories):
            if not isinstance(h, LegacyHistory):
                raise TrajectoryError(f"Trajectory.additional_histories[{k}] has type {type(h).__name__}; "
                                      "expected a LegacyHistory (messages_and_choices, tools).")
            where = f"Trajectory.additional_histories[{k}]"
            h.messages_and_choices = check_messages(h.messages_and_choices, f"{where}.messages_and_choices")
            check_tools(h.tools, f"{where}.tools")

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
        return _protocol_histories().chat_completions_history(self, model, reconcile_text_equivalent_tokenizations)

    def chat_completions_histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return _protocol_histories().chat_completions_histories(self, model, reconcile_text_equivalent_tokenizations)

    def anthropic_messages_history(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return _protocol_histories().anthropic_messages_history(self, model, reconcile_text_equivalent_tokenizations)

    def anthropic_messages_histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return _protocol_histories().anthropic_messages_histories(self, model, reconcile_text_equivalent_tokenizations)

    def responses_history(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return _protocol_histories().responses_history(self, model, reconcile_text_equivalent_tokenizations)

    def responses_histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return _protocol_histories().responses_histories(self, model, reconcile_text_equivalent_tokenizations)

    def completions_token_history(self, *, model: str | None = None) -> Any:
        return _protocol_histories().completions_token_history(self, model)

    def completions_token_histories(self, *, model: str | None = None) -> Any:
        return _protocol_histories().completions_token_histories(self, model)

    def completions_string_history(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return _protocol_histories().completions_string_history(self, model, reconcile_text_equivalent_tokenizations)

    def completions_string_histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return _protocol_histories().completions_string_histories(self, model, reconcile_text_equivalent_tokenizations)

    def history(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return _protocol_histories().trajectory_history(self, model, reconcile_text_equivalent_tokenizations)

    def histories(self, *, model: str | None = None, reconcile_text_equivalent_tokenizations: bool = False) -> Any:
        return _protocol_histories().trajectory_histories(self, model, reconcile_text_equivalent_tokenizations)

    def messages(self) -> Messages:
        """The chat messages of the conversation. For captured exchanges (ART's rule): the one history
        `history()` gives, as Chat Completions messages, so Responses and Anthropic Messages exchanges convert
        too; a ValueError for several protocols, models or branches, and for Completions (no chat messages)."""
        if self.exchanges:
            return _protocol_histories().trajectory_messages(self)
        return get_messages(self.messages_and_choices)

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


def one_chat_conversation(exchanges: TrajectoryExchanges) -> LegacyHistory:
    """The one conversation a trajectory's chat completion exchanges make (ART's `history()` needs exactly one)."""
    others = [name for name, _ in exchanges.all() if name != "chat_completions"]
    if others:
        raise ValueError(f"the messages of a trajectory with {others[0]} exchanges are not provided here; read its "
                         "exchanges (trajectory.exchanges) instead")
    main, rest = LegacyHistory(messages_and_choices=[]), []
    for exchange in exchanges.chat_completions:
        for choice in exchange.response.choices:
            file_turn(main, rest, list(exchange.request.get("messages") or []), exchange.request.get("tools"), choice)
    if rest:
        raise ValueError(f"trajectory messages require exactly one conversation; its chat completions make "
                         f"{len(rest) + 1}")
    return main


_warned_unknown_fields: set[tuple[str, str]] = set()


def _construct(init: Any, cls: type[pydantic.BaseModel], data: dict[str, Any]) -> None:
    """pydantic's __init__ with our error type; unknown fields are ignored as in ART, with one notice each."""
    for name in sorted(set(data) - set(cls.model_fields)):
        if (cls.__name__, name) not in _warned_unknown_fields:
            _warned_unknown_fields.add((cls.__name__, name))
            log.warning("%s has no field %r; it is ignored (as in ART). Known fields: %s", cls.__name__, name,
                        ", ".join(cls.model_fields))
    try:
        init(**data)
    except pydantic.ValidationError as e:
        fields = ", ".join(".".join(str(p) for p in err["loc"]) for err in e.errors())
        raise TrajectoryError(f"{cls.__name__} is malformed (fields: {fields}): {e}") from None


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


# ART 0.5.23's protocol-native histories live in histories.py, which builds on the classes above and on the
# token record (token_record.py, tokens.py): this module reaches them only through the module registered when
# it is imported (`artrl/__init__.py` imports histories), so the data model imports nothing above it.
_PROTOCOL_HISTORIES: Any = None
PROTOCOL_HISTORY_NAMES = ("AnthropicMessageSource", "AnthropicMessagesHistory", "ChatCompletionsHistory",
                          "ChatCompletionsMessageSource", "CompletionsSource", "CompletionsStringHistory",
                          "CompletionsStringSourceSpan", "CompletionsTokenHistory", "CompletionsTokenSourceSpan",
                          "ResponsesHistory", "ResponsesItemSource", "TrajectoryHistory")
"""What ART 0.5.23 exports from art.trajectories that lives in histories.py (read here through `__getattr__`)."""


def register_protocol_histories(module: Any) -> None:
    """Called once by histories.py when it is imported."""
    global _PROTOCOL_HISTORIES
    _PROTOCOL_HISTORIES = module


def _protocol_histories() -> Any:
    if _PROTOCOL_HISTORIES is None:  # only a partial import of the package gets here
        raise RuntimeError("artrl.trajectories.histories is not loaded: import artrl (the package) before using histories")
    return _PROTOCOL_HISTORIES


def __getattr__(name: str) -> Any:
    if name in PROTOCOL_HISTORY_NAMES:
        return getattr(_protocol_histories(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
