"""The speed guard: training throughput and the pipeline's speed against committed baselines.

A change that costs a third of the trainer's throughput (an allocator rule, a lost fast path) passes every test:
the math is the same. This script sees it. It runs, in alternated rounds on an otherwise idle machine,

* `artrl bench train --workload benchmarks/workloads/seed-like.json --scale 0.125`: batched training against
  ART's one-row-per-step layout on the same trainer (`ratio_tokens_per_s`) and the share of the measured matmul
  peak it reaches (`mfu`);
* `python benchmarks/bench.py pipeline` on the tool-bound workload with `--autotune online` (ART's tuner with
  ART's defaults, what a user who turns it on gets): seconds per trained group of the synchronous loop over the pipeline's
  (`ratio_per_trained_group`);

and fails (exit 1) when the median of a figure falls below `FLOOR` of the baseline's median
(`benchmarks/results/speed-baseline.json`). Both figures are ratios measured within one process tree a moment
apart (ours against the reference layout; the loop against the pipeline) or against a peak measured in the same
run, so they travel across machines of one kind better than seconds do; the floor leaves room for this 2-core
machine's noise (alternated runs of one build: ratio 1.24-1.57, MFU 0.32-0.36, docs/testing.md).

    python benchmarks/speed_guard.py                        # compare with the baseline (.ci/run runs this)
    python benchmarks/speed_guard.py --out /tmp/speed.json  # remake it: copy over the baseline, say why

Each bench run prints one JSON line to stderr as it ends; the last line on stdout is the verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "benchmarks" / "results" / "speed-baseline.json"
FLOOR = 0.8
"""A figure fails below this share of the baseline's median: the allocator regression (ratio 1.9 -> 1.2, MFU
0.33 -> 0.19) is far below it, one build's spread is within it."""

TRAIN = ["bench", "train", "--workload", "benchmarks/workloads/seed-like.json", "--scale", "0.125"]
PIPELINE = ["pipeline", "--turns", "2", "--tool-latency", "1.0", "--prompt-words", "50",
            "--result-words", "200", "--max-tokens", "8", "--groups-per-step", "4", "--rollouts-per-group", "4",
            "--steps", "8", "--device", "cpu", "--autotune", "online"]
FIGURES = {"train": ("ratio_tokens_per_s", "mfu"), "pipeline": ("ratio_per_trained_group",)}
COMMANDS = {"train": TRAIN, "pipeline": PIPELINE}
# what runs each: the product's command line (`artrl bench train`), the harness's (benchmarks/bench.py pipeline);
# as the command reads, then as this script starts it (from the repository root)
RUNNERS = {"train": ("artrl", ["-m", "artrl.cli"]), "pipeline": ("python benchmarks/bench.py", ["benchmarks/bench.py"])}


def run_bench(which: str) -> dict:
    shown, runner = RUNNERS[which]
    argv = [sys.executable, *runner, *COMMANDS[which]]
    command = " ".join([shown, *COMMANDS[which]])
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"speed guard: `{command}` failed ({out.returncode}):\n"
                         f"{out.stderr[-3000:]}")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    row = {"bench": which, **{k: report.get(k) for k in FIGURES[which]}, "process_s": round(time.perf_counter() - t0, 1),
           "command": command}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def measure(rounds: int, benches: list[str]) -> dict:
    rows: dict[str, list[dict]] = {b: [] for b in benches}
    for _ in range(rounds):
        for b in benches:  # alternated: a drift of the machine's speed falls on both alike
            rows[b].append(run_bench(b))
    medians = {b: {k: statistics.median(r[k] for r in rows[b]) for k in FIGURES[b]} for b in benches}
    return {"bench": "speed_guard", "rounds": rounds, "medians": medians, "runs": rows}


def compare(measured: dict, baseline: dict, floor: float = FLOOR) -> list[str]:
    """One line per figure below `floor` of the baseline's median; a figure the baseline lacks is an error."""
    problems = []
    for bench, figures in measured["medians"].items():
        for name, value in figures.items():
            try:
                base = baseline["medians"][bench][name]
            except KeyError:
                raise SystemExit(f"speed guard: the baseline has no {bench}.{name}; remake it (--out)") from None
            if value is None or value < floor * base:
                problems.append(f"{bench} {name} {value} is below {floor:.0%} of the baseline's {base} "
                                f"(floor {floor * base:.3f})")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds of each bench (default 3)")
    p.add_argument("--benches", default="train,pipeline", help="which (default: train,pipeline)")
    p.add_argument("--baseline", type=Path, default=BASELINE)
    p.add_argument("--out", type=Path, default=None, help="write the measurement here (and compare with nothing)")
    args = p.parse_args(argv)
    benches = [b.strip() for b in args.benches.split(",") if b.strip()]
    unknown = sorted(set(benches) - set(COMMANDS))
    if unknown or args.rounds < 1:
        p.error(f"--benches takes {sorted(COMMANDS)} (got {unknown}); --rounds >= 1")
    baseline = None
    if args.out is None:
        try:
            baseline = json.loads(args.baseline.read_text())
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"cannot read the baseline {args.baseline}: {e}")
    measured = measure(args.rounds, benches)
    if args.out is not None:
        args.out.write_text(json.dumps(measured, indent=1) + "\n")
        print(json.dumps({"bench": "speed_guard", "written": str(args.out), "medians": measured["medians"]}))
        return 0
    problems = compare(measured, baseline)
    print(json.dumps({"bench": "speed_guard", "ok": not problems, "medians": measured["medians"],
                      "baseline": baseline["medians"], "floor": FLOOR, "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
