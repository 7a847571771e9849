"""artrl.langgraph: a real LangGraph graph, served by the real local server, trains on exactly what it sampled.

The graph is a ReAct loop (model node -> ToolNode while the model calls tools) on
`init_chat_model()`; a summariser node then asks the same model in a fresh conversation
(an additional history). The first turn is bound with `tool_choice="any"`, which the server
enforces with a grammar, so every rollout holds a real tool call and its result. After one RL call,
`train/sampled_logprob_delta_max` must be at float tolerance and every sampled turn trained on its record
(docs/token-record.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pydantic
import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import ToolNode, tools_condition  # noqa: E402
from openai.types.chat.chat_completion import Choice  # noqa: E402

import artrl as art  # noqa: E402
from artrl.langgraph import MissingRecordError, init_chat_model, wrap_rollout  # noqa: E402

SYSTEM = "You add numbers with the add tool."
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOLERANCE = 1e-3


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def react_graph(llm: Any, tools: list[Any], *, summarise: bool = False, prefill: str | None = None) -> Any:
    """model -> tools -> model ... (LangGraph's ReAct loop); then, optionally, a summary in a fresh conversation."""
    must_call, may_call = llm.bind_tools(tools, tool_choice="any"), llm.bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, Any]:
        # the first turn calls a tool (under the server's grammar), later ones choose
        first = not any(isinstance(m, ToolMessage) for m in state["messages"])
        return {"messages": [await (must_call if first else may_call).ainvoke(state["messages"])]}

    async def summary(state: MessagesState) -> dict[str, Any]:
        await llm.ainvoke([SystemMessage("Summarise in one line."), HumanMessage(str(state["messages"][-1].content))])
        return {}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_node("summary", summary)
    if prefill is not None:  # a node that writes an assistant turn the model never sampled
        graph.add_node("prefill", lambda state: {"messages": [AIMessage(prefill), HumanMessage("Go on.")]})
        graph.add_edge(START, "prefill")
        graph.add_edge("prefill", "agent")
    else:
        graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: "summary" if summarise else END})
    graph.add_edge("tools", "agent")
    graph.add_edge("summary", END)
    return graph.compile()


def rollout_fn(model: art.TrainableModel, **graph_options: Any) -> Any:
    async def rollout(task: int) -> art.Trajectory:
        graph = react_graph(init_chat_model(max_tokens=64), [add], **graph_options)
        await graph.ainvoke({"messages": [SystemMessage(SYSTEM), HumanMessage(f"Add {task} and {task + 1}.")]},
                            {"recursion_limit": 8})
        return art.Trajectory(reward=0.0, metadata={"task": task})

    return rollout


def sampled(history: Any) -> list[Choice]:
    return [m for m in history.messages_and_choices if isinstance(m, Choice)]


def test_langgraph_rollouts_train_on_exactly_their_record(tmp_path, caplog) -> None:
    async def main() -> None:
        model = art.TrainableModel(name="agent", project="langgraph", base_model="artrl/tiny")
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            tools = [convert_to_openai_tool(add)]
            # a short lesson in small arguments (under the grammar alone the tiny model writes 90-digit integers)
            lesson = art.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": "Add 1 and 2."},
                                                          {"role": "assistant", "content": CALL}],
                                    tools=tools, reward=0.0)
            await model.train_sft([lesson] * 30, config=art.TrainSFTConfig(learning_rate=1e-2, batch_size=1))
            rollout = wrap_rollout(model, rollout_fn(model, summarise=True))
            with caplog.at_level(logging.WARNING, logger="artrl.langgraph"):
                groups = await art.gather_trajectory_groups(
                    (art.TrajectoryGroup(rollout(task) for _ in range(3)) for task in (1, 2)), pbar_desc=None)
            assert not [r for r in caplog.records if r.name.startswith("artrl.langgraph")], caplog.text

            turns, with_calls = 0, 0
            for g in groups:
                for k, t in enumerate(g):
                    t.reward = float(k)
                    assert t.tools == tools  # the graph's tools, as the model was sent them
                    main_turns = sampled(t)
                    items = t.messages_and_choices
                    calls = [i for i, m in enumerate(items) if isinstance(m, Choice) and m.message.tool_calls]
                    with_calls += any(items[i + 1]["role"] == "tool" for i in calls if i + 1 < len(items))
                    # the summariser's fresh conversation is an additional history, without tools
                    assert len(t.additional_histories) == 1 and t.additional_histories[0].tools is None
                    assert len(sampled(t.additional_histories[0])) == 1
                    for c in main_turns + sampled(t.additional_histories[0]):
                        assert c.model_extra["token_ids"] and c.model_extra["prompt_token_ids"]
                    turns += len(main_turns) + 1
            assert with_calls == 6  # every rollout called the tool and got its result back

            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-4,
                                                                      grad_accumulation_sequences=None))
            metrics = result.metrics
            assert metrics["data/record_turns"] == turns and metrics["data/rendered_turns"] == 0, metrics
            assert metrics["train/sampled_logprob_delta_max"] < TOLERANCE, metrics

            # a graph that writes an assistant turn itself: named, never trained silently
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="artrl.langgraph"):
                t = await wrap_rollout(model, rollout_fn(model, prefill="I will add them."))(3)
            assert "item 2: an assistant message no completion of this rollout sampled" in caplog.text
            assert t.messages_and_choices[2] == {"role": "assistant", "content": "I will add them."}
            with pytest.raises(MissingRecordError, match="main conversation, item 2"):
                await wrap_rollout(model, rollout_fn(model, prefill="I will add them."), on_missing_record="raise")(3)

            # a sync node (LangGraph runs it in a worker thread; the chat model's sync client records too)
            async def sync_rollout() -> art.Trajectory:
                llm = init_chat_model(max_tokens=8)
                graph = StateGraph(MessagesState)
                graph.add_node("agent", lambda state: {"messages": [llm.invoke(state["messages"])]})
                graph.add_edge(START, "agent")
                graph.add_edge("agent", END)
                await graph.compile().ainvoke({"messages": [HumanMessage("Hi.")]})
                return art.Trajectory()

            [choice] = sampled(await wrap_rollout(model, sync_rollout)())
            assert choice.model_extra["token_ids"] and choice.model_extra["prompt_token_ids"]

            # structured output (ART's agents use it for their final answers): the server's grammar, on the record
            class Answer(pydantic.BaseModel):
                total: int = pydantic.Field(ge=0, le=99)

            answers = []

            async def structured_rollout() -> art.Trajectory:
                answers.append(await init_chat_model(max_tokens=16).with_structured_output(Answer).ainvoke(
                    [HumanMessage("Add 1 and 2.")]))
                return art.Trajectory()

            [choice] = sampled(await wrap_rollout(model, structured_rollout)())
            assert isinstance(answers[0], Answer) and json.loads(choice.message.content) == answers[0].model_dump()
            assert choice.model_extra["token_ids"] and choice.model_extra["prompt_token_ids"]
            del backend

    asyncio.run(main())


