"""Progress bars that suit where they are written: live on a terminal, a few lines in a log.

Every tqdm bar of the package is made by `progress_bar` (tqdm's own class and
settings, nothing re-implemented). On a terminal the bar redraws live, as
tqdm does by default. Written to anything else (stderr redirected to a file, a
pipe, a CI log) each redraw would stay in the file, which made `artrl demo 2>
demo.log` megabytes of bar states; there the bar redraws at most every
`LOG_INTERVAL_S` seconds (tqdm's `mininterval`), so a log gets its first state,
one line every few seconds of a long stage, and its last (also for a bar made with
`leave=False`, which on a terminal clears itself when done). Each state there is a
plain line of its own (`PlainLines`): no carriage return, no cursor codes (a second
bar's `ESC[A`), and no line run together with a log line written in between. A
notebook keeps its live widget. transformers draws bars of its own while a model loads
or is saved (`hf_bars_off_in_a_log` turns them off there, off a terminal).
`TQDM_MININTERVAL` in the environment (tqdm's own override) wins over our choice, and
`disable=True` hides a bar wherever it goes.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from tqdm.auto import tqdm as ProgressBar
from tqdm.autonotebook import tqdm as _auto_tqdm

__all__ = ["LOG_INTERVAL_S", "PlainLines", "ProgressBar", "hf_bars_off_in_a_log", "is_live", "progress_bar"]

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


_CURSOR_CODE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class PlainLines:
    """The stream a bar writes to off a terminal: each state tqdm draws becomes one line of plain text.

    tqdm draws a state as `\r<state><padding>`, moves between stacked bars with newlines and `ESC[A`, and ends
    with a newline. Here every cursor code is dropped, each piece between carriage returns and newlines is one
    line (trailing spaces cut), and a blank piece or the state just written is not written again.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._last: str | None = None

    def write(self, text: str) -> int:
        for piece in re.split(r"[\r\n]", _CURSOR_CODE.sub("", text)):
            line = piece.rstrip()
            if line and line != self._last:
                self.stream.write(line + "\n")
                self._last = line
        return len(text)

    def flush(self) -> None:
        flush = getattr(self.stream, "flush", None)
        if callable(flush):
            flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"


def progress_bar(*args: Any, **kwargs: Any) -> ProgressBar:
    """`tqdm.auto.tqdm(*args, **kwargs)`, redrawing at most every LOG_INTERVAL_S seconds unless on a terminal.

    Off a terminal a bar also keeps its last state (`leave=True`): `leave=False` (a bar that tidies itself away
    on a terminal, as the trainer's per-call bar does) would otherwise write a blank over it, and a log would
    never say how far the stage got. Its states are plain lines (`PlainLines`)."""
    if not is_live(kwargs.get("file")):
        if "mininterval" not in kwargs and "TQDM_MININTERVAL" not in os.environ:
            kwargs["mininterval"] = LOG_INTERVAL_S
        kwargs["leave"] = True
        stream = kwargs.get("file") or sys.stderr
        if stream is not None and not kwargs.get("disable"):
            kwargs["file"] = PlainLines(stream)
    return ProgressBar(*args, **kwargs)


@contextlib.contextmanager
def hf_bars_off_in_a_log() -> Iterator[None]:
    """transformers' own bars ("Loading weights", "Writing model shards") and the hub's download bars off for the
    block, when stderr is not a terminal: in a log each is a line of carriage returns. Their setting is put back
    as it was afterwards; on a terminal, or with the bars already off, nothing changes."""
    from transformers.utils import logging as hf_logging

    if is_live() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    import huggingface_hub.utils as hub_utils

    hub_was_off = hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        if hub_was_off:
            hub_utils.disable_progress_bars()
