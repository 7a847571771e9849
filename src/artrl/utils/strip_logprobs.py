"""`strip_logprobs`: a copy of any nested structure without its logprobs (ART's), e.g. to store it small.

Dicts lose their "logprobs" keys; objects with attributes (a `Choice`, a
`Trajectory`) get `logprobs = None`; lists and tuples keep their type. The input
is deep-copied first and left as it was. When it cannot be copied, it is returned
unchanged and a warning says why.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

log = logging.getLogger(__name__)

LOGPROBS = "logprobs"


def strip_logprobs(obj: Any) -> Any:
    try:
        copied = copy.deepcopy(obj)
    except Exception as e:  # noqa: BLE001 - ART's contract: warn and hand back the original
        log.warning("Failed to deepcopy object in strip_logprobs: %s. Returning original object unchanged.", e)
        return obj
    return _strip(copied)


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != LOGPROBS}
    if isinstance(obj, (list, tuple)):
        items = [_strip(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if hasattr(obj, "__dict__"):
        for name, value in list(vars(obj).items()):
            setattr(obj, name, None if name == LOGPROBS else _strip(value))
    return obj
