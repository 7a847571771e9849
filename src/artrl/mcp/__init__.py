"""ART's MCP utilities (`art.mcp`), and a client that serves an MCP server's tools to a rollout.

ART's names: `MCPTool`, `MCPResource`, `GeneratedScenario`, `GeneratedScenarioCollection`
(types.py), `generate_scenarios` (generate_scenarios.py) and `complete_task_tool`
(default_tools.py); none of them needs the `mcp` package. `MCPClient` (client.py) lists a
server's tools as OpenAI tool schemas and calls them, over stdio or streamable HTTP, through
the `mcp` client package (`pip install 'artrl[mcp]'`); every failure of a call is an
`MCPToolError` on that rollout. docs/integrations.md shows them at work.
"""

from __future__ import annotations

from .client import MCPClient, MCPToolError
from .default_tools import complete_task_tool
from .generate_scenarios import generate_scenarios
from .types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool

__all__ = [
    "MCPResource",
    "MCPTool",
    "GeneratedScenario",
    "GeneratedScenarioCollection",
    "complete_task_tool",
    "generate_scenarios",
    "MCPClient",
    "MCPToolError",
]
