"""The table docs/performance.md quotes ("Long trajectories"): each recorded `artrl bench memory --context` run of
benchmarks/results/2026-12-03-cpu/long-context.jsonl beside the memory plan of its own call.

"plan" is `plan_memory` now, for the settings the run recorded (its micro-batch, trained tokens, checkpointing);
"plan then" is the figure the run printed, from the plan before it knew that the LM head's chunks and the
recomputed layer come one after the other in a checkpointed backward (it summed them). tests/test_doc_figures.py
checks the doc's table is this script's output.

    python benchmarks/long_context_table.py
"""

from __future__ import annotations

import json
import pathlib
import sys

from artrl.models.memory_plan import GB, MemorySettings, ModelShape, plan_memory
from artrl.models.shapes import random_config

RUNS = pathlib.Path(__file__).resolve().parent / "results" / "2026-12-03-cpu" / "long-context.jsonl"


def rows(path: pathlib.Path = RUNS) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        run = json.loads(line)
        if "context" not in run:
            continue
        settings = MemorySettings(**run["plan_workload"]["settings"])
        plan = plan_memory(ModelShape.of(random_config(run["model"])), settings).peak / GB
        peak = run["measured_gb"]["train_peak"]
        c = run["context"]
        out.append({"tokens": c["tokens"], "layout": c["layout"], "row": c["row_tokens"], "trained": c["trained_tokens"],
                    "peak": peak, "above": c["train_above_registered_gb"], "per_token": c["mb_per_token_above_registered"],
                    "plan": plan, "error": plan / peak - 1, "plan_then": run["plan_workload"]["peak_gb"],
                    "seconds": run["train"]["seconds"]})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| N | layout | row tokens | trained | train peak GB | above the model GB | MB a token | plan GB (error) "
             "| plan then GB | call s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['tokens']} | {r['layout']} | {r['row']} | {r['trained']} | {r['peak']:.2f} | {r['above']:.2f} "
                     f"| {r['per_token']:.3f} | {r['plan']:.2f} ({r['error']:+.0%}) | {r['plan_then']:.2f} "
                     f"| {r['seconds']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(rows(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else RUNS)))
