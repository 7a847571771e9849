"""What artrl says reaches the screen, as ART's prints do, unless the program set up logging itself.

artrl speaks through `logging` (the `artrl` logger and its children): notices, the untrained-model notice, one
summary line per train call, `verbose=True` output. A program written for ART sets up no logging (ART prints),
and Python's default would show it warnings only. So, once at `import artrl`:

- **no logging set up** (the root logger has no handler): the `artrl` logger's level reads INFO and its own
  handler writes each line, once, to stderr as it is (`%(message)s`, as ART's print and Python's last-resort
  handler write them);
- **logging set up** (`logging.basicConfig(...)`, a handler on root or on `artrl`): the level reads NOTSET and
  the handler stays silent, so the program's configuration alone decides what shows and how (no line twice).

An explicit `logging.getLogger("artrl").setLevel(...)` always wins. The level is read when the logging module
asks for it (it caches the answer per logger; the handler empties that cache when the setup changes), so a
program may set up logging before or after importing artrl.
"""

from __future__ import annotations

import logging
import sys

ARTRL_LOGGER = "artrl"


def logging_configured(logger: logging.Logger) -> bool:
    """Whether the program set up logging: a handler on the root logger, or one of its own on `artrl`."""
    if logging.getLogger().handlers:
        return True
    return any(not isinstance(h, ScreenHandler) for h in logger.handlers)


class ScreenHandler(logging.StreamHandler):
    """Writes a record's message to the current sys.stderr while the program has set up no logging."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self._configured: bool | None = None

    @property
    def stream(self):  # noqa: ANN201  (whatever sys.stderr is now: pytest's capture, a redirected file)
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        configured = logging_configured(logging.getLogger(ARTRL_LOGGER))
        if configured != self._configured:
            self._configured = configured
            logging.Logger.manager._clear_cache()  # the levels the loggers cached came from the other setup
        if not configured:
            super().emit(record)


class _VoiceLogger(logging.Logger):
    """The `artrl` logger, whose level (unless set explicitly) depends on whether logging was set up."""

    @property
    def level(self) -> int:  # type: ignore[override]
        own = self.__dict__.get("_own_level", logging.NOTSET)
        if own != logging.NOTSET:
            return own
        return logging.NOTSET if logging_configured(self) else logging.INFO

    @level.setter
    def level(self, value: int) -> None:
        self.__dict__["_own_level"] = value


def install() -> None:
    """Give the `artrl` logger its screen (idempotent)."""
    logger = logging.getLogger(ARTRL_LOGGER)
    if isinstance(logger, _VoiceLogger):
        return
    own = logger.__dict__.pop("level", logging.NOTSET)
    logger.__class__ = _VoiceLogger
    logger.level = own
    logger.addHandler(ScreenHandler())
    logging.Logger.manager._clear_cache()
