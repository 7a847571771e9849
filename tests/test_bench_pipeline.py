"""`python benchmarks/bench.py pipeline`: the two arms do the same work, the JSON's figures agree with each other,
and the printed command reproduces the run. Speed is not checked here (the bench measures it)."""

from __future__ import annotations

import asyncio
import json
import shlex

import pytest

from benchmarks.harness.agent_workload import AgentWorkload, Intervals, vowel_share
from benchmarks.harness.pipeline_bench import PipelineBenchConfig, config_from_args
from benchmarks.bench import _parser, main
from artrl.errors import ConfigError


def test_busy_time_counts_overlaps_once_and_clips_to_the_window():
    iv = Intervals()
    for span in [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7), (-1.0, 0.5), (9.0, 12.0)]:
        iv.add(*span)
    # [0,3] (the first two overlap, the third starts before the window) + [5,6] + [9,10] (clipped)
    assert iv.busy(0.0, 10.0) == pytest.approx(3.0 + 1.0 + 1.0)
    assert iv.busy(3.5, 4.5) == 0.0
    assert Intervals().busy(0.0, 1.0) == 0.0


def test_overlap_is_the_time_both_sets_run():
    a, b = Intervals([(0.0, 4.0), (6.0, 8.0)]), Intervals([(3.0, 7.0), (7.5, 9.0)])
    assert a.overlap(b, 0.0, 10.0) == pytest.approx(1.0 + 1.0 + 0.5)  # [3,4], [6,7], [7.5,8]
    assert b.overlap(a, 0.0, 10.0) == pytest.approx(2.5)
    assert a.overlap(Intervals(), 0.0, 10.0) == 0.0


def test_reward_is_the_share_of_vowels_among_letters():
    assert vowel_share(["abc", "de"]) == pytest.approx(2 / 5)
    assert vowel_share(["1 2 3", None]) == 0.0
    assert vowel_share(["AEIOU!"]) == 1.0


def test_scenarios_carry_ids_and_the_prompt_and_results_have_the_asked_length():
    w = AgentWorkload(prompt_words=30, result_words=12)
    sc = w.scenarios(3)
    assert [s["id"] for s in sc] == [0, 1, 2] and [s["metadata"]["scenario_id"] for s in sc] == [0, 1, 2]
    assert len(w.system_prompt().split()) == 1 + 30  # "Tools:" and the words
    assert len(w.tool_result(1).split("\n", 1)[1].split()) == 12
    assert "\n" not in AgentWorkload(result_words=0).tool_result(1)


@pytest.mark.parametrize("final_tokens", [0, 7])
def test_a_final_answer_comes_after_the_last_tool_result_with_no_tool_after_it(monkeypatch, final_tokens):
    """Each policy turn but a final answer is followed by one tool wait; the final answer (with final_tokens)
    gets its own budget and carries the last tool result in its prompt."""
    from types import SimpleNamespace

    from benchmarks.harness import agent_workload

    sent, waits = [], []

    class Completions:
        async def create(self, **kwargs):
            sent.append({**kwargs, "messages": list(kwargs["messages"])})  # as sent (the list grows after)
            return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="aei"))])

    model = SimpleNamespace(openai_client=lambda: SimpleNamespace(chat=SimpleNamespace(completions=Completions())),
                            get_inference_name=lambda: "m")

    async def sleep(seconds):
        waits.append((len(sent), seconds))

    monkeypatch.setattr(agent_workload.asyncio, "sleep", sleep)
    monkeypatch.setattr(agent_workload, "choice_from_completion", lambda c: c.choices[0])
    w = AgentWorkload(turns=2, tool_latency_s=0.3, max_tokens=4, final_tokens=final_tokens)
    trajectory = asyncio.run(agent_workload.AgentRollouts(w).rollout(model, w.scenarios(1)[0], 0))
    assert [r["max_tokens"] for r in sent] == [4, 4] + ([final_tokens] if final_tokens else [])
    assert waits == [(1, 0.3), (2, 0.3)]  # after turns 1 and 2; never after the final answer
    if final_tokens:
        assert sent[-1]["messages"][-1]["content"] == w.tool_result(2)
        assert trajectory.reward == 1.0 and len(trajectory.messages_and_choices) == 2 + 2 * 3 - 1


