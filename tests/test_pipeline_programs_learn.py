"""benchmarks/pipeline_programs_learn.py's synchronous arm (`SyncLoop`, put in a pipeline program's
`PipelineTrainer` place) and its window gain, on fakes: no model, no server; and docs/pipeline.md's tables are
the recorded runs'."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import artrl as art
from artrl.pipeline_trainer import PipelineRuntimeConfig
from bench_scripts import load_script

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_programs_learn.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("pipeline_programs_learn")


class FakeBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[list, dict]] = []

    async def train(self, model, groups, **kwargs):
        self.calls.append((list(groups), kwargs))
        return SimpleNamespace(step=len(self.calls), metrics={"loss/train": 0.5})


class FakeModel:
    def __init__(self) -> None:
        self.rows: list[tuple[str, int, dict]] = []

    async def log(self, groups, split, step, metrics):
        self.rows.append((split, step, metrics))


async def rollout(model, scenario, config) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": str(scenario)},
                                                                     {"role": "assistant", "content": "x"}],
                                               reward=r) for r in (0.0, 1.0)])


def trained_scenarios(backend: FakeBackend) -> list[list[str]]:
    return [[g.trajectories[0].messages_and_choices[0]["content"] for g in groups] for groups, _ in backend.calls]


def test_sync_loop_trains_min_batch_size_scenarios_a_step_in_stream_order(bench):
    async def stream():
        for i in range(100):
            yield i

    backend, model = FakeBackend(), FakeModel()
    loop = bench.SyncLoop(model, backend, rollout, stream(), None, eval_fn=object(),
                          pipeline=PipelineRuntimeConfig(min_batch_size=3), learning_rate=0.02, max_steps=3,
                          max_steps_off_policy=6, eval_at_start=False)
    asyncio.run(loop.train())
    assert trained_scenarios(backend) == [["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8"]]
    assert all(kw["learning_rate"] == 0.02 and kw["loss_fn"] == "cispo" for _, kw in backend.calls)
    assert [(split, step) for split, step, _ in model.rows] == [("train", 1), ("train", 2), ("train", 3)]
    assert all(m["steps_off_policy"] == 1.0 and m["loss/train"] == 0.5 for _, _, m in model.rows)


def test_sync_loop_takes_a_plain_iterable_once_and_stops_when_it_ends(bench):
    backend = FakeBackend()
    asyncio.run(bench.SyncLoop(FakeModel(), backend, rollout, ["a", "b", "c", "d", "e"], None, max_steps=5).train())
    assert trained_scenarios(backend) == [["a", "b", "c", "d"], ["e"]]  # ART's default min_batch_size, 4
    backend = FakeBackend()
    cycled = itertools.cycle(["a", "b", "c"])
    asyncio.run(bench.SyncLoop(FakeModel(), backend, rollout, cycled, None, min_batch_size=2, max_steps=2).train())
    assert trained_scenarios(backend) == [["a", "b"], ["c", "a"]]


def test_sync_loop_refuses_what_it_would_not_honour(bench):
    with pytest.raises(TypeError, match="kl_penalty_coef"):
        bench.SyncLoop(FakeModel(), FakeBackend(), rollout, [], None, max_steps=1, kl_penalty_coef=0.1)
    with pytest.raises(ValueError, match="max_steps"):
        bench.SyncLoop(FakeModel(), FakeBackend(), rollout, [], None)


def test_window_gain(bench):
    assert bench.window_gain([0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert bench.window_gain([0.2, 0.6]) == pytest.approx(0.4)  # one step at each end
    assert bench.window_gain([0.3]) is None


@pytest.mark.parametrize("results", ["pipeline-programs-learn.jsonl", "pipeline-programs-learn-lr5e-3.jsonl"])
def test_docs_table_is_the_results_file(bench, results):
    """docs/pipeline.md's tables are what `--table` prints from the recorded runs."""
    root = PATH.parents[1]
    lines = (root / "benchmarks" / "results" / "2026-12-03-cpu" / results).read_text().splitlines()
    rows = bench.table([json.loads(line) for line in lines if line.strip()]).splitlines()[2:]
    docs = (root / "docs" / "pipeline.md").read_text().splitlines()
    assert rows and all(row in docs for row in rows)


