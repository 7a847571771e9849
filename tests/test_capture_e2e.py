"""ART 0.5.23's capture scopes end to end: agents that know only a base URL and a key, four wire protocols,
three HTTP clients, against the local server with the tiny model.

Each rollout is a 3-turn conversation made by the agent's own client (the openai or anthropic SDK,
i.e. httpx; aiohttp; requests), plain or streamed, inside `with art.Trajectory() as t:`;
`art.trajectory_group` runs a group of them concurrently; `model.train(groups)` then trains on the
captured exchanges. Every sampled turn must be trained on the server's token record
(`data/record_turns` counts all of them, none rendered or re-tokenized from text) and the trainer's
logprobs of the sampled tokens must equal the sampled ones (`train/sampled_logprob_delta_max` <
1e-3), whichever protocol and client made the requests; each train call advances the step. Two tool
agents (Anthropic tool_use -> tool_result -> answer, Responses function_call -> function_call_output
-> answer) train the same way. One model and one backend serve the whole module (a loop on a thread).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import requests

import artrl as art
from artrl.chat.format import end_of_turn_ids
from artrl.models.tokenizer import load_tokenizer
from artrl.trajectories.tokens import TokenFlag
from artrl.trajectories import sampled_policy_versions

TOLERANCE = 1e-3
TURNS = 3
MAX_TOKENS = 6
QUESTION = "Name a colour."


# --------------------------------------------------------------------------- one backend for the module


class Served:
    """A trainable tiny model registered on a LocalBackend, on an event loop of its own thread."""

    def __init__(self, path: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.model = art.TrainableModel(name="agent", project="capture", base_model="artrl/tiny")
        self.backend = art.LocalBackend(path=path, show_progress=False)
        self.run(self._start())
        self.url = self.model.inference_base_url
        self.key = self.model.inference_api_key or "x"
        self.name = self.model.get_inference_name()

    async def _start(self) -> None:
        await self.backend.__aenter__()
        await self.model.register(self.backend)

    def run(self, coroutine: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=900)

    def close(self) -> None:
        try:
            self.run(self.backend.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    handle = Served(str(tmp_path_factory.mktemp("capture")))
    yield handle
    handle.close()


Agent = Callable[[Served, str], Awaitable[None]]


async def check_tokenized(group: art.TrajectoryGroup, endpoint: str) -> None:
    """`art.tokenize` gives each trajectory's turns as the record chains them: a turn whose prompt starts with the
    previous prompt + sampled ids extends its sequence, and a sequence ends only where the model closed its turn
    with another end-of-turn token than the template writes (the tiny model may end a tool call with
    <|endoftext|>, the template writes <|im_end|>; the next prompt is then the template's text,
    docs/token-record.md). Each sequence is its last turn's prompt and sampled ids; every turn's sampled ids are
    flagged SAMPLED, with the logprobs the server sent."""
    tokenizer = load_tokenizer("artrl/tiny")
    other_ends = end_of_turn_ids(tokenizer) - {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    tokenized = await art.tokenize(group.trajectories, base_model="artrl/tiny", multi_history=True)
    for t, tt in zip(group.trajectories, tokenized):
        records = [exchange_record(endpoint, e) for e in getattr(t.exchanges, endpoint)]
        chains = [[records[0]]]
        for before, (prompt, ids, lps) in zip(records, records[1:]):
            sequence = before[0] + before[1]
            if prompt[:len(sequence)] == sequence:
                chains[-1].append((prompt, ids, lps))
            else:
                assert before[1][-1] in other_ends, (sequence, prompt)
                chains.append([(prompt, ids, lps)])
        assert [h.tokens for h in tt.histories] == [chain[-1][0] + chain[-1][1] for chain in chains]
        for h, chain in zip(tt.histories, chains):
            sampled = [k for k, flag in enumerate(h.flags) if flag & TokenFlag.SAMPLED]
            assert [h.tokens[k] for k in sampled] == [i for _, ids, _ in chain for i in ids]
            assert [h.logprobs[k] for k in sampled] == pytest.approx([lp for *_, lps in chain for lp in lps])


def exchange_record(endpoint: str, exchange: Any) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, sampled ids, logprobs) as the server put them on an exchange."""
    data = exchange.response.model_dump()
    if endpoint == "chat_completions":
        (choice,) = data["choices"]
        return choice["prompt_token_ids"], choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]
    if endpoint == "messages":
        return data["prompt_token_ids"], data["token_ids"], data["logprobs"]
    (generation,) = data["token_generations"]
    return generation["prompt_token_ids"], generation["token_ids"], generation["compact_logprobs"]


