"""`complete_task_tool`: ART's tool an MCP agent calls to say it is done, with a summary of what it did."""

from __future__ import annotations

from .types import MCPTool

complete_task_tool = MCPTool(
    name="complete_task",
    description="Complete a task",
    parameters={
        "type": "object",
        "properties": {"summary": {"type": "string", "description": "Summary of accomplishments"}},
        "required": ["summary"],
    },
)
