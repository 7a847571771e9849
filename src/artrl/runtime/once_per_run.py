"""Housekeeping that repeats every step says itself once per run at INFO, then only at DEBUG.

A train call's one INFO line (`RL: packed ... rows ...; ... optimizer step ...`, train/call.py) is what a user
reads at each step. Deleting the previous checkpoint, unloading an old policy version, serving the new one:
these happen at every step too and would bury it. Each owner of such a line (a training session, an engine, a
trainer: one per run) holds one `OncePerRun`; the first line of each kind goes out at INFO, saying that the
next ones go to DEBUG (`artrl -v`, or the `artrl` logger at DEBUG, shows every one).

    self._say = OncePerRun(log)
    self._say("deleted", "deleted checkpoints %s of %s; kept %s", deleted, name, kept)

Warnings and errors never go through it: what needs attention is said every time.
"""

from __future__ import annotations

import logging
import threading

LATER_AT_DEBUG = " (said once per run; the next ones at DEBUG)"


class OncePerRun:
    """Log each kind of line at INFO the first time, at DEBUG after that."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str, *args: object) -> None:
        with self._lock:
            first = kind not in self._said
            self._said.add(kind)
        if first:
            self._logger.info(message + LATER_AT_DEBUG, *args)
        else:
            self._logger.debug(message, *args)