def train_on(served: Served, agents: list[Agent], endpoint: str, turns: int,
             check: Callable[[art.TrajectoryGroup, str], Awaitable[None]] | None = None) -> dict[str, float]:
    """One group of rollouts (one per agent, rewards 0, 1, ...) captured with `art.trajectory_group`, checked (and
    by `check`) and trained on; the train call's metrics."""

    async def rollout(agent: Agent, k: int) -> art.Trajectory:
        with art.Trajectory() as t:
            await agent(served, QUESTION)
            art.current_trajectory(require=True).reward = float(k)
        return t

    async def main() -> dict[str, float]:
        step = await served.model.get_step()
        group = await art.trajectory_group(rollout(agent, k) for k, agent in enumerate(agents))
        for t in group:
            assert not t.messages_and_choices and "duration" in t.metrics
            assert len(getattr(t.exchanges, endpoint)) == turns, t.exchanges
            assert [len(getattr(t.exchanges, e)) for e in ("chat_completions", "completions", "responses",
                                                            "messages") if e != endpoint] == [0, 0, 0]
            assert sampled_policy_versions(t) == [step] * turns  # each turn names the policy that sampled it
        if check is not None:
            await check(group, endpoint)
        result = await served.model.train([group], config=art.TrainConfig(learning_rate=1e-4))
        assert result.step == step + 1 and await served.model.get_step() == step + 1
        metrics = result.metrics
        assert metrics["data/record_turns"] == turns * len(agents), metrics
        assert metrics["data/rendered_turns"] == 0 and metrics["data/retokenized_turns"] == 0, metrics
        assert metrics["data/turns_missing_logprobs"] == 0 and metrics["train/sampled_logprob_tokens"] > 0, metrics
        assert metrics["train/sampled_logprob_delta_max"] < TOLERANCE, metrics
        return metrics

    return served.run(main())


def sse(lines: Iterator[bytes]) -> Iterator[tuple[str | None, Any]]:
    """(event name, JSON payload) of a server-sent event stream read line by line (what an agent without an SDK
    writes); `[DONE]` ends it."""
    name = None
    for raw in lines:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield name, json.loads(data)
            name = None


async def aiohttp_post(url: str, headers: dict[str, str], body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, headers=headers, json=body) as response:
            response.raise_for_status()
            if not body.get("stream"):
                return await response.json()
            lines = [line async for line in response.content]
    return list(sse(iter(lines)))


def requests_post(url: str, headers: dict[str, str], body: dict[str, Any]) -> Any:
    response = requests.post(url, headers=headers, json=body, stream=bool(body.get("stream")), timeout=120)
    response.raise_for_status()
    if not body.get("stream"):
        return response.json()
    return list(sse(response.iter_lines()))


def bearer(served: Served) -> dict[str, str]:
    return {"Authorization": f"Bearer {served.key}"}


# --------------------------------------------------------------------------- chat completions


def chat_text(reply: Any) -> str:
    if isinstance(reply, dict):
        return reply["choices"][0]["message"]["content"] or ""
    return "".join(c["delta"].get("content") or "" for _, chunk in reply for c in chunk["choices"])


