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
    """The Choice to append to `messages_and_choices`, with its logprobs and sampled token ids.

    Our server returns `token_ids` on every choice (vLLM: `return_token_ids`); they ride
    along as an extra field, so training uses exactly the sampled ids. A choice without
    logprobs is refused here, where the fix (`logprobs=True` in the request) is obvious.
    """
    choices = getattr(completion, "choices", None)
    if not choices or index >= len(choices):
        raise TrajectoryError(f"the completion has no choice {index}: {completion!r:.200}")
    choice = choices[index]
    if choice.logprobs is None or choice.logprobs.content is None:
        raise TrajectoryError("the choice carries no logprobs; request them with logprobs=True so the sampled "
                              "turn can be trained")
    if (choice.model_extra or {}).get("token_ids") is None:
        log.debug("choice has no token_ids; training will re-tokenise its text")
    return choice
