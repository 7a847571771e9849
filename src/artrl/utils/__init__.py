"""Helpers for rollout and training scripts: ART's `art.utils`, plus `choice_from_completion`.

ART's names: `retry`, `iterate_dataset`, `limit_concurrency`, `strip_logprobs`,
`get_model_step`, `format_message`, `log_http_errors`, and the SFT helpers in
`artrl.utils.sft`.
"""

from __future__ import annotations

import logging
from typing import Any

from openai.types.chat.chat_completion import Choice

from ..errors import TrajectoryError
from . import sft
from .format_message import format_message
from .get_model_step import get_model_step
from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency
from .log_http_errors import log_http_errors
from .retry import retry
from .strip_logprobs import strip_logprobs

__all__ = [
    "DatasetBatch", "choice_from_completion", "format_message", "get_model_step", "iterate_dataset",
    "limit_concurrency", "log_http_errors", "retry", "sft", "strip_logprobs",
]

log = logging.getLogger(__name__)


def choice_from_completion(completion: Any, index: int = 0) -> Choice:
    """The Choice to append to `messages_and_choices`, with its token record and logprobs.

    Our server puts the record on every choice: `prompt_token_ids` (the exact prompt it
    was sampled from) and `token_ids` (the sampled ids), next to the logprobs; they ride
    along as extra fields, so `completion.choices[0]` appended directly works the same.
    A server that returns the prompt ids only once per response (vLLM's
    `return_token_ids`) has them copied onto the choice here. A choice without ids or
    logprobs is still accepted: training renders its context from the text, and a turn
    without logprobs trains as on-policy; both are counted in the train call's metrics
    (docs/token-record.md).
    """
    choices = getattr(completion, "choices", None)
    if not choices or index >= len(choices):
        raise TrajectoryError(f"the completion has no choice {index}: {completion!r:.200}")
    choice = choices[index]
    extra = choice.model_extra if choice.model_extra is not None else {}
    prompt_ids = (getattr(completion, "model_extra", None) or {}).get("prompt_token_ids")
    if extra.get("prompt_token_ids") is None and prompt_ids is not None:
        extra["prompt_token_ids"] = list(prompt_ids)
    if extra.get("token_ids") is None or extra.get("prompt_token_ids") is None:
        log.debug("choice %d has no complete token record; training will render its context from the text", index)
    if choice.logprobs is None or choice.logprobs.content is None:
        log.debug("choice %d has no logprobs; training will treat it as on-policy", index)
    return choice
