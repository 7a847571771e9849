"""Earlier turns' reasoning kept in the templates of families other than Qwen3 (artrl/chat/preserved_thinking.py), as
ART 0.5.23 edits them: Gemma 4, gpt-oss (harmony), MiniMax, Kimi K2.5, GLM.

Gemma 4 (two revisions) and gpt-oss are their real templates (tests/data/chat_templates/README.md). MiniMax's and Kimi
K2.5's are not available offline: each is checked on a small stand-in written here that holds the stock statements the
edit looks for, in the shape of that family's template. For each: the stock template drops turn 1's reasoning from
turn 2's prompt; the edited one keeps it; `preserve_thinking=False` gives the stock rendering back; the edit is
idempotent.
"""

from __future__ import annotations

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from artrl.chat.preserved_thinking import chat_template_with_preserved_thinking, preserves_thinking

from chat_families import DATA

THOUGHT = "I add the two numbers."
Q1 = {"role": "user", "content": "What is 2+2?"}
Q2 = {"role": "user", "content": "And doubled?"}

MINIMAX_LIKE = (
    "{%- set ns = namespace(last_user_index=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user_index = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}{%- set reasoning_content = message.reasoning_content -%}"
    "[assistant]{%- if reasoning_content and loop.index0 > ns.last_user_index -%}<think>{{ reasoning_content }}"
    "</think>{%- endif -%}{{ message.content }}[end]"
    "{%- else -%}[{{ message.role }}]{{ message.content }}[end]{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}[assistant]{%- endif -%}")
KIMI_LIKE = (
    "{%- set ns = namespace(last_non_tool_call_assistant_msg=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' and not m.tool_calls -%}"
    "{%- set ns.last_non_tool_call_assistant_msg = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}"
    "{%- set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg+1:] -%}"
    "{%- for m in hist_msgs -%}[{{ m.role }}]{%- if m.role == 'assistant' -%}<think></think>{%- endif -%}"
    "{{ m.content }}[end]{%- endfor -%}"
    "{%- for m in suffix_msgs -%}[{{ m.role }}]{%- if m.role == 'assistant' -%}<think>{{ m.reasoning_content or '' }}"
    "</think>{%- endif -%}{{ m.content }}[end]{%- endfor -%}"
    "{%- if add_generation_prompt -%}[assistant]"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}")

CASES = {
    "gemma4": ((DATA / "gemma4.jinja").read_text(), {"reasoning": THOUGHT}),
    "gemma4_v5": ((DATA / "gemma4_v5.jinja").read_text(), {"reasoning": THOUGHT}),
    "gpt_oss": ((DATA / "gpt_oss.jinja").read_text(), {"thinking": THOUGHT}),
    "minimax_like": (MINIMAX_LIKE, {"reasoning_content": THOUGHT}),
    "kimi_like": (KIMI_LIKE, {"reasoning_content": THOUGHT}),
}


def render(template: str, messages: list[dict], **kwargs) -> str:
    out = render_jinja_template([messages], chat_template=template, add_generation_prompt=True, **kwargs)
    return out[0][0] if isinstance(out, tuple) else out[0]


@pytest.mark.parametrize("family", sorted(CASES))
def test_earlier_reasoning_is_kept_and_preserve_thinking_false_gives_the_stock_rendering(family):
    stock, reasoning = CASES[family]
    conversation = [Q1, {"role": "assistant", "content": "It is 4.", **reasoning}, Q2]
    edited = chat_template_with_preserved_thinking(stock)
    assert edited != stock and preserves_thinking(edited)
    assert chat_template_with_preserved_thinking(edited) == edited  # idempotent
    assert THOUGHT not in render(stock, conversation)  # the premise: the stock template drops it
    kept = render(edited, conversation)
    assert THOUGHT in kept and kept.index(THOUGHT) < kept.index("It is 4.") < kept.index("And doubled?")
    assert render(edited, conversation, preserve_thinking=False) == render(stock, conversation)


def test_gpt_oss_keeps_the_analysis_of_a_tool_call_a_final_answer_followed():
    """gpt-oss drops the analysis beside an earlier tool call once a final answer follows it; kept when edited, and
    an earlier final answer ends as the model sampled it (<|return|>), not with <|end|>."""
    stock = (DATA / "gpt_oss.jinja").read_text()
    call = {"role": "assistant", "thinking": "I should call the adder.",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}
    conversation = [Q1, call, {"role": "tool", "content": "4"},
                    {"role": "assistant", "thinking": THOUGHT, "content": "It is 4."}, Q2]
    edited = chat_template_with_preserved_thinking(stock)
    before, after = render(stock, conversation), render(edited, conversation)
    assert "I should call the adder." not in before and "It is 4.<|end|>" in before
    assert "I should call the adder." in after and THOUGHT in after and "It is 4.<|return|>" in after
    assert render(edited, conversation, preserve_thinking=False) == before


