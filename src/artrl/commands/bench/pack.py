"""`artrl bench pack`: our packer against the reference (ART) layout on a workload file.

Prints one JSON line. `computed_tokens` is rows x row length: every token slot a
forward pass pays for, padding and repeated prompts included. `unique_tokens` is
what the data holds if each group's prompt is stored once.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ...preprocess.pack import pack, pack_reference
from ...preprocess.rows import PackedRows
from .workload import load_workload, scaled, workload_groups

REFERENCE_MULTIPLE = 2048  # ART rounds its row length up to a multiple of this


def _figures(rows: PackedRows) -> dict[str, Any]:
    s = rows.stats
    return {
        "rows": s.rows,
        "row_length": s.row_length,
        "padding_fraction": round(s.padding_fraction, 4),
        "real_tokens": s.real_tokens,
        "computed_tokens": s.computed_tokens,
        "unique_tokens": s.unique_tokens,
        "dropped": s.dropped,
        "truncated": s.truncated,
    }


def run_pack_bench(workload: str, *, row_length: int | None = None, max_length: int = 32768,
                   scale: float = 1.0) -> dict[str, Any]:
    data = load_workload(workload)
    groups = workload_groups(data, scale=scale)
    t0 = time.perf_counter()
    ours = pack(groups, row_length=row_length, max_length=max_length)
    seconds = time.perf_counter() - t0
    ref = pack_reference(groups, multiple=scaled(REFERENCE_MULTIPLE, scale))  # scaled like `artrl bench train`
    out: dict[str, Any] = {"bench": "pack", "workload": workload, "scale": scale,
                           "trajectories": sum(len(g) for g in groups),
                           "row_length_mode": "fixed" if row_length else "auto"}
    out.update(_figures(ours))
    out["pack_seconds"] = round(seconds, 3)
    out["reference"] = _figures(ref)
    out["computed_vs_reference"] = round(ours.stats.computed_tokens / ref.stats.computed_tokens, 4)
    return out


def add_arguments(p: Any) -> None:
    p.add_argument("--workload", required=True,
                   help="workload JSON (format: benchmarks/workloads/README.md), e.g. benchmarks/workloads/seed-like.json")
    p.add_argument("--row-length", type=int, default=None, help="fix the row length (default: automatic)")
    p.add_argument("--max-length", type=int, default=32768, help="model maximum length bounding the rows")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length by this factor")


def main(args: Any) -> int:
    print(json.dumps(run_pack_bench(args.workload, row_length=args.row_length, max_length=args.max_length,
                                    scale=args.scale)))
    return 0
