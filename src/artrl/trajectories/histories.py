"""ART 0.5.23's protocol-native histories: a trajectory's captured exchanges as the sequences an agent built.

`Trajectory.history()` / `histories()` and their per-protocol forms (`chat_completions_histories`,
`anthropic_messages_histories`, `responses_histories`, `completions_token_histories`,
`completions_string_histories`, and the singular of each) read `Trajectory.exchanges` (exchanges.py)
and return, per model, one history per branch of the conversation, in the protocol's own
shape, each item paired with the exchange it came from:

| history | items | sources (one per item / span) |
|---|---|---|
| `ChatCompletionsHistory` | `messages` (+ `tools`) | `ChatCompletionsMessageSource` (`request_index` or `choice_index`) |
| `AnthropicMessagesHistory` | `messages` (+ `system`, `tools`) | `AnthropicMessageSource` (`request_index`, or None for the response) |
| `ResponsesHistory` | `input` items (+ `instructions`, `tools`) | `ResponsesItemSource` (`request_index` or `output_index`) |
| `CompletionsTokenHistory` | `prompt` token ids (prompt + sampled ids) | `CompletionsTokenSourceSpan`s, `sampled_spans` |
| `CompletionsStringHistory` | `prompt` text (prompt + sampled text) | `CompletionsStringSourceSpan`s, `sampled_spans` |

The branching rule is ART's: exchanges of one model in start order; a request whose prompt begins
with a branch's items (same tools and template) extends the longest such branch, replacing it; a
prompt that is a prefix of a branch (a regeneration) starts a new branch with that branch's sources;
anything else starts a new branch. Several choices make several branches. Chat messages compare
without their reasoning (`reasoning`, `reasoning_content`), as ART's default. Text is not enough
for Chat Completions and Anthropic Messages (ART's token check,
lineage.py): a request continues a branch only when its prompt ids begin with the last
sampled turn's prompt + sampled ids (where both are recorded), and, for chat, still hold every
earlier sampled turn's ids that carried reasoning, and the last turn is not a tool call cut at the
request's token limit. `reconcile_text_equivalent_tokenizations=True` (ART's opt-in to merging
text-equal histories whose ids differ) drops the id checks (not the cut tool call), and chat
messages then compare with their reasoning, as ART's.

What is simpler than ART's (documented in docs/art-compatibility.md): Responses and Completions
string views branch by items alone, without the token check; a Responses exchange with several
`token_generations` is one output, not one branch per generation (sources carry
`generation_index=None`). `History.tokenize()` / `tensorize()` go through artrl's `art.tokenize`
path (tokens.py): the exchanges a history cites are trained on their token record, an earlier
sampled turn that a later prompt spelled again from its text kept as sampled (ART's repair,
`wire_records.reconciled_prompt`), so a history is one sequence. `Trajectory.messages()` is the
one history's Chat Completions messages, whatever protocol it was captured in (ART's).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar, Union

import pydantic

from .exchanges import (ChatCompletionsExchange, CompletionsExchange, MessagesExchange, ResponsesExchange,
                        TrajectoryExchanges)
from .lineage import ChatLineage, MessagesLineage, chat_ids, messages_ids
from .trajectory import History, LegacyHistory, Trajectory, register_protocol_histories
from ..types import Messages, Tools
from .token_record import _extra, _token_id

if TYPE_CHECKING:
    from .tokens import TensorizedHistory, TokenizedHistory


# --------------------------------------------------------------------------- the types (ART's fields)


class _HistorySource(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class ChatCompletionsMessageSource(_HistorySource):
    """Where a chat message came from: a request's `messages[request_index]` or a response's choice."""

    exchange: Union[ChatCompletionsExchange, MessagesExchange, ResponsesExchange]
    request_index: pydantic.StrictInt | None = None
    choice_index: pydantic.StrictInt | None = None
    output_indices: tuple[pydantic.StrictInt, ...] | None = None
    generation_index: pydantic.StrictInt | None = None


class AnthropicMessageSource(_HistorySource):
    exchange: MessagesExchange
    request_index: pydantic.StrictInt | None = None  # None: the exchange's response


class ResponsesItemSource(_HistorySource):
    exchange: ResponsesExchange
    request_index: pydantic.StrictInt | None = None
    output_index: pydantic.StrictInt | None = None
    generation_index: pydantic.StrictInt | None = None


class CompletionsSource(_HistorySource):
    exchange: CompletionsExchange
    prompt_index: pydantic.StrictInt
    choice_index: pydantic.StrictInt | None = None  # None: the request's prompt


class CompletionsTokenSourceSpan(_HistorySource):
    start: pydantic.StrictInt
    end: pydantic.StrictInt
    source: CompletionsSource | None


class CompletionsStringSourceSpan(_HistorySource):
    start: pydantic.StrictInt
    end: pydantic.StrictInt
    source: CompletionsSource | None


_Kept = pydantic.SkipValidation  # items are kept as captured (ART's _Preserved)


class ChatCompletionsHistory(History):
    model: str | None
    messages: _Kept[Messages]
    message_sources: list[ChatCompletionsMessageSource | None]
    tools: _Kept[Tools | None] = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        return self


class AnthropicMessagesHistory(History):
    model: str
    messages: _Kept[list[dict[str, Any]]]
    message_sources: list[AnthropicMessageSource | None]
    system: _Kept[str | list[dict[str, Any]] | None] = None
    system_source: MessagesExchange | None = None
    tools: _Kept[list[dict[str, Any]] | None] = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        return anthropic_as_chat_completions_history(self)


class ResponsesHistory(History):
    model: str
    input: _Kept[list[dict[str, Any]]]
    input_sources: list[ResponsesItemSource | None]
    instructions: str | None = None
    instructions_source: ResponsesExchange | None = None
    tools: _Kept[list[dict[str, Any]] | None] = None
    conversation: _Kept[Any] = None
    previous_response_id: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        return responses_as_chat_completions_history(self)


class CompletionsTokenHistory(History):
    model: str
    prompt: list[int]
    prompt_sources: list[CompletionsTokenSourceSpan]
    sampled_spans: list[tuple[int, int]]

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        raise ValueError("Raw Completions history has no chat-message structure")


class CompletionsStringHistory(History):
    model: str
    prompt: str
    prompt_sources: list[CompletionsStringSourceSpan]
    sampled_spans: list[tuple[int, int]]

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        raise ValueError("Raw Completions history has no chat-message structure")


TrajectoryHistory = Union[LegacyHistory, ChatCompletionsHistory, AnthropicMessagesHistory, ResponsesHistory,
                          CompletionsTokenHistory, CompletionsStringHistory]


# --------------------------------------------------------------------------- selection and branching

_I = TypeVar("_I")
_S = TypeVar("_S")


def _require_unmixed(trajectory: Trajectory) -> None:
    if trajectory.exchanges and (trajectory.messages_and_choices or trajectory.tools is not None
                                 or trajectory.additional_histories):
        raise ValueError("A trajectory cannot contain both exchanges and legacy histories")


def _selected_models(exchanges: Sequence[Any], model: str | None, protocol: str) -> list[tuple[str, list[Any]]]:
    """Exchanges of `model` (exact name first, else a shell pattern; all for None), grouped by model, each group
    in start order."""
    exact = model is not None and any(e.model == model for e in exchanges)
    selected = [e for e in exchanges if model is None or (e.model == model if exact else
                                                           e.model is not None and fnmatch.fnmatchcase(e.model, model))]
    if not selected:
        suffix = f" for model {model!r}" if model is not None else ""
        raise ValueError(f"Trajectory contains no {protocol} exchanges{suffix}")
    if any(e.model is None for e in selected):
        raise ValueError(f"Every {protocol} exchange must identify its model")
    grouped: dict[str, list[Any]] = {}
    for e in sorted(selected, key=lambda e: (e.start_time, e.end_time)):
        grouped.setdefault(e.model, []).append(e)
    return list(grouped.items())


def _one(histories: Sequence[_I], protocol: str) -> _I:
    if len(histories) != 1:
        raise ValueError(f"{protocol} requires exactly one history; found {len(histories)}")
    return histories[0]


def _one_model(histories: Sequence[Any], model: str | None, protocol: str) -> Any:
    if model is None and len({h.model for h in histories}) > 1:
        raise ValueError(f"{protocol} requires exactly one model; pass model= to select one")
    return _one(histories, protocol)


@dataclass
class _Branch(Generic[_I, _S]):
    items: list[_I]
    sources: list[_S | None]
    keys: list[str]
    context: Any
    order: tuple[int, ...]
    first_time: datetime
    context_source: Any = None


@dataclass
class _Branches(Generic[_I, _S]):
    """ART's prefix rule over one model's exchanges (module docstring)."""

    key: Callable[[_I], str]
    branches: list[_Branch[_I, _S]] = field(default_factory=list)

    def prompt_sources(self, prompt: Sequence[_I], defaults: list[_S | None], context: Any,
                       continues: Callable[[_Branch[_I, _S]], bool] | None = None) -> list[_S | None]:
        """The sources of a prompt: those of the longest branch it continues (and `continues` accepts), the rest
        `defaults`."""
        keys = [self.key(i) for i in prompt]
        parents = [b for b in self.branches if len(b.keys) < len(keys) and b.keys == keys[:len(b.keys)]
                   and (continues is None or continues(b))]
        if not parents:
            return defaults
        parent = min(parents, key=lambda b: (-len(b.keys), b.order))
        return [*parent.sources, *defaults[len(parent.items):]]

    def extend(self, prompt: Sequence[_I], prompt_sources: Sequence[_S | None],
               outputs: Sequence[tuple[int, Sequence[_I], Sequence[_S | None]]], context: Any, sequence: int,
               start_time: datetime, context_source: Any = None,
               continues: Callable[[_Branch[_I, _S]], bool] | None = None) -> None:
        """File one exchange: its prompt extends (or regenerates) a branch of the same context that `continues`
        accepts (the token check: ART's, below), else starts a new one; one new branch per output."""
        keys = [self.key(i) for i in prompt]
        same = [(k, b) for k, b in enumerate(self.branches)
                if b.context == context and (continues is None or continues(b))]
        extends = [(k, b) for k, b in same if b.keys == keys[:len(b.keys)] and len(b.keys) <= len(keys)]
        parent: _Branch[_I, _S] | None = None
        if extends:
            k, parent = min(extends, key=lambda kb: (-len(kb[1].keys), kb[1].order))
            self.branches.pop(k)
            sources = [*parent.sources, *prompt_sources[len(parent.items):]]
        else:
            regenerated = [b for _, b in same if keys == b.keys[:len(keys)]]
            if regenerated:
                parent = min(regenerated, key=lambda b: b.order)
                sources = list(parent.sources[:len(prompt)])
            else:
                sources = list(prompt_sources)
        created = [_Branch(items=[*copy.deepcopy(list(prompt)), *copy.deepcopy(list(out))],
                           sources=[*sources, *out_sources], keys=[*keys, *(self.key(i) for i in out)],
                           context=copy.deepcopy(context),
                           order=(*(parent.order if parent is not None else (sequence,)), index),
                           first_time=parent.first_time if parent is not None else start_time,
                           context_source=context_source)
                   for index, out, out_sources in outputs]
        if not created and extends and parent is not None:
            self.branches.append(parent)
        self.branches.extend(created)

    def ordered(self) -> list[_Branch[_I, _S]]:
        return sorted(self.branches, key=lambda b: (b.first_time, b.order))


def _json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _dump(value: Any) -> Any:
    return value.model_dump(mode="json", exclude_none=True) if isinstance(value, pydantic.BaseModel) else value


# --------------------------------------------------------------------------- chat completions


def normalize_chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message in ART's canonical history form (reasoning under `reasoning`; assistant content None -> "";
    no empty tool_calls, no annotations)."""
    data = copy.deepcopy(dict(_dump(message)))
    data.pop("annotations", None)
    if data.get("reasoning_content") is not None and not data.get("reasoning"):
        data["reasoning"] = data.pop("reasoning_content")
    elif data.get("reasoning_content") == data.get("reasoning"):
        data.pop("reasoning_content", None)
    if data.get("role") == "assistant" and data.get("content") is None:
        data["content"] = ""
    elif data.get("content") is None:
        data.pop("content", None)
    if data.get("tool_calls") == []:
        data.pop("tool_calls")
    return data


def _chat_key(message: Mapping[str, Any]) -> str:
    data = normalize_chat_message(message)
    data.pop("reasoning", None)
    data.pop("reasoning_content", None)
    return _json_key(data)


def _chat_key_with_reasoning(message: Mapping[str, Any]) -> str:
    """A message's key when text-equivalent histories merge (ART's reconciling views compare reasoning too: a
    request that dropped an earlier turn's reasoning starts a new branch)."""
    return _json_key(normalize_chat_message(message))


