"""Completions, Responses and Anthropic Messages with vLLM serving (inference_engine="vllm", vLLM's CPU build).

The protocol adapters sit on one request core whatever the engine (serve/http/core.py); this module holds them to
it on vLLM: 3-turn rollouts in each protocol, captured with `art.Trajectory()` (the openai SDK for Completions
and Responses, a bare httpx client for Messages, plain and streamed), train on exactly the tokens vLLM sampled
(every turn from the server's record, `train/sampled_logprob_delta_max` < 1e-3) and advance the step. The
anthropic SDK is not in vLLM's virtualenv; tests/test_capture_e2e.py runs it on the built-in engine.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

import artrl as art

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TURNS = 3
MAX_TOKENS = 6
TOLERANCE = 1e-3


class Served:
    """The tiny model registered on a LocalBackend with vLLM serving it."""

    def __init__(self, model: art.TrainableModel) -> None:
        self.model = model
        self.url = model.inference_base_url
        self.key = model.inference_api_key or "x"
        self.name = model.get_inference_name()


async def completions_agent(served: Served, stream: bool) -> None:
    sdk = openai.AsyncOpenAI(base_url=served.url, api_key=served.key, max_retries=0)
    prompt = "Q: Name a colour.\nA:"
    for turn in range(TURNS):
        ask = {"model": served.name, "prompt": prompt, "max_tokens": MAX_TOKENS}
        if stream:
            text = ""
            async for chunk in await sdk.completions.create(stream=True, **ask):
                text += "".join(c.text or "" for c in chunk.choices)
        else:
            text = (await sdk.completions.create(**ask)).choices[0].text
        prompt += f"{text}\nQ: And {turn}?\nA:"


async def responses_agent(served: Served, stream: bool) -> None:
    sdk = openai.AsyncOpenAI(base_url=served.url, api_key=served.key, max_retries=0)
    items: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
    for turn in range(TURNS):
        ask = {"model": served.name, "input": items, "max_output_tokens": MAX_TOKENS}
        if stream:
            text = ""
            async for event in await sdk.responses.create(stream=True, **ask):
                if event.type == "response.output_text.delta":
                    text += event.delta
        else:
            text = (await sdk.responses.create(**ask)).output_text
        items += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn}?"}]


async def messages_agent(served: Served, stream: bool) -> None:
    headers = {"x-api-key": served.key, "anthropic-version": "2023-06-01"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
    async with httpx.AsyncClient(timeout=300, headers=headers) as client:
        for turn in range(TURNS):
            body = {"model": served.name, "messages": messages, "max_tokens": MAX_TOKENS, "stream": stream}
            if stream:
                text = ""
                async with client.stream("POST", f"{served.url}/messages", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            event = json.loads(line[5:])
                            if event.get("type") == "content_block_delta":
                                text += event["delta"].get("text") or ""
            else:
                response = await client.post(f"{served.url}/messages", json=body)
                response.raise_for_status()
                text = "".join(b.get("text") or "" for b in response.json()["content"])
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn}?"}]


AGENTS = {"completions": completions_agent, "responses": responses_agent, "messages": messages_agent}


@pytest.mark.parametrize("endpoint", list(AGENTS))
def test_each_protocol_on_vllm_trains_on_exactly_its_record(tmp_path, tiny_path, endpoint: str) -> None:
    async def main() -> None:
        model = art.TrainableModel(name="agent", project="protocols", base_model=str(tiny_path),
                                   _internal_config={"inference_engine": "vllm"})
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            served = Served(model)

            async def rollout(stream: bool, reward: float) -> art.Trajectory:
                with art.Trajectory() as t:
                    await AGENTS[endpoint](served, stream)
                    t.reward = reward
                return t

            group = await art.trajectory_group(rollout(stream, float(k))
                                               for k, stream in enumerate([False, True, False, True]))
            for t in group:
                assert len(getattr(t.exchanges, endpoint)) == TURNS, t.exchanges
            step = await model.get_step()
            result = await model.train([group], config=art.TrainConfig(learning_rate=1e-4))
            metrics = result.metrics
            assert result.step == step + 1 and await model.get_step() == step + 1
            assert metrics["data/record_turns"] == TURNS * 4, metrics
            assert metrics["data/rendered_turns"] == 0 and metrics["data/retokenized_turns"] == 0, metrics
            assert metrics["train/sampled_logprob_delta_max"] < TOLERANCE, metrics

    asyncio.run(main())
