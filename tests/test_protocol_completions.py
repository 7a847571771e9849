"""`POST /v1/completions` (OpenAI's legacy Completions) through the real `openai` client: text and token-id
prompts, n, stop, logprobs, streams, the token record, and the errors chat gives."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion

from artrl.serve import ServedModels, ServerHandle, TransformersEngine, create_app, start_server
from artrl.serve.engines.scripted import ScriptedEngine
from engine_helpers import one_thread_engine, recompute

KEY = "sk-protocols"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    with one_thread_engine(max_batch_size=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine: TransformersEngine) -> Iterator[ServerHandle]:
    models = ServedModels("m", engine)
    models.add("scripted", ScriptedEngine.from_text(engine.tokenizer, "one two three four", max_model_len=8192))
    with start_server(create_app(models, api_key=KEY, max_body_bytes=200_000)) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def test_text_prompt_record_is_the_text_and_the_models_logprobs(client: openai.OpenAI,
                                                                 engine: TransformersEngine) -> None:
    tokenizer = engine.tokenizer
    completion = client.completions.create(model="m", prompt="Once upon a time", max_tokens=10, n=2, seed=3,
                                           logprobs=2)
    Completion.model_validate(completion.model_dump())
    prompt = completion.model_extra["prompt_token_ids"]
    assert prompt == tokenizer("Once upon a time").input_ids
    assert len(completion.choices) == 2
    for choice in completion.choices:
        extra = choice.model_extra
        sampled = extra["token_ids"]
        assert extra["prompt_token_ids"] == prompt
        body = sampled[:-1] if sampled[-1] in engine.end_of_turn_ids else sampled
        assert choice.text == tokenizer.decode(body)
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(sampled) == len(logprobs.text_offset)
        assert len(logprobs.top_logprobs) == len(sampled) and all(len(top) <= 2 for top in logprobs.top_logprobs)
        expected = recompute(engine.model, prompt, sampled)
        assert max(abs(a - b) for a, b in zip(logprobs.token_logprobs, expected)) < TOLERANCE
    assert completion.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in completion.choices)


def test_token_id_prompt_and_default_budget(client: openai.OpenAI, engine: TransformersEngine) -> None:
    ids = engine.tokenizer("The weather is", add_special_tokens=False).input_ids
    for prompt in (ids, [ids]):
        completion = client.completions.create(model="m", prompt=prompt, temperature=0.0)
        assert completion.model_extra["prompt_token_ids"] == ids
        choice = completion.choices[0]
        assert len(choice.model_extra["token_ids"]) <= 16  # OpenAI's default max_tokens
        assert choice.logprobs.top_logprobs is None  # not asked; token_logprobs always there
        assert len(choice.logprobs.token_logprobs) == len(choice.model_extra["token_ids"])


def test_stop_cuts_text_and_ids_end_with_the_completing_token(client: openai.OpenAI,
                                                              engine: TransformersEngine) -> None:
    completion = client.completions.create(model="scripted", prompt="count:", stop=["three"], max_tokens=30)
    choice = completion.choices[0]
    assert choice.text == "one two " and choice.finish_reason == "stop"
    assert engine.tokenizer.decode(choice.model_extra["token_ids"]).endswith("three")


def test_stream_adds_up_to_the_reply(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "m", "prompt": "Tell me", "max_tokens": 12, "n": 2, "seed": 7, "logprobs": 1}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [lp for c in mine for lp in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
        appended = [t for c in mine for t in (c.model_extra or {}).get("token_ids") or []]
        assert appended == mine[-1].model_extra["token_ids"] == choice.model_extra["token_ids"]
        assert mine[-1].finish_reason == choice.finish_reason
        assert mine[-1].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]


def post(server: ServerHandle, body: Any, key: str = KEY) -> httpx.Response:
    return httpx.post(server.base_url + "/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=60)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "temperature": 3.0}, "temperature"),
])
def test_bad_input_is_a_clear_400(server: ServerHandle, body: dict[str, Any], param: str) -> None:
    response = post(server, {"model": "m", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error


def test_wrong_key_unknown_model_and_big_body(server: ServerHandle) -> None:
    assert post(server, {"model": "m", "prompt": "hi"}, key="wrong").status_code == 401
    assert post(server, {"model": "nope", "prompt": "hi"}).status_code == 404
    assert post(server, {"model": "m", "prompt": "x" * 300_000}).status_code == 413