def _ordered_choices(choices: Sequence[Any], protocol: str) -> list[Any]:
    if not choices:
        raise ValueError(f"{protocol} response contains no choices")
    indices = [c.index for c in choices]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{protocol} response contains duplicate choice indices")
    return sorted(choices, key=lambda c: c.index)


def legacy_as_chat_completions_history(history: LegacyHistory, *, model: str | None) -> ChatCompletionsHistory:
    messages = history.messages()
    return ChatCompletionsHistory(model=model, messages=messages, message_sources=[None] * len(messages),
                                  tools=copy.deepcopy(history.tools))


def _legacy(trajectory: Trajectory) -> list[LegacyHistory]:
    return [LegacyHistory(messages_and_choices=copy.deepcopy(trajectory.messages_and_choices),
                          tools=copy.deepcopy(trajectory.tools)), *copy.deepcopy(trajectory.additional_histories)]


def chat_completions_histories(trajectory: Trajectory, model: str | None,
                               reconcile: bool = False) -> list[ChatCompletionsHistory]:
    _require_unmixed(trajectory)
    if not trajectory.exchanges:
        return [legacy_as_chat_completions_history(h, model=model) for h in _legacy(trajectory)]
    histories = []
    for name, exchanges in _selected_models(trajectory.exchanges.chat_completions, model, "Chat Completions"):
        tree: _Branches[dict[str, Any], ChatCompletionsMessageSource] = _Branches(
            key=_chat_key_with_reasoning if reconcile else _chat_key)
        for sequence, exchange in enumerate(exchanges):
            request = exchange.request
            context = (_json_key(request.get("tools")), request.get("chat_template"),
                       _json_key(request.get("chat_template_kwargs")))
            prompt = [normalize_chat_message(m) for m in request.get("messages") or []]
            choices = _ordered_choices(exchange.response.choices, "Chat Completions")
            lineage = ChatLineage(chat_ids(exchange, choices[0].index)[0], len(prompt), reconcile)
            sources = tree.prompt_sources(prompt, [ChatCompletionsMessageSource(exchange=exchange, request_index=k)
                                                   for k in range(len(prompt))], context, lineage.cites)
            outputs = [(c.index, [normalize_chat_message(c.message.model_dump(mode="python", exclude_none=True))],
                        [ChatCompletionsMessageSource(exchange=exchange, choice_index=c.index)])
                       for c in choices]
            tree.extend(prompt, sources, outputs, context, sequence, exchange.start_time,
                        context_source=(request.get("tools"), request.get("chat_template"),
                                        request.get("chat_template_kwargs")), continues=lineage.continues)
        for b in tree.ordered():
            tools, template, kwargs = b.context_source
            histories.append(ChatCompletionsHistory(model=name, messages=copy.deepcopy(b.items),
                                                    message_sources=list(b.sources), tools=copy.deepcopy(tools),
                                                    chat_template=template, chat_template_kwargs=copy.deepcopy(kwargs)))
    return histories


