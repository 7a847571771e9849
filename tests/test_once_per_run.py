"""Per-step housekeeping says itself at INFO the first time, then at DEBUG; each owner (a run) on its own."""

from __future__ import annotations

import logging

from artrl.runtime.once_per_run import LATER_AT_DEBUG, OncePerRun


def test_each_kind_is_info_once_then_debug_and_each_owner_starts_afresh(caplog):
    log = logging.getLogger("artrl.test_once_per_run")
    first, second = OncePerRun(log), OncePerRun(log)
    with caplog.at_level(logging.DEBUG, logger="artrl"):
        for step in (1, 2, 3):
            first("deleted", "deleted checkpoint %d", step)
            first("serving", "serving version %d", step)
        second("deleted", "deleted checkpoint %d", 9)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (logging.INFO, f"deleted checkpoint 1{LATER_AT_DEBUG}"), (logging.INFO, f"serving version 1{LATER_AT_DEBUG}"),
        (logging.DEBUG, "deleted checkpoint 2"), (logging.DEBUG, "serving version 2"),
        (logging.DEBUG, "deleted checkpoint 3"), (logging.DEBUG, "serving version 3"),
        (logging.INFO, f"deleted checkpoint 9{LATER_AT_DEBUG}"),
    ]
