"""The results of `python benchmarks/bench.py learn`: one JSON file, rewritten after every finished run.

Layout of the file (`--out`):

    {"bench": "learn", "settings": {...},        # what every run shares; a resume must match it
     "runs": [{"task", "lr", "seed", "arm",      # one per finished (task, lr, seed, arm)
               "steps": [{"prompts": [keys], "rewards": [per sample, prompt-major],
                          "reward": mean, "digest": sha1 of the sampled token ids,
                          "update": {...}}, ...],   # "update": what the train step after it reported
               "first", "last", "gain", "failed", "seconds"}, ...],  # failed: why a run diverged, or null
     "table": [...aggregates by (task, lr, arm)...],
     "paired": [...artrl minus yardstick, seed by seed, by (task, lr)...]}

The score of a run is `gain = last - first`: the mean step reward of the last
`window` steps minus that of the first `window` steps (window = min(3, steps // 2)).
The file is written to a temporary sibling, fsynced and renamed over the old one
(`local.storage.write_json_atomic`), so a crash loses at most the run in progress,
and a rerun with the same `--out` and settings skips the runs already in it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from artrl.errors import ConfigError

WINDOW: Final = 3
"""Steps averaged at each end of a run for its gain."""

ARMS: Final = ("artrl", "yardstick")
RESULTS_VERSION: Final = 1


def window(steps: int) -> int:
    """Steps averaged at each end: WINDOW, or fewer when a run is too short to hold two windows."""
    return max(1, min(WINDOW, steps // 2))


def run_scores(step_rewards: list[float]) -> dict[str, float]:
    """`first`, `last` and `gain` of one run from its per-step mean rewards."""
    w = window(len(step_rewards))
    first = sum(step_rewards[:w]) / w
    last = sum(step_rewards[-w:]) / w
    return {"first": first, "last": last, "gain": last - first}


def run_key(task: str, lr: float, seed: int, arm: str) -> tuple[str, str, int, str]:
    return (task, repr(float(lr)), int(seed), arm)


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"seeds": 0, "mean": None, "std": None, "min": None, "max": None}
    return {"seeds": len(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values)}


def aggregate(runs: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(table, paired): gain statistics per (task, lr, arm), and per (task, lr) of artrl minus yardstick.

    `seeds` counts finished runs, `failed` the runs that diverged (a non-finite update;
    no gain, left out of the statistics). `std` is the sample standard deviation over
    seeds (None with one seed). `paired` uses only seeds that both arms finished: the
    same seed means the same initial adapter, the same prompts and the same first
    samples, so the difference is less noisy than the gains.
    """
    by_key: dict[tuple[str, float, str], dict[int, dict[str, Any]]] = {}
    for r in runs:
        by_key.setdefault((r["task"], float(r["lr"]), r["arm"]), {})[int(r["seed"])] = r
    table = []
    for (task, lr, arm), seeds in sorted(by_key.items()):
        ok = [seeds[s] for s in sorted(seeds) if not seeds[s].get("failed")]
        row = {"task": task, "lr": lr, "arm": arm, **_spread([r["gain"] for r in ok]),
               "failed": len(seeds) - len(ok)}
        row["mean_first"] = statistics.fmean(r["first"] for r in ok) if ok else None
        row["mean_last"] = statistics.fmean(r["last"] for r in ok) if ok else None
        table.append(row)
    paired = []
    for task, lr in sorted({(t, lr) for t, lr, _ in by_key}):
        ours, ref = by_key.get((task, lr, "artrl"), {}), by_key.get((task, lr, "yardstick"), {})
        both = sorted(s for s in set(ours) & set(ref) if not ours[s].get("failed") and not ref[s].get("failed"))
        if both:
            diffs = [ours[s]["gain"] - ref[s]["gain"] for s in both]
            paired.append({"task": task, "lr": lr, **_spread(diffs)})
    return table, paired


def _fmt(x: float | None, signed: bool = True) -> str:
    if x is None:
        return "-"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def format_table(table: list[dict[str, Any]], paired: list[dict[str, Any]]) -> str:
    """The table `python benchmarks/bench.py learn` prints: gain per (task, lr, arm), then artrl minus yardstick."""
    lines = [f"{'task':<9} {'lr':>8} {'arm':<10} {'seeds':>5} {'gain':>7} {'std':>6} {'min..max':>15} "
             f"{'first':>6} {'last':>6} {'failed':>6}"]
    for r in table:
        lines.append(f"{r['task']:<9} {r['lr']:>8.0e} {r['arm']:<10} {r['seeds']:>5} {_fmt(r['mean']):>7} "
                     f"{_fmt(r['std'], False):>6} {_fmt(r['min']) + '..' + _fmt(r['max']):>15} "
                     f"{_fmt(r['mean_first'], False):>6} {_fmt(r['mean_last'], False):>6} {r['failed']:>6}")
    if paired:
        lines += ["", "artrl gain minus yardstick gain, seed by seed:",
                  f"{'task':<9} {'lr':>8} {'seeds':>5} {'diff':>7} {'std':>6} {'min..max':>15}"]
        for p in paired:
            lines.append(f"{p['task']:<9} {p['lr']:>8.0e} {p['seeds']:>5} {_fmt(p['mean']):>7} "
                         f"{_fmt(p['std'], False):>6} {_fmt(p['min']) + '..' + _fmt(p['max']):>15}")
    return "\n".join(lines)