def test_init_chat_model_outside_a_rollout_says_where_to_call_it() -> None:
    with pytest.raises(RuntimeError, match="inside a function wrapped by art.langgraph.wrap_rollout"):
        init_chat_model()


def test_the_wrapped_function_must_return_a_trajectory() -> None:
    async def returns_text() -> str:
        return "done"

    with pytest.raises(TypeError, match="must return an art.Trajectory.*returned str"):
        asyncio.run(wrap_rollout(object(), returns_text)())


def test_artrl_imports_without_the_extras_and_names_the_extra_to_install() -> None:
    code = ("import sys\n"
            "for name in ('langgraph', 'langchain_core', 'langchain_openai', 'mcp'):\n"
            "    sys.modules[name] = None\n"  # as if not installed
            "import artrl, artrl.mcp.types\n"
            "loaded = [m for m, v in sys.modules.items()\n"
            "          if v is not None and m.startswith(('langgraph', 'langchain', 'mcp'))]\n"
            "assert not loaded, loaded\n"
            "try:\n"
            "    import artrl.langgraph\n"
            "except ImportError as e:\n"
            "    print(e)\n"
            "from artrl.mcp import MCPClient\n"
            "try:\n"
            "    MCPClient.stdio('python')\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'artrl[langgraph]'" in out and "pip install 'artrl[mcp]'" in out, out


# --------------------------------------------------------------------------- other servers (a fake endpoint)


class _Endpoint(BaseHTTPRequestHandler):
    """A chat-completions endpoint: our record for "ours", none for anything else; SSE when streamed."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = body["messages"][-1]["content"]
        lp = {"content": [{"token": "o", "logprob": -0.5, "bytes": [111], "top_logprobs": []}]}
        if body.get("stream"):
            chunks = [{"id": "s", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "logprobs": lp,
                                    "token_ids": [7], "finish_reason": "stop"}]}]
            payload, kind = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
                b"data: [DONE]\n\n", "text/event-stream"
        else:
            record = {"token_ids": [7], "prompt_token_ids": [1, 2, 3]} if last == "ours" else {}
            payload = json.dumps({"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"},
                 "logprobs": lp, **record}]}).encode()
            kind = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def endpoint() -> Any:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield art.Model(name="m", project="p", inference_base_url=f"http://127.0.0.1:{server.server_address[1]}/v1",
                    inference_api_key="k")
    server.shutdown()
    server.server_close()


def test_turns_without_a_record_are_named(endpoint: Any, caplog: Any) -> None:
    async def rollout() -> art.Trajectory:
        llm = init_chat_model()
        await llm.ainvoke([HumanMessage("ours")])
        await llm.ainvoke([SystemMessage("another conversation"), HumanMessage("foreign")])
        return art.Trajectory(reward=1.0)

    with caplog.at_level(logging.WARNING, logger="artrl.langgraph"):
        t = asyncio.run(wrap_rollout(endpoint, rollout)())
    assert t.reward == 1.0 and sampled(t)[0].model_extra["prompt_token_ids"] == [1, 2, 3]
    assert "additional history 0, item 2: a sampled turn without token ids" in caplog.text
    assert "main conversation" not in caplog.text  # the turn with a record is not named
    with pytest.raises(MissingRecordError, match="additional history 0, item 2"):
        asyncio.run(wrap_rollout(endpoint, rollout, on_missing_record="raise")())


def test_streamed_turns_are_recorded_from_their_chunks(endpoint: Any, caplog: Any) -> None:
    async def rollout() -> art.Trajectory:
        await init_chat_model(streaming=True).ainvoke([HumanMessage("ours")])
        return art.Trajectory()

    with caplog.at_level(logging.WARNING, logger="artrl.langgraph"):
        t = asyncio.run(wrap_rollout(endpoint, rollout)())
    [choice] = sampled(t)
    assert choice.message.content == "ok" and choice.model_extra["token_ids"] == [7]
    assert choice.logprobs.content[0].logprob == -0.5
    # these chunks carry no prompt ids: named, not silently rendered
    assert "the main conversation, item 1: a sampled turn without token ids" in caplog.text