def chat_completions_history(trajectory: Trajectory, model: str | None,
                             reconcile: bool = False) -> ChatCompletionsHistory:
    return _one_model(chat_completions_histories(trajectory, model, reconcile), model, "Chat Completions history")


# --------------------------------------------------------------------------- anthropic messages


def _anthropic_key(message: Mapping[str, Any]) -> str:
    data = copy.deepcopy(dict(message))
    content = data.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else [
        {k: v for k, v in _dump(b).items() if k not in ("token_ids", "logprobs")}
        for b in content or [] if _dump(b).get("type") not in ("thinking", "redacted_thinking")]
    data["content"] = blocks
    return _json_key(data)


def anthropic_messages_histories(trajectory: Trajectory, model: str | None,
                                 reconcile: bool = False) -> list[AnthropicMessagesHistory]:
    _require_unmixed(trajectory)
    histories = []
    for name, exchanges in _selected_models(trajectory.exchanges.messages, model, "Anthropic Messages"):
        tree: _Branches[dict[str, Any], AnthropicMessageSource] = _Branches(key=_anthropic_key)
        for sequence, exchange in enumerate(exchanges):
            request = exchange.request
            prompt = [copy.deepcopy(dict(m)) for m in request.get("messages") or []]
            lineage = MessagesLineage(messages_ids(exchange)[0], len(prompt), reconcile)
            sources = tree.prompt_sources(prompt, [AnthropicMessageSource(exchange=exchange, request_index=k)
                                                   for k in range(len(prompt))], None, lineage.cites)
            response = {"role": "assistant", "content": [_dump(b) for b in exchange.response.content]}
            context = (_json_key(request.get("system")), _json_key(request.get("tools")),
                       request.get("chat_template"), _json_key(request.get("chat_template_kwargs")))
            tree.extend(prompt, sources, [(0, [response], [AnthropicMessageSource(exchange=exchange)])], context,
                        sequence, exchange.start_time, context_source=exchange, continues=lineage.continues)
        for b in tree.ordered():
            source = b.context_source
            request = source.request
            histories.append(AnthropicMessagesHistory(
                model=name, messages=copy.deepcopy(b.items), message_sources=list(b.sources),
                system=copy.deepcopy(request.get("system")),
                system_source=source if request.get("system") is not None else None,
                tools=copy.deepcopy(request.get("tools")), chat_template=request.get("chat_template"),
                chat_template_kwargs=copy.deepcopy(request.get("chat_template_kwargs"))))
    return histories


