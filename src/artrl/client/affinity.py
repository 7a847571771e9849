"""Session affinity, from the client's side: every turn of one rollout to the same replica.

The router (replicas/router.py) sends requests with the same `X-Session-ID` header to the
same replica. `model.openai_client()` sets that header on every request, one id per rollout,
so that ART's rollout code needs no change. A rollout is what one asyncio task runs: ART's
gathers (`gather_trajectory_groups`, a `TrajectoryGroup` of coroutines, `asyncio.gather`) run
each rollout in a task of its own, and its turns are awaited one after the other in it. So the
id belongs to the task that sends the request (created with its first request, forgotten with
the task); a request that already carries an `X-Session-ID` keeps its own.

The first answer says which replica served the rollout (`x-artrl-replica`, serve/http/control_routes.py);
every later turn says which one it expects (`x-artrl-replica-expected`). A replica that gets a
turn meant for another one (the rollout's replica died and the router sent the turn
elsewhere: the record of its earlier turns and its KV cache are gone with it) answers 410 with
an error that says so, and `x-should-retry: false`, so the rollout fails at once with that
error (ART's gather rules then apply to it), never a silent change of replica, never a hang.
The task's session starts anew after that answer, so a task that goes on to other rollouts
(a long-lived worker) is not tied to the dead replica; `new_session()` starts one on purpose.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from ..serve.http.headers import EXPECTED_HEADER, REPLICA_HEADER, SESSION_HEADER


@dataclass
class Session:
    """One rollout's affinity: its id, and the replica that answered its first turn."""

    id: str
    replica: str | None = None


_sessions: "weakref.WeakKeyDictionary[asyncio.Task[Any], Session]" = weakref.WeakKeyDictionary()


def current_session() -> Session | None:
    """The session of the running task (made at its first request); None outside a task."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return None
    if task is None:
        return None
    session = _sessions.get(task)
    if session is None:
        session = _sessions[task] = Session(uuid.uuid4().hex)
    return session


def new_session() -> None:
    """Give the running task a fresh session: what a task that runs one rollout after another calls before each
    (PipelineTrainer's rollout workers do), so that each rollout is placed anew."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return
    if task is not None:
        _sessions[task] = Session(uuid.uuid4().hex)


async def _on_request(request: Any) -> None:
    session = current_session()
    if session is None or SESSION_HEADER in request.headers:
        return
    request.headers[SESSION_HEADER] = session.id
    if session.replica is not None:
        request.headers[EXPECTED_HEADER] = session.replica


async def _on_response(response: Any) -> None:
    replica = response.headers.get(REPLICA_HEADER)
    if replica is None or SESSION_HEADER not in response.request.headers:
        return
    session = current_session()
    if session is None or response.request.headers[SESSION_HEADER] != session.id:
        return  # the caller's own session header
    if response.status_code == 410:  # its replica is gone: this turn fails; the task's next requests start anew
        _sessions[asyncio.current_task()] = Session(uuid.uuid4().hex)  # type: ignore[index]
    elif response.status_code < 400 and session.replica is None:
        session.replica = replica


def event_hooks() -> dict[str, list[Any]]:
    """The HTTP client event hooks (httpx's shape) that do the module docstring's work."""
    return {"request": [_on_request], "response": [_on_response]}
