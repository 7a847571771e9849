"""A look at a run: `artrl runs show <run dir>` prints rewards and losses per step and plots them.

It reads only `history.jsonl` (see run/history.py for what a row holds), so
it works on a run in progress, a finished one, or a copy of either. One table
row per step merges that step's history rows:

    step  kind  train reward  val reward  loss      trajectories
       0     -             -       0.312         -             48
       1   sft             -       0.688    1.9021              -
       2    rl         0.750       0.729   -0.0123             32

`train reward` at step s is the mean reward of the rollouts that trained step s
(sampled with the weights of step s-1; ART logs a train call's groups at the
step it produces). The PNG has two panels, reward and loss per step, with SFT
steps shaded; SFT and RL losses (cross-entropy and policy loss: different
scales) each have their own y axis.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..run import storage

log = logging.getLogger(__name__)

PLOT_FILE = "history.png"
NO_ROWS = "{run_dir}: history.jsonl has no rows yet"
LOSS_KEYS = ("loss/train", "train/loss")  # ART's name, then the name of runs written before it


@dataclass
class StepRow:
    """What one step of a run measured (None where nothing was logged)."""

    step: int
    kind: str | None = None
    train_reward: float | None = None
    val_reward: float | None = None
    loss: float | None = None
    trajectories: float | None = None


def load_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of `<run_dir>/history.jsonl`; a clear error when the directory is not a run."""
    run = Path(run_dir)
    path = run / storage.HISTORY_FILE
    if not path.is_file():
        raise ConfigError(f"{run} has no {storage.HISTORY_FILE}; pass a run directory, "
                          f"<path>/<project>/{storage.MODELS_DIR}/<name> (e.g. .art/my-project/models/agent-001)")
    return storage.read_jsonl(path)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else None


def step_table(rows: list[dict[str, Any]]) -> list[StepRow]:
    """One StepRow per logged step, ascending; a later row of a step overrides an earlier value."""
    steps: dict[int, StepRow] = {}
    for r in rows:
        if not isinstance(r.get("step"), int):
            continue
        s = steps.setdefault(r["step"], StepRow(r["step"]))
        split = r.get("split")
        if r.get("kind"):
            s.kind = str(r["kind"])
        elif split == "train" and s.kind is None:  # backend.train's and PipelineTrainer's rows: RL, as in ART
            s.kind = "rl"
        if split == "train" and _number(r.get("train/reward")) is not None:
            s.train_reward = _number(r["train/reward"])
        if split == "val" and _number(r.get("val/reward")) is not None:
            s.val_reward = _number(r["val/reward"])
            s.trajectories = _number(r.get("data/step_num_trajectories")) or _number(r.get("val/trajectories"))
        for key in LOSS_KEYS:
            if split == "train" and _number(r.get(key)) is not None:
                s.loss = _number(r[key])
                break
    return [steps[k] for k in sorted(steps)]


def format_table(table: list[StepRow]) -> str:
    """The table `artrl runs show` prints (fixed-width columns, '-' where nothing was logged)."""
    head = ("step", "kind", "train reward", "val reward", "loss", "val trajectories")

    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [head] + [(str(r.step), r.kind or "-", cell(r.train_reward, ".3f"), cell(r.val_reward, ".3f"),
                       cell(r.loss, ".4f"), cell(r.trajectories, ".0f")) for r in table]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def loss_series(table: list[StepRow]) -> dict[str, list[tuple[int, float]]]:
    """(step, loss) points per kind of train call ("sft", "rl", ...), in the order the kinds first appear."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in table:
        if r.loss is not None:
            out.setdefault(r.kind or "train", []).append((r.step, r.loss))
    return out


def plot_run(table: list[StepRow], path: str | Path, title: str | None = None) -> Path:
    """Reward (train, val) and loss per step as a PNG (matplotlib, Agg); SFT steps shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    try:
        series = [("train_reward", top, ".", "train reward (rollouts that trained the step)"),
                  ("val_reward", top, "o", "validation reward")]
        for attr, ax, marker, label in series:
            points = [(r.step, getattr(r, attr)) for r in table if getattr(r, attr) is not None]
            if points:
                ax.plot(*zip(*points), marker=marker, label=label)
        # SFT's loss (cross-entropy, nats/token) and RL's (policy loss, around 0) are different quantities on
        # different scales: one y axis each, RL's on the right where both kinds were trained
        losses = loss_series(table)
        loss_axes = []
        for i, (kind, points) in enumerate(losses.items()):
            ax = bottom if i == 0 else bottom.twinx()
            colour = f"C{2 + i}"
            ax.plot(*zip(*points), marker=".", color=colour, label=f"{kind.upper()} loss")
            ax.set_ylabel(f"{kind.upper()} loss", color=colour)
            loss_axes.append(ax)
        previous = None
        for r in table:
            if r.kind == "sft":
                for ax in (top, bottom):
                    ax.axvspan(r.step - 1, r.step, color="0.9", zorder=0)
                if previous != "sft":  # one label per run of SFT steps
                    top.annotate("SFT", xy=(r.step - 0.5, 0.97), xycoords=("data", "axes fraction"), ha="left",
                                 va="top", color="0.4")
            previous = r.kind
        top.set_ylabel("mean reward")
        if not losses:
            bottom.set_ylabel("loss")
        bottom.set_xlabel("step")
        from matplotlib.ticker import MaxNLocator

        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
        if top.get_legend_handles_labels()[0]:
            top.legend(loc="best")
        if loss_axes:
            handles = [h for ax in loss_axes for h in ax.get_legend_handles_labels()[0]]
            bottom.legend(handles, [str(h.get_label()) for h in handles], loc="best")
        if title:
            top.set_title(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def show(run_dir: str | Path, plot: str | Path | bool | None = None, *, title: str | None = None
         ) -> tuple[str, Path | None]:
    """(the table as text, the PNG written) for a run: the PNG goes to `plot`, by default
    `<run_dir>/history.png`; `plot=False` skips it."""
    table = step_table(load_history(run_dir))
    if not table:
        return NO_ROWS.format(run_dir=run_dir), None
    png = None
    if plot is not False:
        where = Path(plot) if isinstance(plot, (str, Path)) else Path(run_dir) / PLOT_FILE
        png = plot_run(table, where, title or str(run_dir))
    return format_table(table), png


def add_arguments(p: Any) -> None:
    sub = p.add_subparsers(dest="runs", required=True)
    sh = sub.add_parser("show", help="a run's rewards and losses per step: a table, and a PNG")
    sh.add_argument("run_dir", help="the run directory, <path>/<project>/models/<name>")
    sh.add_argument("--plot", default=None, help=f"where to write the PNG (default <run_dir>/{PLOT_FILE})")
    sh.add_argument("--no-plot", action="store_true", help="print the table only")


def main(args: Any) -> int:
    table = step_table(load_history(args.run_dir))
    if not table:
        print(NO_ROWS.format(run_dir=args.run_dir))
        return 0
    # the table before the plot: matplotlib's first use on a machine builds its font cache (seconds, and a line)
    print(format_table(table), flush=True)
    if not args.no_plot:
        where = Path(args.plot) if args.plot is not None else Path(args.run_dir) / PLOT_FILE
        print(f"\nplot: {plot_run(table, where, str(args.run_dir))}")
    return 0