def test_welch_against_a_hand_computed_example(bench):
    # means 2 and 5, sample variances 1 and 10/3, n 3 and 4: se = sqrt(1/3 + (10/3)/4)
    diff, se, t = bench.welch([1.0, 2.0, 3.0], [3.0, 4.0, 6.0, 7.0])
    assert diff == pytest.approx(-3.0)
    assert se == pytest.approx((1 / 3 + 10 / 3 / 4) ** 0.5)
    assert t == pytest.approx(diff / se)
    assert bench.welch([1.0], [2.0, 3.0]) is None


def test_docs_in_flight_binary_prefix_figures_are_the_results_files(bench):
    """docs/pipeline.md's in-flight against step_lora figures on binary prefix are what `--table` prints from
    the recorded runs (12 and 12 replicates over the two days' files)."""
    root = PATH.parents[1]
    files = [root / "benchmarks" / "results" / "2026-12-03-cpu" / "pipeline-programs-learn.jsonl",
             root / "benchmarks" / "results" / "2026-12-04-cpu" / "pipeline-programs-learn-binary-in-flight.jsonl"]
    records = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    line = next(x for x in bench.differences(records).splitlines() if x.startswith("binary_prefix"))
    assert "-0.500, standard error 0.115, Welch t -4.35 (12 and 12 replicates)" in line
    docs = " ".join((root / "docs" / "pipeline.md").read_text().split())
    assert "difference -0.500, standard error 0.115, Welch t -4.35" in docs


def test_age_fit_recovers_a_planted_line(bench):
    """Gains made exactly 0.1 + 0.3 * age - 0.2 for in-flight runs: the fit gives those coefficients back."""
    records = [{"program": "binary_prefix", "arm": arm, "gain": 0.1 + 0.3 * age - (0.2 if arm == "in_flight" else 0),
                "token_policy_age": [0.0, age, age]}
               for arm, age in [("pipeline", 1.0), ("pipeline", 2.0), ("pipeline", 2.5), ("in_flight", 0.5),
                                ("in_flight", 1.0), ("in_flight", 1.5)]]
    assert "gain = +0.100 +0.300 * age -0.200 * [in-flight]" in bench.age_fit(records)
    assert bench.age_fit(records[:3]) == ""  # one arm only: nothing to fit


def test_read_results_takes_the_arms_named(bench, tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps({"arm": arm, "gain": i}) + "\n" for i, arm in enumerate(bench.ARMS)))
    assert [r["arm"] for r in bench.read_results(str(path))] == list(bench.ARMS)
    assert [r["arm"] for r in bench.read_results(f"{path}:in_flight")] == ["in_flight"]
    assert [r["arm"] for r in bench.read_results(f"{path}:sync,in_flight")] == ["sync", "in_flight"]


def test_start_logprobs_hands_the_trainer_each_token_under_the_version_its_rollout_started_on(bench, tmp_path):
    """A reply sampled by version 3 for its first two tokens and version 4 for the last three (in-flight) is
    rescored whole under version 3; a step_lora reply keeps its values; the log counts what moved."""
    from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
    from openai.types.chat.chat_completion_message import ChatCompletionMessage
    from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

    def choice(recorded, spans):
        c = Choice(finish_reason="stop", index=0, message=ChatCompletionMessage(role="assistant", content="x"),
                   logprobs=ChoiceLogprobs(content=[ChatCompletionTokenLogprob(token=f"token_id:{i}", logprob=v,
                                                                               bytes=None, top_logprobs=[])
                                                    for i, v in enumerate(recorded)]))
        extra = {"prompt_token_ids": [1, 2], "token_ids": [10 + i for i in range(len(recorded))]}
        if spans is not None:
            extra["policy_token_spans"] = spans
        for k, v in extra.items():
            setattr(c, k, v)
        return c

    def score(version, prompt, reply):  # version v gives token t the logprob -(v + t / 10)
        assert prompt == [1, 2]
        return [-(version + (t - 10) / 10) for t in reply]

    spans = [{"start_token": 0, "end_token": 2, "policy_version": 3},
             {"start_token": 2, "end_token": 5, "policy_version": 4}]
    in_flight = choice([-3.0, -3.1, -4.2, -4.3, -4.4], spans)
    step = choice([-3.0, -3.1000004], None)
    trajectories = [art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, c], reward=r,
                                   initial_policy_version=3) for c, r in ((in_flight, 1.0), (step, 0.0))]
    log = tmp_path / bench.START_LOGPROBS_FILE
    row = bench.StartLogprobs(score, log).rewrite([art.TrajectoryGroup(trajectories)])

    assert [lp.logprob for lp in in_flight.logprobs.content] == pytest.approx([-3.0, -3.1, -3.2, -3.3, -3.4])
    assert [lp.logprob for lp in step.logprobs.content] == pytest.approx([-3.0, -3.1])
    assert in_flight.model_extra["policy_token_spans"] == spans  # the record of who sampled what stays
    assert row["tokens_rewritten"] == 3 and row["mean_shift"] == pytest.approx(1.0)
    assert row["own_version_abs_err_max"] == pytest.approx(4e-7, abs=1e-7)
    assert json.loads(log.read_text()) == row
    assert bench.start_logprobs_summary(tmp_path) == {
        "start_logprobs_tokens_rewritten": 3, "start_logprobs_mean_shift": pytest.approx(1.0),
        "start_logprobs_own_version_abs_err_max": pytest.approx(4e-7, abs=1e-7)}


