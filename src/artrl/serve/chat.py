"""The server's side of the chat format: request messages in, prompt ids and the token record out.

The rules (roles, content, tool calls, rendering, end-of-turn ids, stops) are
`artrl.chat_format`'s, shared with the data model and the trainer; this module
only applies them to HTTP requests and responses:

* `request_messages` checks a request's `messages` with the same validation as
  trajectories (a failure is an `InvalidRequestError`, answered with 400) and
  normalises them for the template;
* `PromptBuilder` renders prompts and remembers, per tokenizer, the completions
  it returned (`RecentCompletions`, the record cache), so that an assistant
  message this server produced is spelled in a later prompt with the ids it
  sampled (`chat_format.render_prompt` says when);
"""

from __future__ import annotations

import threading
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from artrl.chat_format import (
    Message,
    SampledCompletion,
    check_item,
    message_key,
    render_prompt,
    template_message,
)
from artrl.errors import TrajectoryError
from artrl.serve.engine import InvalidRequestError

DEFAULT_RECORD_CACHE_TOKENS = 4_000_000
"""Sampled token ids the server keeps per tokenizer to spell earlier turns of later prompts (~16 MB of ids)."""


def request_messages(messages: Any) -> list[Message]:
    """Check OpenAI chat `messages` and normalise them for the chat template."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidRequestError(f"messages[{i}] must be a message object with a role, got {message!r:.200}")
        try:
            out.append(template_message(check_item(message, f"messages[{i}]")))
        except TrajectoryError as error:
            raise InvalidRequestError(str(error)) from error
    return out


class RecentCompletions:
    """A bounded cache of recent completions, keyed by the assistant message returned for them.

    The server adds every completion it returns; `render_prompt` looks up the assistant
    messages of a later request here to reuse their sampled ids. Bounded by the number of
    token ids held (oldest messages go first); a few completions per message are kept (the
    same text sampled from several prompts), newest first.
    """

    PER_MESSAGE = 4

    def __init__(self, max_tokens: int = 4_000_000) -> None:
        self.max_tokens = max_tokens
        self._items: OrderedDict[Any, list[SampledCompletion]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def add(self, message: Message, prompt_ids: Sequence[int], completion: Sequence[int], text: str,
            end_id: int | None) -> None:
        entry = SampledCompletion(hash(tuple(prompt_ids)), array("i", completion), text, end_id)
        key = message_key(message)
        with self._lock:
            entries = self._items.pop(key, [])
            entries = [entry, *(e for e in entries if e != entry)]
            for dropped in entries[self.PER_MESSAGE:]:
                self._tokens -= len(dropped.token_ids)
            entries = entries[: self.PER_MESSAGE]
            self._tokens += len(entry.token_ids)
            self._items[key] = entries
            while self._tokens > self.max_tokens and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._tokens -= sum(len(e.token_ids) for e in old)

    def get(self, message: Message) -> list[SampledCompletion]:
        with self._lock:
            entries = self._items.get(message_key(message))
            if entries is None:
                return []
            self._items.move_to_end(message_key(message))
            return list(entries)

    def __len__(self) -> int:
        return len(self._items)


class PromptBuilder:
    """Renders prompts; remembers the completions returned, one cache per tokenizer."""

    def __init__(self, max_tokens: int = DEFAULT_RECORD_CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._caches: weakref.WeakKeyDictionary[Any, RecentCompletions] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def cache(self, tokenizer: Any) -> RecentCompletions:
        with self._lock:
            cache = self._caches.get(tokenizer)
            if cache is None:
                cache = self._caches[tokenizer] = RecentCompletions(self.max_tokens)
            return cache

    def prompt_ids(self, tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None,
                   end_ids: frozenset[int]) -> list[int]:
        """Token ids of the prompt (generation prompt included); a template failure is an InvalidRequestError."""
        try:
            return render_prompt(tokenizer, messages, tools, recent=self.cache(tokenizer), end_ids=end_ids)
        except TrajectoryError as error:
            raise InvalidRequestError(str(error)) from error

    def remember(self, tokenizer: Any, message: Message, prompt_ids: list[int], token_ids: list[int], text: str,
                 end_id: int | None) -> None:
        """Keep a returned completion: `message` as the client will send it back, `text` its ids' text."""
        self.cache(tokenizer).add(message, prompt_ids, token_ids, text, end_id)
