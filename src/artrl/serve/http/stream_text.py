"""One streamed choice's text as its tokens arrive: decoded incrementally, stop strings held back.

`TextStream` takes a choice's sampled ids one at a time (`add`) and says what text may go
out now (`take`), such that everything it ever lets out is a prefix of the content the
non-streamed choice will have:

1. **Incremental decoding without split characters.** Each new token is decoded together
   with the few tokens before it (`prefix_offset` .. end, as vLLM's detokenizer does, so
   tokenizers that spell a word's leading space from its neighbour agree with a whole
   decode); while the text ends in U+FFFD (a token holding part of a UTF-8 character) it
   waits for the tokens that complete it. Each token's cumulative text length is recorded
   once its text is complete (`lengths`), so its logprob goes out with the piece that
   holds its text. An end-of-turn id adds no text (the server drops it from the content).
2. **Stop strings never leak.** Text from the first stop string on is never let out, nor
   a tail that could still grow into one (`"the"` holds back a final `"th"`): the
   engine ends the row at the token that completes a stop string, and the server cuts the
   content there (chat_format.cut_at_stop).
3. **Tool calls are parsed at the end.** When the request offered tools, text from
   `<tool_call>` on is held back, and so is trailing whitespace (serve/tool_calls.py strips
   the content around a call); a reply that starts with whitespace is held back whole
   (whether it is stripped depends on calls not yet sampled).

What is left when the generation ends is sent by the server from the final content, which
this stream's output is a prefix of (serve/http/streaming.py, `LiveStream.finish`).
"""

from __future__ import annotations

import bisect
from typing import Any


class TextStream:
    """See the module docstring. `stops`: the request's stop strings; `tool_tag`: the tool call opening
    tag when the request offered tools, else None."""

    def __init__(self, tokenizer: Any, end_ids: frozenset[int], stops: list[str], tool_tag: str | None) -> None:
        self._tokenizer = tokenizer
        self._end_ids = end_ids
        self._stops = [s for s in stops if s]
        self._tool_tag = tool_tag
        self.token_ids: list[int] = []
        self.text = ""  # the text of every token whose characters are complete
        self.lengths: list[int] = []  # per token with complete text: len(text) through it
        self.emitted = 0  # characters of `text` let out
        self._prefix_offset = 0
        self._read_offset = 0
        self._body: list[int] = []  # ids that spell text (end-of-turn ids left out)

    def add(self, token: int) -> None:
        """Take the next sampled id."""
        self.token_ids.append(token)
        if token in self._end_ids:  # the last id of the row; no text
            self.lengths.extend([len(self.text)] * (len(self.token_ids) - len(self.lengths)))
            return
        self._body.append(token)
        decode = self._tokenizer.decode
        before = decode(self._body[self._prefix_offset:self._read_offset], skip_special_tokens=False)
        after = decode(self._body[self._prefix_offset:], skip_special_tokens=False)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._body)
            self.lengths.extend([len(self.text)] * (len(self.token_ids) - len(self.lengths)))

    def _safe_end(self) -> int:
        """How much of `text` may go out: up to the first stop string, or a tail that could start one."""
        text = self.text
        end = len(text)
        marks = self._stops + ([self._tool_tag] if self._tool_tag else [])
        for mark in marks:
            found = text.find(mark)
            if found != -1:
                end = min(end, found)
            else:
                for m in range(min(len(mark) - 1, len(text)), 0, -1):
                    if text.endswith(mark[:m]):
                        end = min(end, len(text) - m)
                        break
        if self._tool_tag:
            if text[:1].isspace():
                return 0
            end = min(end, len(text[:end].rstrip()))
        return end

    def take(self) -> tuple[str, int]:
        """(the text that may go out now, how many tokens have their text within what is now out)."""
        end = self._safe_end()
        piece = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted += len(piece)
        return piece, self.tokens_within(self.emitted)

    def tokens_within(self, chars: int) -> int:
        """How many leading tokens have all of their text within the first `chars` characters."""
        return bisect.bisect_right(self.lengths, chars)  # lengths never decrease
