"""Tokenization on the tiny model's real tokenizer: masks and logprobs line up with sampled tokens."""

from __future__ import annotations

import math

import pytest

from artrl.errors import TrajectoryError
from artrl.trajectories.sequences import TokenizeStats, group_advantages, tokenize_history
from artrl.trajectories.tokenization import tokenize_groups, tokenize_sft
from artrl.trajectories import History, Trajectory, TrajectoryGroup

SYSTEM = {"role": "system", "content": "You are a calculator."}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add numbers.",
                                            "parameters": {"type": "object", "properties": {
                                                "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def trainable_runs(seq):
    """Contiguous runs of trainable positions -> list of (ids, logprobs)."""
    runs, cur = [], None
    for i, m in enumerate(seq.trainable_mask):
        if m:
            if cur is None:
                cur = ([], [])
                runs.append(cur)
            cur[0].append(seq.token_ids[i])
            cur[1].append(seq.logprobs[i])
        else:
            cur = None
    return runs


def one(seqs):
    """The single sequence a conversation without a split tokenizes into."""
    assert len(seqs) == 1, [len(x) for x in seqs]
    return seqs[0]


def choice_ids_lps(choice):
    return choice.model_extra["token_ids"], [lp.logprob for lp in choice.logprobs.content]


def test_single_turn_mask_covers_exactly_the_sampled_tokens(tok, make_choice):
    c = make_choice("The answer is 4.")
    seq = one(tokenize_history([SYSTEM, {"role": "user", "content": "2+2?"}, c], None, tok))
    ids, lps = choice_ids_lps(c)
    assert trainable_runs(seq) == [(ids, lps)]
    # the prompt before the sampled tokens is exactly the server's rendered generation prompt
    prompt = tok.apply_chat_template([SYSTEM, {"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                     tokenize=False)
    n = seq.first_trainable
    assert seq.token_ids[:n] == tok(prompt, add_special_tokens=False).input_ids
    assert all(math.isnan(x) for x in seq.logprobs[:n])


def test_multi_turn_each_choice_aligned(tok, make_choice):
    c1, c2 = make_choice("First reply."), make_choice("Second reply, longer than the first.")
    msgs = [SYSTEM, {"role": "user", "content": "a"}, c1, {"role": "user", "content": "b"}, c2]
    seq = one(tokenize_history(msgs, None, tok))
    assert trainable_runs(seq) == [choice_ids_lps(c1), choice_ids_lps(c2)]
    # the template's own <|im_end|> after a sampled turn is not duplicated
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    text = tok.decode(seq.token_ids)
    assert "First reply.<|im_end|>\n<|im_start|>user" in text
    assert seq.token_ids.count(im_end) == 5  # system, user, reply, user, reply


def test_tool_call_trajectory(tok, make_choice):
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    c1 = make_choice(call_text)
    c2 = make_choice("2 + 3 = 5")
    msgs = [SYSTEM, {"role": "user", "content": "add 2 and 3"}, c1,
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}, c2]
    seq = one(tokenize_history(msgs, TOOLS, tok))
    assert trainable_runs(seq) == [choice_ids_lps(c1), choice_ids_lps(c2)]
    text = tok.decode(seq.token_ids)
    assert '"name": "add"' in text and "<tool_response>\n5\n</tool_response>" in text
    assert text.count('{"name": "add", "arguments": {"a": 2, "b": 3}}') == 1  # the sampled call, once


def test_truncated_choice_keeps_template_end_as_context(tok, make_choice):
    c = make_choice("cut off in the mid", end=False)
    seq = one(tokenize_history([{"role": "user", "content": "x"}, c, {"role": "user", "content": "y"}], None, tok))
    ids, _ = choice_ids_lps(c)
    first = seq.first_trainable
    assert seq.token_ids[first:first + len(ids)] == ids
    nxt = first + len(ids)
    assert seq.token_ids[nxt] == tok.convert_tokens_to_ids("<|im_end|>") and not seq.trainable_mask[nxt]


def test_choice_without_token_ids_is_retokenized_and_counted(tok, make_choice):
    c = make_choice("Hello there", token_ids=False)
    g = TrajectoryGroup([Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, c], reward=r)
                         for r in (0.0, 1.0)])
    res = tokenize_groups([g], tok)
    assert res.stats.retokenized_turns == 2
    seq = res.sequences[0]
    run_ids, run_lps = trainable_runs(seq)[0]
    assert tok.decode(run_ids) == "Hello there<|im_end|>"
    assert run_lps == [lp.logprob for lp in c.logprobs.content]  # counts agree, so logprobs kept


def test_missing_logprobs_train_on_policy_and_are_counted_unless_required(tok, make_choice):
    c = make_choice("no logprobs", logprobs=False)
    g = TrajectoryGroup([Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, c], reward=r)
                         for r in (0.0, 1.0)])
    res = tokenize_groups([g], tok)
    assert res.stats.turns_missing_logprobs == 2
    (ids, lps), = trainable_runs(res.sequences[0])
    assert ids == c.model_extra["token_ids"] and all(math.isnan(x) for x in lps)  # nan: ratio 1 in the loss
    with pytest.raises(TrajectoryError, match="group 0, trajectory 0: a sampled turn carries no logprobs"):
        tokenize_groups([g], tok, require_logprobs=True)