def anthropic_messages_history(trajectory: Trajectory, model: str | None,
                               reconcile: bool = False) -> AnthropicMessagesHistory:
    return _one_model(anthropic_messages_histories(trajectory, model, reconcile), model,
                      "Anthropic Messages history")


# --------------------------------------------------------------------------- responses


def _responses_input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if value is None:
        return []
    if isinstance(value, list) and all(isinstance(i, dict) for i in value):
        return copy.deepcopy(value)
    raise ValueError("Responses input must be text or a list of input items")


def responses_histories(trajectory: Trajectory, model: str | None,
                        reconcile: bool = False) -> list[ResponsesHistory]:
    _require_unmixed(trajectory)
    histories = []
    for name, exchanges in _selected_models(trajectory.exchanges.responses, model, "Responses"):
        tree: _Branches[dict[str, Any], ResponsesItemSource] = _Branches(key=_json_key)
        # response id -> (items, sources, conversation, previous id outside this trajectory)
        records: dict[str, tuple[list[Any], list[Any], Any, str | None]] = {}
        conversations: dict[str, tuple[list[Any], list[Any], Any, str | None]] = {}
        for sequence, exchange in enumerate(exchanges):
            request = exchange.request
            prompt = _responses_input(request.get("input"))
            sources: list[ResponsesItemSource | None] = [ResponsesItemSource(exchange=exchange, request_index=k)
                                                         for k in range(len(prompt))]
            previous, conversation = request.get("previous_response_id"), request.get("conversation")
            prior = records.get(previous) if isinstance(previous, str) else None
            if prior is None and conversation is not None:
                prior = conversations.get(_json_key(conversation))
            inherited_conversation, inherited_previous = None, None
            if prior is not None:
                items, item_sources, inherited_conversation, inherited_previous = prior
                prompt, sources = [*copy.deepcopy(items), *prompt], [*item_sources, *sources]
            sources = tree.prompt_sources(prompt, sources, None)
            output = [item.model_dump(mode="json", exclude_none=True) for item in exchange.response.output]
            output_sources = [ResponsesItemSource(exchange=exchange, output_index=k) for k in range(len(output))]
            instructions = request.get("instructions")
            if instructions is not None and not isinstance(instructions, str):
                raise ValueError("Responses instructions must be text")
            external_previous = previous if isinstance(previous, str) and previous not in records \
                else inherited_previous
            conversation = conversation if conversation is not None else inherited_conversation
            context = (instructions, _json_key(request.get("tools")), _json_key(conversation), external_previous,
                       request.get("chat_template"), _json_key(request.get("chat_template_kwargs")))
            tree.extend(prompt, sources, [(0, output, output_sources)], context, sequence, exchange.start_time,
                        context_source=(exchange, conversation, external_previous))
            record = ([*prompt, *output], [*sources, *output_sources], copy.deepcopy(conversation),
                      external_previous)
            records[exchange.response.id] = record
            if conversation is not None:
                conversations[_json_key(conversation)] = record
        for b in tree.ordered():
            source, conversation, previous = b.context_source
            request = source.request
            histories.append(ResponsesHistory(
                model=name, input=copy.deepcopy(b.items), input_sources=list(b.sources),
                instructions=request.get("instructions"),
                instructions_source=source if request.get("instructions") is not None else None,
                tools=copy.deepcopy(request.get("tools")), conversation=copy.deepcopy(conversation),
                previous_response_id=previous, chat_template=request.get("chat_template"),
                chat_template_kwargs=copy.deepcopy(request.get("chat_template_kwargs"))))
    return histories


