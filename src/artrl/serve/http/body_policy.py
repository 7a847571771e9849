"""What every route does with a body field it does not take: one policy for the four protocols.

Each protocol's request model (serve/http/request.py: `ChatCompletionRequest`; protocols/) is the list of the
top-level fields its route takes. A body holding any other field is, by default (`unknown_fields="refuse"`), a 400
in the route's own error shape naming the field, as OpenAI's API answers an unrecognised argument
("Unrecognized request argument supplied: ...") and Anthropic's ("...: Extra inputs are not permitted"). The names
come from the scan of the body (request.py: `scan_body`), before it is parsed: an unknown field's value is never
built, however large.

`create_app(unknown_fields="warn")` (`artrl serve --unknown-fields warn`) serves such a request instead, for
clients that send vendor extras, and says so within fixed bounds whatever the clients send:

* at most one WARNING line per request, naming at most `NAMES_PER_LINE` new fields, each cut at `NAME_CHARS`;
* each name is warned about once, and at most `REMEMBERED_NAMES` names are remembered: past that, new names are
  only counted (`GET /metrics`: `requests_with_unknown_fields`), so the memory the policy holds does not grow
  with the names clients invent;
* the unknown fields' values are skipped by the parser, never built (the request models ignore them).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Literal

import pydantic

from .guards import APIError, ServerMetrics

logger = logging.getLogger(__name__)

UnknownFields = Literal["refuse", "warn"]
UNKNOWN_FIELDS_MODES = ("refuse", "warn")
REMEMBERED_NAMES = 256
"""Most unknown field names a server set to warn remembers (each warned about once); later ones are counted only."""
NAMES_PER_LINE = 8
"""Most names one warning line lists."""
NAME_CHARS = 64
"""Characters of a field name kept in a message, a log line or the remembered set."""


@functools.lru_cache(maxsize=None)
def accepted(model: type[pydantic.BaseModel]) -> frozenset[str]:
    """The top-level fields `model` takes."""
    return frozenset(model.model_fields)


def _shown(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[:NAME_CHARS] + "..."


class BodyPolicy:
    """The server's answer to unknown fields (module docstring), shared by every route."""

    def __init__(self, mode: UnknownFields, metrics: ServerMetrics) -> None:
        if mode not in UNKNOWN_FIELDS_MODES:
            raise ValueError(f"unknown_fields must be one of {UNKNOWN_FIELDS_MODES}, got {mode!r}")
        self.mode, self.metrics = mode, metrics
        self._warned: set[str] = set()  # at most REMEMBERED_NAMES names of at most NAME_CHARS characters

    @property
    def remembered(self) -> int:
        """How many unknown names this policy remembers (bounded by `REMEMBERED_NAMES`)."""
        return len(self._warned)

    def check(self, names: Iterable[str], model: type[pydantic.BaseModel], what: str, anthropic: bool) -> None:
        """Refuse (or, set to warn, log and count) the names in `names` that `model` does not take; `what`: the
        protocol's name in a log line, `anthropic`: the route speaks Anthropic's Messages API."""
        taken = accepted(model)
        unknown = [name for name in names if name not in taken]
        if not unknown:
            return
        if self.mode == "refuse":
            self.metrics.unknown_fields_refused += 1
            first = _shown(unknown[0])
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            message = f"{first}: Extra inputs are not permitted{more}" if anthropic else \
                f"Unrecognized request argument supplied: {first}{more}"
            raise APIError(400, message, param=first, code="unknown_parameter")
        self.metrics.requests_with_unknown_fields += 1
        new: list[str] = []
        for name in unknown:
            shown = _shown(name)
            if shown in self._warned:
                continue
            if len(self._warned) >= REMEMBERED_NAMES or len(new) >= NAMES_PER_LINE:
                break
            self._warned.add(shown)
            new.append(shown)
        if new:
            logger.warning("Ignoring unsupported %s parameters: %s%s (create_app(unknown_fields='refuse') refuses "
                           "them)", what, new, " and others" if len(unknown) > len(new) else "")
