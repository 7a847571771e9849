"""The chat format has one owner: validation, rendering, end-of-turn ids and the token record.

Families: the tiny model's tokenizer and in-process tokenizers with the real chat templates and
special tokens of Qwen2.5, Qwen3, Llama 3.1/3.2, Mistral v0.3, Gemma 2/3 (tests/chat_families.py).

Central properties:
* the engine stops on exactly the ids the trainer closes a turn on, and each template's own
  turn-end token is one of them;
* (hypothesis) for random multi-turn conversations served by the real HTTP server, the
  sequence the trainer builds for each sampled turn starts with the server's prompt ids +
  sampled ids, every sampled token is trained exactly once, and on templates that render
  earlier turns unchanged the turns chain into one sequence.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from openai.types.chat.chat_completion import Choice
from transformers import LlamaConfig, LlamaForCausalLM

import artrl as art
from artrl.trajectories import revalidate
from artrl.chat.format import (
    encode,
    end_of_turn_ids,
    message_of,
    render_prompt,
    template_message,
)
from artrl.errors import TrajectoryError
from artrl.trajectories.sequences import TokenizeStats, tokenize_history
from artrl.trajectories.tokenization import tokenize_sft
from artrl.serve import GenerationRequest, ServedModels, create_app
from artrl.serve.http.prompts import RecentCompletions
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.serve.engines.transformers_engine import TransformersEngine
from chat_families import FAMILIES, family_tokenizer, generation_config

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
ALL = ["tiny", *FAMILIES]


@pytest.fixture(scope="module")
def tokenizers(tok) -> dict[str, Any]:
    return {"tiny": tok, **{name: family_tokenizer(name) for name in FAMILIES}}


def family_end_ids(name: str, tokenizer: Any) -> frozenset[int]:
    return end_of_turn_ids(tokenizer, generation_config(name) if name != "tiny" else None)


def turn_end(name: str) -> str:
    return FAMILIES[name]["turn_end"] if name != "tiny" else "<|im_end|>"


# --------------------------------------------------------------------------- encoding

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40) | st.sampled_from(["<|im_end|>\nhi", "a <|im_start|>user b", "  two  spaces"]))
def test_encode_gives_the_wrappers_ids_whatever_state_the_backend_was_left_in(tokenizers, text):
    """`encode` skips the wrapper's batch of one for a plain fast tokenizer; a backend left padding or
    truncating (a caller's earlier `tokenizer(..., padding=...)`), or special tokens split, must not change
    the ids."""
    import copy

    for name, tokenizer in tokenizers.items():
        expected = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert encode(tokenizer, text) == expected, name
        left = copy.deepcopy(tokenizer)
        left._tokenizer.enable_padding(length=64, pad_id=0)
        left._tokenizer.enable_truncation(max_length=2)
        assert encode(left, text) == expected, name
        split = copy.deepcopy(tokenizer)
        split.split_special_tokens = True
        assert encode(split, text) == list(split(text, add_special_tokens=False)["input_ids"]), name


# --------------------------------------------------------------------------- validation and normalisation


def serve(tokenizer: Any, end_ids: frozenset[int]) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, end_ids)
    return TestClient(create_app(ServedModels("m", engine))), engine


BAD_MESSAGES = [
    ({"role": "robot", "content": "hi"}, r"\.role is 'robot'; expected one of"),
    ({"role": "user", "content": 3}, r"\.content has type int"),
    ({"role": "user", "content": None}, r"\.content is None; a 'user' message needs string content"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]},
     r"\.content\[0\] is .*only text parts .* and image parts"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     r"\.content\[0\]\.image_url\.url is 'x'; an image URL is a data: URL"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,AA"}]},
     r"\.content\[0\] is an image part without a URL"),
    ({"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
     r"\.content\[0\] is an image in an assistant message"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     "only assistant messages call tools"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
     r"tool_calls\[0\]\.function\.arguments is not valid JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
     r"tool_calls\[0\]\.function\.name is missing"),
]


@pytest.mark.parametrize("message,fragment", BAD_MESSAGES)
def test_trajectories_and_server_refuse_the_same_messages_with_the_same_words(tok, message, fragment):
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, message], reward=0.0)
    with pytest.raises(TrajectoryError, match=r"Trajectory\.messages_and_choices\[1\].*" + fragment):
        revalidate(traj, "group 0, trajectory 0")  # checked where it is used (logging, training)
    client, engine = serve(tok, end_of_turn_ids(tok))
    response = client.post("/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "q"}, message]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and re.search(r"messages\[1\].*" + fragment, error["message"])
    assert engine.prompts == []  # refused before any work


def test_template_message_normalises_content_and_tool_calls():
    msg = {"role": "assistant", "content": None, "name": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    assert template_message(msg) == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert template_message(parts) == {"role": "user", "content": "ab"}
    assert template_message({"role": "assistant", "content": "x", "tool_calls": None}) == {
        "role": "assistant", "content": "x"}  # Llama templates test `'tool_calls' in message`


def test_tool_call_arguments_render_as_json_objects_for_qwen25(tokenizers):
    # Qwen2.5's template writes `arguments | tojson`: a JSON string would be rendered quoted
    tok = tokenizers["qwen2.5"]
    messages = [template_message(m) for m in [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in text


# --------------------------------------------------------------------------- end of turn


@pytest.mark.parametrize("name", ALL)
def test_each_family_closes_assistant_turns_with_an_end_of_turn_id(tokenizers, name):
    tok = tokenizers[name]
    ends = family_end_ids(name, tok)
    end = tok.convert_tokens_to_ids(turn_end(name))
    assert end in ends and tok.eos_token_id in ends
    if name != "tiny":
        assert {tok.convert_tokens_to_ids(t) for t in FAMILIES[name]["generation_eos"]} <= ends
    # the template ends the assistant's turn with that token ...
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    ids = tok(tok.apply_chat_template(convo, tokenize=False), add_special_tokens=False).input_ids
    assert end in ids
    # ... and the trainer trains the rendered turn through it, not past it
    traj = art.Trajectory(messages_and_choices=convo, reward=0.0)
    (seq,) = tokenize_sft([traj], tok, end_ids=ends).sequences
    trained = [t for t, m in zip(seq.token_ids, seq.trainable_mask) if m]
    assert trained[-1] in ends and "Hello there" in tok.decode(trained)


def constant_model(vocab: int, end_ids: list[int]) -> LlamaForCausalLM:
    """A 1-layer Llama whose next token is always lm_head row `target` (set with `aim`)."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, mlp_bias=True, tie_word_embeddings=False,
                         eos_token_id=end_ids[0])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.bias.zero_()[0] = 1e4  # every position's hidden state ~ +e_0
        model.lm_head.weight.zero_()
    return model