def test_sft_trains_every_assistant_turn_through_end_token(tok):
    t = Trajectory(messages_and_choices=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"}, {"role": "assistant", "content": "goodbye"}], reward=0)
    seq = tokenize_sft([t], tok).sequences[0]
    runs = trainable_runs(seq)
    assert [tok.decode(ids) for ids, _ in runs] == ["hello<|im_end|>", "goodbye<|im_end|>"]


def test_sft_tool_call_dict_trains_rendered_call(tok):
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "1+2"}, call], tools=TOOLS, reward=0)
    seq = tokenize_sft([t], tok).sequences[0]
    (ids, _), = trainable_runs(seq)
    assert '"name": "add"' in tok.decode(ids) and tok.decode(ids).endswith("</tool_call><|im_end|>")


def test_group_advantages_and_zero_advantage_groups_skipped(tok, make_choice):
    assert group_advantages([1.0, 0.0], scale=False) == [0.5, -0.5]
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], scale=True)
    assert adv[0] == pytest.approx(1.0, abs=1e-5) and adv[1] == pytest.approx(-1.0, abs=1e-5)

    def group(rewards):
        return TrajectoryGroup([Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, make_choice("a")],
                                           reward=r) for r in rewards])

    res = tokenize_groups([group([1.0, 1.0]), group([0.5]), group([0.0, 1.0])], tok)
    assert res.stats.groups_skipped_zero_advantage == 2
    assert len(res.groups) == 1 and [s.group_index for s in res.sequences] == [2, 2]


def test_additional_histories_are_tokenized_with_the_trajectory_advantage(tok, make_choice):
    sub = History(messages_and_choices=[{"role": "user", "content": "sub task"}, make_choice("sub answer")])
    ts = [Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, make_choice("a")], reward=r,
                     additional_histories=[sub]) for r in (0.0, 1.0)]
    res = tokenize_groups([TrajectoryGroup(ts)], tok, scale_rewards=False)
    assert [(s.trajectory_index, s.history_index, s.advantage) for s in res.sequences] == [
        (0, 0, -0.5), (0, 1, -0.5), (1, 0, 0.5), (1, 1, 0.5)]


# --------------------------------------------------------------------------- the token record (docs/token-record.md)


def recorded(make_choice, tok, prompt_ids, text):
    """A Choice as our server returns it: the prompt it was sampled from, the sampled ids, logprobs."""
    c = make_choice(text)
    c.model_extra["prompt_token_ids"] = list(prompt_ids)
    return c


