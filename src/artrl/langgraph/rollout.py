"""`wrap_rollout` and `init_chat_model`: ART's LangGraph pair, with the server's token record on every turn.

    @art.langgraph.wrap_rollout(model)          # or wrap_rollout(model, rollout)
    async def rollout(scenario) -> art.Trajectory:
        llm = init_chat_model()                 # ChatOpenAI on the model's server
        agent = create_react_agent(llm, tools)
        await agent.ainvoke({"messages": [...]})
        return art.Trajectory(reward=...)       # messages and choices are filled in

How the returned trajectory is built (ART's rule, on better data):

* Every chat completion the chat models of `init_chat_model` make inside the call is
  recorded as the server sent it (recording.py): the request's messages and tools, and
  the sampled `Choice`, which carries the server's token record.
* Completions are sorted into conversations as `capture_auto_trajectory` does: one whose
  request continues a conversation (its messages so far are a prefix of the request's,
  same tools) extends it, else it starts a new one. The first is the trajectory's
  `messages_and_choices` and `tools`; the others are `additional_histories` (a sub-agent,
  a summariser, a graph that rewrote its history).
* So each assistant turn trains on the prompt ids it was sampled from and the ids it
  sampled (docs/token-record.md): `train/sampled_logprob_delta_max` stays at float noise.
  ART instead logs LangChain messages and re-tokenizes their text.

A turn whose record cannot be found is named, never silently re-tokenized:

* a sampled turn without a record (a server that returns no token ids, e.g. another
  endpoint behind `init_chat_model`'s base URL) would be trained on a rendering of its text;
* an assistant message in a conversation that no completion of this rollout sampled (a
  message the graph wrote or edited) is context only; it is trained (from its text) only
  with `allow_training_without_logprobs`.

`on_missing_record="warn"` (the default) logs one warning per rollout naming each such
turn; `"raise"` raises `MissingRecordError` from the rollout instead (the gather's
exception rules then apply); `"ignore"` says nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from openai.types.chat.chat_completion import Choice

from ..errors import ConfigError, TrajectoryError
from ..trajectories.history import LegacyHistory
from ..trajectories.data import Trajectory
from .recording import CURRENT, RolloutRecorder, recording_clients

log = logging.getLogger(__name__)

OnMissingRecord = Literal["warn", "raise", "ignore"]
DEFAULT_TEMPERATURE = 1.0  # ART's init_chat_model samples at temperature 1


class MissingRecordError(TrajectoryError):
    """A LangGraph rollout holds an assistant turn without the server's token record."""


def wrap_rollout(model: Any, fn: Callable[..., Awaitable[Trajectory]] | None = None, *,
                 on_missing_record: OnMissingRecord = "warn") -> Any:
    """`fn` run in a rollout context of its own; the Trajectory it returns gets the graph's conversations.

    ART's `wrap_rollout(model, fn)`; also usable as a decorator, `@wrap_rollout(model)`.
    `on_missing_record`: what to do with a turn that carries no token record (module docstring).
    """
    if on_missing_record not in ("warn", "raise", "ignore"):
        raise ConfigError(f"on_missing_record={on_missing_record!r}; use 'warn', 'raise' or 'ignore'")
    if fn is None:
        return functools.partial(wrap_rollout, model, on_missing_record=on_missing_record)

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Trajectory:
        recorder = RolloutRecorder(model)
        token = CURRENT.set(recorder)
        try:
            result = await fn(*args, **kwargs)
        finally:
            CURRENT.reset(token)
        if not isinstance(result, Trajectory):
            raise TypeError(f"the function wrapped by wrap_rollout must return an art.Trajectory; "
                            f"{getattr(fn, '__qualname__', fn)!r} returned {type(result).__name__}")
        return _fill(result, recorder, on_missing_record)

    return wrapper


def init_chat_model(model: Any = None, *, model_provider: str | None = None, configurable_fields: Any = None,
                    config_prefix: str | None = None, **kwargs: Any) -> Any:
    """A LangChain `ChatOpenAI` on the wrapped model's inference server (call it inside `wrap_rollout`).

    ART's signature (LangChain's `init_chat_model`); `model`, `model_provider`,
    `configurable_fields` and `config_prefix` are accepted and ignored, as in ART: the chat
    model is always the rollout's model. Other keywords go to `ChatOpenAI` (ART drops them);
    the temperature is 1 unless given.
    """
    from langchain_openai import ChatOpenAI

    recorder = CURRENT.get()
    if recorder is None:
        raise RuntimeError("init_chat_model() is called outside a rollout: call it inside a function wrapped by "
                           "art.langgraph.wrap_rollout(model, fn), which says which model to serve")
    served = recorder.model
    if getattr(served, "inference_base_url", None) is None:
        raise ConfigError(f"model {getattr(served, 'name', served)!r} has no inference server; call "
                          "`await model.register(backend)` before running rollouts")
    sync_client, async_client = recording_clients()
    kwargs.setdefault("temperature", DEFAULT_TEMPERATURE)
    return ChatOpenAI(base_url=served.inference_base_url, api_key=served.inference_api_key or "artrl",
                      model=served.get_inference_name(), http_client=sync_client,
                      http_async_client=async_client, **kwargs)


# --------------------------------------------------------------------------- the trajectory


def _fill(result: Trajectory, recorder: RolloutRecorder, on_missing_record: OnMissingRecord) -> Trajectory:
    recorded = recorder.trajectory
    histories = [LegacyHistory(messages_and_choices=recorded.messages_and_choices, tools=recorded.tools),
                 *recorded.additional_histories]
    if not recorded.messages_and_choices:
        log.warning("wrap_rollout recorded no chat completion: the graph made none through init_chat_model(), "
                    "so the trajectory is returned as the rollout built it")
        return result
    result.messages_and_choices = histories[0].messages_and_choices
    result.tools = histories[0].tools
    result.additional_histories = [*result.additional_histories, *histories[1:]]
    missing = recorder.unreadable + missing_records(histories)
    if missing and on_missing_record != "ignore":
        what = "; ".join(missing)
        if on_missing_record == "raise":
            raise MissingRecordError(f"a LangGraph rollout has turns without the server's token record: {what}. "
                                     "Send every turn through init_chat_model() on the model's own server, or "
                                     "pass on_missing_record='warn' to train on the rest")
        log.warning("LangGraph rollout: %s", what)
    return result


def missing_records(histories: list[LegacyHistory]) -> list[str]:
    """Each assistant turn of `histories` that has no complete token record, named by its place."""
    found = []
    for h, history in enumerate(histories):
        where = "the main conversation" if h == 0 else f"additional history {h - 1}"
        for i, item in enumerate(history.messages_and_choices):
            if isinstance(item, Choice):
                extra = item.model_extra or {}
                if extra.get("token_ids") is None or extra.get("prompt_token_ids") is None:
                    found.append(f"{where}, item {i}: a sampled turn without token ids (a server that does not "
                                 "return them); training would render its text")
            elif _role(item) == "assistant":
                found.append(f"{where}, item {i}: an assistant message no completion of this rollout sampled "
                             "(written or edited by the graph); it is context, not trained (unless "
                             "allow_training_without_logprobs)")
    return found


def _role(item: Any) -> str | None:
    return item.get("role") if isinstance(item, dict) else getattr(item, "role", None)
