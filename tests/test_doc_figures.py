"""Figures the docs quote in more than one place agree with their source.

The demo's rewards come from one recorded run (benchmarks/results/2026-12-01-cpu/demo-fresh-clone.json): its
printout in docs/demo.md, the sentence in docs/getting-started.md and the row in docs/performance.md quote the
same numbers. The memory rule of thumb (docs/getting-started.md, docs/batching.md) quotes the trainer's own
estimate, `train.memory.bytes_per_token`, for an 8B model's shape. The memory table's CPU peaks
(docs/getting-started.md) are the newest runs in benchmarks/results/2026-12-02-cpu/memory.jsonl, and heap.py's
trim figures three of its lines. The image colour quiz's rewards, shares and time (README, docs/models.md, the
example's docstring) are one recorded run (benchmarks/results/2026-12-03-cpu/image-quiz.json). docs/models.md's
table of the token record's delta per compute dtype is benchmarks/results/2026-12-03-cpu/record-dtype-delta.jsonl.
"""

from __future__ import annotations

import json
import pathlib
import re
from types import SimpleNamespace

import pytest

from bench_scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DEMO_RUN = ROOT / "benchmarks" / "results" / "2026-12-01-cpu" / "demo-fresh-clone.json"


def _flat(path: pathlib.Path) -> str:
    return " ".join(path.read_text().split())


def test_the_demos_rewards_are_the_recorded_runs_everywhere():
    run = json.loads(DEMO_RUN.read_text())
    before, sft, rl = (f"{run[k]:.3f}" for k in ("val_reward_before", "val_reward_after_sft", "val_reward_after_rl"))
    demo = _flat(DOCS / "demo.md")
    assert f"validation reward, untrained : {before}" in demo
    assert f"validation reward, after SFT : {sft}" in demo and f"validation reward, after RL : {rl}" in demo
    assert f"({round(run['wall_s'])} s)" in demo
    assert f"{before} untrained, {sft} after SFT and {rl} after RL" in _flat(DOCS / "getting-started.md")
    (row,) = [line for line in (DOCS / "performance.md").read_text().splitlines() if "one run from a fresh clone" in line]
    assert row.rstrip(" |").endswith(f"{sft} / {rl}") and f"| {round(run['wall_s'])} |" in row
    assert not re.search(r"after RL[^.]{0,40}\b0\.96\b", " ".join(_flat(p) for p in DOCS.glob("*.md")))


def test_the_memory_rule_quotes_the_trainers_estimate_for_an_8b_model():
    torch = pytest.importorskip("torch")
    from artrl.train.memory import bytes_per_token

    qwen3_8b = SimpleNamespace(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, num_hidden_layers=36)
    inputs = 2 * qwen3_8b.hidden_size * qwen3_8b.num_hidden_layers  # each layer's input, bf16: the rule's first term
    per_token = bytes_per_token(qwen3_8b, torch.bfloat16, checkpointing=True)
    assert f"{inputs / 1e6:.2f}" == "0.29" and f"{per_token / 1e6:.1f}" == "0.6"  # 0.29 MB + the recomputed layer
    assert round(32768 * per_token / 1e9) == 19  # "about 20 GB" for 32k tokens per micro-batch
    for page, says in (("getting-started.md", ["4096 x 36 x 2 = 0.29 MB plus 0.29 MB, about 0.6 MB", "about 20 GB"]),
                       ("batching.md", ["8B: 0.29 + 0.29, ~0.6 MB", "~20 GB"])):
        text = _flat(DOCS / page)
        assert all(s in text for s in says), page


MEMORY_RUNS = ROOT / "benchmarks" / "results" / "2026-12-02-cpu" / "memory.jsonl"
TABLE_MODELS = {"random:qwen3-0.6b": "Qwen3-0.6B shape", "random:qwen3-8b": "Qwen3-8B shape",
                "random:qwen3-14b": "Qwen3-14B shape"}
TABLE_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


