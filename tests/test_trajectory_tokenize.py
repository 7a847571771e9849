"""ART 0.5.23's `Trajectory.tokenize()` / `tensorize()` (and `TrajectoryGroup`'s, `LegacyHistory`'s),
`Trajectory.messages()` of exchanges in every protocol, and `reconcile_text_equivalent_tokenizations=True`: a
later prompt that spells an earlier sampled turn again from its text, with other ids, continues that turn's
sequence with the turn kept as sampled."""

from __future__ import annotations

import asyncio
import json
import math
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

import artrl as art
from artrl.chat.format import encode, render_text
from artrl.trajectories.exchanges import build_exchange
from artrl.trajectories.tensors import (TensorizedHistory, TensorizedMultiHistoryTrajectory, TensorizedTrajectory,
                                        TensorizedTrajectoryGroup)
from artrl.trajectories.tokens import (TokenFlag, TokenizedHistory, TokenizedMultiHistoryTrajectory,
                                       TokenizedTrajectory, TokenizedTrajectoryGroup)
from artrl.trajectories import ChatCompletionsHistory, LegacyHistory

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
USER = {"role": "user", "content": "What is the capital of France?"}
AGAIN = {"role": "user", "content": "And of Spain?"}
SAMPLED = TokenFlag.EXACT | TokenFlag.SAMPLED | TokenFlag.OUTPUT | TokenFlag.ASSISTANT


def exchange(endpoint: str, request: dict[str, Any], body: dict[str, Any], at: int) -> Any:
    start = T0 + timedelta(seconds=at)
    return build_exchange(endpoint, request, json.dumps(body).encode(), start_time=start,
                          end_time=start + timedelta(milliseconds=500))


def trajectory(*exchanges: Any, reward: float = 0.0) -> art.Trajectory:
    t = art.Trajectory(reward=reward)
    for e in exchanges:
        t.exchanges.append(e)
    return t


def chat(messages: list[dict], text: str, prompt: list[int], ids: list[int], at: int,
         message: dict[str, Any] | None = None) -> Any:
    choice = {"index": 0, "finish_reason": "stop", "message": message or {"role": "assistant", "content": text},
              "prompt_token_ids": prompt, "token_ids": ids, "compact_logprobs": [-0.5] * len(ids), "logprobs": None}
    return exchange("chat_completions", {"model": "m", "messages": messages},
                    {"id": f"c{at}", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}, at)


def completion(prompt: list[int], text: str, ids: list[int], at: int) -> Any:
    choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None, "prompt_token_ids": prompt,
              "token_ids": ids, "compact_logprobs": [-0.5] * len(ids)}
    return exchange("completions", {"model": "m", "prompt": prompt},
                    {"id": f"t{at}", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]},
                    at)


def prompt_ids(tok: Any, messages: list[dict]) -> list[int]:
    """The prompt a server that renders text and tokenizes it sends (vLLM's way: no sampled ids kept)."""
    return encode(tok, render_text(tok, messages, None, add_generation_prompt=True, where="test"))


def other_spelling(tok: Any, text: str) -> list[int]:
    """`text` one character per token: ids a model may sample, that the tokenizer never gives for `text`."""
    ids = [i for ch in text for i in encode(tok, ch)]
    assert ids != encode(tok, text) and tok.decode(ids) == text  # the premise: same text, other ids
    return ids


# --------------------------------------------------------------------------- Trajectory.tokenize() / tensorize()