def chat_agent(client: str, stream: bool) -> Agent:
    async def agent(served: Served, question: str) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        for turn in range(TURNS):
            body = {"model": served.name, "messages": messages, "max_tokens": MAX_TOKENS, "stream": stream}
            if client == "openai":
                sdk = openai.AsyncOpenAI(base_url=served.url, api_key=served.key, max_retries=0)
                if stream:
                    text = ""
                    async for chunk in await sdk.chat.completions.create(**body):
                        text += "".join(c.delta.content or "" for c in chunk.choices)
                else:
                    text = (await sdk.chat.completions.create(**body)).choices[0].message.content or ""
            elif client == "aiohttp":
                text = chat_text(await aiohttp_post(f"{served.url}/chat/completions", bearer(served), body))
            else:
                text = chat_text(await asyncio.to_thread(requests_post, f"{served.url}/chat/completions",
                                                         bearer(served), body))
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn}?"}]
    return agent


def test_chat_completions_rollouts_train_on_exactly_their_record(served: Served) -> None:
    agents = [chat_agent("openai", False), chat_agent("openai", True), chat_agent("aiohttp", False),
              chat_agent("requests", True)]
    metrics = train_on(served, agents, "chat_completions", TURNS, check_tokenized)
    assert metrics["data/record_splits"] == 0, metrics  # each conversation is one sequence


# --------------------------------------------------------------------------- completions


def completion_text(reply: Any) -> str:
    if isinstance(reply, dict):
        return reply["choices"][0]["text"]
    return "".join(c.get("text") or "" for _, chunk in reply for c in chunk["choices"])


def completions_agent(client: str, stream: bool) -> Agent:
    """A raw-prompt agent: each turn's prompt is the text so far (the previous replies re-sent as text)."""
    async def agent(served: Served, question: str) -> None:
        prompt = f"Q: {question}\nA:"
        for turn in range(TURNS):
            body = {"model": served.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream}
            if client == "openai":
                sdk = openai.AsyncOpenAI(base_url=served.url, api_key=served.key, max_retries=0)
                if stream:
                    text = ""
                    async for chunk in await sdk.completions.create(**body):
                        text += "".join(c.text or "" for c in chunk.choices)
                else:
                    text = (await sdk.completions.create(**body)).choices[0].text
            elif client == "aiohttp":
                text = completion_text(await aiohttp_post(f"{served.url}/completions", bearer(served), body))
            else:
                text = completion_text(await asyncio.to_thread(requests_post, f"{served.url}/completions",
                                                               bearer(served), body))
            prompt += f"{text}\nQ: And {turn}?\nA:"
    return agent


def test_completions_rollouts_train_on_exactly_their_record(served: Served) -> None:
    agents = [completions_agent("openai", False), completions_agent("openai", True),
              completions_agent("aiohttp", False), completions_agent("requests", True)]
    train_on(served, agents, "completions", TURNS)  # the prompt is re-sent as text: no claim on record_splits


# --------------------------------------------------------------------------- responses


def responses_text(reply: Any) -> str:
    if not isinstance(reply, dict):  # a stream: its completed response
        reply = next(p["response"] for name, p in reply if p.get("type") in ("response.completed",
                                                                              "response.incomplete"))
    return "".join(part.get("text") or "" for item in reply["output"] if item["type"] == "message"
                   for part in item["content"])


def responses_agent(client: str, stream: bool) -> Agent:
    async def agent(served: Served, question: str) -> None:
        items: list[dict[str, Any]] = [{"role": "user", "content": question}]
        for turn in range(TURNS):
            body = {"model": served.name, "input": items, "max_output_tokens": MAX_TOKENS, "stream": stream}
            if client == "openai":
                sdk = openai.AsyncOpenAI(base_url=served.url, api_key=served.key, max_retries=0)
                if stream:
                    text = ""
                    async for event in await sdk.responses.create(**body):
                        if event.type == "response.output_text.delta":
                            text += event.delta
                else:
                    text = (await sdk.responses.create(**body)).output_text
            elif client == "aiohttp":
                text = responses_text(await aiohttp_post(f"{served.url}/responses", bearer(served), body))
            else:
                text = responses_text(await asyncio.to_thread(requests_post, f"{served.url}/responses",
                                                              bearer(served), body))
            items += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn}?"}]
    return agent