def responses_history(trajectory: Trajectory, model: str | None, reconcile: bool = False) -> ResponsesHistory:
    return _one_model(responses_histories(trajectory, model, reconcile), model, "Responses history")


# --------------------------------------------------------------------------- completions


def _completion_prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [list(value)]
    if isinstance(value, list) and all(isinstance(p, (str, list)) for p in value):
        return [p if isinstance(p, str) else list(p) for p in value]
    raise ValueError("Completions prompt must be text or token IDs")


def _completion_groups(exchange: CompletionsExchange) -> list[tuple[int, str | list[int], list[Any]]]:
    """(prompt index, prompt, its choices): choices split evenly over batched prompts in index order (ART's
    fallback when the response names no `prompt_index`)."""
    if exchange.request.get("suffix") is not None:
        raise ValueError("Completions suffix is not supported")
    prompts = _completion_prompts(exchange.request.get("prompt"))
    choices = _ordered_choices(exchange.response.choices, "Completions")
    named = {c.index: (c.model_extra or {}).get("prompt_index") for c in choices}
    if all(isinstance(v, int) for v in named.values()):
        return [(k, p, [c for c in choices if named[c.index] == k]) for k, p in enumerate(prompts)]
    if len(choices) % len(prompts):
        raise ValueError("Cannot associate Completions choices with batched prompts")
    per = len(choices) // len(prompts)
    return [(k, p, choices[k * per:(k + 1) * per]) for k, p in enumerate(prompts)]


def _completion_ids(exchange: CompletionsExchange, choice: Any) -> tuple[list[int] | None, list[int] | None]:
    """A choice's exact prompt ids and sampled ids (the server's record), each None when not sent."""
    extra = _extra(choice)
    prompt = extra.get("prompt_token_ids", _extra(exchange.response).get("prompt_token_ids"))
    ids = extra.get("token_ids")
    if ids is None and choice.logprobs is not None and choice.logprobs.tokens:
        pairs = [_token_id(t) for t in choice.logprobs.tokens]
        ids = pairs if all(t is not None for t in pairs) else None
    return (list(prompt) if isinstance(prompt, list) else None), (list(ids) if isinstance(ids, list) else None)


def _runs(sources: Sequence[CompletionsSource | None]) -> list[tuple[int, int, CompletionsSource | None]]:
    runs: list[tuple[int, int, CompletionsSource | None]] = []
    for k, source in enumerate(sources):
        if runs and runs[-1][2] == source:
            runs[-1] = (runs[-1][0], k + 1, source)
        else:
            runs.append((k, k + 1, source))
    return runs


def _sampled_spans(sources: Sequence[CompletionsSource | None]) -> list[tuple[int, int]]:
    return [(a, b) for a, b, s in _runs(sources) if s is not None and s.choice_index is not None]


