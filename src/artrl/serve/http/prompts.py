"""The server's side of the chat format: request messages in, prompt ids and the token record out.

The rules (roles, content, tool calls, rendering, end-of-turn ids, stops) are
`artrl.chat.format`'s, shared with the data model and the trainer; this module
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

import functools
import sys
import threading
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ...chat.format import (
    ImageTokens,
    Message,
    SampledCompletion,
    check_item,
    message_key,
    render_prompt,
    template_message,
)
from ...errors import TrajectoryError
from ..errors import InvalidRequestError

DEFAULT_RECORD_CACHE_BYTES = 64 * 1024 * 1024
"""Memory the server's record cache may take per tokenizer (ids, texts, keys and their Python objects), to spell
earlier turns of later prompts with the ids sampled; about 80,000 completions of 64 tokens."""

_ENTRY_OVERHEAD_BYTES = 400
"""Python objects around one cached completion besides its ids and strings (dict slot, key tuple, list, record,
array header); measured with tracemalloc (tests/test_chat_format.py checks the total against it)."""


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
    messages of a later request here to reuse their sampled ids. Bounded in bytes
    (`max_bytes`: the ids, the texts, the keys and an estimate of the Python objects around
    them, `nbytes`); the least recently used messages go first. A few completions per
    message are kept (the same text sampled from several prompts), newest first.
    """

    PER_MESSAGE = 4

    def __init__(self, max_bytes: int = DEFAULT_RECORD_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[Any, list[SampledCompletion]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held, as counted against `max_bytes`."""
        return self._bytes

    @staticmethod
    def _key_bytes(key: Any) -> int:
        content, calls = key
        return sys.getsizeof(content) + sum(sys.getsizeof(name) + sys.getsizeof(args) for name, args in calls)

    @staticmethod
    def _entry_bytes(entry: SampledCompletion) -> int:
        return _ENTRY_OVERHEAD_BYTES + entry.token_ids.itemsize * len(entry.token_ids) + sys.getsizeof(entry.text)

    def add(self, message: Message, prompt_ids: Sequence[int], completion: Sequence[int], text: str,
            end_id: int | None) -> None:
        entry = SampledCompletion(hash(tuple(prompt_ids)), array("i", completion), text, end_id)
        key = message_key(message)
        with self._lock:
            entries = self._items.pop(key, None)
            if entries is None:
                entries = []
                self._bytes += self._key_bytes(key)
            kept = [entry, *(e for e in entries if e != entry)]
            self._bytes += sum(self._entry_bytes(e) for e in kept[: self.PER_MESSAGE]) - \
                sum(self._entry_bytes(e) for e in entries)
            self._items[key] = kept[: self.PER_MESSAGE]
            while self._bytes > self.max_bytes and self._items:
                old_key, old = self._items.popitem(last=False)
                self._bytes -= self._key_bytes(old_key) + sum(self._entry_bytes(e) for e in old)

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

    def __init__(self, max_bytes: int = DEFAULT_RECORD_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._caches: weakref.WeakKeyDictionary[Any, RecentCompletions] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def cache(self, tokenizer: Any) -> RecentCompletions:
        with self._lock:
            cache = self._caches.get(tokenizer)
            if cache is None:
                cache = self._caches[tokenizer] = RecentCompletions(self.max_bytes)
            return cache

    def prompt_ids(self, tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None,
                   end_ids: frozenset[int], images: ImageTokens | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the prompt (generation prompt included; `images`: how its images expand;
        `template_kwargs`: the chat template's other variables, `template_kwargs_problem`); a template failure
        is an InvalidRequestError."""
        try:
            return render_prompt(tokenizer, messages, tools, recent=self.cache(tokenizer), end_ids=end_ids,
                                 images=images, template_kwargs=template_kwargs)
        except TrajectoryError as error:
            raise InvalidRequestError(str(error)) from error

    def remember(self, tokenizer: Any, message: Message, prompt_ids: list[int], token_ids: list[int], text: str,
                 end_id: int | None) -> None:
        """Keep a returned completion: `message` as the client will send it back, `text` its ids' text."""
        self.cache(tokenizer).add(message, prompt_ids, token_ids, text, end_id)


SERVER_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "add_generation_prompt", "documents", "conversation", "chat_template",
    "continue_final_message", "raise_exception", "strftime_now", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})
"""What the server passes to `apply_chat_template` itself, or that changes what it returns: never a client's."""


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables the chat template `template` reads from outside (jinja's undeclared variables)."""
    import jinja2.meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    environment = _compile_jinja_template(template).environment  # transformers' own (its extensions included)
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))


def template_kwargs_problem(tokenizer: Any, kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """(the key at fault, why) when `kwargs` (a request's `chat_template_kwargs`) names a variable the server
    sets itself (`SERVER_TEMPLATE_VARIABLES`, or a special token) or one the tokenizer's chat template does not
    read (it would be accepted and ignored); None when every key is one the template reads."""
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template] if template else []
    read = frozenset().union(*(template_variables(t) for t in templates))
    for key in kwargs:
        if key in SERVER_TEMPLATE_VARIABLES or key.endswith("_token"):
            return key, "the server sets it itself"
        if key not in read:
            return key, (f"the chat template reads no variable {key!r:.100} (it reads "
                         f"{sorted(k for k in read - SERVER_TEMPLATE_VARIABLES if not k.endswith('_token'))}), "
                         "so it would change nothing")
    return None
