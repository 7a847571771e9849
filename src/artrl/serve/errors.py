"""The serving errors both sides share: a request the engine cannot serve (`InvalidRequestError`, with each
`RequestProblem` naming the field at fault) and an engine closed under a request (`EngineClosedError`). The
engines raise them; the structured-output compiler raises them too; the HTTP layer turns them into responses.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ArtrlError


@dataclass(frozen=True)
class RequestProblem:
    """One thing wrong with a request: the `GenerationRequest` field at fault and what to do."""

    field: str
    message: str


class InvalidRequestError(ArtrlError, ValueError):
    """A generation request the engine cannot serve (bad parameter, unknown adapter, too long).

    `problems` lists every fault found, each naming the request field it concerns.
    """

    def __init__(self, message: str, problems: tuple[RequestProblem, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class EngineClosedError(ArtrlError, RuntimeError):
    """The engine was closed (e.g. the program is exiting) while the request was queued or decoding."""
