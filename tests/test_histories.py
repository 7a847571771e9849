"""ART 0.5.23's protocol-native histories over captured exchanges: `Trajectory.history()` / `histories()` and the
per-protocol accessors, each subclass's fields, `as_chat_completions_history()`, and `History.tokenize()`."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from datetime import datetime, timedelta, timezone
from typing import Any

import pydantic
import pytest
from art_source import art_package

import artrl as art
import artrl.trajectories as trajectories
from artrl.trajectories.exchanges import build_exchange
from artrl.trajectories import (AnthropicMessagesHistory, ChatCompletionsHistory, CompletionsStringHistory,
                                CompletionsTokenHistory, History, LegacyHistory, ResponsesHistory)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
SYSTEM, USER = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}


def exchange(endpoint: str, request: dict[str, Any], body: dict[str, Any], at: int) -> Any:
    start = T0 + timedelta(seconds=at)
    return build_exchange(endpoint, request, json.dumps(body).encode(), start_time=start,
                          end_time=start + timedelta(milliseconds=500))


def trajectory(*exchanges: Any) -> art.Trajectory:
    t = art.Trajectory()
    for e in exchanges:
        t.exchanges.append(e)
    return t


def chat(messages: list[dict], texts: list[str], at: int, model: str = "m", prompt: list[int] | None = None,
         **request: Any) -> Any:
    """A chat exchange; its choices carry sampled ids, and `prompt` ids when given (without them, only the
    messages decide the branches)."""
    choices = [{"index": k, "finish_reason": "stop", "message": {"role": "assistant", "content": text},
                "prompt_token_ids": prompt, "token_ids": [4 + k, 9], "logprobs": None}
               for k, text in enumerate(texts)]
    return exchange("chat_completions", {"model": model, "messages": messages, **request},
                    {"id": f"c{at}", "object": "chat.completion", "created": 1, "model": model, "choices": choices},
                    at)


def completion(prompt: Any, text: str, at: int, ids: tuple[list[int], list[int]] | None = None) -> Any:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
    if ids is not None:
        choice.update(prompt_token_ids=ids[0], token_ids=ids[1], compact_logprobs=[-0.1] * len(ids[1]))
    return exchange("completions", {"model": "m", "prompt": prompt},
                    {"id": f"t{at}", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}, at)


def response(request: dict[str, Any], rid: str, output: list[dict], at: int) -> Any:
    return exchange("responses", {"model": "m", **request},
                    {"id": rid, "object": "response", "created_at": 1, "model": "m", "status": "completed",
                     "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "output": output}, at)


def message(request: dict[str, Any], content: list[dict], at: int) -> Any:
    return exchange("messages", {"model": "m", "max_tokens": 8, **request},
                    {"id": f"a{at}", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn",
                     "content": content, "usage": {"input_tokens": 3, "output_tokens": 2}}, at)


def test_chat_completions_turns_extend_one_history_with_their_sources() -> None:
    first = chat([SYSTEM, USER], ["a1"], 0)
    follow = {"role": "user", "content": "more"}
    second = chat([SYSTEM, USER, {"role": "assistant", "content": "a1"}, follow], ["a2"], 1)
    judge = chat([{"role": "user", "content": "score it"}], ["7"], 2, model="judge")
    t = trajectory(first, second, judge)

    h = t.chat_completions_history(model="m")
    assert type(h) is ChatCompletionsHistory and isinstance(h, History) and h.model == "m"
    assert h.messages == [SYSTEM, USER, {"role": "assistant", "content": "a1"}, follow,
                          {"role": "assistant", "content": "a2"}]
    assert [(s.exchange is e, s.request_index, s.choice_index) for s, e in
            zip(h.message_sources, [first, first, first, second, second])] == [
        (True, 0, None), (True, 1, None), (True, None, 0), (True, 3, None), (True, None, 0)]
    assert h.as_chat_completions_history() is h and h.tools is None and h.chat_template is None

    assert [x.model for x in t.chat_completions_histories()] == ["m", "judge"]
    assert t.history(model="jud*").messages[-1] == {"role": "assistant", "content": "7"}  # a shell pattern
    with pytest.raises(ValueError, match="requires exactly one model; pass model="):
        t.history()
    with pytest.raises(ValueError, match="no Chat Completions exchanges for model 'other'"):
        t.chat_completions_histories(model="other")
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        ChatCompletionsHistory(model="m", messages=[], message_sources=[], reward=1.0)


def test_chat_choices_and_changed_tools_branch() -> None:
    two = chat([USER], ["x", "y"], 0)  # n=2: one branch per choice
    retooled = chat([USER, {"role": "assistant", "content": "x"}, USER], ["z"], 1,
                    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    t = trajectory(two, retooled)
    histories = t.histories()
    assert [type(h) for h in histories] == [ChatCompletionsHistory] * 3
    assert [[m["content"] for m in h.messages] for h in histories] == [["hi", "x"], ["hi", "y"],
                                                                        ["hi", "x", "hi", "z"]]
    assert histories[1].message_sources[1].choice_index == 1
    assert histories[2].tools[0]["function"]["name"] == "f"
    # a new branch (other tools) still cites where its earlier messages came from: the first exchange's choice
    assert [(s.exchange is e, s.request_index, s.choice_index) for s, e in
            zip(histories[2].message_sources, [two, two, retooled, retooled])] == [
        (True, 0, None), (True, None, 0), (True, 2, None), (True, None, 0)]
    with pytest.raises(ValueError, match="exactly one history; found 3"):
        t.history()


def test_anthropic_messages_history_and_its_chat_form() -> None:
    tools = [{"name": "look", "description": "look up", "input_schema": {"type": "object"}}]
    first = message({"system": "sys", "tools": tools, "messages": [{"role": "user", "content": "find x"}]},
                    [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                     {"type": "tool_use", "id": "u1", "name": "look", "input": {"q": "x"}}], 0)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u1", "content": "42"}]}
    prior = {"role": "assistant", "content": [{"type": "tool_use", "id": "u1", "name": "look", "input": {"q": "x"}}]}
    second = message({"system": "sys", "tools": tools,
                      "messages": [{"role": "user", "content": "find x"}, prior, result]},
                     [{"type": "text", "text": "it is 42"}], 1)
    t = trajectory(first, second)
    h = t.anthropic_messages_history()
    assert type(h) is AnthropicMessagesHistory and t.history().model_dump() == h.model_dump()
    assert h.system == "sys" and h.system_source is second and h.tools == tools
    assert [m["role"] for m in h.messages] == ["user", "assistant", "user", "assistant"]
    assert [(s.exchange is e, s.request_index) for s, e in zip(h.message_sources, [first, first, second, second])] \
        == [(True, 0), (True, None), (True, 2), (True, None)]  # the thinking block is not part of the match

    c = h.as_chat_completions_history()
    assert type(c) is ChatCompletionsHistory and c.model == "m"
    assert c.messages[0] == {"role": "system", "content": "sys"}
    # the items are the latest request's (its copy of the turn has no thinking), the source is the first response
    assert c.messages[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "u1", "type": "function", "function": {"name": "look", "arguments": '{"q": "x"}'}}]}
    assert c.messages[3] == {"role": "tool", "tool_call_id": "u1", "content": "42"}
    assert c.messages[4] == {"role": "assistant", "content": "it is 42"}
    assert c.tools == [{"type": "function", "function": {"name": "look", "description": "look up",
                                                         "parameters": {"type": "object"}}}]
    assert [s.output_indices for s in c.message_sources] == [None, None, (0,), None, (0,)]


def test_responses_history_follows_previous_response_id_and_converts_to_chat() -> None:
    said = {"type": "message", "id": "o1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "hello", "annotations": []}]}
    call = {"type": "function_call", "id": "f", "call_id": "k", "name": "add", "arguments": "{}",
            "status": "completed"}
    first = response({"instructions": "be kind", "input": "hi"}, "r1", [said], 0)
    second = response({"instructions": "be kind", "previous_response_id": "r1",
                       "input": [{"role": "user", "content": "add"}]}, "r2", [call], 1)
    t = trajectory(first, second)
    [h] = t.responses_histories()
    assert type(h) is ResponsesHistory and h.instructions == "be kind" and h.instructions_source is second
    assert h.previous_response_id is None and h.conversation is None
    assert [i.get("type", "message") for i in h.input] == ["message", "message", "message", "function_call"]
    assert [(s.exchange is e, s.request_index, s.output_index) for s, e in
            zip(h.input_sources, [first, first, second, second])] == [
        (True, 0, None), (True, None, 0), (True, 0, None), (True, None, 0)]
    c = h.as_chat_completions_history()
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert c.messages[2]["content"] == "hello" and c.messages[4]["tool_calls"][0]["function"]["name"] == "add"
    assert c.message_sources[4].output_indices == (0,) and c.message_sources[4].exchange is second

    opaque = trajectory(response({"previous_response_id": "elsewhere", "input": "go"}, "r3", [said], 0))
    assert opaque.responses_history().previous_response_id == "elsewhere"
    with pytest.raises(ValueError, match="Opaque Responses context"):
        opaque.history().as_chat_completions_history()


def test_completions_token_and_string_histories() -> None:
    first = completion([10, 11], "ab", 0, ids=([10, 11], [12, 13]))
    second = completion([10, 11, 12, 13, 14], "c", 1, ids=([10, 11, 12, 13, 14], [15]))
    t = trajectory(first, second)
    h = t.completions_token_history()
    assert type(h) is CompletionsTokenHistory and t.history().model_dump() == h.model_dump()
    assert h.prompt == [10, 11, 12, 13, 14, 15] and h.sampled_spans == [(2, 4), (5, 6)]
    assert [(s.start, s.end, s.source.exchange is e, s.source.choice_index) for s, e in
            zip(h.prompt_sources, [first, first, second, second])] == [
        (0, 2, True, None), (2, 4, True, 0), (4, 5, True, None), (5, 6, True, 0)]
    with pytest.raises(ValueError, match="no chat-message structure"):
        h.as_chat_completions_history()

    text = trajectory(completion("Q: 1+1? A:", " 2", 0), completion("Q: 1+1? A: 2\nQ: 2+2? A:", " 4", 1))
    with pytest.raises(ValueError, match="requires exact token IDs"):
        text.completions_token_histories()
    s = text.history()  # no token ids: the string history, as in ART
    assert type(s) is CompletionsStringHistory and s.prompt == "Q: 1+1? A: 2\nQ: 2+2? A: 4"
    assert s.sampled_spans == [(10, 12), (23, 25)] and s.prompt[10:12] == " 2"
    with pytest.raises(ValueError, match="no chat-message structure"):
        s.as_chat_completions_history()


def test_legacy_mixed_and_refused() -> None:
    legacy = art.Trajectory(messages_and_choices=[USER], additional_histories=[
        LegacyHistory(messages_and_choices=[SYSTEM])])
    assert [type(h) for h in legacy.histories()] == [LegacyHistory, LegacyHistory]
    [c, other] = legacy.chat_completions_histories(model="x")
    assert c.messages == [USER] and c.message_sources == [None] and c.model == "x" and other.messages == [SYSTEM]
    assert LegacyHistory(messages_and_choices=[USER]).as_chat_completions_history().messages == [USER]

    mixed = trajectory(chat([USER], ["a"], 0), completion("p", "q", 1))
    with pytest.raises(ValueError, match="multiple protocol histories"):
        mixed.histories()
    assert type(mixed.chat_completions_history()) is ChatCompletionsHistory  # one protocol, asked for by name


def test_history_tokenize_is_art_tokenize_of_the_exchanges_it_cites(tok) -> None:
    end = tok.eos_token_id
    t = trajectory(completion([10, 11], "a", 0, ids=([10, 11], [12, end])),
                   completion([10, 11, 12, end, 14], "b", 1, ids=([10, 11, 12, end, 14], [15])))
    [whole] = asyncio.run(art.tokenize([t], tokenizer=tok))
    one = t.completions_token_history().tokenize(tokenizer=tok)
    assert one.tokens == whole.tokens == [10, 11, 12, end, 14, 15] and one.flags == whole.flags
    assert one.model == "m"
    tensors = t.completions_token_history().tensorize(tokenizer=tok)
    assert tensors.tokens.tolist() == whole.tokens
    with pytest.raises(art.ConfigError, match="chat_template"):
        t.history().tokenize(tokenizer=tok, chat_template="{{ x }}")

    two = trajectory(chat([USER], ["x", "y"], 0, prompt=[1, 2, 3]))  # one chat branch: only its choice is tokenized
    first, second = two.chat_completions_histories()
    assert first.tokenize(tokenizer=tok).tokens == [1, 2, 3, 4, 9]
    assert second.tokenize(tokenizer=tok).tokens == [1, 2, 3, 5, 9]


ART_PACKAGE = art_package()


def _art_classes(source: str) -> dict[str, tuple[list[str], list[str], list[str]]]:
    """Top-level classes of an ART module: name -> (bases, annotated fields, methods). Read line by line, since
    ART's module uses syntax (PEP 695 `type` statements) older Pythons cannot parse."""
    classes: dict[str, tuple[list[str], list[str], list[str]]] = {}
    current = None
    for line in source.splitlines():
        if m := re.match(r"class (\w+)(?:\((.*)\))?:", line):
            current = classes.setdefault(m.group(1), ([b.strip() for b in (m.group(2) or "").split(",")], [], []))
        elif line and not line[0].isspace():
            current = None
        elif current is not None and (m := re.match(r"    (\w+): ", line)):
            current[1].append(m.group(1))
        elif current is not None and (m := re.match(r"    (?:async )?def (\w+)\(", line)):
            current[2].append(m.group(1))
    return classes


