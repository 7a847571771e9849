"""Captured exchanges -> the token record the trainer trains on (docs/token-record.md), for every protocol.

A trajectory of exchanges (exchanges.py) trains exactly as one of `Choice`s: each sampled
turn becomes a `Choice` carrying the server's record (`prompt_token_ids`, `token_ids`, one
logprob per sampled id, `policy_version`), and the turns are filed into conversations
(`LegacyHistory`s); trajectories/sequences.py then trains each turn on its record, chaining turns whose
prompt extends the sequence so far. Where each protocol keeps its record (vLLM's extensions,
as ART 0.5.23 reads them; artrl's server emits the same fields):

| protocol | prompt ids | sampled ids | logprobs |
|---|---|---|---|
| chat completions | choice `prompt_token_ids` (else the response's) | choice `token_ids` | `logprobs.content[*].logprob` (or `compact_logprobs`) |
| completions | choice `prompt_token_ids` (else the response's) | choice `token_ids` (else `logprobs.tokens` spelled `token_id:N`) | `compact_logprobs`, else `logprobs.token_logprobs` |
| responses | `token_generations[i].prompt_token_ids` | `token_generations[i].token_ids` (else its `output_tokens` pairs) | `compact_logprobs` (else the pairs' `logprob`) |
| messages | response `prompt_token_ids` | response `token_ids` | response `logprobs` (or `compact_logprobs`) |

Filing: a chat completion extends the conversation its request messages continue (ART's
prefix rule, trajectories.file_turn, shared with `auto_trajectory`), so a chat turn without a record still
trains on a rendering of its messages (counted). The other protocols' requests are not chat
messages: their turns are filed by tokens (a turn extends the conversation whose last prompt +
sampled ids begin its prompt), and a turn of theirs without a complete record is refused with a
`TrajectoryError` naming the exchange (there is no text to render it from that would be right).
A chat response with several choices gives several turns; each branches from the same messages.
Logprobs that are missing, or not all numbers, leave the turn without logprobs (trained as
on-policy and counted, as for any such choice). With ART's opt-in `reconcile_text_equivalent_tokenizations`
(art.tokenize only), a turn also extends a conversation whose earlier sampled turns its prompt spells
from their text with other ids (`reconciled_prompt`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from openai.types.chat.chat_completion import Choice

from ..errors import TrajectoryError
from .exchanges import (ChatCompletionsExchange, CompletionsExchange, Endpoint, Exchange, MessagesExchange,
                        ResponsesExchange)

#: The field of a sampled choice, set by artrl's server, naming the policy version (training step) that
#: sampled it (docs/token-record.md).
POLICY_VERSION_FIELD = "policy_version"


#: ART's field of a sampled choice with in-flight adapter updates (`rollout_weight_update_mode="in_flight_lora"`):
#: `[{start_token, end_token, policy_version, ...}, ...]`, the version that sampled each run of its tokens.
POLICY_TOKEN_SPANS_FIELD = "policy_token_spans"


#: Keys holding the sampled ids' logprobs as a plain list of numbers (vLLM's compact form; ART's own key).
COMPACT_LOGPROBS_KEYS = ("compact_logprobs", "art_completion_logprobs")


# --------------------------------------------------------------------------- one exchange -> its turns


def extra_field(model: Any) -> dict[str, Any]:
    return (getattr(model, "model_extra", None) or {}) if not isinstance(model, dict) else model


def token_id(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.startswith("token_id:") and value[9:].isdigit():
        return int(value[9:])
    return None


def _numbers(values: Any, n: int) -> list[float] | None:
    """`values` as n finite floats, or None (missing, another length, or not all numbers)."""
    if not isinstance(values, list) or len(values) != n:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        return None
    return [float(v) for v in values]


def _compact(extra: dict[str, Any], n: int) -> list[float] | None:
    return next((lps for key in COMPACT_LOGPROBS_KEYS if (lps := _numbers(extra.get(key), n)) is not None), None)


_FINISH = {"length": "length", "max_tokens": "length", "incomplete": "length", "tool_calls": "tool_calls",
           "tool_use": "tool_calls", "content_filter": "content_filter", "refusal": "content_filter"}


def record_choice(text: str, prompt: Any, ids: Any, logprobs: list[float] | None, *, finish: Any = None,
                  policy_version: Any = None, index: int = 0, policy_token_spans: Any = None) -> Choice:
    """A Choice carrying a record read from another protocol: its text, prompt ids, sampled ids, logprobs."""
    data: dict[str, Any] = {"index": index, "finish_reason": _FINISH.get(str(finish), "stop"),
                            "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "prompt_token_ids": prompt, "token_ids": ids}
    if logprobs is not None and isinstance(ids, list):
        data["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                        for t, lp in zip(ids, logprobs)], "refusal": None}
    if policy_version is not None:
        data[POLICY_VERSION_FIELD] = policy_version
    if policy_token_spans is not None:  # in-flight adapter updates: the version of each run of tokens
        data[POLICY_TOKEN_SPANS_FIELD] = policy_token_spans
    return Choice.model_validate(data)


def chat_turns(exchange: ChatCompletionsExchange) -> list[Choice]:
    response_prompt = extra_field(exchange.response).get("prompt_token_ids")
    turns = []
    for choice in exchange.response.choices:
        choice = choice.model_copy(deep=True)  # the captured exchange stays as the server sent it
        extra = choice.model_extra if choice.model_extra is not None else {}
        if extra.get("prompt_token_ids") is None and response_prompt is not None:
            extra["prompt_token_ids"] = list(response_prompt)
        ids = extra.get("token_ids")
        has_content = choice.logprobs is not None and choice.logprobs.content
        if isinstance(ids, list) and not has_content and (lps := _compact(extra, len(ids))) is not None:
            choice = choice.model_copy(update={"logprobs": record_choice("", None, ids, lps).logprobs})
        turns.append(choice)
    return turns


def _completion_turns(exchange: CompletionsExchange, where: str) -> list[Choice]:
    if exchange.request.get("echo") is True:
        raise TrajectoryError(f"{where}: a completions request with echo=true; its logprobs mix the prompt's and the "
                              "sample's, which training does not split yet. Send echo=false.")
    response_prompt = extra_field(exchange.response).get("prompt_token_ids")
    turns = []
    for choice in exchange.response.choices:
        extra = extra_field(choice)
        prompt = extra.get("prompt_token_ids", response_prompt)
        classic = choice.logprobs.model_dump() if choice.logprobs is not None else {}
        ids = extra.get("token_ids")
        if ids is None and classic.get("tokens"):
            pairs = [token_id(t) for t in classic["tokens"]]
            ids = pairs if all(t is not None for t in pairs) else None
        n = len(ids) if isinstance(ids, list) else -1
        lps = _compact(extra, n) or _numbers(classic.get("token_logprobs"), n)
        turns.append(record_choice(choice.text, prompt, ids, lps, finish=choice.finish_reason,
                                   policy_version=extra.get(POLICY_VERSION_FIELD), index=choice.index,
                                   policy_token_spans=extra.get(POLICY_TOKEN_SPANS_FIELD)))
    return turns


def _responses_turns(exchange: ResponsesExchange) -> list[Choice]:
    response = exchange.response
    extra = extra_field(response)
    generations = extra.get("token_generations")
    version = extra.get(POLICY_VERSION_FIELD)
    finish = "incomplete" if response.status == "incomplete" else None
    if not isinstance(generations, list) or not generations:  # no record: one turn of the whole output
        return [record_choice(response.output_text, None, None, None, finish=finish, policy_version=version)]
    turns = []
    for k, generation in enumerate(generations):
        generation = generation if isinstance(generation, dict) else {}
        ids, lps = generation.get("token_ids"), None
        if isinstance(ids, list):
            lps = _compact(generation, len(ids))
        if lps is None and isinstance(generation.get("output_tokens"), list):
            pairs = [p if isinstance(p, dict) else {} for p in generation["output_tokens"]]
            pair_ids = [token_id(p.get("token_id", p.get("token"))) for p in pairs]
            if all(t is not None for t in pair_ids) and (ids is None or ids == pair_ids):
                ids = pair_ids
                lps = _numbers([p.get("logprob") for p in pairs], len(pair_ids))
        text = "".join(_output_text(response.output[i]) for i in generation.get("output_indices") or []
                       if isinstance(i, int) and 0 <= i < len(response.output))
        turns.append(record_choice(text, generation.get("prompt_token_ids"), ids, lps, finish=finish,
                                   policy_version=generation.get(POLICY_VERSION_FIELD, version), index=k,
                                   policy_token_spans=generation.get(POLICY_TOKEN_SPANS_FIELD)))
    return turns


def _output_text(item: Any) -> str:
    data = item.model_dump() if hasattr(item, "model_dump") else dict(item)
    if data.get("type") == "function_call":
        return f"{data.get('name')}({data.get('arguments')})"
    return "".join(part.get("text") or part.get("refusal") or "" for part in data.get("content") or []
                   if isinstance(part, dict))


def _messages_turns(exchange: MessagesExchange) -> list[Choice]:
    response = exchange.response
    data = response.model_dump()
    ids = data.get("token_ids")
    n = len(ids) if isinstance(ids, list) else -1
    lps = _compact(data, n) or _numbers(data.get("logprobs"), n)
    text = "".join(block.get("text") or "" for block in data.get("content") or [] if isinstance(block, dict))
    return [record_choice(text, data.get("prompt_token_ids"), ids, lps, finish=data.get("stop_reason"),
                          policy_version=data.get(POLICY_VERSION_FIELD),
                          policy_token_spans=data.get(POLICY_TOKEN_SPANS_FIELD))]


def exchange_turns(endpoint: Endpoint, exchange: Exchange, where: str = "exchange") -> list[Choice]:
    """The sampled turns of one exchange, each a Choice carrying its record (whatever of it the server sent)."""
    if isinstance(exchange, ChatCompletionsExchange):
        return chat_turns(exchange)
    if isinstance(exchange, CompletionsExchange):
        return _completion_turns(exchange, where)
    if isinstance(exchange, ResponsesExchange):
        return _responses_turns(exchange)
    if isinstance(exchange, MessagesExchange):
        return _messages_turns(exchange)
    raise TrajectoryError(f"{where} has type {type(exchange).__name__}; expected an exchange of {endpoint}.")


# --------------------------------------------------------------------------- text-equivalent prompts (opt-in)


@dataclass
class SampledSpan:
    """A sampled turn inside a token sequence: where its ids start, the ids, and the text they spell (None when
    the turn is more than text: tool calls, reasoning)."""

    start: int
    ids: list[int]
    text: str | None


def sampled_text(choice: Choice) -> str | None:
    """The text a sampled turn's ids spell, when that is all the turn is (no tool calls, no reasoning)."""
    message = choice.message
    extra = message.model_extra or {}
    if message.tool_calls or extra.get("reasoning") or extra.get("reasoning_content"):
        return None
    return message.content if isinstance(message.content, str) else None


