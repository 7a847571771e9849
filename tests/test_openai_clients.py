"""`model.openai_client()`: the aiohttp transport for the local server, one client per event loop, closed with it.

A client made on one loop answers there, a later `asyncio.run` gets a new one (an aiohttp session cannot
outlive its loop), nothing reports an unclosed session, and outside a loop or for another host the SDK's
httpx client is kept as before."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator

import openai
import pytest

import artrl as art
from artrl.client.openai import aiohttp_available, transport_of
from artrl.serve import ServedModels, create_app, start_server
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.models.tiny import build_tiny_tokenizer

pytestmark = pytest.mark.skipif(not aiohttp_available(), reason="the openai SDK's aiohttp extra is not installed")

QUESTION = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    engine = ScriptedEngine.from_text(build_tiny_tokenizer(), "hello")
    with start_server(create_app(ServedModels("m", engine))) as handle:
        yield handle.base_url


def test_each_event_loop_gets_its_own_aiohttp_client_closed_when_the_loop_ends(base_url, caplog):
    model = art.Model(name="m", project="p", inference_base_url=base_url, inference_api_key="k")

    async def turn() -> tuple[openai.AsyncOpenAI, str]:
        client = model.openai_client()
        assert model.openai_client() is client  # rollouts may call it per request
        reply = await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
        return client, reply.choices[0].message.content

    caplog.set_level(logging.ERROR, logger="asyncio")
    first, text = asyncio.run(turn())
    assert text == "hello" and transport_of(first) == "AiohttpTransport"
    assert first.is_closed()  # closed when its loop shut down
    second, text = asyncio.run(turn())  # a new loop: a client of its own, not the closed one
    assert text == "hello" and second is not first
    del first, second
    gc.collect()
    assert not [r for r in caplog.records if "Unclosed" in r.getMessage()]


def test_outside_a_loop_or_for_another_host_the_httpx_client_is_shared(base_url):
    local = art.Model(name="m", project="p", inference_base_url=base_url, inference_api_key="k")
    outside = local.openai_client()  # no running loop: no loop to bind an aiohttp session to
    assert local.openai_client() is outside and transport_of(outside) != "AiohttpTransport"
    remote = art.Model(name="openai/gpt-4o", project="p", inference_base_url="https://api.openai.com/v1",
                       inference_api_key="sk-x")

    async def inside() -> openai.AsyncOpenAI:
        return remote.openai_client()

    assert transport_of(asyncio.run(inside())) != "AiohttpTransport"
    assert (outside.timeout.read, outside.timeout.connect) == (1200.0, 5.0)


def test_a_new_server_address_gets_a_new_client(base_url):
    model = art.Model(name="m", project="p", inference_base_url=base_url, inference_api_key="k")

    async def both() -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI, openai.AsyncOpenAI]:
        before = model.openai_client()
        model.inference_api_key = "other"
        after = model.openai_client()
        return before, after, model.openai_client()

    before, after, again = asyncio.run(both())
    assert after is not before and again is after and after.api_key == "other"
