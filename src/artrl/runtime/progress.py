"""Progress bars that suit where they are written: live on a terminal, a few lines in a log.

Every tqdm bar of the package is made by `progress_bar` (tqdm's own class and
settings, nothing re-implemented). On a terminal the bar redraws live, as
tqdm does by default. Written to anything else (stderr redirected to a file, a
pipe, a CI log) each redraw would stay in the file, which made `artrl demo 2>
demo.log` megabytes of bar states; there the bar redraws at most every
`LOG_INTERVAL_S` seconds (tqdm's `mininterval`), so a log gets its first state,
one line every few seconds of a long stage, and its last (also for a bar made with
`leave=False`, which on a terminal clears itself when done). A notebook keeps its
live widget. `TQDM_MININTERVAL` in the environment (tqdm's own override) wins
over our choice, and `disable=True` hides a bar wherever it goes.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from tqdm.auto import tqdm as ProgressBar
from tqdm.autonotebook import tqdm as _auto_tqdm

__all__ = ["LOG_INTERVAL_S", "ProgressBar", "is_live", "progress_bar"]

LOG_INTERVAL_S = 10.0
"""Seconds between two redraws of a bar written to a file or pipe."""


def is_live(stream: TextIO | None = None) -> bool:
    """Whether bars written to `stream` (default: stderr, tqdm's) redraw live: a terminal, or a notebook."""
    if _auto_tqdm.__module__.endswith("notebook"):  # tqdm.auto chose the notebook widget
        return True
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def progress_bar(*args: Any, **kwargs: Any) -> ProgressBar:
    """`tqdm.auto.tqdm(*args, **kwargs)`, redrawing at most every LOG_INTERVAL_S seconds unless on a terminal.

    Off a terminal a bar also keeps its last state (`leave=True`): `leave=False` (a bar that tidies itself away
    on a terminal, as the trainer's per-call bar does) would otherwise write a blank over it, and a log would
    never say how far the stage got."""
    if not is_live(kwargs.get("file")):
        if "mininterval" not in kwargs and "TQDM_MININTERVAL" not in os.environ:
            kwargs["mininterval"] = LOG_INTERVAL_S
        kwargs["leave"] = True
    return ProgressBar(*args, **kwargs)
