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

3. **Other families**, each made only where the stock statement occurs exactly once, each keyed on
   `preserve_thinking` so that `preserve_thinking=False` renders as the stock template does:
   Gemma 4 (a model turn's thought is kept before the last user turn too, not only beside a tool call after
   it); MiniMax (reasoning before the last user turn); gpt-oss / harmony (the analysis beside an earlier tool
   call that a final answer followed, the analysis of an earlier final answer, and that answer closed with
   the `<|return|>` the model sampled instead of `<|end|>`); Kimi K2.5 (every turn through the branch that
   keeps reasoning, none through the one that blanks it); GLM with `clear_thinking` false (an answer's
   whitespace as sampled, not stripped); Gemma 4's trim of a turn's text.

4. **Qwen3.5 and later** (3.5, 3.6, 3.8: a kept turn is written as a `<think>` block of its structured reasoning,
   then its content, and the generation prompt opens the block when thinking is on): with `preserve_thinking`,
   content that holds `</think>` (the sampled text, as artrl's server returns it) is written as it was sampled,
   after the `<think>\n` the generation prompt opened when it does not open its own block, instead of after an
   empty block of its own (3.8 has no parser and wrote two blocks; 3.5 and 3.6 parsed it and, with the first
   rewrite, also wrote two). So turn 2's prompt starts with turn 1's prompt and sampled text, and the server's
   token record carries the very ids sampled for turn 1 into it (chat_format.turn_marker: the placeholder that
   stands for such a turn holds the closing tag too, so the template writes it where the sampled text goes).

The rewrite is idempotent, and a template it does not recognise is returned unchanged. What this does not
do (ART does; docs/art-compatibility.md): DeepSeek V4 (its chat format is a Python encoder, not a template,
and ART passes it `drop_thinking=False`), and the whitespace-keeping edits of later Qwen templates for
structured `reasoning_content` (which they trim). Where ART disables Qwen's inline parser outright, artrl disables
it only while `preserve_thinking` is true, so `preserve_thinking=False` gives the stock rendering back.
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
_QWEN35_WRITES_THINK: Final = (r"{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + "
                                r"'\n</think>\n\n' + content }}")
"""Qwen3.5 and later: a kept turn is written as a `<think>` block of its reasoning, then its content (whose own
`<think>` block, the sampled text, these templates parse out, or in 3.8 do not parse at all, writing two blocks)."""
_QWEN35_WRITES_LITERAL: Final = (r"{{- '<|im_start|>' + message.role + '\n' + (((content if '<think>' in content "
                                 r"else '<think>\n' + content)) if (" + _PRESERVING
                                 + r" and message.reasoning_content is not string and '</think>' in content) else "
                                 r"'<think>\n' + reasoning_content + '\n</think>\n\n' + content) }}")
"""With `preserve_thinking`, content holding `</think>` is the sampled text: as it is when it opens its own block,
after the `<think>\n` that these templates' generation prompt opens (thinking on) when it does not."""
_QWEN3_REWRITES: Final = ((_QWEN3_DROPS_EARLIER, _QWEN3_KEEPS_EARLIER), (_QWEN3_PARSES_INLINE, _QWEN3_LITERAL_INLINE),
                          (_QWEN3_LAST_TURN, _QWEN3_LAST_TURN_LITERAL), (_QWEN35_WRITES_THINK, _QWEN35_WRITES_LITERAL))

# Other families, each rewrite made only where its stock text occurs exactly once (the stock conditions are the
# templates' own text, so an unknown revision is left as it ships):


def _or_preserving(guard: str, condition: str) -> tuple[str, str]:
    """(stock, kept) for a stock test `guard and condition` that drops earlier reasoning: kept, `condition` holds
    only while `preserve_thinking` is not true."""
    return f"{guard} and {condition}", f"{guard} and ({_PRESERVING} or {condition})"


_DROPS_EARLIER: Final = (
    # Gemma 4: a model turn's thought is written only after the last user turn, and only beside a tool call
    _or_preserving("thinking_text", "loop.index0 > ns_turn.last_user_idx and message.get('tool_calls')"),
    # a Gemma 4 revision with its own switch, which keeps only earlier thoughts beside a tool call
    ("(loop.index0 > ns_turn.last_user_idx) or (" + PRESERVE_THINKING + " and message.get('tool_calls'))",
     PRESERVE_THINKING + " or (loop.index0 > ns_turn.last_user_idx)"),
    # MiniMax: reasoning is written only after the last user turn
    _or_preserving("reasoning_content", "loop.index0 > ns.last_user_index"),
    # gpt-oss (harmony): an assistant turn's analysis is written only when no final answer follows it
    _or_preserving("message.content", "not future_final_message.found"),
    _or_preserving("message.thinking", "not future_final_message.found"),
    # gpt-oss: where an earlier turn's final answer is written, its analysis is not ...
    ("{#- CoT is dropped during all previous turns, so we never render it for inference #}",
     "{%- if " + _PRESERVING + " and message.thinking is defined %}"
     "<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{%- endif %}"),
    # ... and the answer is closed with <|end|>, where the model sampled <|return|>
    ('"<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>"',
     '"<|start|>assistant<|channel|>final<|message|>" + message.content + ("<|return|>" if ' + _PRESERVING
     + ' else "<|end|>")'))
_KIMI_HISTORY_MARK: Final = "set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1]"
_KIMI_HISTORY: Final = ((_KIMI_HISTORY_MARK,
                         "set hist_msgs = [] if " + _PRESERVING
                         + " else messages[:ns.last_non_tool_call_assistant_msg+1]"),
                        ("set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg+1:]",
                         "set suffix_msgs = messages if " + _PRESERVING
                         + " else messages[ns.last_non_tool_call_assistant_msg+1:]"),
                        ("{%- if thinking is defined and thinking is false -%}",
                         "{%- if thinking is defined and thinking is false and not " + _PRESERVING + " -%}"))
"""Kimi K2.5: turns up to the last plain answer are rendered by a branch that blanks their reasoning; with
`preserve_thinking` every turn goes through the branch that keeps it."""
_GLM_STRIPS: Final = (("{{ content.strip() }}", "{{ content if not " + CLEAR_THINKING + " else content.strip() }}"),
                      ("{%- if content.strip() -%}",
                       "{%- if (content if not " + CLEAR_THINKING + " else content.strip()) -%}"))
"""GLM: an assistant turn's text is stripped of its whitespace, which the model sampled."""
_GEMMA4_TRIMS: Final = tuple(("{{- " + value + " | trim -}}",
                              "{{- " + value + " if " + _PRESERVING + " and message.role == 'assistant' else "
                              + value + " | trim -}}") for value in ("message['content']", "item['text']"))
"""Gemma 4: an assistant turn's text is trimmed, which the model sampled with its whitespace."""


def _family_rewrites(template: str) -> tuple[tuple[str, str], ...]:
    """The (stock, kept) rewrites of the families other than Qwen3 that `template` may hold."""
    return (_DROPS_EARLIER + (_KIMI_HISTORY if _KIMI_HISTORY_MARK in template else ())
            + (_GLM_STRIPS if CLEAR_THINKING in template else ())
            + (_GEMMA4_TRIMS if "ns_turn.last_user_idx" in template else ()))


def _rewritten(template: str, rewrites: tuple[tuple[str, str], ...]) -> str:
    """`template` with each stock text that occurs exactly once replaced by its kept form, in order."""
    for stock, kept in rewrites:
        if template.count(stock) == 1:
            template = template.replace(stock, kept)
    return template


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
    if "enable_thinking" in template and (template.count(_QWEN3_DROPS_EARLIER) == 1
                                          or template.count(_QWEN35_WRITES_THINK) == 1):
        template = _rewritten(template, _QWEN3_REWRITES)
    template = _rewritten(template, _family_rewrites(template))
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
