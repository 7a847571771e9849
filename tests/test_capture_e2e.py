"""ART 0.5.23's capture scopes end to end: an agent that knows only a base URL and a key, four HTTP clients.

Each rollout is a 3-turn conversation with the local server (the tiny model), made by the agent's
own client, inside `with art.Trajectory() as t:`; `art.trajectory_group` runs a group of them
concurrently; `model.train(groups)` then trains on the captured exchanges. Every sampled turn must be
trained on the server's token record (`data/record_turns` counts all of them, nothing rendered from
text) and the trainer's logprobs of the sampled tokens must equal the sampled ones
(`train/sampled_logprob_delta_max` < 1e-3), turn after turn, whichever client sent the requests.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import requests

import artrl as art
from artrl.trajectories import sampled_policy_versions

TOLERANCE = 1e-3
TURNS = 3
QUESTIONS = ["Name a colour.", "Count to three.", "Say hello."]


async def _openai(url: str, key: str, model: str, messages: list[dict[str, Any]], stream: bool) -> str:
    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
    if not stream:
        response = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
        return response.choices[0].message.content or ""
    text = ""
    async for chunk in await client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                                            stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


async def _aiohttp(url: str, key: str, model: str, messages: list[dict[str, Any]], stream: bool) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                json={"model": model, "messages": messages, "max_tokens": 6}) as response:
            body = await response.json()
    return body["choices"][0]["message"]["content"] or ""


def _requests(url: str, key: str, model: str, messages: list[dict[str, Any]], stream: bool) -> str:
    payload = {"model": model, "messages": messages, "max_tokens": 6, "stream": stream}
    response = requests.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=payload,
                             stream=stream, timeout=120)
    if not stream:
        return response.json()["choices"][0]["message"]["content"] or ""
    text = ""
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


CLIENTS = {"openai": (_openai, False), "openai-stream": (_openai, True), "aiohttp": (_aiohttp, False),
           "requests-stream": (_requests, True)}


async def agent(url: str, key: str, model: str, question: str, client: str) -> None:
    """A 3-turn conversation; it knows nothing of artrl, only where the model is served."""
    call, stream = CLIENTS[client]
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for turn in range(TURNS):
        if asyncio.iscoroutinefunction(call):
            reply = await call(url, key, model, messages, stream)
        else:
            reply = await asyncio.to_thread(call, url, key, model, messages, stream)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And {turn}?"}]


def test_captured_rollouts_train_on_exactly_their_record(tmp_path) -> None:
    async def main() -> None:
        model = art.TrainableModel(name="agent", project="capture", base_model="artrl/tiny")
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            url, key, name = model.inference_base_url, model.inference_api_key or "x", model.get_inference_name()

            async def rollout(question: str, k: int, client: str) -> art.Trajectory:
                with art.Trajectory() as t:
                    await agent(url, key, name, question, client)
                    art.current_trajectory(require=True).reward = float(k)
                return t

            groups = [await art.trajectory_group(rollout(q, k, c) for k, c in enumerate(CLIENTS))
                      for q in QUESTIONS]
            for g in groups:
                assert [len(t.exchanges.chat_completions) for t in g] == [TURNS] * len(CLIENTS)
                for t in g:
                    assert not t.messages_and_choices and "duration" in t.metrics
                    assert sampled_policy_versions(t) == [0] * TURNS  # each turn names the policy that sampled it
                    for e in t.exchanges.chat_completions:
                        assert e.response.choices[0].model_extra["token_ids"]
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))
            metrics = result.metrics
            assert result.step == 1 and await model.get_step() == 1
            turns = TURNS * len(CLIENTS) * len(QUESTIONS)
            assert metrics["data/record_turns"] == turns and metrics["data/rendered_turns"] == 0, metrics
            assert metrics["train/sampled_logprob_delta_max"] < TOLERANCE, metrics
            assert metrics["data/record_splits"] == 0, metrics  # each conversation is one sequence

    asyncio.run(main())