def test_grammar_ratios_hand_each_token_its_ratio_within_the_grammar(bench, tmp_path):
    """A reply sampled by version 3 (its first two tokens) then 4 (the third), trained from version 5: each token
    is handed log pi_v(a) - log Z_v + log Z_5, so exp(log pi_5(a) - handed) is the ratio of the masked policies;
    a forced position (one allowed token) gets ratio 1 whatever the versions' raw logprobs; a reply the grammar
    refuses keeps its record, counted."""
    import math

    import torch
    from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
    from openai.types.chat.chat_completion_message import ChatCompletionMessage
    from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

    reply = [0, 2, 1]
    logits = {v: torch.tensor([[1.0 * v, 0.0, 2.0, -1.0], [0.5, 0.0, 0.3 * v, 1.0], [0.0, 0.1 * v, -0.5, 0.2]])
              for v in (3, 4, 5)}
    lp = {v: torch.log_softmax(x, -1) for v, x in logits.items()}
    allowed = torch.tensor([[True, False, False, False],  # forced
                            [True, False, True, True], [False, True, True, False]])

    def choice(tokens):
        recorded = [lp[3][0, tokens[0]].item(), lp[3][1, tokens[1]].item(), lp[4][2, tokens[2]].item()]
        c = Choice(finish_reason="stop", index=0, message=ChatCompletionMessage(role="assistant", content="x"),
                   logprobs=ChoiceLogprobs(content=[ChatCompletionTokenLogprob(token=f"token_id:{t}", logprob=v,
                                                                               bytes=None, top_logprobs=[])
                                                    for t, v in zip(tokens, recorded)]))
        for k, v in {"prompt_token_ids": [7], "token_ids": tokens,
                     "policy_token_spans": [{"start_token": 0, "end_token": 2, "policy_version": 3},
                                            {"start_token": 2, "end_token": 3, "policy_version": 4}]}.items():
            setattr(c, k, v)
        return c, recorded

    (kept, _), (refused, refused_record) = choice(reply), choice([1, 2, 1])
    trajectories = [art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, c], reward=r,
                                   initial_policy_version=3) for c, r in ((kept, 1.0), (refused, 0.0))]
    scored = []

    def score(version, prompt, tokens):
        scored.append(version)
        assert prompt == [7]
        return lp[version]

    def allowed_for(tokens):
        return allowed if tokens == reply else None  # token 1 is outside the grammar at position 0

    log = tmp_path / bench.GRAMMAR_RATIOS_FILE
    row = bench.GrammarRatios(score, allowed_for, log).rewrite([art.TrajectoryGroup(trajectories)], trained_from=5)

    def masked(v, i):  # log of the grammar-masked policy of version v at position i, for the sampled token
        return (lp[v][i, reply[i]] - torch.logsumexp(lp[v][i].masked_fill(~allowed[i], -math.inf), -1)).item()

    handed = [t.logprob for t in kept.logprobs.content]
    ratios = [math.exp(lp[5][i, reply[i]].item() - handed[i]) for i in range(3)]
    assert ratios == pytest.approx([math.exp(masked(5, 0) - masked(3, 0)), math.exp(masked(5, 1) - masked(3, 1)),
                                    math.exp(masked(5, 2) - masked(4, 2))], rel=1e-5)
    assert ratios[0] == pytest.approx(1.0)  # forced
    assert all(v <= 0 for v in handed)
    assert [t.logprob for t in refused.logprobs.content] == refused_record
    assert sorted(set(scored)) == [3, 4, 5]
    assert row["tokens_rewritten"] == 3 and row["replies_refused"] == 1 and row["trained_from"] == 5
    assert row["recompute_abs_err_max"] == pytest.approx(0.0, abs=1e-6)
    assert json.loads(log.read_text()) == row
    summary = bench.grammar_ratios_summary(tmp_path)
    assert summary["grammar_ratios_tokens_rewritten"] == 3 and summary["grammar_ratios_replies_refused"] == 1


