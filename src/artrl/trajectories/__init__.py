"""ART's `art.trajectories`: the data model of an episode and everything that records and reads it.

    trajectory.py     Trajectory, TrajectoryGroup, LegacyHistory, History (ART's, field for field)
    exchanges.py      the requests and replies a rollout made, as the server saw them (one type per protocol)
    capture/          recording those exchanges from the rollout's HTTP clients (core.py; clients.py:
                      httpx, aiohttp, requests) into the open trajectory
    scopes.py         `trajectory()` / `trajectory_group()` scopes and `current_trajectory()`
    gather_context.py the open gather a rollout reports to (metrics, progress)
    token_record.py   the ids and logprobs the server sampled, carried on each choice
    lineage.py        which protocol-native request continues which (a conversation's branches)
    histories.py      ART 0.5.23's protocol-native histories and the branching views over exchanges
    sequences.py      one conversation -> token ids, labels and logprobs (the trainer's tokenize stage)
    tokens.py         ART's tokenize/tensorize of trajectories, groups and histories

Imports chat, models (a tokenizer), types, errors and runtime; preprocess, train, serve and the backends read it.
"""

from .exchanges import (ChatCompletionsExchange, CompletionsExchange, MessagesExchange, ResponsesExchange,
                        TrajectoryExchanges, exchange_policy_token_spans, exchange_policy_versions)
from .histories import (AnthropicMessageSource, AnthropicMessagesHistory, ChatCompletionsHistory,
                        ChatCompletionsMessageSource, CompletionsSource, CompletionsStringHistory,
                        CompletionsStringSourceSpan, CompletionsTokenHistory, CompletionsTokenSourceSpan,
                        ResponsesHistory, ResponsesItemSource, TrajectoryHistory)
from .trajectory import (POLICY_TOKEN_SPANS_FIELD, POLICY_VERSION_FIELD, History, LegacyHistory, MetadataValue,
                         PendingGroup, PydanticException, Trajectory, TrajectoryGroup, choice_policy_version,
                         continues, file_turn, get_messages, one_chat_conversation, policy_token_counts, revalidate,
                         sampled_policy_versions)
