"""ART's `art.trajectories`: the data model of an episode and everything that records and reads it.

    data.py               Trajectory, TrajectoryGroup (ART's, field for field)
    history.py            the conversation types: LegacyHistory, History and its Chat Completions form; ART's prefix
                          rule that files captured turns into conversations; one history's tokenize
    protocol_histories.py the other protocol-native histories (Anthropic Messages, Responses, Completions)
    branches.py           the views `Trajectory.history()` / `histories()`: one history per branch of a conversation
    exchanges.py          the requests and replies a rollout made, as the server saw them (one type per protocol)
    capture/              recording those exchanges from the rollout's HTTP clients (core.py; clients.py: httpx,
                          aiohttp, requests) into the open trajectory
    scopes.py             `trajectory()` / `trajectory_group()` scopes, `current_trajectory()`, `no_capture()`
    gather_context.py     the open gather a rollout reports to (metrics, progress)
    token_record.py       the ids and logprobs the server sampled, carried on each choice
    lineage.py            which request continues which, by the token record (ART's token check)
    sequences.py          one conversation -> token ids, trainable mask and logprobs (the tokenize core)
    tokens.py             ART's per-item views of that (TokenFlag, Tokenized*); tensors.py their torch form
    tokenization.py       the entry points: ART's tokenize / tensorize, the trainer's tokenize_groups / tokenize_sft

Inside, each module imports only those listed below it in the order that tests/test_layers.py keeps (exchanges,
capture, gather_context, token_record, lineage, sequences, tensors, tokens, history, protocol_histories,
branches, data, tokenization, scopes). Imports chat, models (a tokenizer), types, errors and runtime; preprocess,
train, serve and the backends read it.
"""

from .data import (MetadataValue, PendingGroup, PydanticException, Trajectory, TrajectoryGroup, choice_policy_version,
                   policy_token_counts, revalidate, sampled_policy_versions)
from .exchanges import (ChatCompletionsExchange, CompletionsExchange, MessagesExchange, ResponsesExchange,
                        TrajectoryExchanges, exchange_policy_token_spans, exchange_policy_versions)
from .history import (ChatCompletionsHistory, ChatCompletionsMessageSource, History, LegacyHistory, continues,
                      file_turn, get_messages, one_chat_conversation)
from .protocol_histories import (AnthropicMessageSource, AnthropicMessagesHistory, CompletionsSource,
                                 CompletionsStringHistory, CompletionsStringSourceSpan, CompletionsTokenHistory,
                                 CompletionsTokenSourceSpan, ResponsesHistory, ResponsesItemSource, TrajectoryHistory)
from .scopes import current_trajectory, no_capture, trajectory, trajectory_group
from .tensors import (TensorizedHistory, TensorizedMultiHistoryTrajectory, TensorizedTrajectory,
                      TensorizedTrajectoryGroup)
from .token_record import POLICY_TOKEN_SPANS_FIELD, POLICY_VERSION_FIELD
from .tokenization import tensorize, tokenize
from .tokens import (TokenFlag, TokenizedHistory, TokenizedMultiHistoryTrajectory, TokenizedTrajectory,
                     TokenizedTrajectoryGroup)
