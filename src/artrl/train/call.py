"""A prepared train call: what will run (steps, rows, plan, learning rates) and the line that says so.

`prepare_call` (prepare.py: `prepare_rl` / `prepare_sft` of rl.py, sft.py) builds
one from a `BuildContext` (what the trainer that will run it is: tokenizer,
end-of-turn ids, maximum length, device) through `build_batches`, the one
mapping of a config's batch settings onto preprocess/build.py. A prepared call
is plain data: it runs here (`run_call` on a Trainer: per-step metrics plus
the call's summary metrics) or is shipped whole to training workers. Every call
logs one line, e.g.

    RL: packed 120 sequences of 120 trajectories into 14 rows of 3072 tokens (2.7% padding);
    7 micro-batches of <=2 rows; 2 optimizer steps of 8 groups
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from collections.abc import Sequence

from ..preprocess.build import BuiltCall, build_call
from ..preprocess.plan import BatchPlan
from ..preprocess.rows import PackedRows
from ..trajectories.sequences import TokenizedSequence, TokenizeStats
from ..runtime.once_per_run import OncePerRun
from ..runtime.threads import use_training_threads
from ..types import BatchConfig, OptimizerConfig
from .trainer import BuildContext, LossFn, StepOptions, Trainer

log = logging.getLogger(__name__)

# Per-step metrics that add up over a call (the rest are averaged over its steps).
SUMMED_METRICS = ("trainable_tokens", "computed_tokens", "micro_batches", "rows", "step_seconds",
                  "skipped_nonfinite_steps", "sampled_logprob_tokens")


def build_batches(units: Sequence[Sequence[TokenizedSequence]], config: BatchConfig, ctx: BuildContext, *,
                  units_per_step: int | None, rows_per_step: int | None = None) -> BuiltCall:
    """Units -> optimizer steps -> rows -> micro-batches with `config`'s batch settings (RL and SFT alike)."""
    max_length = min(ctx.max_length, config.max_row_length or ctx.max_length)
    max_tokens = config.max_tokens_per_microbatch
    if (max_tokens is None and config.per_device_train_batch_size is None and ctx.memory_budget is not None
            and rows_per_step is None):
        # the free device memory sets the token budget (train/memory.py); never below the longest sequence
        # that the row limits keep, so the memory changes the layout only, never what is trained
        longest = min(max((len(s) for unit in units for s in unit), default=0),
                      config.row_length or max_length)
        max_tokens, checkpointing = ctx.memory_budget.choose(longest, ctx.gradient_checkpointing)
        if config.row_length is not None:
            max_tokens = max(max_tokens, config.row_length)
        notes = ctx.memory_notes if ctx.memory_notes is not None else OncePerRun(log)
        notes("budget", "token budget %d per micro-batch from %.1f GB free device memory (activation checkpointing %s)",
              max_tokens, ctx.memory_budget.free_bytes / 1e9, "on" if checkpointing else "off")
    return build_call(
        units, units_per_step=units_per_step, rows_per_step=rows_per_step, row_length=config.row_length,
        max_length=max_length, on_too_long=config.on_too_long, share_prompts=config.share_prompts,
        pad_id=ctx.pad_id,
        per_device_train_batch_size=config.resolved_per_device_train_batch_size(ctx.device_type, rows_per_step),
        max_tokens_per_microbatch=max_tokens)


