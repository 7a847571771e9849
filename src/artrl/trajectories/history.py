"""The conversation types every history view builds on, and what makes a conversation of captured exchanges.

* `LegacyHistory` (ART 0.5.23's name; 0.5.18's `History`): a conversation as messages and sampled choices, the
  element type of `Trajectory.additional_histories`; `get_messages` turns it into chat messages.
* `History`: ART 0.5.23's base of the protocol-native histories (protocol_histories.py), and its Chat
  Completions form `ChatCompletionsHistory`, which every other protocol converts to.
* ART's prefix rule (`continues`, `file_turn`): a chat turn extends the conversation its request's messages
  continue; `record_histories` files a trajectory's captured exchanges into conversations this way (chat) or by
  tokens (the other protocols; token_record.py says why).
* `History.tokenize()` / `LegacyHistory.tokenize()`: one conversation's one token sequence (tokens.py).

Everything here reads exchanges and the token record below it and builds no `Trajectory` (data.py, above, builds
on these types).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any, Union

import pydantic
from openai.types.chat.chat_completion import Choice

from ..chat.format import check_messages, check_tools, encode, end_of_turn_ids
from ..errors import TrajectoryError
from ..types import Messages, MessagesAndChoices, Tools
from .exchanges import ChatCompletionsExchange, MessagesExchange, ResponsesExchange, TrajectoryExchanges
from .token_record import SampledSpan, chat_turns, exchange_turns, reconciled_prompt, sampled_text
from .tensors import Conversation
from .tokens import TokenizedHistory, check_unsupported, resolve_tokenizer, sequence_name, sequences_of

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- conversations


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
        construct(super().__init__, type(self), data)

    def messages(self) -> Messages:
        return get_messages(self.messages_and_choices)

    def as_chat_completions_history(self, *, model: str | None = None) -> Any:
        """This conversation as a `ChatCompletionsHistory` of `model` (its messages, no sources)."""
        return legacy_as_chat_completions_history(self, model=model)

    def tokenize(self, *, model: str, base_model: str | None = None, tokenizer: Any = None,
                 chat_template: str | None = None, chat_template_kwargs: Mapping[str, object] | None = None) -> Any:
        """This conversation's one token sequence (a `TokenizedHistory` named `model`), as `art.tokenize` makes it:
        sampled turns on their token record, turns without one rendered (tokens.py)."""
        check_unsupported(chat_template, chat_template_kwargs)
        tok = resolve_tokenizer(tokenizer, base_model, model)
        conversation = LegacyHistory(messages_and_choices=copy.deepcopy(self.messages_and_choices),
                                     tools=copy.deepcopy(self.tools))
        check_conversation(conversation, "Trajectory")
        one = _one(sequences_of([(conversation, "LegacyHistory")], tok, end_of_turn_ids(tok), model))
        one.history = self  # the conversation asked about, as ART's `TokenizedHistory.history`
        return one

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
        its sources cite are trained on their token record."""
        check_unsupported(chat_template, chat_template_kwargs)
        tok = resolve_tokenizer(tokenizer, base_model, self.model)
        end_ids = end_of_turn_ids(tok)
        where = f"{type(self).__name__}(model={self.model!r})"
        name = self.model or base_model or ""
        exchanges = _cited_exchanges(self)
        if exchanges:
            # a history's turns are one sequence: an earlier sampled turn the server spelled again from its text
            # is kept as sampled (reconciled), as ART tokenizes the text-equivalent histories its reconciling
            # views give
            spelling = ((lambda text: encode(tok, text)), end_ids)
            conversations = record_histories(exchanges, where, spelling)
            name = sequence_name(exchanges, None, name)
        elif isinstance(self, ChatCompletionsHistory):  # no captured record: rendered from its messages
            conversation = LegacyHistory(messages_and_choices=copy.deepcopy(self.messages), tools=self.tools)
            check_conversation(conversation, "Trajectory")
            conversations = [(conversation, where)]
        else:
            raise ValueError(f"{type(self).__name__} cites no exchanges; there is nothing to tokenize")
        return _one(sequences_of(conversations, tok, end_ids, name, reconcile=True))

    def tensorize(self, *, base_model: str | None = None, tokenizer: Any = None, chat_template: str | None = None,
                  chat_template_kwargs: Mapping[str, object] | None = None, device: Any = None) -> Any:
        """`tokenize()`, as torch tensors on `device` (a `TensorizedHistory`)."""
        return self.tokenize(base_model=base_model, tokenizer=tokenizer, chat_template=chat_template,
                             chat_template_kwargs=chat_template_kwargs).tensorize(device=device)