def aim(model: LlamaForCausalLM, token: int) -> None:
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[token, 0] = 100.0


@pytest.mark.parametrize("name", ALL)
def test_the_engine_stops_on_exactly_the_ids_the_trainer_ends_turns_on(tokenizers, name):
    tok = tokenizers[name]
    model = constant_model(len(tok), [tok.eos_token_id])
    if name != "tiny":
        model.generation_config = generation_config(name)
    trainer_ends = end_of_turn_ids(tok, model)  # what train/rl.py and train/sft.py pass to tokenize
    engine = TransformersEngine(model, tok, max_batch_size=4)
    try:
        assert engine.end_of_turn_ids == trainer_ends
        prompt = tok("hello", add_special_tokens=False).input_ids
        ordinary = tok("a", add_special_tokens=False).input_ids[0]
        for token in [*sorted(trainer_ends), ordinary]:
            aim(model, token)
            (result,) = asyncio.run(engine.generate(GenerationRequest(prompt, max_tokens=3)))
            if token in trainer_ends:
                assert (result.token_ids, result.finish_reason) == ([token], "stop"), tok.decode([token])
            else:
                assert (result.token_ids, result.finish_reason) == ([token] * 3, "length")
    finally:
        engine.close()


# --------------------------------------------------------------------------- prompts that extend the record


def sampled(tok: Any, text: str, end: str | None) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids + ([tok.convert_tokens_to_ids(end)] if end else [])