def _memory_rows() -> dict[tuple[str, str], str]:
    """getting-started.md's memory table: (model, base weights) -> the measured-on-CPU cell."""
    rows = {}
    for line in (DOCS / "getting-started.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("Qwen3-"):
            rows[(cells[0], cells[1])] = cells[3]
    return rows


def test_the_memory_table_quotes_the_newest_measured_runs():
    """Each CPU peak in the table (and the plan beside it in brackets) is the newest run of its model, base weights
    and checkpointing in memory.jsonl; a refused run's row says how fast it was refused."""
    newest: dict[tuple[str, str, bool], dict] = {}
    for line in MEMORY_RUNS.read_text().splitlines():
        run = json.loads(line)
        s = run["settings"]
        weights = "4-bit" if s.get("load_in_4bit") else TABLE_DTYPES.get(s["dtype"], s["dtype"])
        newest[(run["model"], weights, bool(s.get("gradient_checkpointing")))] = run
    rows = _memory_rows()
    checked = 0
    for (model, weights, checkpointing), run in newest.items():
        name = TABLE_MODELS[model]
        cell = rows.get((name, weights))
        if cell is None:  # the fp32 refusal: the table's bf16 row speaks for it
            assert run["refused"] and weights == "fp32"
            continue
        if run["refused"]:
            assert f"refused by the plan {run['seconds']} s into `register`" in cell
        else:
            figure = f"{run['measured_gb']['peak']:.1f} GB [{run['plan_workload']['peak_gb']:.1f}]"
            if checkpointing:
                assert f"with checkpointing {figure}" in cell, (name, weights, cell)
            else:
                assert cell.startswith(figure), (name, weights, cell)
        checked += 1
    assert checked >= 6


QUIZ_RUN = ROOT / "benchmarks" / "results" / "2026-12-03-cpu" / "image-quiz.json"


def test_the_image_quizs_figures_are_the_recorded_runs_everywhere():
    """README, docs/models.md and the example's docstring quote one recorded run of examples/image_colour_quiz.py."""
    run = json.loads(QUIZ_RUN.read_text())
    rewards = [f"{run[k]['reward']:.3f}" for k in ("untrained", "after_sft", "after_rl")]
    minutes = f"about {round(run['wall_s'] / 60)} minutes"
    readme = _flat(ROOT / "README.md")
    assert f"reward {rewards[0]} untrained, {rewards[1]} after SFT, {rewards[2]} after RL" in readme
    assert f"image_colour_quiz.py` ({minutes} on a 2-core CPU)" in readme
    models = _flat(DOCS / "models.md")
    assert f"a shared 2-core CPU, {round(run['wall_s'])} s," in models
    for label, key in (("untrained", "untrained"), ("after SFT", "after_sft"), ("after RL", "after_rl")):
        row = run[key]
        assert (f"| {label} | {row['reward']:.3f} | {round(100 * row['right_colour'])}% | "
                f"{round(100 * row['one_word'])}% |") in models, label
    docstring = (ROOT / "examples" / "image_colour_quiz.py").read_text()
    assert f"# {minutes} on a 2-core CPU" in docstring


def test_the_heap_trim_figures_are_the_recorded_runs():
    """src/artrl/runtime/heap.py quotes lines 4, 8 and 10 of the memory runs (random:qwen3-8b in 4-bit)."""
    runs = [json.loads(line) for line in MEMORY_RUNS.read_text().splitlines()]
    no_trim, trim_loaded, trim_each = (runs[i - 1]["measured_gb"] for i in (4, 8, 10))
    assert all(runs[i - 1]["model"] == "random:qwen3-8b" and runs[i - 1]["settings"].get("load_in_4bit")
               for i in (4, 8, 10))
    text = _flat(ROOT / "src" / "artrl" / "runtime" / "heap.py")
    assert (f"resident once registered {no_trim['registered']:.2f} GB with no trim, {trim_loaded['registered']:.2f} "
            "GB with the trim after loading") in text
    assert (f"the load's peak {trim_loaded['load_peak']:.2f} GB with that trim alone, {trim_each['load_peak']:.2f} "
            "GB with the trim after each tensor too") in text


DTYPE_DELTA_RUNS = ROOT / "benchmarks" / "results" / "2026-12-03-cpu" / "record-dtype-delta.jsonl"
DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bf16"}


def _sci(x: float) -> str:
    return f"{x:.1e}".replace("e-0", "e-")  # 4.8e-6, as the docs write it


def test_the_dtype_delta_table_quotes_the_recorded_runs():
    """docs/models.md's table of the token record's delta per compute dtype: each row (found by its
    InternalModelConfig cell) is a line of record-dtype-delta.jsonl, with the dtype that line says it computed
    in, and the command that wrote it is quoted beside it."""
    rows = {}
    for line in (DOCS / "models.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("`") and ("dtype=" in cells[1] or "load_in_4bit=" in cells[1]):
            rows[cells[1]] = cells
    runs = [json.loads(line) for line in DTYPE_DELTA_RUNS.read_text().splitlines()]
    assert runs and len(rows) == len(runs)
    for run in runs:
        config = "`" + ", ".join(f"{k}={json.dumps(v).replace('true', 'True').replace('false', 'False')}"
                                 for k, v in run["config"].items()) + "`"
        weights, _, computed, top, mean = rows[config]
        ran = run["ran"]
        assert computed == DTYPE_NAMES[(ran["4bit_matmul_input_dtypes"] or ran["other_weights_dtypes"])[0]], config
        assert weights.startswith("4-bit" if run["config"]["load_in_4bit"] else "full precision"), config
        assert (top, mean) == (_sci(run["sampled_logprob_delta_max"]), _sci(run["sampled_logprob_delta_mean"])), config
    assert f"`{runs[0]['command'].rsplit(' --setting', 1)[0]}`" in (DOCS / "models.md").read_text()


def test_the_planned_context_table_is_the_plans_own():
    """docs/performance.md's planned longest context per model and GPU is what benchmarks/context_plan.py prints from
    the memory plan now: a change to the plan shows here until the table is printed again."""
    module = load_script("context_plan")
    table = module.markdown(module.plan_table())
    assert table in (DOCS / "performance.md").read_text()


def test_the_long_context_table_is_the_recorded_runs_beside_the_plan():
    """docs/performance.md's long-context table is benchmarks/long_context_table.py's output: the recorded runs of
    long-context.jsonl, each beside the plan of its own call now; and the plan holds within 20% of each peak."""
    module = load_script("long_context_table")
    table = module.rows()
    assert len(table) >= 6 and all(abs(r["error"]) < 0.2 for r in table)
    assert module.markdown(table) in (DOCS / "performance.md").read_text()