def test_gemma4_v5_keeps_earlier_thoughts_without_a_tool_call():
    """Gemma 4's current revision reads preserve_thinking itself, and keeps only earlier thoughts beside a tool
    call; edited, `preserve_thinking` keeps every earlier thought, and it is on by default."""
    stock = (DATA / "gemma4_v5.jinja").read_text()
    conversation = [Q1, {"role": "assistant", "reasoning": THOUGHT, "content": "It is 4."}, Q2]
    assert THOUGHT not in render(stock, conversation, preserve_thinking=True)
    assert THOUGHT in render(chat_template_with_preserved_thinking(stock), conversation)


GLM_LIKE = (
    "{%- for m in messages -%}[{{ m.role }}]"
    "{%- if m.role == 'assistant' -%}{%- set content = m.content -%}"
    "{%- if content.strip() -%}{{ content.strip() }}{%- endif -%}"
    "{%- else -%}{{ m.content }}{%- endif -%}[end]{%- endfor -%}"
    "{%- if add_generation_prompt -%}[assistant]{%- if clear_thinking -%}{%- endif -%}{%- endif -%}")


def test_glm_keeps_an_answers_whitespace_unless_clear_thinking():
    """GLM strips an assistant turn's text, whose whitespace the model sampled; with `clear_thinking` false (the
    history-keeping default) the edited template writes it as it is (a stand-in holding GLM's stock statements)."""
    answer = {"role": "assistant", "content": "\nIt is 4.\n"}
    edited = chat_template_with_preserved_thinking(GLM_LIKE)
    assert "[assistant]It is 4.[end]" in render(GLM_LIKE, [Q1, answer, Q2])
    assert "[assistant]\nIt is 4.\n[end]" in render(edited, [Q1, answer, Q2])
    assert render(edited, [Q1, answer, Q2], clear_thinking=True) == render(GLM_LIKE, [Q1, answer, Q2])


SAMPLED = "<think>\nI add them.\n</think>\n\nIt is 4."  # what artrl's server returns as an assistant turn's content


@pytest.mark.parametrize("name", ["qwen3_5_think", "qwen3_6", "qwen3_8"])
def test_later_qwen_templates_write_an_earlier_sampled_turn_as_it_was_sampled(name):
    """Qwen3.5, 3.6 and 3.8 write a kept turn as a `<think>` block of its reasoning, then its content. Content that
    holds its own block (the sampled text) lost it to 3.5's and 3.6's parser before the last user turn, and got a
    second, empty block in front of it in 3.8's, which has no parser. Edited, it is written as it was sampled,
    and structured `reasoning_content` is kept as before."""
    stock = (DATA / f"{name}.jinja").read_text()
    edited = chat_template_with_preserved_thinking(stock)
    assert chat_template_with_preserved_thinking(edited) == edited and preserves_thinking(edited)
    inline = [Q1, {"role": "assistant", "content": SAMPLED}, Q2]
    verbatim = "<|im_start|>assistant\n" + SAMPLED + "<|im_end|>"
    assert verbatim not in render(stock, inline)
    assert verbatim in render(edited, inline)
    structured = [Q1, {"role": "assistant", "reasoning_content": THOUGHT, "content": "It is 4."}, Q2]
    assert f"<think>\n{THOUGHT}\n</think>\n\nIt is 4." in render(edited, structured)
    for conversation in (inline, structured):
        assert render(edited, conversation, preserve_thinking=False) == render(stock, conversation,
                                                                                 preserve_thinking=False)


@pytest.mark.parametrize("name", ["qwen3_5_think", "qwen3_6", "qwen3_8"])
def test_later_qwen_turn_2_prompt_holds_turn_1_as_the_model_saw_and_sampled_it(name):
    """These templates' generation prompt opens the `<think>` block (thinking on), so the sampled text, which the
    server returns as the turn's content, starts inside it. Turn 2's prompt text starts with turn 1's prompt text +
    that sampled text + the end of turn: the context the model was in."""
    edited = chat_template_with_preserved_thinking((DATA / f"{name}.jinja").read_text())
    prompt1 = render(edited, [Q1])
    assert prompt1.endswith("<|im_start|>assistant\n<think>\n")
    sampled = "I add them.\n</think>\n\nIt is 4."
    prompt2 = render(edited, [Q1, {"role": "assistant", "content": sampled}, Q2])
    assert prompt2.startswith(prompt1 + sampled + "<|im_end|>\n<|im_start|>user\nAnd doubled?")