def test_the_printed_command_parses_back_to_the_same_config():
    cfg = PipelineBenchConfig(turns=3, tool_latency_s=0.25, groups_per_step=5, rollouts_per_group=3, steps=7,
                              max_steps_off_policy=2, rollout_workers=9, max_tokens=5, prompt_words=11,
                              result_words=13, model="artrl/tiny", device="cpu", train_threads=1,
                              train_in_worker=True, learning_rate=3e-4, loss_fn="ppo", seed=4, arms=("pipeline",),
                              autotune="online", final_tokens=12)
    argv = shlex.split(cfg.command())
    assert argv[:3] == ["python", "benchmarks/bench.py", "pipeline"]
    assert config_from_args(_parser().parse_args(argv[2:] + ["--path", "/x"])) == cfg
    assert config_from_args(_parser().parse_args(shlex.split(PipelineBenchConfig().command())[2:])) \
        == PipelineBenchConfig()


@pytest.mark.parametrize("field, value", [("turns", 0), ("rollouts_per_group", 1), ("tool_latency_s", -1.0),
                                          ("max_steps_off_policy", -1), ("loss_fn", "sft"), ("arms", ("async",)),
                                          ("rollout_workers", 0), ("autotune", "profile"), ("final_tokens", -1)])
def test_config_refuses_values_that_cannot_run(field, value):
    with pytest.raises(ConfigError, match=field.split("_s")[0] if field != "arms" else "arms"):
        PipelineBenchConfig(**{field: value}).check()


def test_workers_default_to_what_the_bound_lets_run_ahead():
    assert PipelineBenchConfig(groups_per_step=4, max_steps_off_policy=0).workers == 4
    assert PipelineBenchConfig(groups_per_step=4, max_steps_off_policy=2).workers == 12
    assert PipelineBenchConfig(groups_per_step=4, rollout_workers=5).workers == 5


