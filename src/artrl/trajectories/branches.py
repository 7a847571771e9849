"""The branching views: a trajectory's captured exchanges as the protocol-native histories an agent built.

`Trajectory.history()` / `histories()` and their per-protocol forms (`chat_completions_histories`,
`anthropic_messages_histories`, `responses_histories`, `completions_token_histories`,
`completions_string_histories`, and the singular of each) read `Trajectory.exchanges` (exchanges.py)
and return, per model, one history per branch of the conversation, in the protocol's own
shape (history.py, protocol_histories.py), each item paired with the exchange it came from:

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
`generation_index=None`). `History.tokenize()` / `tensorize()` (history.py) go through artrl's `art.tokenize`
path (tokens.py): the exchanges a history cites are trained on their token record, an earlier
sampled turn that a later prompt spelled again from its text kept as sampled (ART's repair,
`token_record.reconciled_prompt`), so a history is one sequence. `Trajectory.messages()` is the
one history's Chat Completions messages, whatever protocol it was captured in (ART's).
"""

from __future__ import annotations

import copy
import fnmatch
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

from ..types import Messages, MessagesAndChoices, Tools
from .exchanges import CompletionsExchange, TrajectoryExchanges
from .history import (ChatCompletionsHistory, ChatCompletionsMessageSource, LegacyHistory,
                      legacy_as_chat_completions_history)
from .lineage import ChatLineage, MessagesLineage, chat_ids, messages_ids
from .protocol_histories import (AnthropicMessageSource, AnthropicMessagesHistory, CompletionsSource,
                                 CompletionsStringHistory, CompletionsStringSourceSpan, CompletionsTokenHistory,
                                 CompletionsTokenSourceSpan, ResponsesHistory, ResponsesItemSource, as_plain)
from .token_record import extra_field, token_id


class Trajectory(Protocol):
    """What the views read of a trajectory (data.py's `Trajectory`, which calls them): its exchanges, or its
    legacy histories."""

    exchanges: TrajectoryExchanges
    messages_and_choices: MessagesAndChoices
    tools: Tools | None
    additional_histories: list[LegacyHistory]


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


# --------------------------------------------------------------------------- chat completions


def normalize_chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message in ART's canonical history form (reasoning under `reasoning`; assistant content None -> "";
    no empty tool_calls, no annotations)."""
    data = copy.deepcopy(dict(as_plain(message)))
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
        {k: v for k, v in as_plain(b).items() if k not in ("token_ids", "logprobs")}
        for b in content or [] if as_plain(b).get("type") not in ("thinking", "redacted_thinking")]
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
            response = {"role": "assistant", "content": [as_plain(b) for b in exchange.response.content]}
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
    extra = extra_field(choice)
    prompt = extra.get("prompt_token_ids", extra_field(exchange.response).get("prompt_token_ids"))
    ids = extra.get("token_ids")
    if ids is None and choice.logprobs is not None and choice.logprobs.tokens:
        pairs = [token_id(t) for t in choice.logprobs.tokens]
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


def trajectory_messages(trajectory: Trajectory) -> Messages:
    """`Trajectory.messages()` of captured exchanges (ART's): the one history's Chat Completions messages."""
    return trajectory_history(trajectory, None).as_chat_completions_history().messages