def completions_token_histories(trajectory: Trajectory, model: str | None) -> list[CompletionsTokenHistory]:
    _require_unmixed(trajectory)
    histories = []
    for name, exchanges in _selected_models(trajectory.exchanges.completions, model, "Completions"):
        tree: _Branches[int, CompletionsSource] = _Branches(key=str)
        for sequence, exchange in enumerate(exchanges):
            for prompt_index, request_prompt, choices in _completion_groups(exchange):
                for choice in choices:
                    prompt, sampled = _completion_ids(exchange, choice)
                    if prompt is None and isinstance(request_prompt, list):
                        prompt = list(request_prompt)
                    if prompt is None or sampled is None:
                        raise ValueError("Completions token history requires exact token IDs for every choice")
                    ps = CompletionsSource(exchange=exchange, prompt_index=prompt_index)
                    out = CompletionsSource(exchange=exchange, prompt_index=prompt_index, choice_index=choice.index)
                    tree.extend(prompt, [ps] * len(prompt), [(choice.index, sampled, [out] * len(sampled))], (),
                                sequence, exchange.start_time)
        for b in tree.branches:
            histories.append(CompletionsTokenHistory(
                model=name, prompt=list(b.items),
                prompt_sources=[CompletionsTokenSourceSpan(start=a, end=e, source=s) for a, e, s in _runs(b.sources)],
                sampled_spans=_sampled_spans(b.sources)))
    if not histories:
        raise ValueError("Completions token history requires exact token IDs")
    return histories


def completions_token_history(trajectory: Trajectory, model: str | None) -> CompletionsTokenHistory:
    return _one(completions_token_histories(trajectory, model), "Completions token history")


def completions_string_histories(trajectory: Trajectory, model: str | None,
                                 reconcile: bool = False) -> list[CompletionsStringHistory]:
    _require_unmixed(trajectory)
    histories = []
    for name, exchanges in _selected_models(trajectory.exchanges.completions, model, "Completions"):
        tree: _Branches[str, CompletionsSource] = _Branches(key=lambda ch: ch)
        for sequence, exchange in enumerate(exchanges):
            for prompt_index, prompt, choices in _completion_groups(exchange):
                if not isinstance(prompt, str):
                    raise ValueError("Completions string history requires text prompts for every choice")
                for choice in choices:
                    text = choice.text
                    if exchange.request.get("echo") is True:
                        if not text.startswith(prompt):
                            raise ValueError("Cannot locate echoed Completions prompt boundary")
                        text = text[len(prompt):]
                    ps = CompletionsSource(exchange=exchange, prompt_index=prompt_index)
                    out = CompletionsSource(exchange=exchange, prompt_index=prompt_index, choice_index=choice.index)
                    tree.extend(list(prompt), [ps] * len(prompt), [(choice.index, list(text), [out] * len(text))],
                                (), sequence, exchange.start_time)
        for b in tree.branches:
            histories.append(CompletionsStringHistory(
                model=name, prompt="".join(b.items),
                prompt_sources=[CompletionsStringSourceSpan(start=a, end=e, source=s)
                                for a, e, s in _runs(b.sources)],
                sampled_spans=_sampled_spans(b.sources)))
    if not histories:
        raise ValueError("Completions string history requires text prompts")
    return histories


def completions_string_history(trajectory: Trajectory, model: str | None,
                               reconcile: bool = False) -> CompletionsStringHistory:
    return _one(completions_string_histories(trajectory, model, reconcile), "Completions string history")


# --------------------------------------------------------------------------- any protocol


def trajectory_histories(trajectory: Trajectory, model: str | None,
                         reconcile: bool = False) -> list[Any]:
    """ART's `Trajectory.histories()`: the legacy histories, or the histories of the one protocol whose exchanges
    `model` selects (a ValueError when it selects several protocols)."""
    _require_unmixed(trajectory)
    if not trajectory.exchanges:
        return _legacy(trajectory)
    exact = model is not None and any(e.model == model for _, e in trajectory.exchanges.all())

    def chosen(exchanges: Sequence[Any]) -> bool:
        return any(model is None or (e.model == model if exact else
                                     e.model is not None and fnmatch.fnmatchcase(e.model, model)) for e in exchanges)

    ex = trajectory.exchanges
    candidates: list[Any] = []
    if chosen(ex.chat_completions):
        candidates += chat_completions_histories(trajectory, model, reconcile)
    if chosen(ex.completions):
        try:
            candidates += completions_token_histories(trajectory, model)
        except ValueError as error:
            if "requires exact token IDs" not in str(error):
                raise
            candidates += completions_string_histories(trajectory, model, reconcile)
    if chosen(ex.responses):
        candidates += responses_histories(trajectory, model, reconcile)
    if chosen(ex.messages):
        candidates += anthropic_messages_histories(trajectory, model, reconcile)
    if not candidates:
        suffix = f" for model {model!r}" if model is not None else ""
        raise ValueError(f"Trajectory contains no exchanges{suffix}")
    if len({type(h) for h in candidates}) != 1:
        raise ValueError("Trajectory resolves to multiple protocol histories; use a protocol-specific method")
    return candidates


def trajectory_history(trajectory: Trajectory, model: str | None, reconcile: bool = False) -> Any:
    histories = trajectory_histories(trajectory, model, reconcile)
    if model is None and len({h.model for h in histories if not isinstance(h, LegacyHistory)}) > 1:
        raise ValueError("Trajectory history requires exactly one model; pass model= to select one")
    return _one(histories, "Trajectory history")