def reconciled_prompt(prompt: Sequence[int], sequence: Sequence[int], sampled: Sequence[SampledSpan],
                      encode: Callable[[str], list[int]], end_ids: Collection[int]) -> list[int] | None:
    """`prompt` with each earlier sampled turn spelled with its sampled ids, where the server re-tokenized that
    turn's text when it built `prompt`; None unless the result then begins with `sequence` (ART 0.5.23's
    `reconcile_text_equivalent_tokenizations`).

    The server renders a later request's messages as text and tokenizes it, so a turn whose sampled ids are not
    the tokenizer's own spelling of its text (" Paris" sampled as " Par" "is") comes back spelled differently.
    Only that is repaired: the prompt must hold, at the turn's place, exactly the tokenizer's ids of its text
    (then the turn's final end-of-turn id, when it sampled one), and agree with `sequence` everywhere else.
    """
    repaired = list(prompt)
    for span in sampled:
        core = span.ids[:-1] if span.ids and span.ids[-1] in end_ids else span.ids
        if span.text is None:
            return None
        spelled = encode(span.text)
        if spelled == core:
            continue
        written = [*spelled, *span.ids[len(core):]]
        start = span.start
        if repaired[:start] != list(sequence[:start]) or repaired[start:start + len(written)] != written:
            return None
        repaired[start:start + len(written)] = span.ids
    return repaired if repaired[:len(sequence)] == list(sequence) else None
