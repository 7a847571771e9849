"""One logged notice per process for an ART option that has no effect here.

ART scripts pass options that only mean something to ART's own machinery
(Unsloth's quantised loading, vLLM engine arguments, Hugging Face Trainer
arguments, a matplotlib plot of packed tensors). artrl accepts every one of them
(a script must run unchanged) and says once, at WARNING level on the
`artrl.notices` logger, which option it ignored and why. Nothing is silently
dropped and nothing repeats every train step.

    notice_once("train.plot_tensors", "plot_tensors=True has no effect here: ...")
"""

from __future__ import annotations

import logging
import threading

# The logger's name is public (docs/art-compatibility.md tells users to filter it), so it stays put when the
# module moves.
NOTICES_LOGGER = "artrl.notices"
log = logging.getLogger(NOTICES_LOGGER)

_seen: set[str] = set()
_lock = threading.Lock()


def notice_once(key: str, message: str) -> bool:
    """Log `message` the first time `key` is noticed in this process; True if it was logged now."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    log.warning("%s", message)
    return True


def forget(*keys: str) -> None:
    """Let `keys` (all when none given) be noticed again; for tests that count notices."""
    with _lock:
        if keys:
            _seen.difference_update(keys)
        else:
            _seen.clear()