# --------------------------------------------------------------------------- conversions to chat


def _content_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "".join(str(_dump(b).get("text") or "") for b in value or [] if isinstance(_dump(b), dict))


def _anthropic_messages(system: Any, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic messages as chat messages (ART's mapping: text -> content, thinking -> reasoning, tool_use ->
    tool_calls, tool_result -> a tool message)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _content_text(system)})
    for raw in messages:
        role, content = raw.get("role", "user"), raw.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        text, reasoning, calls = "", "", []
        for block in (_dump(b) for b in content or []):
            kind = block.get("type")
            if kind == "text":
                text += str(block.get("text") or "")
            elif kind == "thinking":
                reasoning += str(block.get("thinking") or "")
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                if text:
                    out.append({"role": role, "content": text})
                    text = ""
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id", block.get("id")),
                            "content": result if isinstance(result, str) else _content_text(result)})
            else:
                raise ValueError(f"Unsupported Anthropic content block type: {kind!r}")
        message: dict[str, Any] = {"role": role, "content": text}
        if reasoning:
            message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = calls
        if text or reasoning or calls or role == "assistant":
            out.append(message)
    return out


def _openai_tools(tools: Any, *, schema_key: str) -> Any:
    """Anthropic (`input_schema`) or Responses (`parameters`) function tools as chat completion tools."""
    if not isinstance(tools, list):
        return tools
    out = []
    for tool in tools:
        data = _dump(tool)
        if not isinstance(data, dict) or data.get("type", "function") not in ("function", "custom"):
            out.append(tool)
            continue
        function = {"name": data.get("name"), "description": data.get("description"),
                    "parameters": data.get(schema_key, {})}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def anthropic_as_chat_completions_history(history: AnthropicMessagesHistory) -> ChatCompletionsHistory:
    messages: list[dict[str, Any]] = []
    sources: list[ChatCompletionsMessageSource | None] = []
    if history.system:
        messages += _anthropic_messages(history.system, [])
        sources.append(ChatCompletionsMessageSource(exchange=history.system_source)
                       if history.system_source is not None else None)
    for message, source in zip(history.messages, history.message_sources, strict=True):
        converted = _anthropic_messages(None, [message])
        messages += converted
        sources += [ChatCompletionsMessageSource(exchange=source.exchange, request_index=source.request_index,
                                                 output_indices=(0,) if source.request_index is None else None)
                    if source is not None else None] * len(converted)
    return ChatCompletionsHistory(model=history.model, messages=messages, message_sources=sources,
                                  tools=_openai_tools(history.tools, schema_key="input_schema"),
                                  chat_template=history.chat_template,
                                  chat_template_kwargs=copy.deepcopy(history.chat_template_kwargs))


def _responses_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    text = ""
    for block in (_dump(b) for b in content or []):
        kind = block.get("type")
        if kind not in ("input_text", "output_text", "refusal", "text"):
            raise ValueError(f"Unsupported Responses content block type: {kind!r}")
        text += str(block.get("refusal" if kind == "refusal" else "text") or "")
    return text


def _reasoning_text(item: Mapping[str, Any]) -> str:
    return "".join(b.get("text", "") for f in ("content", "summary") for b in item.get(f) or []
                   if isinstance(b, dict) and isinstance(b.get("text"), str))


def responses_as_chat_completions_history(history: ResponsesHistory) -> ChatCompletionsHistory:
    """Responses items as chat messages (ART's grouping): reasoning joins the assistant message or function calls
    after it; consecutive function calls make one assistant message with several tool calls; a function call output
    is a tool message. Each message's source cites its items' exchange (request index, or output indices)."""
    if history.previous_response_id is not None or history.conversation is not None:
        raise ValueError("Opaque Responses context cannot be represented as Chat Completions")
    messages: list[dict[str, Any]] = []
    sources: list[ChatCompletionsMessageSource | None] = []
    if history.instructions:
        messages.append({"role": "system", "content": history.instructions})
        sources.append(ChatCompletionsMessageSource(exchange=history.instructions_source)
                       if history.instructions_source is not None else None)
    groups: list[tuple[dict[str, Any], list[ResponsesItemSource | None]]] = []
    reasoning, reasoning_sources = "", []  # pending reasoning and its items' sources
    calls: dict[str, Any] | None = None  # the open assistant message of consecutive function calls
    for item, source in zip(history.input, history.input_sources, strict=True):
        kind = item.get("type")
        if kind == "reasoning":
            calls = None
            reasoning += _reasoning_text(item)
            reasoning_sources.append(source)
            continue
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if calls is None:
                calls = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    calls["reasoning"] = reasoning
                groups.append((calls, [*reasoning_sources, source]))
                reasoning, reasoning_sources = "", []
            else:
                calls["tool_calls"].append(call)
                groups[-1][1].append(source)
            continue
        calls = None
        if kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": item.get("call_id"),
                       "content": _responses_text(item.get("output", ""))}
        elif kind in (None, "message") and item.get("role"):
            message = {"role": item["role"], "content": _responses_text(item.get("content"))}
        else:
            raise ValueError(f"Unsupported Responses input item type: {kind!r}")
        if reasoning_sources:
            if message["role"] == "assistant":
                if reasoning:
                    message["reasoning"] = reasoning
                groups.append((message, [*reasoning_sources, source]))
            else:
                groups.append(({"role": "assistant", "content": "", "reasoning": reasoning}, reasoning_sources))
                groups.append((message, [source]))
            reasoning, reasoning_sources = "", []
        else:
            groups.append((message, [source]))
    if reasoning_sources:
        groups.append(({"role": "assistant", "content": "", "reasoning": reasoning}, reasoning_sources))
    for message, group in groups:
        messages.append(message)
        sources.append(_chat_source(group))
    return ChatCompletionsHistory(model=history.model, messages=messages, message_sources=sources,
                                  tools=_openai_tools(history.tools, schema_key="parameters"),
                                  chat_template=history.chat_template,
                                  chat_template_kwargs=copy.deepcopy(history.chat_template_kwargs))