def test_free_tokens_leave_the_grammar_forced_tokens_out_of_the_loss(bench, tmp_path, monkeypatch):
    """Patched into the tokenizer, FreeTokens unflags the sampled positions where the grammar allowed one token;
    the context stays untrained, the free tokens keep their flag and logprob; a turn the grammar refuses is
    kept whole and counted."""
    import math

    import torch

    from artrl.trajectories import sequences as tokenize

    monkeypatch.setattr(tokenize, "_extend", tokenize._extend)  # restored after the test
    allowed = {(5, 6, 7): torch.tensor([[True, False, False], [True, True, False], [False, False, True]])}
    free = bench.FreeTokens(lambda ids: allowed.get(tuple(ids)))
    free.install()
    seq = tokenize.TokenizedSequence(token_ids=[], trainable_mask=[], logprobs=[])
    tokenize._extend(seq, [1, 2], [5, 6, 7], [-0.1, -0.2, -0.3])
    tokenize._extend(seq, [3], [8, 9], [-0.4, -0.5])  # refused by the grammar: kept whole
    assert seq.token_ids == [1, 2, 5, 6, 7, 3, 8, 9]
    assert seq.trainable_mask == [False, False, False, True, False, False, True, True]
    assert [None if math.isnan(v) else v for v in seq.logprobs] == [None, None, None, -0.2, None, None, -0.4, -0.5]
    assert free.counts == {"free": 3, "forced": 2, "turns": 2, "turns_refused": 1}
    free.save(tmp_path / bench.FREE_TOKENS_FILE)
    assert bench.free_tokens_summary(tmp_path) == {"free_tokens_free": 3, "free_tokens_forced": 2,
                                                   "free_tokens_turns": 2, "free_tokens_turns_refused": 1}


def test_tool_call_grammar_replays_a_forced_call_and_refuses_free_text(bench, tiny_path):
    """The binary-prefix program's forced tool call, compiled as the server compiles it: a call replays (its
    fixed parts allow one token each), text that is no call does not."""
    import torch
    from transformers import AutoTokenizer

    program = bench.load_program(bench.PROGRAMS_DIR / bench.PROGRAMS["binary_prefix"])
    grammar, vocab = bench.tool_call_grammar(str(tiny_path), program)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_path))
    call = '<tool_call>\n{"name": "make_guess", "arguments": {"guess": "10"}}\n</tool_call>' + tokenizer.eos_token
    ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    allowed = bench.allowed_tokens(grammar, vocab, ids)
    assert allowed is not None and allowed.shape == (len(ids), vocab)
    assert allowed[0].sum() == 1 and allowed[0, ids[0]]  # the call's opening is forced
    assert allowed[torch.arange(len(ids)), ids].all()  # every token of the call is allowed where it stands
    assert bench.allowed_tokens(grammar, vocab, tokenizer("hello", add_special_tokens=False)["input_ids"]) is None


