"""`auto_trajectory` / `capture_auto_trajectory`: ART 0.5.18's capture, on the capture core of ART 0.5.23's scopes.

`trajectory = await art.capture_auto_trajectory(agent(...))` runs the agent and returns a
`Trajectory` holding every chat completion the agent made inside that call, as legacy histories
(`messages_and_choices` with the sampled `Choice`s, `additional_histories`). Inside,
`art.auto_trajectory()` is that trajectory (e.g. to set the reward); outside a capture it is None
(`required=True`: RuntimeError). ART 0.5.23's scopes (`with art.Trajectory() as t:`, trajectories/scopes.py)
record the same traffic as `exchanges` instead; both are one capture core (trajectories/capture/core.py) over the
same wrapped clients (trajectories/capture/clients.py: httpx, aiohttp, requests), so this capture now also sees
aiohttp and requests clients. Only chat completions are filed here (the other protocols have no
`Choice` in ART 0.5.18's model; they are left out, with a debug line).

How requests are sorted into conversations (ART's rule, trajectories.file_turn): a completion
whose request messages continue the main conversation (its messages so far are a prefix of the
request's, with the same tools) extends it; otherwise the first additional history it
continues; otherwise it starts a new additional history. The request's new messages are
appended, then the response's first `Choice` (a streamed one assembled from its chunks), with
the server's token record (a response-level `prompt_token_ids` copied onto it). Prefix matching
ignores keys whose value is None or an empty `tool_calls` list, so an assistant turn sent back
as a dumped message object (`choice.message.model_dump()`) still continues its conversation;
ART compares the dicts exactly and would start a new history.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Coroutine
from datetime import datetime, timezone
from typing import Any

from openai.types.chat.chat_completion import Choice

from .trajectories.capture import core as capture, clients as capture_http
from .trajectories.exchanges import ChatCompletionsExchange, build_exchange
from .trajectories.data import Trajectory
from .trajectories.history import file_turn
from .trajectories.token_record import exchange_turns

log = logging.getLogger(__name__)

CHAT_COMPLETIONS_PATH = "/chat/completions"


class AutoTrajectoryContext:
    """One capture: the trajectory being recorded and the rule that files each completion."""

    # ART 0.5.17's auto_trajectory read a stream whose choice never sent a finish_reason as finished ("stop");
    # its own test server sends such streams (exchanges.build_exchange)
    unfinished_as_stop = True

    def __init__(self) -> None:
        self.trajectory = Trajectory()

    def __enter__(self) -> Trajectory:
        capture_http.open_scope(self)
        return self.trajectory

    def __exit__(self, *exc_info: Any) -> None:
        capture_http.close_scope(self)
        self.trajectory.finish()

    def on_exchange(self, exchange: Any) -> None:
        if not isinstance(exchange, ChatCompletionsExchange):
            log.debug("capture_auto_trajectory files chat completions only; a %s is left out",
                      type(exchange).__name__)
            return
        turns = exchange_turns("chat_completions", exchange)
        if turns:
            self.record(exchange.request, turns[0])

    def record(self, request: dict[str, Any], choice: Choice) -> None:
        """File one completion (its request's messages and tools, and the sampled choice)."""
        file_turn(self.trajectory, self.trajectory.additional_histories, list(request["messages"]),
                  request.get("tools"), choice)


def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """The trajectory of the innermost enclosing `capture_auto_trajectory`, or None outside one."""
    for scope in reversed(capture.scopes()):
        if isinstance(scope, AutoTrajectoryContext):
            return scope.trajectory
    if required:
        raise RuntimeError("No auto trajectory in context. `auto_trajectory(required=True)` must be called "
                           "in a `capture_auto_trajectory(...)` scope.")
    return None


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run `coroutine`; return the trajectory of the chat completions it made (its `duration` metric set)."""
    with AutoTrajectoryContext() as trajectory:
        await coroutine
        return trajectory


# --------------------------------------------------------------------------- for recorders of one client


def chat_request(request: Any) -> dict[str, Any] | None:
    """The JSON body of an httpx chat completions request, or None for any other request."""
    if request.method != "POST" or not request.url.path.endswith(CHAT_COMPLETIONS_PATH):
        return None
    try:
        body = json.loads(request.content)
    except Exception:  # noqa: BLE001 - a streamed or non-JSON body is not a chat request we can read
        return None
    return body if isinstance(body, dict) and isinstance(body.get("messages"), list) else None


def recorded_choice(body: bytes, streamed: bool) -> Choice:
    """The first sampled choice of a chat completion response's bytes, with its token record."""
    now = datetime.now(timezone.utc)
    exchange = build_exchange("chat_completions", {"stream": streamed}, body, start_time=now, end_time=now,
                              unfinished_as_stop=AutoTrajectoryContext.unfinished_as_stop)
    return exchange_turns("chat_completions", exchange)[0]