def test_responses_rollouts_train_on_exactly_their_record(served: Served) -> None:
    agents = [responses_agent("openai", False), responses_agent("openai", True), responses_agent("aiohttp", True),
              responses_agent("requests", False)]
    train_on(served, agents, "responses", TURNS, check_tokenized)


# --------------------------------------------------------------------------- anthropic messages


def messages_text(reply: Any) -> str:
    if isinstance(reply, dict):
        return "".join(block.get("text") or "" for block in reply["content"])
    return "".join(p["delta"].get("text") or "" for _, p in reply if p.get("type") == "content_block_delta")


def anthropic_root(served: Served) -> str:
    """The anthropic SDK appends /v1/messages to its base URL: it takes the server's root."""
    return served.url.removesuffix("/v1")


def messages_agent(client: str, stream: bool) -> Agent:
    async def agent(served: Served, question: str) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        headers = {"x-api-key": served.key, "anthropic-version": "2023-06-01"}
        for turn in range(TURNS):
            body = {"model": served.name, "messages": messages, "max_tokens": MAX_TOKENS, "stream": stream}
            if client == "anthropic":
                sdk = anthropic.AsyncAnthropic(base_url=anthropic_root(served), api_key=served.key, max_retries=0)
                if stream:
                    async with sdk.messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as events:
                        text = "".join([piece async for piece in events.text_stream])
                else:
                    reply = await sdk.messages.create(**body)
                    text = "".join(block.text for block in reply.content if block.type == "text")
            elif client == "aiohttp":
                text = messages_text(await aiohttp_post(f"{served.url}/messages", headers, body))
            else:
                text = messages_text(await asyncio.to_thread(requests_post, f"{served.url}/messages", headers, body))
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"And {turn}?"}]
    return agent


def test_messages_rollouts_train_on_exactly_their_record(served: Served) -> None:
    agents = [messages_agent("anthropic", False), messages_agent("anthropic", True), messages_agent("aiohttp", True),
              messages_agent("requests", False)]
    train_on(served, agents, "messages", TURNS, check_tokenized)


# --------------------------------------------------------------------------- tool agents


UNITS = {"type": "object", "properties": {"celsius": {"type": "boolean"}}, "required": ["celsius"],
         "additionalProperties": False}


def anthropic_tool_agent(stream: bool) -> Agent:
    """tool_use -> tool_result -> answer, with the anthropic SDK (the call forced by `tool_choice`)."""
    async def agent(served: Served, question: str) -> None:
        sdk = anthropic.AsyncAnthropic(base_url=anthropic_root(served), api_key=served.key, max_retries=0)
        tools = [{"name": "set_units", "description": "Pick the units.", "input_schema": UNITS}]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather?"}]
        ask = {"model": served.name, "max_tokens": 40, "tools": tools,
               "tool_choice": {"type": "tool", "name": "set_units", "disable_parallel_tool_use": True}}
        if stream:
            async with sdk.messages.stream(messages=messages, **ask) as events:
                first = await events.get_final_message()
        else:
            first = await sdk.messages.create(messages=messages, **ask)
        assert first.stop_reason == "tool_use", first
        (use,) = [block for block in first.content if block.type == "tool_use"]
        messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "21 degrees"}]}]
        # the same tools and the default tool_choice: the prompt extends the first
        await sdk.messages.create(model=served.name, max_tokens=MAX_TOKENS, tools=tools, messages=messages)
    return agent