_warned_unknown_fields: set[tuple[str, str]] = set()


def construct(init: Any, cls: type[pydantic.BaseModel], data: dict[str, Any]) -> None:
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


def check_conversation(history: Any, where: str) -> None:
    """Check one conversation's messages and tools before it is used (`where`: "Trajectory",
    "Trajectory.additional_histories[k]"); dict-shaped choices become `Choice` objects and message objects dicts.
    Raises TrajectoryError naming the first bad field."""
    history.messages_and_choices = check_messages(history.messages_and_choices, f"{where}.messages_and_choices")
    check_tools(history.tools, f"{where}.tools")


# --------------------------------------------------------------------------- Chat Completions histories


class HistorySource(pydantic.BaseModel):
    """Where an item of a protocol-native history came from (ART's sources: frozen, no extra fields)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class ChatCompletionsMessageSource(HistorySource):
    """Where a chat message came from: a request's `messages[request_index]` or a response's choice."""

    exchange: Union[ChatCompletionsExchange, MessagesExchange, ResponsesExchange]
    request_index: pydantic.StrictInt | None = None
    choice_index: pydantic.StrictInt | None = None
    output_indices: tuple[pydantic.StrictInt, ...] | None = None
    generation_index: pydantic.StrictInt | None = None


Kept = pydantic.SkipValidation  # items are kept as captured (ART's _Preserved)


class ChatCompletionsHistory(History):
    model: str | None
    messages: Kept[Messages]
    message_sources: list[ChatCompletionsMessageSource | None]
    tools: Kept[Tools | None] = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        return self


def legacy_as_chat_completions_history(history: LegacyHistory, *, model: str | None) -> ChatCompletionsHistory:
    messages = history.messages()
    return ChatCompletionsHistory(model=model, messages=messages, message_sources=[None] * len(messages),
                                  tools=copy.deepcopy(history.tools))


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


def continues(history: Conversation, messages: list[Any], tools: Any) -> bool:
    """Whether a request with `messages` and `tools` continues `history` (its messages so far begin them)."""
    so_far = history.messages()
    if len(so_far) > len(messages):
        return False
    try:
        same = _normal(so_far) == _normal([dict(m) for m in messages[:len(so_far)]])
    except (TypeError, ValueError):
        return False
    return same and (history.tools == tools or (not so_far and history.tools is None))


def file_turn(main: Conversation, others: list[LegacyHistory], messages: list[Any], tools: Any,
              choice: Choice) -> None:
    """Append a chat turn (its request's new messages, then the sampled choice) to the conversation it continues:
    `main` first, else the first of `others`, else a new LegacyHistory appended to `others`."""
    history: Conversation = main
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


def _has_record(choice: Choice) -> bool:
    extra = choice.model_extra or {}
    return isinstance(extra.get("prompt_token_ids"), list) and bool(extra["prompt_token_ids"]) and \
        isinstance(extra.get("token_ids"), list) and bool(extra["token_ids"])


def record_histories(exchanges: TrajectoryExchanges, where: str = "trajectory",
                     reconcile: tuple[Callable[[str], list[int]], Collection[int]] | None = None
                     ) -> list[tuple[LegacyHistory, str]]:
    """The conversations of a trajectory's exchanges, each with a name for messages: chat completions filed by
    their messages, the other protocols by their tokens (module docstring). `reconcile` (the tokenizer's encode
    and end-of-turn ids): a turn whose prompt continues a conversation once earlier sampled turns are spelled
    with their sampled ids (`reconciled_prompt`) is filed into it."""
    out: list[tuple[LegacyHistory, str]] = []
    chat_main = LegacyHistory(messages_and_choices=[])
    chat_others: list[LegacyHistory] = []
    for k, exchange in enumerate(exchanges.chat_completions):
        messages = exchange.request.get("messages")
        if not isinstance(messages, list):
            raise TrajectoryError(f"{where}: exchanges.chat_completions[{k}].request has no messages list.")
        for choice in chat_turns(exchange):
            file_turn(chat_main, chat_others, messages, exchange.request.get("tools"), choice)
    for n, h in enumerate([chat_main, *chat_others] if chat_main.messages_and_choices else chat_others):
        out.append((h, f"{where}, exchanges.chat_completions (conversation {n})"))
    for endpoint in ("completions", "responses", "messages"):
        # (conversation, its last prompt + sampled ids, its sampled turns in those ids)
        chains: list[tuple[LegacyHistory, list[int], list[SampledSpan]]] = []
        for k, exchange in enumerate(getattr(exchanges, endpoint)):
            at = f"{where}: exchanges.{endpoint}[{k}]"
            for choice in exchange_turns(endpoint, exchange, at):
                if not _has_record(choice):
                    raise TrajectoryError(
                        f"{at} carries no complete token record (prompt_token_ids and sampled token_ids); a "
                        f"{endpoint} turn is trained only on its record. Serve the model with artrl's server (or "
                        "vLLM with return_token_ids) so every response carries it.")
                prompt, ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
                chain = next((c for c in chains if prompt[:len(c[1])] == c[1]), None)
                if chain is None and reconcile is not None:
                    for c in chains:
                        if (repaired := reconciled_prompt(prompt, c[1], c[2], *reconcile)) is not None:
                            chain, prompt = c, repaired
                            break
                if chain is None:
                    chain = (LegacyHistory(messages_and_choices=[]), [], [])
                    chains.append(chain)
                chain[0].messages_and_choices.append(choice)
                chain[2].append(SampledSpan(len(prompt), list(ids), sampled_text(choice)))
                chain[1][:] = [*prompt, *ids]
        out += [(h, f"{where}, exchanges.{endpoint} (conversation {n})") for n, (h, _, _) in enumerate(chains)]
    return out


# --------------------------------------------------------------------------- tokenizing one history


def _cited_exchanges(history: History) -> TrajectoryExchanges:
    """The exchanges a history's sources cite, each once, in start order; a chat exchange keeps only the choices
    the history holds (another choice is another branch)."""
    cited: dict[int, Any] = {}
    choices: dict[int, set[int]] = {}
    for name in ("message_sources", "input_sources"):
        for s in getattr(history, name, None) or []:
            if s is not None:
                cited.setdefault(id(s.exchange), s.exchange)
                if (index := getattr(s, "choice_index", None)) is not None:
                    choices.setdefault(id(s.exchange), set()).add(index)
    for span in getattr(history, "prompt_sources", None) or []:
        if span.source is not None:
            cited.setdefault(id(span.source.exchange), span.source.exchange)
            if span.source.choice_index is not None:
                choices.setdefault(id(span.source.exchange), set()).add(span.source.choice_index)
    out = TrajectoryExchanges()
    for key, exchange in sorted(cited.items(), key=lambda kv: (kv[1].start_time, kv[1].end_time)):
        if key in choices:
            response = exchange.response.model_copy(
                update={"choices": [c for c in exchange.response.choices if c.index in choices[key]]})
            exchange = exchange.model_copy(update={"response": response})
        out.append(exchange)
    return out


def _one(sequences: list[TokenizedHistory]) -> TokenizedHistory:
    if len(sequences) != 1:
        raise ValueError(f"History tokenization requires exactly one history; found {len(sequences)}")
    return sequences[0]