def test_docs_start_logprobs_figures_are_the_results_file(bench):
    """docs/pipeline.md's "The gap is the ratios" figures are what `--table` prints from the recorded runs."""
    root = PATH.parents[1]
    path = root / "benchmarks" / "results" / "2026-12-04-cpu" / "pipeline-programs-learn-binary-start-logprobs.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = bench.differences(records)
    docs = " ".join((root / "docs" / "pipeline.md").read_text().split())
    for line_part, docs_part in [
            ("in-flight - pipeline gain -0.427, standard error 0.107, Welch t -3.99 (8 and 8",
             "-0.427, standard error 0.107, Welch t -3.99"),
            ("in-flight (start logprobs) - pipeline (start logprobs) gain +0.146, standard error 0.161, Welch t +0.91",
             "+0.146 (standard error 0.161, Welch t +0.91)"),
            ("in-flight (start logprobs) - in-flight gain +0.547, standard error 0.167, Welch t +3.27",
             "+0.547 (standard error 0.167, Welch t +3.27"),
            ("pipeline (start logprobs) - pipeline gain -0.025, standard error 0.096",
             "-0.025 (standard error 0.096)")]:
        assert line_part in found
        assert docs_part in docs
    table = bench.table(records)
    for arm, cell in [("pipeline_start_logprobs", "+0.450 +- 0.204 (median +0.488)"),
                      ("in_flight_start_logprobs", "+0.596 +- 0.406 (median +0.605)")]:
        assert f"| {bench.arm_label(arm)} | 8 | {cell} |" in table and cell in docs
    for cell in ("+0.476 +- 0.179 (median +0.488)", "+0.049 +- 0.244 (median -0.055)"):  # step_lora, in-flight
        assert cell in table and cell in docs
    summaries = [r for r in records if r["arm"] in bench.START_LOGPROBS_ARMS]
    assert max(r["start_logprobs_own_version_abs_err_max"] for r in summaries) < 2e-5  # the recompute is the record
    assert sum(r["start_logprobs_tokens_rewritten"] for r in summaries if r["arm"] == "in_flight_start_logprobs") \
        == 28225
    assert all(r["start_logprobs_tokens_rewritten"] == 0 for r in summaries if r["arm"] == "pipeline_start_logprobs")


def test_docs_grammar_ratio_figures_are_the_results_file(bench):
    """docs/pipeline.md's "Within the grammar" figures are what `--table` prints from the recorded runs, and the
    runs' own checks hold: the recompute is the record, no reply refused, ratios within the grammar near 1."""
    root = PATH.parents[1]
    path = root / "benchmarks" / "results" / "2026-12-04-cpu" / "pipeline-programs-learn-binary-grammar-ratios.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    docs = " ".join((root / "docs" / "pipeline.md").read_text().split())
    found = bench.differences(records)
    assert "in-flight - pipeline gain -0.521, standard error 0.101, Welch t -5.18 (8 and 8" in found
    assert "in-flight (grammar ratios) - pipeline (grammar ratios) gain +0.010, standard error 0.044" in found
    assert "-0.521, standard error 0.101, Welch t -5.18" in docs
    assert "in-flight minus step_lora +0.010, standard error 0.044" in docs
    table = bench.table(records)
    for arm, cell in [("pipeline", "+0.533 +- 0.135 (median +0.512)"), ("in_flight", "+0.012 +- 0.251 (median -0.090)"),
                      ("pipeline_grammar_ratios", "-0.160 +- 0.084 (median -0.184)"),
                      ("in_flight_grammar_ratios", "-0.150 +- 0.090 (median -0.184)")]:
        assert cell in table and cell in docs, arm
    grammar = [r for r in records if r["arm"] in bench.GRAMMAR_RATIO_ARMS]
    assert len(grammar) == 16
    assert max(r["grammar_ratios_recompute_abs_err_max"] for r in grammar) < 2e-5
    assert sum(r["grammar_ratios_replies_refused"] for r in grammar) == 0
    assert [sum(r["grammar_ratios_tokens_rewritten"] for r in grammar if r["arm"] == arm)
            for arm in ("pipeline_grammar_ratios", "in_flight_grammar_ratios")] == [123899, 122428]
    ratios = [x for r in grammar for x in r["mean_ratio"][1:] if x is not None]
    assert 0.985 <= min(ratios) and max(ratios) <= 1.018  # "0.991-1.018", "0.985-1.012" in the docs' table
    assert "| step_lora, grammar ratios | -0.160 +- 0.084 (median -0.184) | 7 | 0.991-1.018 |" in docs
    assert "| in-flight, grammar ratios | -0.150 +- 0.090 (median -0.184) | 7 | 0.985-1.012 |" in docs


