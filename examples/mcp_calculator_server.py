"""A small calculator MCP server (the `mcp` package), for examples/langgraph_mcp_agent.py and the tests.

Tools: `add(a, b)` and `multiply(a, b)` on integers from -1000 to 1000; one resource, `calc://about`.
Run it as a stdio subprocess (the default: what `artrl.mcp.McpServer.stdio(...)` starts) or
over streamable HTTP (`--http PORT`, endpoint `/mcp`).

`--faults` adds the tools the fault tests need, each one way a tool server goes wrong:
`fail` raises, `hang` never answers, `crash` kills the server process mid-call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Annotated

from pydantic import Field

from mcp.server.mcpserver import MCPServer  # mcp 2's FastMCP

# Bounded operands: a model sampling under the tool's JSON schema (tool_choice "required") writes short numbers
Operand = Annotated[int, Field(ge=-1000, le=1000)]


def build(faults: bool = False) -> MCPServer:
    server = MCPServer("calculator")

    @server.tool(description="Add two integers and return the sum.")
    def add(a: Operand, b: Operand) -> int:
        return a + b

    @server.tool(description="Multiply two integers and return the product.")
    def multiply(a: Operand, b: Operand) -> int:
        return a * b

    @server.resource("calc://about", name="about", description="What this calculator does.")
    def about() -> str:
        return "Integer addition and multiplication."

    if faults:
        @server.tool(description="Always raises.")
        def fail(reason: Annotated[str, Field(max_length=20)]) -> str:
            raise RuntimeError(f"fail was asked to fail: {reason}")

        @server.tool(description="Never answers.")
        async def hang() -> str:
            await asyncio.Event().wait()
            return "unreachable"

        @server.tool(description="Kills the server process.")
        def crash() -> str:
            os._exit(3)

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", action="store_true", help="add the fail / hang / crash tools")
    parser.add_argument("--http", type=int, default=None, metavar="PORT", help="serve streamable HTTP on PORT")
    args = parser.parse_args()
    if args.http is None:
        build(args.faults).run("stdio")
    else:
        build(args.faults).run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
