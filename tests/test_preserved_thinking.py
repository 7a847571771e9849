"""Earlier assistant turns keep their `<think>` block, as in ART 0.5.23 (artrl/chat/preserved_thinking.py).

Qwen3's stock template drops the reasoning of turns before the last user message. The tokenizer the
server and the trainer load (`models.loading.load_tokenizer`, and `artrl.get_tokenizer`) gets a template
that keeps it, so turn 2 is sampled from, and trained on, a context holding turn 1's reasoning. Tests use
the offline tiny tokenizer saved with Qwen3's real template (tests/data/chat_templates/qwen3.jinja): the
template edit, the server's prompt builder and the trainer's tokenizer on their own, then the tiny model
with that template served and trained by LocalBackend.
"""

from __future__ import annotations

import copy
import pathlib

import pytest
from openai.types.chat.chat_completion import Choice

import artrl as art
from artrl.chat.format import encode, end_of_turn_ids, template_message
from artrl.models.tokenizer import load_tokenizer
from artrl.trajectories.sequences import TokenizeStats, tokenize_history
from artrl.chat.preserved_thinking import chat_template_with_preserved_thinking, preserves_thinking
from artrl.serve.http.prompts import PromptBuilder
from artrl.models.tiny import CHAT_TEMPLATE, tiny_model_path

from chat_families import DATA, family_tokenizer

QWEN3 = (DATA / "qwen3.jinja").read_text()
THOUGHT = "<think>\nThe user wants the sum, so 2 and 2 make 4.\n</think>\n\n"
REPLY = THOUGHT + "It is 4."
Q1 = {"role": "user", "content": "What is 2+2?"}
Q2 = {"role": "user", "content": "And doubled?"}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The tiny tokenizer saved with Qwen3's stock template, as a model directory would hold it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    tok.chat_template = QWEN3
    out = tmp_path_factory.mktemp("tiny-qwen3-template")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(qwen3_dir: pathlib.Path):
    return load_tokenizer(str(qwen3_dir))


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_stock_qwen3_template_drops_earlier_reasoning():
    """The premise: without the edit, turn 2's prompt has no trace of turn 1's reasoning."""
    stock = family_tokenizer("qwen3")
    text = render(stock, [Q1, {"role": "assistant", "content": REPLY}, Q2])
    assert "<think>" not in text and "It is 4." in text


def test_loaded_tokenizer_keeps_earlier_reasoning(tok, qwen3_dir):
    assert preserves_thinking(tok.chat_template)
    text = render(tok, [Q1, {"role": "assistant", "content": REPLY}, Q2])
    assert "<|im_start|>assistant\n" + REPLY + "<|im_end|>\n<|im_start|>user\nAnd doubled?" in text
    # reasoning given as a field renders the same way
    assert render(tok, [Q1, {"role": "assistant", "content": "It is 4.",
                             "reasoning_content": THOUGHT[len("<think>\n"):-len("\n</think>\n\n")]}, Q2]) == text
    # the switch is the template's default, not forced: a caller can still ask for the stock behaviour
    assert "<think>" not in render(tok, [Q1, {"role": "assistant", "content": REPLY}, Q2], preserve_thinking=False)
    # `artrl.get_tokenizer` (ART's `art.get_tokenizer`) loads the same template
    assert art.get_tokenizer(str(qwen3_dir)).chat_template == tok.chat_template


def test_edit_is_idempotent_and_leaves_other_templates_alone():
    once = chat_template_with_preserved_thinking(QWEN3)
    assert once != QWEN3 and chat_template_with_preserved_thinking(once) == once
    assert chat_template_with_preserved_thinking(CHAT_TEMPLATE) == CHAT_TEMPLATE  # tiny's keeps history already
    for name in ("qwen2.5", "llama3.1", "gemma3"):
        template = family_tokenizer(name).chat_template
        assert chat_template_with_preserved_thinking(template) == template, name
    # a template with its own switch gets the history-keeping default; a caller's value still wins
    switch = "{% if preserve_thinking %}kept{% else %}dropped{% endif %}|{% if clear_thinking %}c{% endif %}"
    edited = chat_template_with_preserved_thinking(switch)
    t = copy.copy(family_tokenizer("qwen2.5"))
    t.chat_template = edited
    assert render(t, [Q1]) == "kept|"
    assert render(t, [Q1], preserve_thinking=False, clear_thinking=True) == "dropped|c"
    assert chat_template_with_preserved_thinking({"default": QWEN3, "tool_use": CHAT_TEMPLATE}) == {
        "default": once, "tool_use": CHAT_TEMPLATE}


