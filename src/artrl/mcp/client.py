"""`MCPClient`: an MCP server's tools as OpenAI tool schemas, and their calls, for a rollout.

    async with MCPClient.stdio("python", ["server.py"]) as server:     # or MCPClient.http(url)
        tools = await server.tool_schemas()          # OpenAI `tools=[...]`
        ...
        message = await server.call(tool_call)       # {"role": "tool", "tool_call_id": ..., "content": ...}

What ART leaves to its notebook, through the real `mcp` client package (the `mcp` extra):
the stdio transport (the server runs as a subprocess of this one, closed with the client)
and streamable HTTP.

Every way a tool call can go wrong is an `MCPToolError` naming the server, the tool and the
arguments, raised from the call so it fails that rollout only (the gather's
`max_exceptions` rules then apply), never a hang:

* arguments the model wrote that are not a JSON object, or a tool the server does not have;
* a tool that raises on the server (an `isError` result, or a JSON-RPC error);
* a tool that does not answer within `call_timeout` seconds;
* a server that dies or drops the connection (the call fails at once; later calls too).

Opening and closing are bounded by `connect_timeout` the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from ..errors import ArtrlError
from .types import MCPResource, MCPTool

log = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 30.0


class MCPToolError(ArtrlError, RuntimeError):
    """An MCP tool call that failed: bad arguments, a tool error, a timeout, or a dead server."""


def _require_mcp() -> Any:
    try:
        import mcp
    except ImportError as e:
        raise ImportError("artrl.mcp.MCPClient needs the MCP client package; install the extra: "
                          "pip install 'artrl[mcp]'") from e
    return mcp


class MCPClient:
    """One connection to an MCP server (an async context manager; use it from one task)."""

    def __init__(self, connect: Callable[[], Any], *, name: str, call_timeout: float = DEFAULT_CALL_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        """`connect()` returns the transport's async context manager (yielding read and write streams)."""
        if call_timeout <= 0 or connect_timeout <= 0:
            raise ValueError(f"call_timeout={call_timeout} and connect_timeout={connect_timeout} must be > 0")
        self.name = name
        self.call_timeout = call_timeout
        self.connect_timeout = connect_timeout
        self._connect = connect
        self._stack: contextlib.AsyncExitStack | None = None
        self._session: Any = None
        self._broken: str | None = None  # why the connection is unusable, once it is
        self._tools: dict[str, MCPTool] | None = None

    @classmethod
    def stdio(cls, command: str, args: list[str] | tuple[str, ...] = (), *, env: dict[str, str] | None = None,
              cwd: str | None = None, **options: Any) -> MCPClient:
        """A server started as a subprocess speaking MCP on its stdin / stdout."""
        mcp = _require_mcp()
        params = mcp.StdioServerParameters(command=command, args=list(args), env=env, cwd=cwd)
        return cls(lambda: mcp.stdio_client(params), name=" ".join([command, *args]), **options)

    @classmethod
    def http(cls, url: str, **options: Any) -> MCPClient:
        """A server at a streamable-HTTP endpoint (e.g. `http://127.0.0.1:8000/mcp`)."""
        _require_mcp()
        from mcp.client.streamable_http import streamable_http_client

        return cls(lambda: streamable_http_client(url), name=url, **options)

    # ----------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> MCPClient:
        from mcp import ClientSession

        stack = contextlib.AsyncExitStack()
        try:
            async with asyncio.timeout(self.connect_timeout):
                streams = await stack.enter_async_context(self._connect())
                self._session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await self._session.initialize()
        except BaseException as e:
            await self._close(stack)
            if isinstance(e, TimeoutError):
                raise MCPToolError(f"MCP server {self.name!r} did not answer the handshake within "
                                   f"connect_timeout={self.connect_timeout}s") from e
            if isinstance(e, Exception):
                raise MCPToolError(f"could not connect to MCP server {self.name!r}: {type(e).__name__}: {e}") from e
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        stack, self._stack, self._session = self._stack, None, None
        if stack is not None:
            await self._close(stack)

    async def _close(self, stack: contextlib.AsyncExitStack) -> None:
        """Close the session and transport (the stdio server is terminated); never hangs, never raises."""
        try:
            async with asyncio.timeout(self.connect_timeout):
                await stack.aclose()
        except Exception as e:  # noqa: BLE001 - a dead server's transport may fail to close; it is gone anyway
            log.debug("closing MCP server %r: %s: %s", self.name, type(e).__name__, e)

    def _live_session(self) -> Any:
        if self._broken is not None:
            raise MCPToolError(f"MCP server {self.name!r} is no longer usable: {self._broken}")
        if self._session is None:
            raise MCPToolError(f"MCP server {self.name!r} is not connected; use `async with` around its use")
        return self._session

    # ----------------------------------------------------------------------- listing

    async def list_tools(self) -> list[MCPTool]:
        result = await self._request("list the tools", lambda s: s.list_tools())
        tools = [MCPTool(name=t.name, description=t.description or "",
                         parameters=dict(_field(t, "input_schema", "inputSchema") or {})) for t in result.tools]
        self._tools = {t.name: t for t in tools}
        return tools

    async def list_resources(self) -> list[MCPResource]:
        result = await self._request("list the resources", lambda s: s.list_resources())
        return [MCPResource(uri=str(r.uri), name=r.name, description=r.description or "",
                            mime_type=_field(r, "mime_type", "mimeType")) for r in result.resources]

    async def tool_schemas(self) -> list[dict[str, Any]]:
        """The server's tools as OpenAI chat-completions tool schemas."""
        return [t.to_tool_schema() for t in await self.list_tools()]

    # ----------------------------------------------------------------------- calling

    async def call_tool(self, name: str, arguments: str | dict[str, Any] | None = None) -> str:
        """Call tool `name` with `arguments` (a JSON object, or its text as the model wrote it); its text result."""
        args = _parse_arguments(self.name, name, arguments)
        if self._tools is None:
            await self.list_tools()
        assert self._tools is not None
        if name not in self._tools:
            raise MCPToolError(f"MCP server {self.name!r} has no tool {name!r} (called with {args}); its tools: "
                               f"{sorted(self._tools)}")
        result = await self._request(f"call tool {name!r} with {args}", lambda s: s.call_tool(name, args))
        text = _text(result)
        if _field(result, "is_error", "isError"):
            raise MCPToolError(f"tool {name!r} of MCP server {self.name!r} failed on arguments {args}: {text}")
        return text

    async def call(self, tool_call: Any) -> dict[str, Any]:
        """The tool message answering an OpenAI tool call (a `ChatCompletionMessageToolCall` or its dict)."""
        call = tool_call.model_dump() if hasattr(tool_call, "model_dump") else dict(tool_call)
        function = call.get("function") or {}
        content = await self.call_tool(function.get("name", ""), function.get("arguments"))
        return {"role": "tool", "tool_call_id": call.get("id", ""), "content": content}

    async def _request(self, what: str, send: Callable[[Any], Any]) -> Any:
        session = self._live_session()
        try:
            async with asyncio.timeout(self.call_timeout):
                return await send(session)
        except TimeoutError as e:
            raise MCPToolError(f"MCP server {self.name!r} did not answer within call_timeout={self.call_timeout}s "
                               f"when asked to {what}") from e
        except Exception as e:  # noqa: BLE001 - every failure of the server or its transport is this rollout's
            from mcp.shared.exceptions import MCPError

            if not isinstance(e, MCPError) or _is_connection_error(e):
                self._broken = f"{type(e).__name__}: {e}"
                raise MCPToolError(f"MCP server {self.name!r} failed (it died or dropped the connection?) when "
                                   f"asked to {what}: {type(e).__name__}: {e}") from e
            raise MCPToolError(f"MCP server {self.name!r} refused to {what}: {e}") from e


def _is_connection_error(e: Exception) -> bool:
    error = getattr(e, "error", None)
    return getattr(error, "code", None) == -32000 and "closed" in str(e).lower()


def _parse_arguments(server: str, name: str, arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise MCPToolError(f"the arguments of a call to tool {name!r} (MCP server {server!r}) are not JSON: "
                               f"{e}; the model wrote {arguments[:300]!r}") from e
    if not isinstance(arguments, dict):
        raise MCPToolError(f"the arguments of a call to tool {name!r} (MCP server {server!r}) must be a JSON "
                           f"object; the model wrote {json.dumps(arguments)[:300]}")
    return arguments


def _field(obj: Any, name: str, v1_name: str) -> Any:
    """A field of an `mcp` result by its mcp 2 name (snake case), or its mcp 1 name."""
    return getattr(obj, name, getattr(obj, v1_name, None))


def _text(result: Any) -> str:
    """A tool result as text: its text parts joined, other parts as JSON, or the structured content."""
    parts = []
    for block in getattr(result, "content", None) or []:
        text = getattr(block, "text", None)
        parts.append(text if text is not None else json.dumps(block.model_dump(mode="json", exclude_none=True)))
    structured = _field(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured))
    return "\n".join(parts)
