"""The planned longest RL context on a GPU, from the memory plan (models/memory_plan.py's `max_context`).

For each model shape (Qwen3 0.6B, 8B, 14B), base weights (4-bit NF4 or bf16, LoRA rank 8, bf16 compute) and GPU
memory (24, 80, 141 GB), the most tokens one micro-batch of one sequence may hold when every token is trained,
with activation checkpointing and its inputs offloaded to host memory (the best setting a call may choose), and
the engine's cache of a trajectory pair of that length on the same GPU. One JSON line each, then the markdown
table docs/performance.md quotes ("Long trajectories"; tests/test_doc_figures.py checks the two agree).

    python benchmarks/context_plan.py
"""

from __future__ import annotations

import json

from artrl.models.memory_plan import MemorySettings, ModelShape, max_context
from artrl.models.shapes import random_config

MODELS = {"Qwen3-0.6B": "random:qwen3-0.6b", "Qwen3-8B": "random:qwen3-8b", "Qwen3-14B": "random:qwen3-14b"}
WEIGHTS = {"4-bit": "4bit", "bf16": None}
GPUS_GB = (24, 80, 141)
CACHED_SEQUENCES = 2  # the trajectory pair the engine sampled


def plan_table() -> list[dict]:
    rows = []
    for label, name in MODELS.items():
        shape = ModelShape.of(random_config(name))
        for weights, quantization in WEIGHTS.items():
            row = {"model": label, "weights": weights}
            for gb in GPUS_GB:
                s = MemorySettings(device_type="cuda", quantization=quantization, dtype_bytes=2,
                                   gradient_checkpointing=True, offload_activations=True)
                row[f"{gb}GB"] = max_context(shape, s, int(gb * 1e9), cached_sequences=CACHED_SEQUENCES)
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    def cell(n: int) -> str:
        return f"{n // 1000}k" if n >= 1000 else ("does not fit" if n == 0 else str(n))

    lines = ["| model | base weights | " + " | ".join(f"{gb} GB" for gb in GPUS_GB) + " |",
             "|---|---|" + "---|" * len(GPUS_GB)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['weights']} | " + " | ".join(cell(r[f'{gb}GB']) for gb in GPUS_GB) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    table = plan_table()
    for row in table:
        print(json.dumps({"bench": "context_plan", **row}))
    print(markdown(table))