def record_choice(tokenizer, prompt_ids: list[int], text: str) -> Choice:
    """A Choice as the server returns it: its prompt ids, the sampled ids (with <|im_end|>), their logprobs."""
    ids = encode(tokenizer, text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return Choice.model_validate({
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text},
        "logprobs": {"content": [{"token": tokenizer.decode([i]), "logprob": -0.5, "bytes": None,
                                  "top_logprobs": []} for i in ids]},
        "token_ids": ids, "prompt_token_ids": prompt_ids})


def two_turns(tokenizer) -> tuple[list[int], Choice, list[int], Choice]:
    """Turn 1 and turn 2 through the server's prompt builder, which reuses the ids it sampled for turn 1."""
    builder, end = PromptBuilder(), end_of_turn_ids(tokenizer)
    prompt1 = builder.prompt_ids(tokenizer, [Q1], None, end)
    c1 = record_choice(tokenizer, prompt1, REPLY)
    ids1 = c1.model_extra["token_ids"]
    builder.remember(tokenizer, template_message(c1), prompt1, ids1, REPLY, ids1[-1])
    prompt2 = builder.prompt_ids(tokenizer, [Q1, template_message(c1), Q2], None, end)
    return prompt1, c1, prompt2, record_choice(tokenizer, prompt2, "It is 8.")


def test_server_prompt_extends_the_record_with_the_reasoning(tok):
    prompt1, c1, prompt2, _ = two_turns(tok)
    sampled = c1.model_extra["token_ids"]
    # turn 2's prompt is turn 1's prompt + the very ids sampled for turn 1, <think> block included
    assert prompt2[:len(prompt1) + len(sampled)] == prompt1 + sampled
    assert THOUGHT in tok.decode(prompt2)


def test_trainer_trains_turn_2_on_the_context_it_was_sampled_from(tok):
    prompt1, c1, prompt2, c2 = two_turns(tok)
    stats = TokenizeStats()
    seqs = tokenize_history([Q1, c1, Q2, c2], None, tok, stats=stats)
    # one sequence: turn 2's record extends turn 1's, so both turns train in one context holding the reasoning
    assert len(seqs) == 1 and stats.record_splits == 0 and stats.record_turns == 2
    assert seqs[0].token_ids == prompt2 + c2.model_extra["token_ids"]
    # without a record (plain messages, e.g. SFT data) the trainer's rendering keeps the reasoning too
    stats = TokenizeStats()
    last = "<think>\nDouble 4.\n</think>\n\nIt is 8."
    plain = [Q1, {"role": "assistant", "content": REPLY}, Q2, {"role": "assistant", "content": last}]
    (seq,) = tokenize_history(plain, None, tok, train_on="assistant", stats=stats)
    assert stats.rendered_turns == 2
    text = tok.decode(seq.token_ids)
    assert THOUGHT + "It is 4.<|im_end|>\n<|im_start|>user\nAnd doubled?" in text
    # the last turn is its text as written (no empty <think> block put in front of it), and is what trains
    assert text.endswith("And doubled?<|im_end|>\n<|im_start|>assistant\n" + last + "<|im_end|>\n")
    trained = tok.decode([t for t, m in zip(seq.token_ids, seq.trainable_mask) if m])
    assert trained == REPLY + "<|im_end|>" + last + "<|im_end|>"


def test_local_backend_samples_and_trains_turns_on_the_earlier_reasoning(tmp_path):
    """End to end: the tiny model with Qwen3's template, served and trained by LocalBackend. Turn 2's prompt (the
    server's record) holds turn 1's <think> block; turn 3's prompt extends turn 2's record; the train call
    trains each trajectory as one sequence on those records."""
    import asyncio
    import json
    import shutil

    from artrl.chat.format import message_of

    model_dir = tmp_path / "tiny-qwen3"
    shutil.copytree(tiny_model_path(), model_dir)
    stock = load_tokenizer(str(model_dir))
    stock.chat_template = QWEN3
    stock.save_pretrained(model_dir)
    tok = load_tokenizer(str(model_dir))

    async def rollout(client, model, seed: int) -> art.Trajectory:
        messages = [Q1, {"role": "assistant", "content": REPLY}, Q2]
        trajectory = art.Trajectory(messages_and_choices=list(messages), reward=float(seed))
        for turn in range(2):
            response = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=6, temperature=1.0,
                seed=seed * 10 + turn)
            choice = response.choices[0]
            trajectory.messages_and_choices.append(choice)
            messages.append(json.loads(json.dumps(message_of(choice))))
            nudge = {"role": "user", "content": "Go on."}
            messages.append(nudge)
            trajectory.messages_and_choices.append(nudge)
        return trajectory

    async def main() -> None:
        model = art.TrainableModel(name="thinker", project="think", base_model=str(model_dir))
        async with art.LocalBackend(path=str(tmp_path / "runs"), show_progress=False) as backend:
            await model.register(backend)
            client = model.openai_client()
            group = art.TrajectoryGroup([await rollout(client, model, seed) for seed in (1, 2)])
            for trajectory in group:
                c2, c3 = [m for m in trajectory.messages_and_choices if not isinstance(m, dict)]
                prompt2, prompt3 = c2.model_extra["prompt_token_ids"], c3.model_extra["prompt_token_ids"]
                # the server sampled turn 2 from a prompt holding turn 1's reasoning ...
                assert THOUGHT + "It is 4.<|im_end|>\n<|im_start|>user\nAnd doubled?" in tok.decode(prompt2)
                # ... and sampled turn 3 from turn 2's record, extended
                record2 = prompt2 + c2.model_extra["token_ids"]
                assert prompt3[:len(record2)] == record2
            result = await model.train([group], config=art.TrainConfig(learning_rate=1e-12))
            # the trainer trains both sampled turns of each trajectory in one sequence: that context
            assert result.metrics["data/record_turns"] == 4
            assert result.metrics["data/record_splits"] == 0
            assert result.metrics["data/rendered_turns"] == 0

    asyncio.run(main())


