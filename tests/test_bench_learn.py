"""`python benchmarks/bench.py learn`: its output says what it claims, both arms see the same data, bad input is refused.

Learning figures are not checked here (the benchmark is how they are measured);
what is checked is that every figure in the results file follows from the
per-step rewards it records, and that the two arms are compared on equal terms.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.harness.learn_bench import LearnSettings, Sample, grpo_step, run_learn_bench
from benchmarks.harness.learn_results import aggregate, format_table, run_scores, window
from benchmarks.harness.learn_tasks import TASKS, Prompt, WarmUp, no_digit, prompt_schedule, vowel_share
from benchmarks.bench import main

TINY_ARGS = ["--tasks", "vowels", "--lrs", "1e-2", "--seeds", "1", "--steps", "3", "--prompts", "2",
             "--samples", "4"]


def _check_consistent(doc: dict, *, steps: int, prompts: int, samples: int) -> None:
    runs = doc["runs"]
    for r in runs:
        assert len(r["steps"]) == steps
        for i, s in enumerate(r["steps"]):
            assert len(s["prompts"]) == prompts and len(s["rewards"]) == prompts * samples
            assert s["reward"] == pytest.approx(statistics.fmean(s["rewards"]))
            assert all(0.0 <= x <= 1.0 for x in s["rewards"])
            assert ("update" in s) == (i + 1 < steps)  # no update after the last measured step
        w = window(steps)
        rewards = [s["reward"] for s in r["steps"]]
        assert r["first"] == pytest.approx(statistics.fmean(rewards[:w]))
        assert r["last"] == pytest.approx(statistics.fmean(rewards[-w:]))
        assert r["gain"] == pytest.approx(r["last"] - r["first"]) and r["failed"] is None
    # the table follows from the runs
    assert len(doc["table"]) == len({(r["task"], r["lr"], r["arm"]) for r in runs})
    for row in doc["table"]:
        gains = [r["gain"] for r in runs if (r["task"], r["lr"], r["arm"]) == (row["task"], row["lr"], row["arm"])]
        assert row["seeds"] == len(gains)
        assert row["mean"] == pytest.approx(statistics.fmean(gains))
        assert (row["min"], row["max"]) == (min(gains), max(gains))
        assert row["std"] == (pytest.approx(statistics.stdev(gains)) if len(gains) > 1 else None)
        assert row["failed"] == 0
    for p in doc["paired"]:
        by = {(r["arm"], r["seed"]): r["gain"] for r in runs if (r["task"], r["lr"]) == (p["task"], p["lr"])}
        diffs = [by["artrl", s] - by["yardstick", s] for (arm, s) in by if arm == "artrl" and ("yardstick", s) in by]
        assert p["seeds"] == len(diffs) and p["mean"] == pytest.approx(statistics.fmean(diffs))


def test_bench_learn_output_is_self_consistent_and_resumes(tmp_path, capsys):
    out = tmp_path / "learn.json"
    assert main(["learn", *TINY_ARGS, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    _check_consistent(doc, steps=3, prompts=2, samples=4)
    runs = {r["arm"]: r for r in doc["runs"]}
    assert sorted(runs) == ["artrl", "yardstick"]
    ours, ref = runs["artrl"], runs["yardstick"]
    # both arms saw the same prompts, drawn from (task, seed) alone
    schedule = [[p.key for p in step] for step in prompt_schedule(TASKS["vowels"], 0, 3, 2)]
    assert [s["prompts"] for s in ours["steps"]] == [s["prompts"] for s in ref["steps"]] == schedule
    # same initial weights and the same sampling: the first step's samples agree token for token
    assert ours["steps"][0]["digest"] == ref["steps"][0]["digest"]
    assert ours["steps"][0]["rewards"] == ref["steps"][0]["rewards"]
    # artrl trained through its public call (one optimizer step for this small batch), on-policy
    update = ours["steps"][0]["update"]
    assert update["optimizer_steps"] >= 1 and update["mean_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert ref["steps"][0]["update"]["tokens"] > 0
    # the printed table carries the file's figures
    for row in doc["table"]:
        assert f"{row['mean']:+.3f}" in printed
    # a second run with the same settings finds everything done and changes no run
    assert main(["learn", *TINY_ARGS, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["runs"] == doc["runs"]
    # other settings must not mix into the same file
    assert main(["learn", *TINY_ARGS, "--steps", "4", "--out", str(out)]) == 2
    assert "steps: file 3, now 4" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--config", "learning_rate=1"], "learning rates come from --lrs"),
    (["--config", "no_such_field=1"], "no_such_field"),
    (["--config", "scale_rewards"], "expected FIELD=VALUE"),
    (["--samples", "1"], "two replies"),
    (["--prompts", "25"], "exceeds the 24 prompts"),
    (["--lrs", "0"], "learning rates > 0"),
])
def test_bench_learn_refuses_bad_settings_before_running(tmp_path, capsys, argv, message):
    out = tmp_path / "learn.json"
    assert main(["learn", "--tasks", "vowels", "--seeds", "1", *argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_results_that_are_not_ours_are_not_overwritten(tmp_path, capsys):
    out = tmp_path / "learn.json"
    out.write_text(json.dumps({"something": "else"}))
    assert main(["learn", *TINY_ARGS, "--out", str(out)]) == 2
    assert "not a `bench.py learn` results file" in capsys.readouterr().err
    assert json.loads(out.read_text()) == {"something": "else"}


def test_rewards():
    assert vowel_share("Aeb!") == pytest.approx(2 / 3)
    assert vowel_share("") == vowel_share("123 ?!") == 0.0
    assert vowel_share("aeiou") == 1.0 and vowel_share("xyz") == 0.0
    assert no_digit("no digits here") == 1.0 and no_digit("room 101") == 0.0
    colours = TASKS["colours"]
    banana = next(p for p in colours.prompts if p.target == "yellow")
    assert colours.grade("yellow", banana) == 1.0 and colours.grade("yellow, I think.", banana) == 0.3


@given(st.text(max_size=60))
def test_rewards_are_in_range(text):
    assert 0.0 <= vowel_share(text) <= 1.0 and no_digit(text) in (0.0, 1.0)


def test_prompt_schedule_is_the_seeds_alone():
    task = TASKS["vowels"]
    a, b = prompt_schedule(task, 3, 5, 6), prompt_schedule(task, 3, 5, 6)
    assert a == b and prompt_schedule(task, 4, 5, 6) != a
    assert all(len({p.key for p in step}) == 6 for step in a)  # distinct prompts within a step


def test_aggregate_pairs_only_seeds_both_arms_finished():
    def run(arm, seed, gain):
        return {"task": "t", "lr": 0.01, "arm": arm, "seed": seed, "gain": gain, "first": 0.0, "last": gain}

    table, paired = aggregate([run("artrl", 0, 0.3), run("artrl", 1, 0.1), run("yardstick", 0, 0.2)])
    ours = next(r for r in table if r["arm"] == "artrl")
    ref = next(r for r in table if r["arm"] == "yardstick")
    assert ours["seeds"] == 2 and ours["mean"] == pytest.approx(0.2) and ours["std"] == pytest.approx(math.sqrt(0.02))
    assert ref["seeds"] == 1 and ref["std"] is None
    assert paired == [{"task": "t", "lr": 0.01, "seeds": 1, "mean": pytest.approx(0.1), "std": None,
                       "min": pytest.approx(0.1), "max": pytest.approx(0.1)}]
    assert run_scores([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])["gain"] == pytest.approx(4.0)  # (4+5+6)/3 - (0+1+2)/3


def test_aggregate_counts_diverged_runs_without_averaging_them():
    def run(arm, seed, gain, failed=None):
        return {"task": "t", "lr": 0.03, "arm": arm, "seed": seed, "gain": gain, "first": 0.0 if gain is not None
                else None, "last": gain, "failed": failed}

    runs = [run("artrl", 0, 0.2), run("artrl", 1, None, "NonFiniteError ..."), run("yardstick", 0, 0.1),
            run("yardstick", 1, 0.3)]
    table, paired = aggregate(runs)
    ours = next(r for r in table if r["arm"] == "artrl")
    assert (ours["seeds"], ours["failed"], ours["mean"]) == (1, 1, pytest.approx(0.2))
    assert paired[0]["seeds"] == 1 and paired[0]["mean"] == pytest.approx(0.1)  # seed 1 has no artrl gain
    table, paired = aggregate([run("artrl", 0, None, "diverged")])
    assert table[0]["seeds"] == 0 and table[0]["mean"] is None and paired == []
    row = format_table(table, paired).splitlines()[1].split()
    assert row[3:5] == ["0", "-"] and row[-1] == "1"  # no seeds, no gain, one failed run


def test_yardstick_step_moves_towards_the_better_reply(tiny_path):
    from artrl.models.loading import load_model
    from artrl.config.model import InternalModelConfig

    model, tok = load_model(str(tiny_path), InternalModelConfig(seed=0, device="cpu"))
    prompt = Prompt("p", ({"role": "user", "content": "Say a word."},))
    prompt_ids = tok.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    good, bad = tok("aeiou", add_special_tokens=False).input_ids, tok("xyz 42", add_special_tokens=False).input_ids

    def logp(ids: list[int]) -> float:
        x = torch.tensor([prompt_ids + ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
        return float(lp[torch.arange(len(prompt_ids) - 1, x.shape[1] - 1), x[0, len(prompt_ids):]].sum())

    before = logp(good), logp(bad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    group = [Sample(prompt, None, prompt_ids, good, 1.0), Sample(prompt, None, prompt_ids, bad, 0.0)]
    metrics = grpo_step(model, opt, [group], pad_id=tok.pad_token_id)
    assert metrics["tokens"] == len(good) + len(bad) and metrics["grad_norm"] > 0
    assert logp(good) > before[0] and logp(bad) < before[1]
    # a non-finite loss is refused before the optimizer moves anything
    weights = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    broken = [Sample(prompt, None, prompt_ids, good, math.inf), Sample(prompt, None, prompt_ids, bad, 0.0)]
    with pytest.raises(FloatingPointError, match="not finite"):
        grpo_step(model, opt, [broken], pad_id=tok.pad_token_id)
    assert all(torch.equal(a, b) for a, b in zip(weights, [p for p in model.parameters() if p.requires_grad]))


def test_colours_runs_from_a_warmed_up_model(tmp_path):
    settings = LearnSettings(tasks=("colours",), lrs=(1e-2,), seeds=1, steps=2, prompts=2, samples=4,
                             warm_up=WarmUp(epochs=1))
    results = asyncio.run(run_learn_bench(settings, tmp_path / "learn.json", show_progress=False))
    doc = results.document()
    _check_consistent(doc, steps=2, prompts=2, samples=4)
    base = {r["base_model"] for r in doc["runs"]}
    assert len(base) == 1 and "colours-warmup-" in base.pop()  # both arms start from the same warmed-up model
    warmed = list((tmp_path / "learn.models").iterdir())
    assert len(warmed) == 1 and (warmed[0] / "artrl_bench_warmup.json").exists()  # no temporary left behind