def test_server_prompt_reuses_the_sampled_ids_of_its_own_turns(tok):
    ends = end_of_turn_ids(tok)
    recent = RecentCompletions()
    messages = [{"role": "user", "content": "Say hi."}]
    p1 = render_prompt(tok, messages, recent=recent, end_ids=ends)
    # the model spelled "hi there" its own way: one id per character, not the tokenizer's merges
    ids = [tok.convert_tokens_to_ids(c) for c in "hi"] + tok(" there", add_special_tokens=False).input_ids
    ids += [tok.convert_tokens_to_ids("<|im_end|>")]
    assert ids[:-1] != tok("hi there", add_special_tokens=False).input_ids
    recent.add({"role": "assistant", "content": "hi there"}, p1, ids, "hi there", ids[-1])
    messages += [{"role": "assistant", "content": "hi there"}, {"role": "user", "content": "Again."}]
    p2 = render_prompt(tok, messages, recent=recent, end_ids=ends)
    assert p2[:len(p1) + len(ids)] == p1 + ids  # the record extends: one training sequence
    assert tok.decode(p2) == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # without the cache the same text is re-tokenized, and the record would not extend
    plain = render_prompt(tok, messages)
    assert plain[:len(p1) + len(ids)] != p1 + ids and tok.decode(plain) == tok.decode(p2)


def test_server_prompt_keeps_the_template_where_it_rewrites_a_turn(tokenizers):
    # Qwen3 drops the <think> block of assistant turns before the last user message
    tok = tokenizers["qwen3"]
    ends = family_end_ids("qwen3", tok)
    recent = RecentCompletions()
    messages = [{"role": "user", "content": "Hi"}]
    p1 = render_prompt(tok, messages, recent=recent, end_ids=ends)
    text = "<think>\nhmm\n</think>\n\nHello"
    ids = sampled(tok, text, "<|im_end|>")
    recent.add({"role": "assistant", "content": text}, p1, ids, text, ids[-1])
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Bye"}]
    p2 = render_prompt(tok, messages, recent=recent, end_ids=ends)
    assert tok.decode(p2) == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "hmm" not in tok.decode(p2) and p2[:len(p1) + len(ids)] != p1 + ids  # a new sequence for turn 2