# ------------------------------------------------------------------- Qwen3.5 and later: the prompt opens the block

LATER_TURN_1 = "The user wants the sum, so 2 and 2 make 4.\n</think>\n\nIt is 4."  # sampled after "<think>\n"
LATER_TURN_2 = "Double it.\n</think>\n\nIt is 8."


@pytest.fixture(scope="module", params=["qwen3_6", "qwen3_8"])
def later_tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The tiny tokenizer with a Qwen3.6 or 3.8 template, loaded as the server and the trainer load it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    tok.chat_template = (DATA / f"{request.param}.jinja").read_text()
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    tok.save_pretrained(out)
    return load_tokenizer(str(out))


def test_a_later_qwen_thinking_turn_carries_its_record_into_turn_2(later_tok):
    """Thinking on, the generation prompt opens the `<think>` block and the sampled text closes it. Turn 2's prompt is
    turn 1's prompt + the very ids sampled for turn 1 (spelled here as the model may spell them, not as the text
    encodes: one word letter by letter), and the trainer trains both turns in one sequence."""
    tok = later_tok
    builder, end = PromptBuilder(), end_of_turn_ids(tok)
    prompt1 = builder.prompt_ids(tok, [Q1], None, end)
    assert tok.decode(prompt1).endswith("<|im_start|>assistant\n<think>\n")
    head, word, tail = LATER_TURN_1.partition("sum")
    spelled = encode(tok, head) + [i for ch in word for i in encode(tok, ch)] + encode(tok, tail)
    assert spelled != encode(tok, LATER_TURN_1) and tok.decode(spelled) == LATER_TURN_1
    c1 = record_choice(tok, prompt1, LATER_TURN_1)
    data = c1.model_dump()
    data["token_ids"] = ids1 = spelled + [tok.convert_tokens_to_ids("<|im_end|>")]
    data["logprobs"]["content"] = [{"token": tok.decode([i]), "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                   for i in ids1]
    c1 = Choice.model_validate(data)
    builder.remember(tok, template_message(c1), prompt1, ids1, LATER_TURN_1, ids1[-1])
    prompt2 = builder.prompt_ids(tok, [Q1, template_message(c1), Q2], None, end)
    assert prompt2[:len(prompt1) + len(ids1)] == prompt1 + ids1
    c2 = record_choice(tok, prompt2, LATER_TURN_2)
    stats = TokenizeStats()
    seqs = tokenize_history([Q1, c1, Q2, c2], None, tok, stats=stats)
    assert len(seqs) == 1 and stats.record_splits == 0 and stats.record_turns == 2
    assert seqs[0].token_ids == prompt2 + c2.model_extra["token_ids"]


def test_a_later_qwen_thinking_turn_without_its_prompt_renders_after_the_opened_block(later_tok):
    """A sampled turn with its ids but not its prompt's (another server's Choice) is trained by rendering the
    conversation around it: its ids go after the `<think>` the generation prompt opened, as the model saw them."""
    tok = later_tok
    data = record_choice(tok, [], LATER_TURN_1).model_dump()
    del data["prompt_token_ids"]
    c1 = Choice.model_validate(data)
    stats = TokenizeStats()
    (seq,) = tokenize_history([Q1, c1, Q2], None, tok, stats=stats)
    assert stats.rendered_turns == 1 and stats.record_turns == 0
    text = tok.decode(seq.token_ids)
    assert "What is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n" + LATER_TURN_1 + "<|im_end|>" in text
    trained = tok.decode([t for t, m in zip(seq.token_ids, seq.trainable_mask) if m])
    assert trained == LATER_TURN_1 + "<|im_end|>"