def test_docs_free_token_figures_are_the_results_files(bench):
    """docs/pipeline.md's "Nor with the grammar's forced tokens left out" figures are `--table`'s, and the runs
    left out what the docs say."""
    results = PATH.parents[1] / "benchmarks" / "results" / "2026-12-04-cpu"
    free = [json.loads(line) for line in (results / "pipeline-programs-learn-binary-free-tokens.jsonl")
            .read_text().splitlines() if line.strip()]
    plain = bench.read_results(f"{results / 'pipeline-programs-learn-binary-grammar-ratios.jsonl'}:pipeline,in_flight")
    docs = " ".join((PATH.parents[1] / "docs" / "pipeline.md").read_text().split())
    table = bench.table(free)
    for label, cell, below in [("synchronous loop", "-0.192 +- 0.023 (median -0.199)", 8),
                               ("step_lora", "+0.076 +- 0.358 (median -0.047)", 5),
                               ("in-flight", "-0.192 +- 0.030 (median -0.195)", 8)]:
        assert cell in table
        assert f"| {label}, free tokens | {cell} | {below} |" in docs
    for arm, below in (("sync_free_tokens", 8), ("pipeline_free_tokens", 5), ("in_flight_free_tokens", 8)):
        assert sum(r["gain"] < 0 for r in free if r["arm"] == arm) == below
    assert "pipeline (free tokens) - pipeline gain -0.457, standard error 0.135, Welch t -3.38" in \
        bench.differences(free + plain)
    assert "-0.457 against its plain arm over the same replicate numbers (standard error 0.135, Welch t -3.38)" in docs
    for arm in bench.FREE_TOKEN_ARMS:
        runs = [r for r in free if r["arm"] == arm]
        share = sum(r["free_tokens_forced"] for r in runs) / sum(r["free_tokens_forced"] + r["free_tokens_free"]
                                                                  for r in runs)
        assert 0.67 <= share <= 0.71 and sum(r["free_tokens_turns_refused"] for r in runs) == 0


def test_docs_binary_prefix_at_1e_3_figures_are_the_results_files(bench):
    """docs/pipeline.md's figures at learning rate 1e-3 (11 and 11 plain runs, six rescored) are `--table`'s."""
    results = PATH.parents[1] / "benchmarks" / "results" / "2026-12-04-cpu"
    records = [json.loads(line) for name in ("pipeline-programs-learn-binary-lr1e-3.jsonl",
                                             "pipeline-programs-learn-binary-lr1e-3-start-logprobs.jsonl")
               for line in (results / name).read_text().splitlines() if line.strip()]
    assert {r["sizes"]["LEARNING_RATE"] for r in records} == {"1e-3"}
    docs = " ".join((PATH.parents[1] / "docs" / "pipeline.md").read_text().split())
    found = bench.differences(records)
    assert "in-flight - pipeline gain -0.312, standard error 0.092, Welch t -3.40 (11 and 11" in found
    assert "(difference -0.312, standard error 0.092, Welch t -3.40, eleven each)" in docs
    assert "gain = -0.248 +0.372 * age -0.068 * [in-flight]" in bench.age_fit(records)
    table = bench.table(records)
    for cell in ("+0.362 +- 0.237", "+0.050 +- 0.190", "+0.197 +- 0.310"):
        assert cell in table and cell in docs