def test_server_prompt_reuses_the_turns_the_template_keeps_and_renders_the_ones_it_rewrites(tokenizers):
    # Qwen3, a user question then a tool loop: the first answer's <think> is dropped (before the last user
    # message), the tool-calling turn after it keeps its <think>: that turn's ids are reused, the first's not
    tok = tokenizers["qwen3"]
    ends = family_end_ids("qwen3", tok)
    recent = RecentCompletions()
    first, second = "<think>\nhmm\n</think>\n\nHello", "<think>\nadd them\n</think>\n\n" + CALL
    messages = [{"role": "user", "content": "Hi"}]
    p1 = render_prompt(tok, messages, recent=recent, end_ids=ends)
    spelled = [tok.convert_tokens_to_ids(c) for c in "Hello"]  # an unusual spelling, so reuse would show
    s1 = sampled(tok, "<think>\nhmm\n</think>\n\n", None) + spelled + sampled(tok, "", "<|im_end|>")
    recent.add({"role": "assistant", "content": first}, p1, s1, first, s1[-1])
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Now add 1 and 2."}]
    p2 = render_prompt(tok, messages, TOOLS, recent=recent, end_ids=ends)
    s2 = sampled(tok, second, "<|im_end|>")
    call = {"role": "assistant", "content": "<think>\nadd them\n</think>", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
    recent.add(call, p2, s2, second, s2[-1])
    messages += [template_message(call), {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    p3 = render_prompt(tok, messages, TOOLS, recent=recent, end_ids=ends)
    assert tok.decode(p3) == tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert p3[:len(p2) + len(s2)] == p2 + s2  # turn 3 extends turn 2's record
    assert "hmm" not in tok.decode(p3) and not any(p3[i:i + 5] == spelled for i in range(len(p3)))


def test_an_extra_generation_config_eos_stops_the_turn_and_the_record_stays_exact(tokenizers):
    # Qwen2.5's generation_config adds <|endoftext|>: sampling stops there, while the template closes turns
    # with <|im_end|>. The server strips it from the text; the trainer trains it; the next prompt is the
    # template's, so turn 2 is its own sequence, each turn on exactly its record.
    tok = tokenizers["qwen2.5"]
    ends = family_end_ids("qwen2.5", tok)
    client, engine = serve(tok, ends)
    history: list[Any] = [{"role": "user", "content": "Hi"}]
    for text in ["Hello", "Bye"]:
        ids = sampled(tok, text, "<|endoftext|>")
        engine.next = (ids, [-0.25] * len(ids))
        messages = [template_message(m) if isinstance(m, dict) else {"role": "assistant", "content":
                    m.message.content} for m in history]
        body = client.post("/v1/chat/completions", json={"model": "m", "messages": messages}).json()
        choice = Choice.model_validate(body["choices"][0])
        assert choice.message.content == text and choice.finish_reason == "stop"
        assert choice.model_extra["token_ids"] == ids and choice.model_extra["prompt_token_ids"] == engine.prompts[-1]
        history += [choice, {"role": "user", "content": "More"}]
    stats = TokenizeStats()
    seqs = tokenize_history(history, None, tok, end_ids=ends, stats=stats)
    assert (stats.record_turns, stats.record_splits, len(seqs)) == (2, 1, 2)
    for seq, choice in zip(seqs, [h for h in history if isinstance(h, Choice)]):
        record = choice.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
        assert seq.token_ids == record


# --------------------------------------------------------------------------- the property


@st.composite
def conversations(draw, name: str) -> dict[str, Any]:
    spec = FAMILIES.get(name, {"roles": ["system", "user", "assistant", "tool"], "hermes_tools": True})
    tools = "tool" in spec["roles"] and name != "mistral" and draw(st.booleans())
    words = st.text(alphabet="abcdé XYZ,.!?\n", min_size=1, max_size=16)
    turns = []
    for _ in range(draw(st.integers(1, 4))):
        call = tools and draw(st.booleans())
        text = draw(words)
        if call:
            text = CALL if draw(st.booleans()) else text.strip() + "\n" + CALL if text.strip() else CALL
        turns.append({"text": text, "end": draw(st.sampled_from(["turn_end", "turn_end", "other_end", "none"])),
                      "call": call, "reply": draw(words)})
    return {"system": "system" in spec["roles"] and draw(st.booleans()), "tools": tools, "turns": turns,
            "first": draw(words), "think": name == "qwen3" and draw(st.booleans())}


_SERVERS: dict[str, Any] = {}


def server_for(name: str, tok: Any) -> tuple[TestClient, ScriptedEngine, frozenset[int]]:
    if name not in _SERVERS:
        ends = family_end_ids(name, tok)
        _SERVERS[name] = (*serve(tok, ends), ends)
    return _SERVERS[name]


def run_conversation(name: str, tok: Any, c: dict[str, Any]) -> tuple[list[Any], bool]:
    """Play the conversation through the server; returns (messages_and_choices, whether it must chain)."""
    client, engine, ends = server_for(name, tok)
    other_ends = sorted(ends - {tok.convert_tokens_to_ids(turn_end(name))})
    history: list[Any] = ([{"role": "system", "content": "Be brief."}] if c["system"] else [])
    history.append({"role": "user", "content": c["first"]})
    chains = name in ("tiny", "qwen2.5", "qwen3")
    for k, turn in enumerate(c["turns"]):
        text = ("<think>\nok\n</think>\n\n" if c["think"] else "") + turn["text"]
        end = {"turn_end": turn_end(name), "other_end": tok.convert_ids_to_tokens(other_ends[0]) if other_ends
               else None, "none": None}[turn["end"]]
        ids = sampled(tok, text, end)
        engine.next = (ids, [-0.5 - 0.01 * i for i in range(len(ids))])
        messages = [m if isinstance(m, dict) else json.loads(json.dumps(message_of(m)))
                    for m in history]
        body = {"model": "m", "messages": messages, **({"tools": TOOLS} if c["tools"] else {})}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = Choice.model_validate(response.json()["choices"][0])
        assert choice.model_extra["prompt_token_ids"] == engine.prompts[-1] and choice.model_extra["token_ids"] == ids
        history.append(choice)
        if turn["call"] and choice.message.tool_calls:
            history.append({"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": turn["reply"]})
        else:
            history.append({"role": "user", "content": turn["reply"]})
        chains = chains and turn["end"] != "other_end" and not (c["think"] and k < len(c["turns"]) - 1)
    return history, chains


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_each_sampled_turn_trains_on_the_servers_prompt_and_sampled_ids(tokenizers, name, data):
    tok = tokenizers[name]
    c = data.draw(conversations(name))
    history, chains = run_conversation(name, tok, c)
    choices = [m for m in history if isinstance(m, Choice)]
    stats = TokenizeStats()
    seqs = tokenize_history(history, TOOLS if c["tools"] else None, tok, end_ids=server_for(name, tok)[2],
                            stats=stats)
    assert stats.record_turns == len(choices) and stats.rendered_turns == 0
    for choice in choices:
        prompt, ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
        lps = [lp.logprob for lp in choice.logprobs.content]
        holder = [s for s in seqs if s.token_ids[:len(prompt) + len(ids)] == prompt + ids]
        assert holder, f"no sequence starts with turn {choices.index(choice)}'s record"
        n = len(prompt)
        assert all(holder[0].trainable_mask[n:n + len(ids)]) and holder[0].logprobs[n:n + len(ids)] == lps
    # every sampled token is trained exactly once, and nothing else is
    assert sum(s.n_trainable for s in seqs) == sum(len(c.model_extra["token_ids"]) for c in choices)
    assert all(math.isnan(lp) for s in seqs for lp, m in zip(s.logprobs, s.trainable_mask) if not m)
    if chains:  # templates that render earlier turns unchanged: one sequence, nothing repeated
        assert (len(seqs), stats.record_splits) == (1, 0)
    assert stats.record_splits == len(seqs) - 1
    event(f"{len(choices)} turns in {len(seqs)} sequences" + (", must chain" if chains else ""))
    event("with a parsed tool call" if any(c.message.tool_calls for c in choices) else "no tool call")


def test_a_record_with_ids_outside_the_vocabulary_is_refused(tok, make_choice):
    choice = make_choice("hi")
    choice.model_extra["prompt_token_ids"] = [1, len(tok) + 7]
    with pytest.raises(TrajectoryError, match=r"group 0, trajectory 1: messages_and_choices\[1\]: "
                                              r"prompt_token_ids\[1\] is \d+, not a token id"):
        tokenize_history([{"role": "user", "content": "q"}, choice], None, tok, where="group 0, trajectory 1")


def test_a_request_the_template_cannot_render_is_a_400(tokenizers):
    tok = tokenizers["gemma2"]  # Gemma's template refuses a system message
    client, engine = serve(tok, family_end_ids("gemma2", tok))
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    assert response.status_code == 400 and "System role not supported" in response.json()["error"]["message"]
    assert engine.prompts == []


def test_the_record_cache_is_bounded_in_bytes_and_memory_levels_off():
    """Distinct completions, far more than fit: the count against max_bytes stays under it, the memory the cache
    really holds (tracemalloc) stays near it, and the newest completions are the ones kept."""
    import tracemalloc

    limit = 512 * 1024
    recent = RecentCompletions(max_bytes=limit)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        held = []
        for i in range(20_000):
            text = f"answer {i}: the sky is blue"
            recent.add({"role": "assistant", "content": text}, [1, 2, i], list(range(i % 50 + 1)), text, 7)
            if i % 5_000 == 4_999:
                held.append(tracemalloc.get_traced_memory()[0] - start)
    finally:
        tracemalloc.stop()
    assert 0 < recent.nbytes <= limit
    assert max(held) < 1.1 * limit, held  # the estimate covers what Python really holds
    assert max(held) - min(held) < 0.1 * limit, held  # levelled off
    assert recent.get({"role": "assistant", "content": "answer 19999: the sky is blue"})
    assert not recent.get({"role": "assistant", "content": "answer 0: the sky is blue"})