def test_bench_pipeline_runs_both_arms_on_the_same_work(capsys, tmp_path):
    argv = ["pipeline", "--steps", "2", "--groups-per-step", "2", "--rollouts-per-group", "2",
            "--turns", "2", "--tool-latency", "0.01", "--max-tokens", "3", "--prompt-words", "5", "--device", "cpu",
            "--trainer", "here", "--path", str(tmp_path)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # the JSON line is the only standard output (the pipeline's status goes to stderr)
    out = json.loads(lines[0])
    sync, pipe = out["sync"], out["pipeline"]
    for arm in (sync, pipe):
        assert arm["steps"] >= 1 and arm["groups_trained"] + arm["groups_discarded"] == 4
        assert 0 <= arm["trainer_idle_fraction"] <= 1 and 0 <= arm["actor_idle_fraction"] <= 1
        assert 0 < arm["train_s"] <= arm["wall_s"] and 0 < arm["rollout_s"] <= arm["wall_s"]
        assert 0 < arm["request_s"] <= arm["rollout_s"]  # requests run inside rollouts
        assert 0 <= arm["request_during_train_s"] <= min(arm["request_s"], arm["train_s"])
    assert sync["steps"] == 2 and sync["groups_trained"] == 4
    assert sync["mean_staleness"] == sync["max_staleness"] == 0  # the synchronous loop is on-policy
    assert sync["request_during_train_s"] == pytest.approx(0, abs=1e-3)  # it never samples while training
    assert 0 <= pipe["max_staleness"] <= out["max_steps_off_policy"]
    assert out["ratio_sync_over_pipeline"] == round(sync["wall_s"] / pipe["wall_s"], 3)
    assert out["threads"] == {"train": out["threads"]["train"], "engine": 1} and out["threads"]["train"] >= 1
    assert out["engine"] == "builtin" and out["device"] == "cpu" and out["train_in_worker"] is False
    assert shlex.split(out["command"])[:3] == ["python", "benchmarks/bench.py", "pipeline"]
    assert "--tool-latency 0.01" in out["command"] and "--turns 2" in out["command"]
    assert "--trainer here" in out["command"]


def _choice(token_ids, spans=None, version=None):
    from openai.types.chat.chat_completion import Choice

    extra = {"token_ids": token_ids, **({"policy_token_spans": spans} if spans is not None else {}),
             **({"policy_version": version} if version is not None else {})}
    return Choice.model_validate({"index": 0, "finish_reason": "stop", "logprobs": None,
                                  "message": {"role": "assistant", "content": "x"}, **extra})


def test_token_lag_counts_each_token_by_the_version_that_sampled_it():
    """With spans (in-flight updates) each token counts at its own version; without, each turn's sampled ids
    count at the version the server recorded on that turn, and at the trajectory's initial version when it
    recorded none."""
    import artrl as art
    from benchmarks.harness.pipeline_bench import _count_token_lag

    user = {"role": "user", "content": "q"}
    spans = [{"start_token": 0, "end_token": 3, "generation_id": 0, "policy_version": 2},
             {"start_token": 3, "end_token": 8, "generation_id": 0, "policy_version": 3}]
    moved = art.Trajectory(messages_and_choices=[user, _choice(list(range(8)), spans)], reward=0.0,
                           initial_policy_version=2, final_policy_version=3)
    kept = art.Trajectory(messages_and_choices=[user, _choice([1, 2, 3]), user, _choice([4, 5])], reward=1.0,
                          initial_policy_version=2, final_policy_version=2)
    lags: dict[int, int] = {}
    _count_token_lag(lags, moved, from_step=3)
    assert lags == {1: 3, 0: 5}
    _count_token_lag(lags, kept, from_step=3)
    assert lags == {1: 8, 0: 5}
    # step updates: the second turn was served by version 3, after the first turn's version 2
    later = art.Trajectory(messages_and_choices=[user, _choice([1, 2, 3], version=2), user, _choice([4, 5], version=3)],
                           reward=1.0, initial_policy_version=2, final_policy_version=3)
    _count_token_lag(lags, later, from_step=3)
    assert lags == {1: 11, 0: 7}


def test_docs_in_flight_lag_figures_are_the_results_file():
    """docs/pipeline.md's and docs/performance.md's in-flight lag figures on rollouts that end with a long
    answer are the recorded runs': per mode and seed, the mean lag, and seed 1's tokens by lag."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = root / "benchmarks" / "results" / "2026-12-04-cpu" / "bench-pipeline-in-flight-final-answer.jsonl"
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pipeline_md = " ".join((root / "docs" / "pipeline.md").read_text().split())
    performance_md = " ".join((root / "docs" / "performance.md").read_text().split())
    by = {}
    for r in runs:
        assert r["final_tokens"] == 64 and "--final-tokens 64" in r["command"]
        by.setdefault((r["tool_latency_s"], shlex.split(r["command"])[shlex.split(r["command"]).index("--seed") + 1]),
                      {})[r["rollout_weight_update_mode"]] = r["pipeline"]
    for (tools, seed), modes in by.items():
        step, flight = modes["step_lora"]["token_policy_lag_mean"], modes["in_flight_lora"]["token_policy_lag_mean"]
        assert f"| {step:.3f} | {flight:.3f} | {flight / step:.2f} |" in performance_md
    seed1 = by[(3.0, "1")]
    for mode, mean in (("step_lora", "1.485"), ("in_flight_lora", "0.548")):
        counts = " | ".join(f"{seed1[mode]['tokens_by_policy_lag'][k]:,}" for k in "0123")
        assert f"| `{mode}` | {counts} | {mean}" in pipeline_md