def test_docs_grammar_mass_figures_are_the_results_file():
    """docs/pipeline.md's grammar figures are in-flight_diagnose.py --grammar-mass's recorded summaries."""
    root = PATH.parents[1]
    path = root / "benchmarks" / "results" / "2026-12-04-cpu" / "in-flight-grammar-mass.jsonl"
    runs = {r["mode"]: r["grammar_mass"] for r in map(json.loads, path.read_text().splitlines())}
    docs = " ".join((root / "docs" / "pipeline.md").read_text().split())
    flight, step = runs["in_flight_lora"], runs["step_lora"]
    assert flight["replies_the_grammar_refused"] == step["replies_the_grammar_refused"] == 0
    assert step["tokens"] == 0  # step_lora's replies never change version
    assert flight["mean_masked_difference"] <= 0 < flight["mean_raw_difference"]
    for figure in (f"{flight['tokens']:,} tokens", f"+{flight['mean_raw_difference']:.3f} raw",
                   f"{flight['mean_masked_difference']:.3f} within the grammar",
                   f"at {flight['share_of_tokens_where_start_has_more_allowed_mass']:.0%} of them",
                   f"{flight['mean_log_allowed_mass_start']:.3f} against {flight['mean_log_allowed_mass_sampler']:.3f}",
                   f"averages {flight['mean_log_allowed_mass_trained_from_minus_sampler']:.3f} in that run and "
                   f"{step['mean_log_allowed_mass_trained_from_minus_sampler']:.3f} in the step_lora one"):
        assert figure in docs, figure


CORRECTION_RESULTS = [PATH.parents[1] / "benchmarks" / "results" / day for day in ("2026-12-05-cpu", "2026-12-06-cpu")]


def test_a_run_collapses_when_it_stops_early_or_gains_too_little(bench):
    record = {"steps_done": 16, "sizes": {"MAX_STEPS": "16"}, "gain": bench.COLLAPSE_GAIN}
    assert not bench.collapsed(record)
    assert bench.collapsed({**record, "gain": bench.COLLAPSE_GAIN - 0.01})
    assert bench.collapsed({**record, "steps_done": 2})
    assert bench.collapsed({**record, "collapsed": True})  # the recorded flag wins


def test_corrected_runs_add_their_fields_to_every_train_call(bench):
    """Each correction's fields are TrainConfig's (so a run cannot train with a misspelt one), and `none`
    adds nothing."""
    from artrl.types import TrainConfig

    assert bench.CORRECTIONS["none"] == {}
    for name, fields in bench.CORRECTIONS.items():
        TrainConfig(**fields).check()
        assert set(fields) <= set(TrainConfig.model_fields), name


def test_docs_correction_table_is_the_results_files(bench):
    """docs/off-policy.md's table is what `--correction-table` prints from the recorded runs."""
    records = [r for folder in CORRECTION_RESULTS for path in sorted(folder.glob("*-corrections*.jsonl"))
               for r in bench.read_results(str(path))]
    rows = bench.correction_table(records).splitlines()[2:]
    docs = (PATH.parents[1] / "docs" / "off-policy.md").read_text().splitlines()
    assert rows and all(row in docs for row in rows)
    documented = [line for line in docs if line.startswith(tuple(f"| {p} | " for p in bench.PROGRAMS))]
    assert sorted(documented) == sorted(rows)  # and no row the files no longer give


@pytest.mark.parametrize("dtype", ["bfloat16", "nf4"])
def test_a_sampler_dtype_changes_what_the_engine_computes_and_leaves_the_trainer_alone(bench, tmp_path, monkeypatch,
                                                                                      dtype):
    """`--sampler-dtype` patches the serving copy the built-in engine makes (the function its module calls), so
    the engine's logits move off the trainer's by that dtype's rounding, while the trainer's weights stay its
    own float32 ones."""
    import torch
    from peft import LoraConfig, get_peft_model

    from artrl.models.tiny import load_tiny
    from artrl.serve.engines import transformers_engine

    monkeypatch.setattr(transformers_engine, "serving_copy", transformers_engine.serving_copy)
    plain = transformers_engine.serving_copy
    bench.patch_sampler(dtype)
    assert transformers_engine.serving_copy is not plain
    model = get_peft_model(load_tiny(tmp_path / "cache")[0], LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.arange(3, 19).unsqueeze(0)  # [1, 16]
    with torch.no_grad():
        want = plain(model)(ids).logits  # [1, 16, vocab]
        got = transformers_engine.serving_copy(model)(ids).logits
        assert torch.equal(model(ids).logits, want)  # the trainer computes as before the copy
    assert got.dtype == torch.float32 or dtype == "bfloat16"
    gap = (got.float() - want).abs().max().item()
    assert 1e-4 < gap < 10.0, gap  # rounded, not broken
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    bench.patch_sampler("float32")  # nothing to patch
