"""Workload files (token lengths of one train call, no text) -> synthetic tokenized groups.

Format (benchmarks/workloads/README.md): `{"description": str, "groups": [{"prompt_tokens": int,
"completion_tokens": [int, ...]}, ...]}`. Each group becomes sequences that share a prompt of
`prompt_tokens` random ids and add a completion of the given length, all of it trainable.
`scale` multiplies every length (at least 1 token each), so a CPU run keeps the workload's shape.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...trajectories.sequences import TokenizedSequence


def load_workload(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"workload file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"workload file {path} is not valid JSON: {e}") from None
    groups = data.get("groups") if isinstance(data, dict) else None
    if not isinstance(groups, list) or not groups:
        raise ConfigError(f"workload file {path} has no 'groups' list")
    for i, g in enumerate(groups):
        ok = (isinstance(g, dict) and isinstance(g.get("prompt_tokens"), int) and g["prompt_tokens"] >= 1
              and isinstance(g.get("completion_tokens"), list) and g["completion_tokens"]
              and all(isinstance(c, int) and c >= 1 for c in g["completion_tokens"]))
        if not ok:
            raise ConfigError(f"workload file {path}: groups[{i}] needs prompt_tokens >= 1 and a non-empty "
                              f"list of completion_tokens >= 1, got {g!r:.200}")
    return data


def scaled(n: int, scale: float) -> int:
    return max(1, int(math.floor(n * scale + 0.5)))


def workload_groups(data: dict[str, Any], *, scale: float = 1.0, vocab_size: int = 2048,
                    seed: int = 0) -> list[list[TokenizedSequence]]:
    """Synthetic tokenized groups with the workload's lengths (random ids in [10, vocab_size))."""
    rng = random.Random(seed)
    groups = []
    for gi, g in enumerate(data["groups"]):
        p = scaled(g["prompt_tokens"], scale)
        prompt = [rng.randrange(10, vocab_size) for _ in range(p)]
        seqs = []
        for ti, c in enumerate(g["completion_tokens"]):
            c = scaled(c, scale)
            comp = [rng.randrange(10, vocab_size) for _ in range(c)]
            seqs.append(TokenizedSequence(
                token_ids=prompt + comp, trainable_mask=[False] * p + [True] * c,
                logprobs=[math.nan] * p + [-rng.uniform(0.1, 3.0) for _ in range(c)],
                advantage=rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5), group_index=gi, trajectory_index=ti))
        groups.append(seqs)
    return groups
