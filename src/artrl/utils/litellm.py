"""`convert_litellm_choice_to_openai` (ART's `art.utils.litellm`): a litellm choice as an OpenAI `Choice`.

A rollout made with `litellm.acompletion` gets litellm's `Choices`; a trajectory
wants OpenAI's `Choice` (`messages_and_choices`). As in ART, the message's
content, role and function tool calls, the finish reason, the index and the
token logprobs (with their top logprobs) are carried over. Beyond ART: the
token record of artrl's server (`token_ids`, `prompt_token_ids`), where litellm
kept it on the choice, rides along as it does on a choice from the `openai`
client (docs/token-record.md), so the turn trains on the ids it was sampled with.

litellm is optional (`pip install "artrl[litellm]"`); this module imports without
it and the function says so when called. Where ART asserts, a bad choice here is
a TypeError or ValueError that says what was given.
"""

from __future__ import annotations

from typing import Any

from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message import ChatCompletionMessage
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall, Function
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob

TOKEN_RECORD_FIELDS = ("prompt_token_ids", "token_ids")


def convert_litellm_choice_to_openai(litellm_choice: Any) -> Choice:
    """The OpenAI `Choice` for a non-streaming litellm choice (`response.choices[i]` of `litellm.acompletion`)."""
    try:
        from litellm.types.utils import Choices, StreamingChoices
    except ImportError as e:
        raise ImportError("convert_litellm_choice_to_openai needs litellm: pip install \"artrl[litellm]\"") from e
    if isinstance(litellm_choice, StreamingChoices):
        raise TypeError("convert_litellm_choice_to_openai takes a complete choice; a streamed one (StreamingChoices) "
                        "is not supported (as in ART): rebuild the response first, e.g. "
                        "litellm.stream_chunk_builder(chunks)")
    if not isinstance(litellm_choice, Choices):
        raise TypeError("convert_litellm_choice_to_openai takes a litellm Choices, got "
                        f"{type(litellm_choice).__name__}")
    message = litellm_choice.message
    if message.role != "assistant":
        raise ValueError(f"the choice's message has role {message.role!r}; only assistant messages are converted")
    tool_calls = [_tool_call(i, call) for i, call in enumerate(message.tool_calls)] if message.tool_calls else None
    logprobs = getattr(litellm_choice, "logprobs", None)
    extra = {name: value for name in TOKEN_RECORD_FIELDS
             if (value := _extra_field(litellm_choice, name)) is not None}
    return Choice(
        message=ChatCompletionMessage(content=message.content, role="assistant", tool_calls=tool_calls),
        finish_reason=litellm_choice.finish_reason,
        index=litellm_choice.index,
        logprobs=None if logprobs is None else _logprobs(logprobs),
        **extra,
    )


def _tool_call(i: int, call: Any) -> ChatCompletionMessageToolCall:
    if call.type != "function":
        raise ValueError(f"tool call {i} has type {call.type!r}; only function tool calls are converted (as in ART)")
    if call.function.name is None:
        raise ValueError(f"tool call {i} has no function name")
    return ChatCompletionMessageToolCall(id=call.id, type="function",
                                         function=Function(name=call.function.name,
                                                           arguments=call.function.arguments))


def _logprobs(logprobs: Any) -> ChoiceLogprobs:
    content = getattr(logprobs, "content", None)
    if content is None:
        raise ValueError("the choice has logprobs without token content; pass a choice whose logprobs.content "
                         "lists the sampled tokens")
    return ChoiceLogprobs(content=[
        ChatCompletionTokenLogprob(token=t.token, bytes=t.bytes, logprob=t.logprob, top_logprobs=[
            TopLogprob(token=top.token, logprob=top.logprob, bytes=top.bytes) for top in t.top_logprobs or []])
        for t in content])


def _extra_field(choice: Any, name: str) -> Any:
    value = getattr(choice, name, None)
    if value is None:
        value = (getattr(choice, "provider_specific_fields", None) or {}).get(name)
    return value
