"""A prepared train call: what will run (rows, plan, learning rates) and the line that says so.

`prepare_rl` / `prepare_sft` (rl.py, sft.py) build one; `run_call` executes it
on a Trainer and returns per-step metrics plus call-level figures. Every call
logs one summary line, e.g.

    Packed 118 trajectories into 57 rows of 6144 tokens (2.1% padding); 29 micro-batches of <=2 rows;
    15 optimizer steps
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..preprocess.pack import PackedRows
from ..preprocess.plan import BatchPlan
from ..preprocess.tokenize import TokenizeStats
from .trainer import LossFn, Trainer

log = logging.getLogger(__name__)


@dataclass
class PreparedCall:
    kind: str  # "rl" or "sft"
    packed: PackedRows | None
    plan: BatchPlan | None
    loss_fn: LossFn | None
    learning_rates: list[float]
    max_grad_norm: float | None
    tokenize_stats: TokenizeStats
    need_ref: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.plan is None or not self.plan.steps

    def summary(self) -> str:
        t = self.tokenize_stats
        s = self.packed.stats if self.packed is not None else None
        counts = [
            (t.groups_skipped_zero_advantage, "zero-advantage groups skipped"),
            (t.groups_skipped_empty, "empty groups skipped"),
            (t.trajectories_without_trainable_tokens, "trajectories without trainable turns"),
            (s.dropped if s else 0, "too long, dropped"),
            (s.truncated if s else 0, "truncated"),
            (t.turns_missing_logprobs, "turns without logprobs trained on-policy"),
            (t.rendered_turns if self.kind == "rl" else 0, "turns rendered from text (no token record)"),
            (t.retokenized_turns, "turns re-tokenized (no token ids)"),
            (t.record_splits, "record splits (prompt not extending the previous turn)"),
        ]
        skipped = [f"{n} {label}" for n, label in counts if n]
        extra = f" [{'; '.join(skipped)}]" if skipped else ""
        if self.empty or self.packed is None or self.plan is None:
            return f"{self.kind.upper()}: nothing to train on {t.trajectories} trajectories{extra}"
        assert s is not None
        return (f"{self.kind.upper()}: packed {s.sequences} sequences of {t.trajectories} trajectories into {s.rows} "
                f"rows of {s.row_length} "
                f"tokens ({100 * s.padding_fraction:.1f}% padding); {self.plan.describe()}{extra}")

    def figures(self) -> dict[str, float]:
        out = {f"data/{k}": v for k, v in self.tokenize_stats.as_metrics().items()}
        if self.packed is not None:
            s = self.packed.stats
            out.update({"data/rows": float(s.rows), "data/row_length": float(s.row_length),
                        "data/padding_fraction": s.padding_fraction, "data/dropped": float(s.dropped),
                        "data/truncated": float(s.truncated)})
        if self.plan is not None:
            out.update({"data/micro_batches": float(self.plan.num_micro_batches),
                        "data/optimizer_steps": float(len(self.plan.steps))})
        return out


def run_call(trainer: Trainer, call: PreparedCall, *, show_progress: bool = True,
             desc: str | None = None) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Execute a prepared call; returns (metrics per optimizer step, averaged metrics + figures)."""
    log.info("%s", call.summary())
    steps: list[dict[str, float]] = []
    if not call.empty:
        assert call.packed is not None and call.plan is not None and call.loss_fn is not None
        steps = list(trainer.run(call.packed, call.plan, call.loss_fn, call.learning_rates,
                                 max_grad_norm=call.max_grad_norm, need_ref=call.need_ref,
                                 desc=desc or call.kind, show_progress=show_progress))
    avg: dict[str, float] = {}
    if steps:
        for key in steps[0]:
            vals = [m[key] for m in steps if key in m]
            summed = key in ("trainable_tokens", "computed_tokens", "micro_batches", "rows", "step_seconds",
                             "skipped_nonfinite_steps", "sampled_logprob_tokens")
            if key.endswith("_max"):
                avg[key] = max(vals)
            else:
                avg[key] = sum(vals) if summed else sum(vals) / len(vals)
        seconds = avg.get("step_seconds", 0.0)
        avg["tokens_per_second"] = avg["trainable_tokens"] / seconds if seconds else 0.0
    avg.update(call.figures())
    return steps, avg