@pytest.mark.skipif(ART_PACKAGE is None, reason="set ART_SOURCE to ART 0.5.23's source to compare with it")
def test_arts_history_names_and_accessors_are_all_here() -> None:
    source = (ART_PACKAGE / "trajectories" / "__init__.py").read_text()
    classes = _art_classes(source)
    names = [name for name, (bases, _, _) in classes.items() if {"History", "_HistorySource"} & set(bases)]
    assert "TrajectoryHistory: TypeAlias" in source
    assert len(names) == 11, names  # 6 sources and spans, 5 histories
    for name in [*names, "TrajectoryHistory"]:
        assert hasattr(trajectories, name), name
    for name in names:  # ART's fields, by name
        ours = set(getattr(trajectories, name).model_fields)
        assert set(classes[name][1]) <= ours, (name, set(classes[name][1]) - ours)
    accessors = [f for f in classes["Trajectory"][2] if "history" in f or "histories" in f]
    assert len(accessors) == 12, accessors
    for name in accessors:
        assert callable(getattr(art.Trajectory, name, None)), name
    for name in classes["History"][2]:  # as_chat_completions_history, tokenize, tensorize
        assert callable(getattr(History, name, None)), name
    for cls, ours in (("LegacyHistory", LegacyHistory), ("Trajectory", art.Trajectory),
                      ("TrajectoryGroup", art.TrajectoryGroup)):
        assert {"tokenize", "tensorize"} <= set(classes[cls][2]), cls
        for name in ("tokenize", "tensorize"):  # keyword for keyword
            theirs = re.search(rf"class {cls}\(.*?\n    def {name}\(\n        self,\n        \*,\n(.*?)\n    \)",
                               source, re.S)
            assert theirs is not None, (cls, name)
            keywords = re.findall(r"^        (\w+):", theirs.group(1), re.M)
            assert keywords == [p for p in inspect.signature(getattr(ours, name)).parameters if p != "self"], \
                (cls, name, keywords)