def test_trajectory_and_group_tokenize_are_art_tokenize_of_one_item(tok) -> None:
    end = tok.eos_token_id
    first = completion([10, 11], "a", [12, end], 0)
    t = trajectory(first, completion([10, 11, 12, end, 14], "b", [15], 1), reward=0.5)
    [whole] = asyncio.run(art.tokenize([t], tokenizer=tok))
    one = t.tokenize(tokenizer=tok)
    assert type(one) is TokenizedTrajectory and one.trajectory is t and one.reward == 0.5
    assert one.tokens == whole.tokens == [10, 11, 12, end, 14, 15] and one.flags == whole.flags
    assert one.model == "m" and t.tokenize(tokenizer=tok, base_model="artrl/tiny").model == "m"  # the served model
    tensors = t.tensorize(tokenizer=tok)
    assert type(tensors) is TensorizedTrajectory and tensors.tokens.tolist() == one.tokens
    assert tensors.flags.tolist() == [int(f) for f in one.flags] and str(tensors.tokens.dtype) == "torch.int64"

    two = trajectory(first, completion([20], "c", [21], 1))  # two sequences: one needs multi_history
    with pytest.raises(ValueError, match="exactly one history; found 2"):
        two.tokenize(tokenizer=tok)
    multi = two.tokenize(tokenizer=tok, multi_history=True)
    assert type(multi) is TokenizedMultiHistoryTrajectory and [h.tokens for h in multi.histories] == [
        [10, 11, 12, end], [20, 21]]
    multi_tensors = two.tensorize(tokenizer=tok, multi_history=True)
    assert type(multi_tensors) is TensorizedMultiHistoryTrajectory
    assert [h.tokens.tolist() for h in multi_tensors.histories] == [h.tokens for h in multi.histories]

    group = art.TrajectoryGroup([t, two])
    with pytest.raises(ValueError, match=r"group.trajectories\[1\]: .*exactly one history"):
        group.tokenize(tokenizer=tok)
    tokenized = group.tokenize(tokenizer=tok, multi_history=True)
    assert type(tokenized) is TokenizedTrajectoryGroup and tokenized.trajectory_group is group
    assert [len(x.histories) for x in tokenized.trajectories] == [1, 2]
    group_tensors = art.TrajectoryGroup([t]).tensorize(tokenizer=tok)
    assert type(group_tensors) is TensorizedTrajectoryGroup
    assert group_tensors.trajectories[0].tokens.tolist() == one.tokens
    with pytest.raises(art.ConfigError, match="chat_template"):
        t.tokenize(tokenizer=tok, chat_template="{{ x }}")


def test_legacy_trajectories_and_histories_tokenize(tok, make_choice) -> None:
    choice = make_choice("Paris")
    legacy = art.Trajectory(messages_and_choices=[USER, choice], additional_histories=[
        LegacyHistory(messages_and_choices=[AGAIN, make_choice("Madrid")])])
    [whole] = asyncio.run(art.tokenize([legacy], tokenizer=tok, multi_history=True))
    multi = legacy.tokenize(tokenizer=tok, multi_history=True, model="policy")
    assert [h.tokens for h in multi.histories] == [h.tokens for h in whole.histories] and len(multi.histories) == 2
    assert all(h.model == "policy" for h in multi.histories)

    history = legacy.additional_histories[0]
    h = history.tokenize(model="policy", tokenizer=tok)
    assert type(h) is TokenizedHistory and h.history is history and h.model == "policy"
    assert h.tokens == multi.histories[1].tokens and h.flags == multi.histories[1].flags
    tensors = history.tensorize(model="policy", tokenizer=tok)
    assert type(tensors) is TensorizedHistory and tensors.tokens.tolist() == h.tokens
    with pytest.raises(TypeError, match="model"):
        history.tokenize(tokenizer=tok)  # ART's LegacyHistory.tokenize needs model=


# --------------------------------------------------------------------------- messages() in every protocol