def test_record_turns_chain_and_split_where_the_prompt_does_not_extend(tok, make_choice):
    p1 = tok("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    c1 = recorded(make_choice, tok, p1, "first")
    gap = tok("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    c2 = recorded(make_choice, tok, p1 + c1.model_extra["token_ids"] + gap, "second")
    edited = tok("<|im_start|>user\nQ!<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    c3 = recorded(make_choice, tok, edited, "third")  # sampled from a history that no longer extends the record
    items = [{"role": "user", "content": "q"}, c1, {"role": "user", "content": "more"}, c2,
             {"role": "user", "content": "x"}, c3]
    stats = TokenizeStats()
    first, second = tokenize_history(items, None, tok, stats=stats)
    assert first.token_ids == c2.model_extra["prompt_token_ids"] + c2.model_extra["token_ids"]
    assert trainable_runs(first) == [choice_ids_lps(c1), choice_ids_lps(c2)]
    assert second.token_ids == edited + c3.model_extra["token_ids"] and trainable_runs(second) == [choice_ids_lps(c3)]
    assert (stats.record_turns, stats.record_splits, stats.rendered_turns) == (3, 1, 0)
    assert stats.repeated_context_tokens == len(edited)


def test_turns_without_a_record_are_rendered_and_counted(tok, make_choice):
    p1 = tok("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    ours, foreign = recorded(make_choice, tok, p1, "ours"), make_choice("foreign reply")
    g = TrajectoryGroup([Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, ours,
                                                          {"role": "user", "content": "and?"}, foreign], reward=r)
                         for r in (0.0, 1.0)])
    res = tokenize_groups([g], tok)
    s = res.stats
    assert (s.record_turns, s.rendered_turns, s.retokenized_turns, s.sequences) == (2, 2, 0, 4)
    record, rendered = [x for x in res.sequences if x.trajectory_index == 0]
    assert trainable_runs(record) == [choice_ids_lps(ours)]
    assert trainable_runs(rendered) == [choice_ids_lps(foreign)]  # the earlier turn is context here
    assert "ours<|im_end|>" in tok.decode(rendered.token_ids)


def test_allow_training_without_logprobs_trains_assistant_dicts_as_on_policy_as_in_art(tok, make_choice):
    def group():
        return TrajectoryGroup([Trajectory(messages_and_choices=[
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a plain dict"},
            {"role": "user", "content": "and?"}, make_choice("sampled")], reward=r) for r in (0.0, 1.0)])

    default = tokenize_groups([group()], tok)
    assert default.stats.turns_missing_logprobs == 0 and len(trainable_runs(default.sequences[0])) == 1
    art_meaning = tokenize_groups([group()], tok, allow_training_without_logprobs=True)
    runs = trainable_runs(art_meaning.sequences[0])
    assert [tok.decode(ids) for ids, _ in runs] == ["a plain dict<|im_end|>", "sampled<|im_end|>"]
    assert all(math.isnan(x) for x in runs[0][1])  # no sampled logprobs: ratio 1
    assert art_meaning.stats.turns_missing_logprobs == 2  # one dict per trajectory, counted


def test_an_assistant_dict_in_rl_data_is_explained_once_per_call(tok, caplog):
    """A first-hour trap: the reply appended as {"role": "assistant", ...} instead of the Choice. RL skips it;
    the warning must say that RL trains the server's Choice objects, and how to train text (SFT, or ART's
    allow_training_without_logprobs), once for the call rather than once per trajectory."""
    g = TrajectoryGroup([Trajectory(messages_and_choices=[{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": f"reply {r}"}], reward=r)
                         for r in (0.0, 1.0, 0.5, 0.25)])
    with caplog.at_level("WARNING", logger="artrl"):
        res = tokenize_groups([g], tok)
    assert res.sequences == [] and res.stats.trajectories_without_trainable_tokens == 4
    (record,) = [r for r in caplog.records if "no trainable turn" in r.getMessage()]
    msg = record.getMessage()
    assert "Choice objects the inference server returned" in msg
    assert "train_sft" in msg and "allow_training_without_logprobs=True" in msg
    assert "group 0 trajectory 2 and 1 more" in msg
    assert tokenize_groups([g], tok, allow_training_without_logprobs=True).stats.trajectories_without_trainable_tokens == 0
