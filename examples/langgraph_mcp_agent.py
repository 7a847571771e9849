"""A LangGraph ReAct agent whose tools live behind an MCP server, trained with RL on its own sampled tokens.

    python examples/langgraph_mcp_agent.py --steps 6

Needs the extras `langgraph` and `mcp` (`pip install 'artrl[langgraph,mcp]'`); runs offline on
a CPU with the tiny model (docs/integrations.md records a run).

1. The calculator MCP server (examples/mcp_calculator_server.py) starts as a stdio
   subprocess; `artrl.mcp.MCPClient` lists its tools, `artrl.langgraph.mcp_tools` makes them
   LangChain tools.
2. `artrl.mcp.generate_scenarios` writes the tasks with the model itself, through its own
   server: the JSON-schema response format is a grammar there, so even the tiny model's
   reply is a valid scenario list (its tasks are not good English; a real model's are).
3. Each rollout is a LangGraph ReAct loop (model -> tools -> model ...) on
   `art.langgraph.init_chat_model()`, wrapped by `wrap_rollout`: the trajectory holds the
   server's `Choice` for every turn, so training uses exactly the sampled tokens
   (`train/sampled_logprob_delta_max` is logged each step). The first turn must call a tool
   (`tool_choice="required"`, strict schemas: the server's grammar keeps the call valid); the
   last allowed turn gets no tools.
4. A checker grades each trajectory: 0.5 when a tool answered, up to 0.5 more as the final
   reply states the last tool result (the longest piece of it found in the reply). A few RL steps
   follow (ART's loop: gather groups, train).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import sys
import time
from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import artrl as art
from artrl.langgraph import init_chat_model, mcp_tools, wrap_rollout
from artrl.mcp import GeneratedScenario, MCPClient, generate_scenarios

log = logging.getLogger("langgraph_mcp_agent")

SERVER = pathlib.Path(__file__).with_name("mcp_calculator_server.py")
SYSTEM = "You are a calculator assistant. Use the tools, then state the result."
MAX_MODEL_TURNS = 3


def react_agent(tools: list[Any], max_tokens: int) -> Any:
    """LangGraph's ReAct loop; turn 1 must call a tool, the last turn may not."""
    llm = init_chat_model(max_tokens=max_tokens)
    must, may, answer = (llm.bind_tools(tools, tool_choice="required", strict=True),
                         llm.bind_tools(tools, strict=True), llm)

    async def agent(state: MessagesState) -> dict[str, Any]:
        turn = 1 + sum(isinstance(m, ToolMessage) for m in state["messages"])
        chat = must if turn == 1 else answer if turn >= MAX_MODEL_TURNS else may
        return {"messages": [await chat.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "agent")
    return graph.compile()


def reported(result: str, text: str) -> float:
    """How much of `result` the reply states: the longest piece of it found in `text`, over its length."""
    return max((k for k in range(1, len(result) + 1) for i in range(len(result) - k + 1) if result[i:i + k] in text),
               default=0) / max(1, len(result))


def check(trajectory: art.Trajectory) -> float:
    """0.5 if a tool answered; up to 0.5 more as the final reply states the last tool result."""
    results = [m["content"] for m in trajectory.messages_and_choices if isinstance(m, dict) and m["role"] == "tool"]
    final = trajectory.messages_and_choices[-1]
    text = "" if isinstance(final, dict) else final.message.content or ""
    trajectory.metrics["tool_answered"] = bool(results)
    trajectory.metrics["reported_result"] = reported(results[-1], text) if results else 0.0
    return 0.5 * trajectory.metrics["tool_answered"] + 0.5 * trajectory.metrics["reported_result"]


async def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    model = art.TrainableModel(name=args.name, project="artrl-examples", base_model="artrl/tiny")
    backend = art.LocalBackend(path=args.path)
    await model.register(backend)
    try:
        async with MCPClient.stdio(sys.executable, [str(SERVER)], call_timeout=30) as server:
            tools = await mcp_tools(server)
            scenarios = await generate_scenarios(
                await server.list_tools(), await server.list_resources(), num_scenarios=args.scenarios,
                custom_instructions="Each task asks to add or multiply two integers between 1 and 20.",
                generator_model=model.get_inference_name(), generator_base_url=model.inference_base_url,
                generator_api_key=model.inference_api_key, max_task_chars=80, max_tokens=60 * args.scenarios + 40)
            log.info("%d scenarios from generate_scenarios, e.g. %r", len(scenarios), scenarios[0].task)

            @wrap_rollout(model)
            async def rollout(scenario: GeneratedScenario) -> art.Trajectory:
                graph = react_agent(tools, args.max_tokens)
                await graph.ainvoke({"messages": [SystemMessage(SYSTEM), HumanMessage(scenario.task)]},
                                    {"recursion_limit": 2 * MAX_MODEL_TURNS + 2})
                return art.Trajectory(reward=0.0, metadata={"difficulty": scenario.difficulty})

            start = await model.get_step()
            for step in range(start, start + args.steps):
                batch = [scenarios[(step * args.groups + k) % len(scenarios)] for k in range(args.groups)]
                groups = await art.gather_trajectory_groups(
                    (art.TrajectoryGroup(rollout(s) for _ in range(args.rollouts)) for s in batch),
                    pbar_desc=f"gather step {step}", max_exceptions=0.25)
                for g in groups:
                    for t in g.trajectories:
                        t.reward = check(t)
                await model.delete_checkpoints()
                result = await model.train(groups, config=art.TrainConfig(learning_rate=args.lr),
                                           _config=art.dev.TrainConfig(scale_rewards=False))
                trajectories = [t for g in groups for t in g.trajectories]
                mean = lambda key: sum(float(t.metrics[key]) for t in trajectories) / len(trajectories)  # noqa: E731
                trained = ("nothing trained (every group had one reward)" if "train/sampled_logprob_delta_max" not in result.metrics
                           else f"{result.metrics['data/record_turns']:.0f} turns trained on their record, sampled-"
                                f"logprob delta max {result.metrics['train/sampled_logprob_delta_max']:.2g}")
                log.info("step %d -> %d: reward %.3f (tool answered %.2f, result reported %.2f), %d failed "
                         "rollouts; %s", step, result.step, sum(t.reward for t in trajectories) / len(trajectories),
                         mean("tool_answered"), mean("reported_result"), sum(len(g.exceptions) for g in groups),
                         trained)
    finally:
        backend.close()
    log.info("done in %.0f s", time.perf_counter() - started)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="RL steps (default 6)")
    p.add_argument("--scenarios", type=int, default=8, help="scenarios to generate (default 8)")
    p.add_argument("--groups", type=int, default=4, help="scenarios per step (default 4)")
    p.add_argument("--rollouts", type=int, default=4, help="rollouts per scenario (default 4)")
    p.add_argument("--max-tokens", type=int, default=48, help="max tokens per model turn (default 48)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--path", default="./.art", help="LocalBackend directory (default ./.art)")
    p.add_argument("--name", default="calculator-agent", help="model name")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "uvicorn", "uvicorn.access", "uvicorn.error", "mcp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(main(p.parse_args()))
