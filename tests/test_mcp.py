"""artrl.mcp against a real MCP server (examples/mcp_calculator_server.py, a subprocess), and ART's MCP types.

The fault cases of an MCP-backed rollout, each a clear `MCPToolError` on that rollout and
never a hang (every test runs under `asyncio.timeout`): malformed arguments, an unknown
tool, a tool that raises, a tool that never answers, a server that dies mid-call. Then the
same faults reached by a LangGraph agent through the real local server: the failing rollouts
land in their group's `exceptions` (ART's gather rules), the others are trajectories.
`generate_scenarios` runs on the tiny model, whose JSON the server's grammar keeps valid.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import socket
import subprocess
import sys
from typing import Any

import pytest

from artrl.mcp import (GeneratedScenario, GeneratedScenarioCollection, MCPClient, MCPTool, MCPToolError,
                       complete_task_tool, generate_scenarios)

mcp = pytest.importorskip("mcp")

SERVER = str(pathlib.Path(__file__).parents[1] / "examples" / "mcp_calculator_server.py")
NO_HANG_S = 120  # far above any call here: reaching it means something hung
CALL_TIMEOUT_S = 2.0
SLOW_CALL_S = 60.0  # a call that must not time out: a first call on a loaded machine can take seconds


def calculator(call_timeout: float = CALL_TIMEOUT_S, **options: Any) -> MCPClient:
    return MCPClient.stdio(sys.executable, [SERVER, "--faults"], call_timeout=call_timeout, **options)


def run(coroutine: Any) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(NO_HANG_S):
            return await coroutine

    return asyncio.run(bounded())


def test_tools_are_listed_as_openai_schemas_and_called() -> None:
    async def main() -> None:
        async with calculator() as server:
            schemas = {s["function"]["name"]: s for s in await server.tool_schemas()}
            assert {"add", "multiply", "fail", "hang", "crash"} <= set(schemas)
            add = schemas["add"]
            assert add["type"] == "function" and add["function"]["description"].startswith("Add two integers")
            assert add["function"]["parameters"]["required"] == ["a", "b"]
            assert await server.call_tool("add", '{"a": 2, "b": 3}') == "5"
            assert await server.call_tool("multiply", {"a": 4, "b": 5}) == "20"
            call = {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}
            assert await server.call(call) == {"role": "tool", "tool_call_id": "call_7", "content": "2"}
            [about] = await server.list_resources()
            assert about.uri == "calc://about" and about.name == "about"

    run(main())


@pytest.mark.parametrize("name, arguments, message", [
    ("add", '{"a": 2', r"arguments of a call to tool 'add' .* are not JSON.*the model wrote '\{\"a\": 2'"),
    ("add", "[1, 2]", r"must be a JSON object; the model wrote \[1, 2\]"),
    ("divide", "{}", r"has no tool 'divide'.*its tools: \['add', 'crash'"),
    ("add", '{"a": "two", "b": 1}', r"tool 'add' of MCP server .* failed on arguments \{'a': 'two', 'b': 1\}"),
    ("fail", '{"reason": "testing"}', r"tool 'fail' of MCP server .* failed on arguments"),
    ("hang", "{}", r"did not answer within call_timeout=2.0s when asked to call tool 'hang'"),
])
def test_each_fault_is_an_error_naming_the_call_and_the_server_stays_usable(name: str, arguments: str,
                                                                            message: str) -> None:
    async def main() -> None:
        # only the call that hangs waits for the short timeout; on a loaded machine a server's first answer
        # may take longer than that
        async with calculator(call_timeout=CALL_TIMEOUT_S if name == "hang" else SLOW_CALL_S) as server:
            with pytest.raises(MCPToolError, match=message):
                await server.call_tool(name, arguments)
            assert await server.call_tool("add", {"a": 1, "b": 2}) == "3"  # one bad call breaks nothing else

    run(main())


def test_a_server_that_dies_mid_call_fails_that_call_and_every_later_one() -> None:
    async def main() -> None:
        async with calculator() as server:
            with pytest.raises(MCPToolError, match=r"failed \(it died or dropped the connection\?\) when asked to "
                                                   r"call tool 'crash'"):
                await server.call_tool("crash")
            with pytest.raises(MCPToolError, match="is no longer usable"):
                await server.call_tool("add", {"a": 1, "b": 2})

    run(main())


def test_a_server_that_cannot_start_is_a_connection_error() -> None:
    async def main() -> None:
        with pytest.raises(MCPToolError, match="could not connect to MCP server|did not answer the handshake"):
            async with MCPClient.stdio(sys.executable, ["-c", "import sys; sys.exit(2)"], connect_timeout=10):
                pass

    run(main())


def test_streamable_http_transport() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)

    async def main() -> None:
        while True:  # until the server listens (bounded by run()'s timeout)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None:
                    raise AssertionError(f"the HTTP server exited with {process.returncode}")
                await asyncio.sleep(0.2)
        async with MCPClient.http(f"http://127.0.0.1:{port}/mcp", call_timeout=CALL_TIMEOUT_S) as server:
            assert "add" in {s["function"]["name"] for s in await server.tool_schemas()}
            assert await server.call_tool("add", '{"a": 20, "b": 22}') == "42"

    try:
        run(main())
    finally:
        process.terminate()
        process.wait(timeout=30)


# --------------------------------------------------------------------------- ART's types


def test_scenario_types_keep_arts_behaviour() -> None:
    collection = GeneratedScenarioCollection.from_json(json.dumps(
        {"scenarios": [{"task": f"task {i}", "difficulty": 1 + i % 5} for i in range(7)]}))
    assert len(collection) == 7 and collection[2].difficulty == 3
    assert GeneratedScenarioCollection.from_json(collection.to_json()).to_dicts() == collection.to_dicts()
    assert len(GeneratedScenarioCollection.from_json(json.dumps(collection.to_dicts()))) == 7  # a bare list
    train, val = collection.split(5)
    assert [s.task for s in val] == ["task 5", "task 6"]
    with pytest.raises(ValueError, match=r"train_size \(8\) cannot be larger than total scenarios \(7\)"):
        collection.split(8)
    assert {s.difficulty for s in collection.filter_by_difficulty(2, 3)} == {2, 3}
    assert collection.get_summary()["total_scenarios"] == 7
    assert sorted(s.task for s in collection.shuffle()) == sorted(s.task for s in collection)
    for bad in (0, 6, 2.5, True):
        with pytest.raises(ValueError, match="Difficulty must be an integer between 1 and 5"):
            GeneratedScenario(task="t", difficulty=bad)
    assert GeneratedScenario(task="x" * 200, difficulty=1).preview(10) == "x" * 10 + "…"
    tool = MCPTool.from_dict({"name": "add", "description": "d", "parameters": {"type": "object"}})
    assert tool.to_tool_schema() == {"type": "function", "function": {"name": "add", "description": "d",
                                                                      "parameters": {"type": "object"}}}
    assert complete_task_tool.to_tool_schema()["function"]["parameters"]["required"] == ["summary"]


def test_generate_scenarios_needs_a_key_and_something_to_write_about(monkeypatch) -> None:
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(ValueError, match="generator_api_key is required or OPENROUTER_API_KEY"):
        asyncio.run(generate_scenarios([complete_task_tool]))
    with pytest.raises(ValueError, match="At least one tool or resource"):
        asyncio.run(generate_scenarios([], generator_api_key="k"))


# --------------------------------------------------------------------------- through the local server


def test_faults_reached_by_a_langgraph_agent_fail_only_their_rollout_and_scenarios_are_valid(tmp_path) -> None:
    pytest.importorskip("langgraph")
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    import artrl as art
    from artrl.langgraph import init_chat_model, mcp_tools, wrap_rollout

    async def main() -> None:
        model = art.TrainableModel(name="agent", project="mcp", base_model="artrl/tiny")
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            async with calculator() as server:
                tools = {t["function"]["name"]: t for t in await server.tool_schemas()}
                # the tiny model writes valid JSON for the schema: the grammar holds it to it
                scenarios = await generate_scenarios(
                    [MCPTool.from_dict(t["function"]) for t in tools.values()], num_scenarios=3,
                    generator_model=model.get_inference_name(), generator_base_url=model.inference_base_url,
                    generator_api_key=model.inference_api_key, max_task_chars=60, max_tokens=400)
                assert len(scenarios) == 3 and all(1 <= s.difficulty <= 5 and len(s.task) <= 60 for s in scenarios)

                lc_tools = await mcp_tools(server)

                async def rollout(tool: str) -> art.Trajectory:
                    # one turn that must call `tool` (a named tool_choice: the server's grammar), then the tools
                    llm = init_chat_model(max_tokens=48).bind_tools(lc_tools, tool_choice=tool, strict=True)

                    async def agent(state: MessagesState) -> dict[str, Any]:
                        return {"messages": [await llm.ainvoke(state["messages"])]}

                    graph = StateGraph(MessagesState)
                    graph.add_node("agent", agent)
                    graph.add_node("tools", ToolNode(lc_tools))
                    graph.add_edge(START, "agent")
                    graph.add_edge("agent", "tools")
                    graph.add_edge("tools", END)
                    await graph.compile().ainvoke({"messages": [SystemMessage("Use the tools."),
                                                                HumanMessage(f"Please use {tool}.")]})
                    return art.Trajectory(reward=1.0)

                wrapped = wrap_rollout(model, rollout)
                [group] = await art.gather_trajectory_groups(
                    [art.TrajectoryGroup(wrapped(tool) for tool in ("add", "fail", "hang", "multiply"))],
                    pbar_desc=None, max_exceptions=4)
                assert len(group.trajectories) == 2, [t.messages_and_choices[-1] for t in group.trajectories]
                assert sorted(t.messages_and_choices[-1].message.tool_calls[0].function.name
                              for t in group.trajectories) == ["add", "multiply"]
                messages = sorted(e.message for e in group.exceptions)
                assert len(messages) == 2, messages
                assert all(e.type.endswith("MCPToolError'>") for e in group.exceptions), group.exceptions
                assert "did not answer within call_timeout" in messages[0] and "'hang'" in messages[0]
                assert "tool 'fail' of MCP server" in messages[1]

                # a server that dies mid-rollout fails that rollout (and, being dead, the ones after it)
                with pytest.raises(MCPToolError, match="died or dropped the connection"):
                    await wrapped("crash")
            del backend

    run(main())


@pytest.mark.slow
def test_the_langgraph_mcp_example_runs_end_to_end(tmp_path) -> None:
    """examples/langgraph_mcp_agent.py, shortened: every step trains its turns on their record."""
    pytest.importorskip("langgraph")
    example = pathlib.Path(SERVER).with_name("langgraph_mcp_agent.py")
    out = subprocess.run([sys.executable, str(example), "--steps", "2", "--scenarios", "2", "--groups", "2",
                          "--rollouts", "3", "--path", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stderr.splitlines() if "langgraph_mcp_agent: step" in line]
    assert len(steps) == 2, out.stderr[-3000:]
    assert all("0 failed rollouts" in line for line in steps), steps
    for line in steps:
        if "sampled-logprob delta max" in line:
            assert float(line.rsplit(" ", 1)[1]) < 1e-3, line
