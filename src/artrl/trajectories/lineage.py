"""ART 0.5.23's token check of its history views: text alone does not decide a branch.

A request whose messages repeat a branch's (histories.py) continues it only when its prompt ids
begin with the last sampled turn's prompt + sampled ids (when both are recorded), so a history is
one token sequence. A server that spelled that turn again from its text breaks the chain: a new
branch, unless `reconcile_text_equivalent_tokenizations=True` merges text-equal turns
(`History.tokenize()` then keeps the re-spelled turn as sampled). For chat, a prompt must also still
hold the ids of every earlier sampled turn that carried reasoning (a template that drops old
reasoning splits the history), and a tool call cut at the request's token limit is never continued,
reconciling or not. A prompt's messages still cite an earlier turn's sources when the prompt kept
the end of what it sampled (`cites`).

A drawn example (prompt ids | sampled ids): turn 1 `[1 2] | [3 4]`; a turn 2 prompt `[1 2 3 4 5]`
continues it; `[1 2 7 4 5]` does not (another spelling), nor does it cite it (`[7 ...]` does not
begin with an end of `[3 4]`); `[1 2 4 5]` does not continue it but cites it (it kept `[4]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .exchanges import ChatCompletionsExchange, MessagesExchange
from .token_record import extra_field, token_id

_Ids = tuple[list[int] | None, list[int] | None]


def _ids(value: Any) -> list[int] | None:
    return [int(t) for t in value] if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value) else None


def _prefix_function(seq: Sequence[Any]) -> list[int]:
    """pi[i]: the length of the longest proper prefix of seq[:i + 1] that is also its suffix (Knuth-Morris-Pratt)."""
    pi = [0] * len(seq)
    for i in range(1, len(seq)):
        k = pi[i - 1]
        while k and seq[i] != seq[k]:
            k = pi[k - 1]
        pi[i] = k + 1 if seq[i] == seq[k] else 0
    return pi


def _contains(tokens: Sequence[int], part: Sequence[int]) -> bool:
    return not part or len(part) in _prefix_function([*part, None, *tokens])[len(part) + 1:]


def _keeps_suffix(prompt: list[int] | None, output: list[int] | None, later: Sequence[int] | None) -> bool:
    """Whether `later` begins with `prompt`, then some (non-empty) end of `output`."""
    if prompt is None or output is None or later is None or list(later[:len(prompt)]) != prompt:
        return False
    rest = list(later[len(prompt):len(prompt) + len(output)])
    return bool(output and rest) and _prefix_function([*rest, None, *output])[-1] > 0


def chat_ids(exchange: ChatCompletionsExchange, choice_index: int) -> _Ids:
    """A chat choice's recorded prompt ids and sampled ids (each None when not sent)."""
    choice = next((c for c in exchange.response.choices if c.index == choice_index), None)
    if choice is None:
        raise ValueError("Chat choice source index is out of bounds")
    extra = extra_field(choice)
    ids = _ids(extra.get("token_ids"))
    if ids is None and choice.logprobs is not None and choice.logprobs.content:
        pairs = [token_id(lp.token) for lp in choice.logprobs.content]
        ids = pairs if all(t is not None for t in pairs) else None  # type: ignore[assignment]
    return _ids(extra.get("prompt_token_ids", extra_field(exchange.response).get("prompt_token_ids"))), ids


@dataclass
class ChatLineage:
    """ART's checks of whether a chat request's prompt ids continue a branch (above)."""

    prompt_ids: list[int] | None
    length: int  # messages in the request
    reconcile: bool

    def _last(self, branch: Any) -> Any:
        return next((s for s in reversed(branch.sources[:self.length]) if s is not None
                     and isinstance(s.exchange, ChatCompletionsExchange) and s.choice_index is not None), None)

    def exact(self, branch: Any) -> bool:
        if self.prompt_ids is None or (last := self._last(branch)) is None:
            return True
        prompt, output = chat_ids(last.exchange, last.choice_index)
        return prompt is None or output is None or self.prompt_ids[:len(prompt) + len(output)] == [*prompt, *output]

    def keeps_reasoning(self, branch: Any) -> bool:
        """A template that dropped an earlier sampled turn's reasoning splits the history (ART's rule)."""
        if self.prompt_ids is None:
            return True
        for message, source in zip(branch.items[:self.length], branch.sources[:self.length]):
            if (message.get("reasoning") or message.get("reasoning_content")) and source is not None and \
                    isinstance(source.exchange, ChatCompletionsExchange) and source.choice_index is not None:
                _, output = chat_ids(source.exchange, source.choice_index)
                if output and not _contains(self.prompt_ids, output):
                    return False
        return True

    def cut_tool_call(self, branch: Any) -> bool:
        """The last sampled turn is a tool call that ran into the request's token limit: never continued."""
        if (last := self._last(branch)) is None:
            return False
        choice = next((c for c in last.exchange.response.choices if c.index == last.choice_index), None)
        if choice is None or choice.finish_reason != "tool_calls" or not choice.message.tool_calls:
            return False
        limit = last.exchange.request.get("max_completion_tokens", last.exchange.request.get("max_tokens"))
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            return False
        _, output = chat_ids(last.exchange, last.choice_index)
        return output is not None and len(output) >= limit

    def continues(self, branch: Any) -> bool:
        return not self.cut_tool_call(branch) and (self.reconcile or (self.keeps_reasoning(branch)
                                                                      and self.exact(branch)))

    def cites(self, branch: Any) -> bool:
        """Whether the prompt's messages cite the branch's sources (it continues it, or kept its last output)."""
        if self.reconcile or self.exact(branch):
            return True
        last = self._last(branch)
        return last is not None and _keeps_suffix(*chat_ids(last.exchange, last.choice_index), self.prompt_ids)


def messages_ids(exchange: MessagesExchange) -> _Ids:
    data = exchange.response.model_dump()  # the record's fields are extras of the SDK's Message (token_record.py)
    return _ids(data.get("prompt_token_ids")), _ids(data.get("token_ids"))


@dataclass
class MessagesLineage:
    """ART's check for Anthropic Messages: the request's prompt ids continue the last response's record."""

    prompt_ids: list[int] | None
    length: int
    reconcile: bool

    def _last(self, branch: Any) -> Any:
        return next((s for s in reversed(branch.sources[:self.length]) if s is not None and s.request_index is None),
                    None)

    def continues(self, branch: Any) -> bool:
        if self.reconcile or self.prompt_ids is None or (last := self._last(branch)) is None:
            return True
        prompt, output = messages_ids(last.exchange)
        return prompt is None or output is None or self.prompt_ids[:len(prompt) + len(output)] == [*prompt, *output]

    def cites(self, branch: Any) -> bool:
        if self.continues(branch):
            return True
        last = self._last(branch)
        return last is not None and _keeps_suffix(*messages_ids(last.exchange), self.prompt_ids)