def responses_tool_agent(stream: bool, chained: bool = False) -> Agent:
    """function_call -> function_call_output -> answer, with the openai SDK's Responses API; `chained` sends only
    the tool's output and names the first response by `previous_response_id` (as the OpenAI Agents SDK may)."""
    async def agent(served: Served, question: str) -> None:
        sdk = openai.AsyncOpenAI(base_url=served.url, api_key=served.key, max_retries=0)
        tools = [{"type": "function", "name": "set_units", "description": "Pick the units.", "parameters": UNITS,
                  "strict": True}]
        items: list[Any] = [{"role": "user", "content": "What is the weather?"}]
        ask = {"model": served.name, "max_output_tokens": 40, "tools": tools, "parallel_tool_calls": False,
               "tool_choice": {"type": "function", "name": "set_units"}}
        if stream:
            first = None
            async for event in await sdk.responses.create(input=items, stream=True, **ask):
                if event.type in ("response.completed", "response.incomplete"):
                    first = event.response
            assert first is not None
        else:
            first = await sdk.responses.create(input=items, **ask)
        (call,) = [item for item in first.output if item.type == "function_call"]
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
        if chained:
            then: dict[str, Any] = {"input": [output], "previous_response_id": first.id}
        else:
            then = {"input": [*items, *[item.model_dump(exclude_none=True) for item in first.output], output]}
        await sdk.responses.create(model=served.name, max_output_tokens=MAX_TOKENS, tools=tools, **then)
    return agent


def test_anthropic_tool_agent_trains_on_the_exact_record(served: Served) -> None:
    train_on(served, [anthropic_tool_agent(False), anthropic_tool_agent(True)], "messages", 2, check_tokenized)


def test_responses_tool_agent_trains_on_the_exact_record(served: Served) -> None:
    agents = [responses_tool_agent(False), responses_tool_agent(True), responses_tool_agent(False, chained=True)]
    train_on(served, agents, "responses", 2, check_tokenized)


# --------------------------------------------------------------------------- the examples of docs/agents.md


DOC = Path(__file__).resolve().parents[1] / "docs" / "agents.md"


def doc_examples() -> list[str]:
    """The agents of docs/agents.md's "One example per protocol" (each block that defines `rollout`)."""
    text = DOC.read_text()
    section = text[text.index("### One example per protocol"):]
    section = section[:section.index("\n### ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return [block for block in blocks if "async def rollout(" in block]


def test_docs_examples_run_and_train_on_exactly_their_record(served: Served) -> None:
    """Every example agent of the docs runs as written; two rollouts of each, captured with
    `art.trajectory_group`, train on their record whichever protocol they speak."""
    examples = doc_examples()
    assert len(examples) == 5, examples

    async def main() -> None:
        groups, turns, spoken = [], 0, []
        for source in examples:
            namespace: dict[str, Any] = {}
            exec(compile(source, str(DOC), "exec"), namespace)  # noqa: S102 - the docs' own code
            group = await art.trajectory_group(namespace["rollout"](served.model, QUESTION) for _ in range(2))
            for k, t in enumerate(group):
                t.reward = float(k)  # the examples' rewards are all 0 on the tiny model: give the group a spread
                counts = {e: len(getattr(t.exchanges, e)) for e in ("chat_completions", "completions", "responses",
                                                                    "messages")}
                (endpoint,) = [e for e, n in counts.items() if n]  # one protocol per example
                spoken.append(endpoint)
                turns += counts[endpoint]
            groups.append(group)
        assert set(spoken) == {"chat_completions", "completions", "responses", "messages"}, spoken
        step = await served.model.get_step()
        result = await served.model.train(groups, config=art.TrainConfig(learning_rate=1e-4))
        assert result.step == step + 1
        metrics = result.metrics
        assert metrics["data/record_turns"] == turns, metrics
        assert metrics["data/rendered_turns"] == 0 and metrics["data/retokenized_turns"] == 0, metrics
        assert metrics["data/turns_missing_logprobs"] == 0, metrics
        assert metrics["train/sampled_logprob_delta_max"] < TOLERANCE, metrics

    served.run(main())