@dataclass
class PreparedCall:
    kind: str  # "rl" or "sft"
    built: BuiltCall
    loss_fn: LossFn | None
    learning_rates: list[float]
    optimizer: OptimizerConfig
    tokenize_stats: TokenizeStats
    step_unit: str = "groups"  # what an optimizer step is made of: "groups" (RL) or "trajectories" (SFT)
    options: StepOptions = field(default_factory=StepOptions)

    @property
    def packed(self) -> PackedRows | None:
        return self.built.packed

    @property
    def plan(self) -> BatchPlan | None:
        return self.built.plan

    @property
    def empty(self) -> bool:
        return self.built.empty

    def line(self) -> str:
        """The call's one-line description (what the log and a train result's warning show)."""
        t = self.tokenize_stats
        s = self.built.stats
        counts = [
            (t.groups_skipped_zero_advantage, "zero-advantage groups skipped"),
            (t.groups_skipped_empty, "empty groups skipped"),
            (t.trajectories_without_trainable_tokens, "trajectories without trainable turns"),
            (s.dropped, "too long, dropped"),
            (s.truncated, "truncated"),
            (t.turns_missing_logprobs, "turns without logprobs trained on-policy"),
            (t.rendered_turns if self.kind == "rl" else 0, "turns rendered from text (no token record)"),
            (t.retokenized_turns, "turns re-tokenized (no token ids)"),
            (t.record_splits, "record splits (prompt not extending the previous turn)"),
        ]
        skipped = [f"{n} {label}" for n, label in counts if n]
        extra = f" [{'; '.join(skipped)}]" if skipped else ""
        if self.empty or self.packed is None or self.plan is None:
            return f"{self.kind.upper()}: nothing to train on {t.trajectories} trajectories{extra}"
        units = sorted({len(u) for u in self.built.step_units})
        per_step = f"{units[0]}" if len(units) == 1 else f"{units[0]}-{units[-1]}"
        return (f"{self.kind.upper()}: packed {s.sequences} sequences of {t.trajectories} trajectories into {s.rows} "
                f"rows of {s.row_length} tokens ({100 * s.padding_fraction:.1f}% padding); "
                f"{self.plan.describe()} of {per_step} {self.step_unit}{extra}")

    def figures(self) -> dict[str, float]:
        out = {f"data/{k}": v for k, v in self.tokenize_stats.as_metrics().items()}
        s = self.built.stats
        out.update({"data/dropped": float(s.dropped), "data/truncated": float(s.truncated)})
        if self.packed is not None:
            out.update({"data/rows": float(s.rows), "data/row_length": float(s.row_length),
                        "data/padding_fraction": s.padding_fraction})
        if self.plan is not None:
            out.update({"data/micro_batches": float(self.plan.num_micro_batches),
                        "data/optimizer_steps": float(len(self.plan.steps))})
        return out


def run_call(trainer: Trainer, call: PreparedCall, *, show_progress: bool = True, desc: str | None = None,
             verbose: bool = False) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Execute a prepared call; returns (metrics per optimizer step, the call's summary metrics: averaged
    step metrics + data figures).

    `verbose` (ART's keyword) also logs each optimizer step's metrics at INFO level.
    """
    log.info("%s", call.line())
    steps: list[dict[str, float]] = []
    if not call.empty:
        use_training_threads()  # the process's thread count, whichever thread runs the call (artrl/runtime/threads.py)
        assert call.packed is not None and call.plan is not None and call.loss_fn is not None
        for k, metrics in enumerate(trainer.run(call.packed, call.plan, call.loss_fn, call.learning_rates,
                                                optimizer=call.optimizer, options=call.options,
                                                desc=desc or call.kind, show_progress=show_progress)):
            steps.append(metrics)
            if verbose:
                log.info("%s optimizer step %d/%d: %s", call.kind.upper(), k + 1, len(call.plan.steps),
                         ", ".join(f"{key}={value:.4g}" for key, value in metrics.items()))
    return steps, summarize(steps, call.figures())


def summarize(steps: list[dict[str, float]], figures: dict[str, float]) -> dict[str, float]:
    """Per-call metrics from per-step ones: counts add up, `*_max` keys take the max, the rest average."""
    out: dict[str, float] = {}
    if steps:
        for key in steps[0]:
            vals = [m[key] for m in steps if key in m]
            if key in SUMMED_METRICS:
                out[key] = sum(vals)
            elif key.endswith("_max"):
                out[key] = max(vals)
            else:
                out[key] = sum(vals) / len(vals)
        seconds = out.get("step_seconds", 0.0)
        out["tokens_per_second"] = out["trainable_tokens"] / seconds if seconds else 0.0
    out.update(figures)
    return out
