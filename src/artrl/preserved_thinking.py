"""Chat templates that keep earlier assistant turns' reasoning, as ART 0.5.23 configures them.

A reasoning model's stock chat template often drops the `<think>` block of assistant turns that came
before the last user message (Qwen3: `loop.index0 > ns.last_query_index`). At sampling time the model
of turn 2 then sees turn 1 without its reasoning, and a trainer that renders the conversation again
sees it without too. ART keeps the reasoning instead (its tokenizer loader and its inference servers
edit the template; `art.utils.chat_template.configure_preserved_thinking_chat_template`), so a
multi-turn reasoning agent is sampled from, and trained on, its whole history. artrl does the same,
at the one place a tokenizer is loaded for the server and the trainer (`models/loading.load_tokenizer`)
and in `artrl.get_tokenizer`:

1. **Qwen3 (hybrid thinking templates, those that read `enable_thinking`).** The test that decides
   whether an assistant turn is rendered with its reasoning becomes "`preserve_thinking` is true, or
   the turn comes after the last user query" (the stock test is the second half alone). With
   `preserve_thinking` true, an assistant message whose content holds its own `<think>` block (what
   artrl's server returns: the sampled text) renders as it is, not parsed and spelled again, and the
   last turn gets no empty `<think>` block in front of it; so the rendering is exactly the sampled
   text, which the server's token record (docs/token-record.md) and the trainer's placeholders need.
   Reasoning given as `reasoning_content` renders as the stock template renders it. Each rewrite is
   made only when its stock text occurs exactly once, so an unknown variant is left as it is.
2. **Templates that read the switch themselves** (a template that tests `preserve_thinking`, or
   GLM's `clear_thinking`) get its history-keeping value as their default: `preserve_thinking`
   true, `clear_thinking` false, written into the template's first line. A value passed to
   `apply_chat_template` still wins; nothing else needs to pass one, so the server's prompt, the
   trainer's rendering and a user's own `tokenizer.apply_chat_template` all agree.

The rewrite is idempotent, and a template it does not recognise is returned unchanged. What this does not
do (ART does; docs/art-compatibility.md): the rewrites of Gemma 4, MiniMax, gpt-oss (harmony), Kimi K2.5,
GLM (beyond the default) and DeepSeek V4 templates, and the whitespace-keeping edits of later Qwen templates
(those that trim `reasoning_content`). Where ART disables Qwen's inline parser outright, artrl disables it
only while `preserve_thinking` is true, so `preserve_thinking=False` gives the stock rendering back.
"""

from __future__ import annotations

from typing import Any, Final

PRESERVE_THINKING: Final = "preserve_thinking"
"""The template variable that keeps earlier turns' reasoning when true (ART's name, and Qwen's)."""
CLEAR_THINKING: Final = "clear_thinking"
"""GLM's template variable that drops earlier turns' reasoning when true."""

_QWEN3_DROPS_EARLIER: Final = "{%- if loop.index0 > ns.last_query_index %}"
"""Qwen3's test: an assistant turn keeps its reasoning only after the last user query."""
_QWEN3_KEEPS_EARLIER: Final = ("{%- if (" + PRESERVE_THINKING + " is defined and " + PRESERVE_THINKING
                               + " is true) or (loop.index0 > ns.last_query_index) %}")

_PRESERVING: Final = "(" + PRESERVE_THINKING + " is defined and " + PRESERVE_THINKING + " is true)"
_QWEN3_PARSES_INLINE: Final = "{%- if '</think>' in content %}"
"""Qwen3's inline parser: content holding `</think>` is split into reasoning and answer, then re-spelled."""
_QWEN3_LITERAL_INLINE: Final = "{%- if '</think>' in content and not " + _PRESERVING + " %}"
_QWEN3_LAST_TURN: Final = "{%- if loop.last or (not loop.last and reasoning_content) %}"
"""Qwen3's test for writing a `<think>` block: always on the last turn (an empty one without reasoning)."""
_QWEN3_LAST_TURN_LITERAL: Final = ("{%- if (loop.last and not (" + _PRESERVING + " and '<think>' in content)) "
                                   "or (not loop.last and reasoning_content) %}")
_QWEN3_REWRITES: Final = ((_QWEN3_DROPS_EARLIER, _QWEN3_KEEPS_EARLIER), (_QWEN3_PARSES_INLINE, _QWEN3_LITERAL_INLINE),
                          (_QWEN3_LAST_TURN, _QWEN3_LAST_TURN_LITERAL))

_DEFAULTS: Final = ((PRESERVE_THINKING, "true"), (CLEAR_THINKING, "false"))
"""Template variable -> the value that keeps history, set as the template's default."""


def _default_line(name: str, value: str) -> str:
    return "{%- set " + name + " = " + name + " | default(" + value + ") -%}"


def chat_template_with_preserved_thinking(chat_template: Any) -> Any:
    """`chat_template` edited to keep earlier turns' reasoning (module docstring); a dict of named templates
    is edited template by template; anything it does not recognise comes back unchanged."""
    if isinstance(chat_template, dict):
        return {name: chat_template_with_preserved_thinking(t) for name, t in chat_template.items()}
    if not isinstance(chat_template, str):
        return chat_template
    template = chat_template
    if "enable_thinking" in template and template.count(_QWEN3_DROPS_EARLIER) == 1:
        for stock, kept in _QWEN3_REWRITES:
            if template.count(stock) == 1:
                template = template.replace(stock, kept)
    for name, value in reversed(_DEFAULTS):
        line = _default_line(name, value)
        if name in template and line not in template:
            template = line + template
    return template


def configure_preserved_thinking_chat_template(tokenizer: Any) -> Any:
    """Set `tokenizer.chat_template` to its history-keeping form (in place) and return the tokenizer."""
    template = getattr(tokenizer, "chat_template", None)
    edited = chat_template_with_preserved_thinking(template)
    if edited != template:
        tokenizer.chat_template = edited
    return tokenizer


def preserves_thinking(chat_template: Any) -> bool:
    """Whether a template was edited to keep earlier turns' reasoning by default (for logs and tests)."""
    return isinstance(chat_template, str) and _default_line(PRESERVE_THINKING, "true") in chat_template