def test_messages_of_responses_anthropic_and_completions_trajectories() -> None:
    said = {"type": "message", "id": "o1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Paris", "annotations": []}]}
    responses = trajectory(exchange("responses", {"model": "m", "instructions": "be brief", "input": "capital?"},
                                    {"id": "r1", "object": "response", "created_at": 1, "model": "m",
                                     "status": "completed", "parallel_tool_calls": True, "tool_choice": "auto",
                                     "tools": [], "output": [said]}, 0))
    assert responses.messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "capital?"},
                                    {"role": "assistant", "content": "Paris"}]

    anthropic = trajectory(exchange("messages", {"model": "m", "max_tokens": 8, "system": "sys",
                                                 "messages": [{"role": "user", "content": "capital?"}]},
                                    {"id": "a", "type": "message", "role": "assistant", "model": "m",
                                     "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 2},
                                     "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                                 {"type": "text", "text": "Paris"}]}, 0))
    assert anthropic.messages() == [{"role": "system", "content": "sys"}, {"role": "user", "content": "capital?"},
                                    {"role": "assistant", "content": "Paris", "reasoning": "hmm"}]
    assert anthropic.messages() == anthropic.history().as_chat_completions_history().messages

    with pytest.raises(ValueError, match="no chat-message structure"):  # as ART's
        trajectory(completion([1, 2], "x", [3], 0)).messages()


# --------------------------------------------------------------------------- reconcile_text_equivalent_tokenizations


def _respelled_chat(tok: Any) -> tuple[art.Trajectory, list[int], list[int], list[int]]:
    """Two chat turns from a server that re-tokenizes: turn 1 sampled "Paris" as other ids than the tokenizer's;
    turn 2's prompt spells it the tokenizer's way."""
    end = tok.eos_token_id
    first_prompt = prompt_ids(tok, [USER])
    sampled = [*other_spelling(tok, "Paris"), end]
    history = [USER, {"role": "assistant", "content": "Paris"}, AGAIN]
    second_prompt = prompt_ids(tok, history)
    assert second_prompt[:len(first_prompt)] == first_prompt
    assert second_prompt[len(first_prompt):len(first_prompt) + len(sampled)] != sampled  # the server's spelling
    second = encode(tok, "Madrid") + [end]
    t = trajectory(chat([USER], "Paris", first_prompt, sampled, 0), chat(history, "Madrid", second_prompt, second, 1))
    return t, first_prompt, sampled, second_prompt


def test_reconcile_keeps_a_respelled_chat_turn_in_one_sequence(tok) -> None:
    t, first_prompt, sampled, second_prompt = _respelled_chat(tok)
    with pytest.raises(ValueError, match="exactly one history; found 2"):  # by default: two sequences
        t.tokenize(tokenizer=tok)
    assert len(t.tokenize(tokenizer=tok, multi_history=True).histories) == 2

    one = t.tokenize(tokenizer=tok, reconcile_text_equivalent_tokenizations=True)
    [same] = asyncio.run(art.tokenize([t], tokenizer=tok, reconcile_text_equivalent_tokenizations=True))
    assert same.tokens == one.tokens and same.flags == one.flags
    spelled = encode(tok, "Paris") + [tok.eos_token_id]
    added = second_prompt[len(first_prompt) + len(spelled):]  # turn 2's new context (after its copy of turn 1)
    second_ids = encode(tok, "Madrid") + [tok.eos_token_id]
    assert one.tokens == [*first_prompt, *sampled, *added, *second_ids]  # turn 1 as sampled, not as re-spelled
    n1, n2 = len(first_prompt), len(first_prompt) + len(sampled)
    assert all(f == TokenFlag.EXACT for f in one.flags[:n1])
    assert [f & ~TokenFlag.STOP for f in one.flags[n1:n2]] == [SAMPLED] * len(sampled)
    assert one.flags[n2 - 1] & TokenFlag.STOP
    # the context added after the repair is not what the server sent as turn 2's prompt: not EXACT
    assert all(f == TokenFlag(0) for f in one.flags[n2:n2 + len(added)])
    assert all(f & SAMPLED == SAMPLED for f in one.flags[n2 + len(added):])
    assert [lp for lp in one.logprobs if not math.isnan(lp)] == [-0.5] * (len(sampled) + len(second_ids))

    # the views (ART's default): turn 2's prompt ids do not continue turn 1's record, so two histories, each one
    # of the two sequences; reconciling, one history of both turns, whose tokenize() repairs as ART's does
    views = t.histories()
    assert [len(h.messages) for h in views] == [2, 4]
    assert [h.tokenize(tokenizer=tok).tokens for h in views] == [
        h.tokens for h in t.tokenize(tokenizer=tok, multi_history=True).histories]
    with pytest.raises(ValueError, match="exactly one history; found 2"):
        t.messages()
    merged = t.history(reconcile_text_equivalent_tokenizations=True)
    assert len(merged.messages) == 4 and merged.tokenize(tokenizer=tok).tokens == one.tokens


def test_reconcile_files_respelled_turns_of_other_protocols_together_and_only_them(tok) -> None:
    end = tok.eos_token_id
    prompt = encode(tok, "Q: capital of France? A:")
    sampled = [*other_spelling(tok, " Paris"), end]
    later = [*prompt, *encode(tok, " Paris"), end, *encode(tok, " Q: and Spain? A:")]
    t = trajectory(completion(prompt, " Paris", sampled, 0), completion(later, " Madrid", [7, end], 1))
    assert len(t.tokenize(tokenizer=tok, multi_history=True).histories) == 2
    one = t.tokenize(tokenizer=tok, reconcile_text_equivalent_tokenizations=True)
    assert one.tokens == [*prompt, *sampled, *encode(tok, " Q: and Spain? A:"), 7, end]

    # a third turn whose prompt spells both earlier turns the tokenizer's way: both kept as sampled
    madrid = other_spelling(tok, " Madrid")
    t3 = trajectory(completion(prompt, " Paris", sampled, 0), completion(later, " Madrid", [*madrid, end], 1),
                    completion([*later, *encode(tok, " Madrid"), end, *encode(tok, " Q: Italy?")], " Rome",
                               [9, end], 2))
    assert len(t3.tokenize(tokenizer=tok, multi_history=True).histories) == 3
    three = t3.tokenize(tokenizer=tok, reconcile_text_equivalent_tokenizations=True)
    assert three.tokens == [*prompt, *sampled, *encode(tok, " Q: and Spain? A:"), *madrid, end,
                            *encode(tok, " Q: Italy?"), 9, end]
    assert sum(1 for f in three.flags if f & TokenFlag.SAMPLED) == len(sampled) + len(madrid) + 1 + 2

    # another text at the turn's place is not text-equivalent: still two sequences
    other = [*prompt, *encode(tok, " Lyon"), end, *encode(tok, " Q: and Spain? A:")]
    t2 = trajectory(completion(prompt, " Paris", sampled, 0), completion(other, " Madrid", [7, end], 1))
    with pytest.raises(ValueError, match="exactly one history; found 2"):
        t2.tokenize(tokenizer=tok, reconcile_text_equivalent_tokenizations=True)


def test_history_views_follow_the_token_record_unless_reconciling() -> None:
    ask = {"role": "user", "content": [{"type": "text", "text": "capital?"}]}
    reply = [{"type": "text", "text": "Paris"}]

    def message(messages: list[dict], ids: tuple[list[int], list[int]], at: int) -> Any:
        return exchange("messages", {"model": "m", "max_tokens": 8, "messages": messages},
                        {"id": f"a{at}", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn",
                         "usage": {"input_tokens": 3, "output_tokens": 2}, "content": reply,
                         "prompt_token_ids": ids[0], "token_ids": ids[1]}, at)

    history = [ask, {"role": "assistant", "content": reply}, {"role": "user", "content": "Spain?"}]
    chained = trajectory(message([ask], ([1, 2], [3, 4]), 0), message(history, ([1, 2, 3, 4, 5], [6]), 1))
    assert len(chained.anthropic_messages_history().messages) == 4
    respelled = trajectory(message([ask], ([1, 2], [3, 4]), 0), message(history, ([1, 2, 4, 5], [6]), 1))
    first, second = respelled.anthropic_messages_histories()
    assert len(first.messages) == 2 and len(second.messages) == 4
    # the second prompt kept the end of what the first sampled ([4], not [3]; a template that drops thinking does
    # that): its copy of the turn cites the first response
    assert second.message_sources[1].exchange is respelled.exchanges.messages[0]
    assert len(respelled.anthropic_messages_history(reconcile_text_equivalent_tokenizations=True).messages) == 4
    elsewhere = trajectory(message([ask], ([1, 2], [3, 4]), 0), message(history, ([1, 2, 7, 8, 5], [6]), 1))
    assert elsewhere.anthropic_messages_histories()[1].message_sources[1].exchange is \
        elsewhere.exchanges.messages[1]  # nothing of it kept: the request's own message


def test_reconciling_history_views_compare_reasoning(tok) -> None:
    thought = {"role": "assistant", "content": "Paris", "reasoning_content": "France's capital"}
    first = chat([USER], "Paris", [1, 2], [3], 0, message=thought)
    second = chat([USER, {"role": "assistant", "content": "Paris"}, AGAIN], "Madrid", [1, 2, 3, 4], [5], 1)
    t = trajectory(first, second)
    [merged] = t.chat_completions_histories()  # reasoning left out of the comparison (ART's default)
    assert len(merged.messages) == 4
    split = t.chat_completions_histories(reconcile_text_equivalent_tokenizations=True)
    assert [len(h.messages) for h in split] == [2, 4] and all(type(h) is ChatCompletionsHistory for h in split)
    assert split[0].messages[1]["reasoning"] == "France's capital"
    assert len(t.histories(reconcile_text_equivalent_tokenizations=True)) == 2


def _turn(messages: list[dict], message: dict, at: int, record: tuple[list[int], list[int]] | None,
          finish: str = "stop", **request: Any) -> Any:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "message": message, "logprobs": None}
    if record is not None:
        choice.update(prompt_token_ids=record[0], token_ids=record[1])
    return exchange("chat_completions", {"model": "m", "messages": messages, **request},
                    {"id": f"c{at}", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}, at)


def test_chat_views_split_where_a_prompt_lost_sampled_reasoning_or_continued_a_cut_tool_call() -> None:
    thought = {"role": "assistant", "content": "Paris", "reasoning_content": "France's capital"}
    said = {"role": "assistant", "content": "Madrid"}
    later = [USER, thought, AGAIN, said, {"role": "user", "content": "Italy?"}]

    def rollout(third_prompt: list[int]) -> art.Trajectory:  # turn 2 has no record: only reasoning can decide
        return trajectory(_turn([USER], thought, 0, ([1, 2], [3, 4])), _turn([USER, thought, AGAIN], said, 1, None),
                          _turn(later, {"role": "assistant", "content": "Rome"}, 2, (third_prompt, [8])))

    assert len(rollout([1, 2, 3, 4, 5, 6, 7]).chat_completions_histories()) == 1
    assert len(rollout([1, 2, 9, 5, 6, 7]).chat_completions_histories()) == 2  # turn 1's reasoning ids are gone
    assert len(rollout([1, 2, 9, 5, 6, 7]).chat_completions_histories(
        reconcile_text_equivalent_tokenizations=True)) == 1

    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "k", "type": "function", "function": {"name": "look", "arguments": "{\"q\": \"Pa"}}]}
    result = {"role": "tool", "tool_call_id": "k", "content": "?"}

    def tool_rollout(limit: int) -> art.Trajectory:
        return trajectory(_turn([USER], call, 0, ([1, 2], [3, 4]), finish="tool_calls", max_tokens=limit),
                          _turn([USER, call, result], said, 1, ([1, 2, 3, 4, 5], [6])))

    assert len(tool_rollout(8).chat_completions_histories()) == 1
    assert len(tool_rollout(2).chat_completions_histories()) == 2  # the call ran into max_tokens: never continued
    assert len(tool_rollout(2).chat_completions_histories(reconcile_text_equivalent_tokenizations=True)) == 2
