"""ART's `plot_tensors=True`: a picture of what one train call packed, written to the run directory.

One heatmap per row tensor of the call (preprocess/pack.py's layout): token ids,
sampled logprobs, segment (node) ids, parent ids, positions, trainable mask,
advantages and weights; one image row per packed row, one column per slot.
ART draws its own packed tensors the same way (`packed_tensors_plot_<time>.png`
in the model directory); the panels differ where the layouts do (artrl's
segments and parents describe prefix-sharing trees).

Drawn with matplotlib's object API on an Agg canvas (no pyplot, so no global
backend switch), written to a temporary file and renamed into place.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..runtime.fs import fsync_dir
from ..preprocess.rows import PackedRows
from ..run.storage import TMP_PREFIX

PLOT_FILE = "packed_tensors_plot_{stamp}.png"

PANELS = (
    ("input_ids", "token ids"),
    ("logprobs", "sampled logprobs (nan: none)"),
    ("segment_ids", "segment (node) ids"),
    ("parent_ids", "parent ids"),
    ("position_ids", "positions"),
    ("trainable_mask", "trainable mask"),
    ("advantages", "advantages"),
    ("weights", "weights"),
)


def plot_packed(packed: PackedRows, out_dir: Path) -> Path:
    """Draw `packed` (every panel of PANELS) into `out_dir/packed_tensors_plot_<ms>.png`; returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 24))
    FigureCanvasAgg(fig)
    axes = fig.subplots(4, 2)
    for ax, (name, title) in zip(axes.flat, PANELS):
        values = getattr(packed, name).detach().to(torch.float32).cpu().numpy()  # [rows, row_length]
        image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(image, ax=ax)
        ax.set_title(title)
        ax.set_xlabel("slot")
        ax.set_ylabel("row")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PLOT_FILE.format(stamp=int(time.time() * 1000))
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")  # removed on the next open if a crash leaves it
    with open(tmp, "wb") as fh:
        fig.savefig(fh, format="png")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(out_dir)
    return path
