"""One stage of benchmarks/gpu.sh, recorded: its JSON line(s) appended to a results file, its figures printed.

    python benchmarks/gpu_record.py STAGE FILE RC SECONDS STDOUT_FILE STDERR_FILE

Every JSON line the stage printed gets `"stage"` and `"stage_seconds"` and is appended to FILE. A stage
that failed (non-zero exit, a timeout: 124 / 137) or printed no JSON adds one line with its exit code and the
last lines of its stderr instead, so a results file says what ran and what did not. One short line of the
stage's headline figures goes to the console.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HEADLINES = ("mfu", "ratio_tokens_per_s", "computed_tokens_ratio", "trainable_tokens_per_s", "seconds",
             "peak_memory_mb", "max_micro_batch_tokens", "completion_tokens_per_s", "requests_per_s",
             "device_name", "torch", "liger_kernel", "trl", "error",
             # the demo's: wall time, its split, decode speed while sampling, rewards
             "wall_s", "rollout_s", "train_s", "rollout_completion_tokens_per_s", "val_reward_after_rl",
             # bench pipeline's: the ratio, where the workload sits, each arm's idle shares and staleness
             "ratio_sync_over_pipeline", "sync_rollout_over_train", "trainer_idle_fraction", "actor_idle_fraction",
             "mean_staleness",
             # bench memory --context's: the plan's error, the call's peak above the model, its choices
             "plan_error", "row_tokens", "train_above_registered_gb", "checkpointing", "offloaded", "peak_gb",
             "call_refused", "message", "fit", "fit_tokens", "offloaded_gb", "host_max_resident", "gpu_memory_gb")
PARTS = ("ours", "reference", "artrl", "trl", "concurrent", "sequential", "sync", "pipeline", "context", "train",
         "measured_gb")


def headline(record: dict[str, Any]) -> str:
    """The few figures worth a glance, from a record and its parts (ours / reference, artrl / trl, ...)."""
    parts = []
    scopes = [("", record)] + [(f"{k}.", record[k]) for k in PARTS if isinstance(record.get(k), dict)]
    for label, scope in scopes:
        for key in HEADLINES:
            if key in scope and not isinstance(scope[key], (dict, list)):
                parts.append(f"{label}{key}={scope[key]}")
        if isinstance(scope.get("kernels"), dict):
            parts.append(f"{label}kernels=" + ",".join(k for k, v in scope["kernels"].items() if v))
    groups = ((record.get("ours") or {}).get("profile") or {}).get("groups")
    if groups:
        parts.append("profile " + " ".join(f"{k}={v['share']:.0%}" for k, v in groups.items() if v["share"]))
    return ", ".join(parts)


def main(stage: str, file: str, rc: str, seconds: str, stdout: str, stderr: str) -> int:
    records = []
    for line in Path(stdout).read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    code = int(rc)
    if code != 0 or not records:
        tail = Path(stderr).read_text(errors="replace").strip().splitlines()[-12:]
        why = {124: "timed out", 137: "killed after timing out"}.get(code, f"exit {code}")
        record = {"error": why if code else "printed no JSON", "rc": code, "stderr_tail": tail}
        if not records:
            record["stdout_tail"] = Path(stdout).read_text(errors="replace").strip().splitlines()[-12:]
        records.append(record)
    with open(file, "a") as f:
        for r in records:
            r = {"stage": stage, "stage_seconds": float(seconds), **r}
            f.write(json.dumps(r) + "\n")
            print(f"[{stage}] {float(seconds):.0f}s {headline(r)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:7]))
