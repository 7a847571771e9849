"""`mcp_tools(client)`: an MCP server's tools as LangChain tools, for a LangGraph `ToolNode` or ReAct agent.

Each tool keeps the server's name, description and JSON-schema parameters (the model is sent
exactly the schema `MCPClient.tool_schemas()` gives), and calls `MCPClient.call_tool`. A
failed call raises `MCPToolError` out of the graph (LangGraph's `ToolNode` hands only
argument-validation errors back to the model by default), so it fails that rollout, and the
gather's exception rules apply; pass `handle_tool_errors=True` to `ToolNode` to show the
error to the model instead.
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import BaseTool, StructuredTool

from ..mcp import MCPClient, MCPTool


async def mcp_tools(client: MCPClient) -> list[BaseTool]:
    """The tools of the connected `client`, as LangChain tools that call it."""
    return [_tool(client, t) for t in await client.list_tools()]


def _tool(client: MCPClient, spec: MCPTool) -> BaseTool:
    async def call(**arguments: Any) -> str:
        return await client.call_tool(spec.name, arguments)

    return StructuredTool(name=spec.name, description=spec.description, args_schema=spec.parameters,
                          coroutine=call)