GAIN_FLOOR: Final = 0.75
"""A run set fails its baseline when artrl's mean gain falls below this share of the baseline's, for any
(task, lr): a change that halves what RL learns fails by a wide margin, and the seed-to-seed spread of the
guard's setting (colours at 2e-3: std 0.04 over 12 seeds, docs/performance.md) stays well inside it."""
PAIRED_MARGIN: Final = 0.05
"""...or when artrl's gain minus the yardstick's, seed by seed, falls more than this below the baseline's (a
regression in artrl's own update, with the sampling and the model shared by both arms, shows here first)."""


def compare_to_baseline(doc: dict[str, Any], baseline: dict[str, Any], *, floor: float = GAIN_FLOOR,
                        paired_margin: float = PAIRED_MARGIN) -> list[str]:
    """The regressions of results `doc` against results `baseline` (both `ResultsFile.document()`s): one line
    each, naming the figures; empty when `doc` learns as the baseline did. The two must share their settings
    and hold the same (task, lr) pairs, else a ConfigError (a comparison of different sweeps means nothing)."""
    if doc.get("settings") != baseline.get("settings"):
        theirs, ours = baseline.get("settings", {}), doc.get("settings", {})
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise ConfigError(f"the baseline was measured with other settings ({', '.join(differ)}); rerun it with "
                          "the same command, or compare against a baseline of these settings")
    rows = {(r["task"], float(r["lr"]), r["arm"]): r for r in doc["table"]}
    base_rows = {(r["task"], float(r["lr"]), r["arm"]): r for r in baseline["table"]}
    missing = sorted(set(base_rows) - set(rows))
    if missing:
        raise ConfigError(f"the results lack the baseline's {missing}; run the baseline's tasks, lrs and arms")
    problems = []
    for (task, lr, arm), base in sorted(base_rows.items()):
        row = rows[task, lr, arm]
        if row["failed"]:
            problems.append(f"{task} lr={lr:g} {arm}: {row['failed']} runs diverged (the baseline: {base['failed']})")
        if arm != "artrl" or base["mean"] is None or base["mean"] <= 0:
            continue
        if row["mean"] is None or row["mean"] < floor * base["mean"]:
            problems.append(f"{task} lr={lr:g}: artrl's mean gain {_fmt(row['mean'])} over {row['seeds']} seeds is "
                            f"below {floor:.0%} of the baseline's {_fmt(base['mean'])}")
    paired = {(p["task"], float(p["lr"])): p for p in doc["paired"]}
    for base in baseline["paired"]:
        p = paired.get((base["task"], float(base["lr"])))
        if p is not None and p["mean"] < base["mean"] - paired_margin:
            problems.append(f"{base['task']} lr={float(base['lr']):g}: artrl's gain minus the yardstick's "
                            f"{_fmt(p['mean'])} is more than {paired_margin} below the baseline's {_fmt(base['mean'])}")
    return problems


class ResultsFile:
    """The `--out` file: settings, finished runs, and their aggregates, saved after each run."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        self.settings = settings
        self.runs: list[dict[str, Any]] = []
        if path.exists():
            self._resume()

    def _resume(self) -> None:
        import json

        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.path} exists but is not a readable results file ({e}); pass another --out "
                              "or move it away") from e
        if not isinstance(data, dict) or data.get("bench") != "learn" or not isinstance(data.get("runs"), list):
            raise ConfigError(f"{self.path} exists but is not a `bench.py learn` results file; pass another "
                              "--out or move it away")
        old = data.get("settings", {})
        differ = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
        if differ:
            detail = "; ".join(f"{k}: file {old.get(k)!r}, now {self.settings.get(k)!r}" for k in differ)
            raise ConfigError(f"{self.path} holds runs made with other settings ({detail}). Resume with the same "
                              "settings, or pass another --out to start a new sweep.")
        self.runs = data["runs"]

    def done(self) -> set[tuple[str, str, int, str]]:
        return {run_key(r["task"], r["lr"], r["seed"], r["arm"]) for r in self.runs}

    def add(self, run: dict[str, Any]) -> None:
        self.runs.append(run)
        self.save()

    def document(self) -> dict[str, Any]:
        table, paired = aggregate(self.runs)
        return {"bench": "learn", "version": RESULTS_VERSION, "settings": self.settings, "runs": self.runs,
                "table": table, "paired": paired}

    def save(self) -> None:
        from artrl.run.storage import json_safe, write_json_atomic

        write_json_atomic(self.path, json_safe(self.document()))