def _chat_source(group: Sequence[ResponsesItemSource | None]) -> ChatCompletionsMessageSource | None:
    """One chat message's source from its Responses items' sources (None when any item has none)."""
    if not group or any(s is None for s in group):
        return None
    present = [s for s in group if s is not None]
    if len({id(s.exchange) for s in present}) != 1:
        raise ValueError("One projected Chat message cannot span multiple Responses exchanges")
    outputs = tuple(dict.fromkeys(s.output_index for s in present if s.output_index is not None))
    if outputs:
        return ChatCompletionsMessageSource(exchange=present[0].exchange, output_indices=outputs)
    return ChatCompletionsMessageSource(exchange=present[0].exchange,
                                        request_index=next(s.request_index for s in present
                                                           if s.request_index is not None))


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


def tokenize_history(history: History, *, base_model: str | None, tokenizer: Any, chat_template: str | None,
                     chat_template_kwargs: Mapping[str, object] | None) -> TokenizedHistory:
    """`History.tokenize()`: the history's one token sequence, as `art.tokenize` makes it (tokens.py)."""
    from ..chat.format import end_of_turn_ids
    from .tokens import _check_unsupported, _resolve_tokenizer, _sequences

    _check_unsupported(chat_template, chat_template_kwargs)
    tok = _resolve_tokenizer(tokenizer, base_model, history.model)
    exchanges = _cited_exchanges(history)
    if exchanges:
        trajectory = Trajectory(exchanges=exchanges)
    elif isinstance(history, ChatCompletionsHistory):  # no captured record: rendered from its messages
        trajectory = Trajectory(messages_and_choices=copy.deepcopy(history.messages), tools=history.tools)
    else:
        raise ValueError(f"{type(history).__name__} cites no exchanges; there is nothing to tokenize")
    trajectory.validate_fields()
    where = f"{type(history).__name__}(model={history.model!r})"
    # a history's turns are one sequence: an earlier sampled turn the server spelled again from its text is kept
    # as sampled (reconciled), as ART tokenizes the text-equivalent histories its reconciling views give
    seqs = _sequences(trajectory, tok, end_of_turn_ids(tok), history.model or base_model or "", None, where,
                      reconcile=True)
    return _one(seqs, "History tokenization")


def tensorize_history(history: History, *, device: Any = None, **kwargs: Any) -> TensorizedHistory:
    return tokenize_history(history, **kwargs).tensorize(device=device)


def tokenize_legacy_history(history: LegacyHistory, *, model: str, base_model: str | None, tokenizer: Any,
                            chat_template: str | None,
                            chat_template_kwargs: Mapping[str, object] | None) -> TokenizedHistory:
    """`LegacyHistory.tokenize()`: its one token sequence, named `model`, as `art.tokenize` makes it."""
    from ..chat.format import end_of_turn_ids
    from .tokens import _check_unsupported, _resolve_tokenizer, _sequences

    _check_unsupported(chat_template, chat_template_kwargs)
    tok = _resolve_tokenizer(tokenizer, base_model, model)
    trajectory = Trajectory(messages_and_choices=copy.deepcopy(history.messages_and_choices),
                            tools=copy.deepcopy(history.tools))
    trajectory.validate_fields()
    seqs = _sequences(trajectory, tok, end_of_turn_ids(tok), model, None, "LegacyHistory")
    one = _one(seqs, "History tokenization")
    one.history = history  # the conversation asked about, as ART's `TokenizedHistory.history`
    return one


def tokenize_item(item: Any, **kwargs: Any) -> Any:
    """`Trajectory.tokenize()` / `TrajectoryGroup.tokenize()`: `art.tokenize` of the one item (tokens.py)."""
    from .tokens import tokenize_item as tokenize

    return tokenize(item, **kwargs)


def trajectory_messages(trajectory: Trajectory) -> Messages:
    """`Trajectory.messages()` of captured exchanges (ART's): the one history's Chat Completions messages."""
    return trajectory_history(trajectory, None).as_chat_completions_history().messages


register_protocol_histories(sys.modules[__name__])  # Trajectory's history accessors and art.trajectories' names
