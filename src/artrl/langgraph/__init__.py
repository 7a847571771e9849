"""ART's LangGraph integration (`art.langgraph`): train a LangGraph agent on the turns it sampled.

`wrap_rollout(model, fn)` runs `fn` (an async rollout returning a `Trajectory`) in a context
of its own; inside it, `init_chat_model()` returns a LangChain `ChatOpenAI` bound to the
model's inference server. Every chat completion that model serves the graph is recorded, and
the returned trajectory gets the graph's conversations (the main one as its
`messages_and_choices`, the others as `additional_histories`) with their tools.

Where ART logs LangChain messages and re-tokenizes them, each assistant turn here is the
server's own `Choice`, with its token record (prompt ids, sampled ids, logprobs), so the
agent trains on exactly what it sampled (rollout.py says how, docs/integrations.md shows it).

`mcp_tools(client)` turns the tools of an `artrl.mcp.MCPClient` into LangChain tools.

Needs the `langgraph` extra: `pip install 'artrl[langgraph]'`.
"""

from __future__ import annotations

try:
    import langchain_core  # noqa: F401
    import langchain_openai  # noqa: F401
    import langgraph  # noqa: F401
except ImportError as e:
    raise ImportError(
        f"artrl.langgraph needs LangChain and LangGraph ({e.name} is not installed); install the extra: "
        "pip install 'artrl[langgraph]'") from e

from .mcp_tools import mcp_tools
from .rollout import MissingRecordError, init_chat_model, wrap_rollout

__all__ = ["wrap_rollout", "init_chat_model", "MissingRecordError", "mcp_tools"]
