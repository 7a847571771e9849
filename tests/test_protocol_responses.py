"""`POST /v1/responses` (OpenAI Responses) through the real `openai` client: replies, streams, a function call
round trip (by `previous_response_id` and by whole input), the token record (`token_generations`), and the
errors chat gives.

The tiny model ("m", built-in engine, live streaming) answers text; a scripted engine ("scripted") answers what a
test sets, for tool calls the untrained tiny model never writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from artrl.serve import ServedModels, ServerHandle, TransformersEngine, create_app, start_server
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.serve.http.request import INLINE_PARSE_BYTES
from engine_helpers import one_thread_engine, recompute
from protocol_helpers import COUNTED_MESSAGES, counting_server, live_step, refused_by_count

KEY = "sk-protocols"
TOLERANCE = 1e-4
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    with one_thread_engine(max_batch_size=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def scripted(engine: TransformersEngine) -> ScriptedEngine:
    return ScriptedEngine.from_text(engine.tokenizer, CALL_TEXT, max_model_len=8192)


@pytest.fixture(scope="module")
def server(engine: TransformersEngine, scripted: ScriptedEngine) -> Iterator[ServerHandle]:
    models = ServedModels("m", engine)
    models.add("scripted", scripted)
    app = create_app(models, api_key=KEY, max_body_bytes=200_000, responses_store_bytes=20_000)
    with start_server(app) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def script(engine: ScriptedEngine, text: str) -> None:
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids + [engine.tokenizer.eos_token_id]
    engine.next = (ids, [-0.5] * len(ids))


def generation(response: Any) -> dict[str, Any]:
    (one,) = response.model_extra["token_generations"]
    assert one["output_indices"] == list(range(len(response.output)))
    assert len(one["compact_logprobs"]) == len(one["token_ids"])
    return one


def test_reply_carries_a_token_record_that_is_the_text_and_the_models_logprobs(
        client: openai.OpenAI, engine: TransformersEngine) -> None:
    tokenizer = engine.tokenizer
    response = client.responses.create(model="m", instructions="Be brief.", input="Say hi", max_output_tokens=12,
                                       temperature=0.0)
    Response.model_validate(response.model_dump())  # every field the SDK's type requires is there
    record = generation(response)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    prompt, sampled = record["prompt_token_ids"], record["token_ids"]
    assert prompt == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    body = sampled[:-1] if sampled[-1] in engine.end_of_turn_ids else sampled
    assert response.output_text == tokenizer.decode(body)
    assert response.status in ("completed", "incomplete")
    assert response.usage.input_tokens == len(prompt) and response.usage.output_tokens == len(sampled)
    expected = recompute(engine.model, prompt, sampled)
    assert max(abs(a - b) for a, b in zip(record["compact_logprobs"], expected)) < TOLERANCE


def test_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input="Hello", max_output_tokens=2, temperature=0.0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert len(generation(response)["token_ids"]) == 2


def test_stream_adds_up_to_the_reply_and_completes_with_its_record(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "m", "input": "Tell me a story", "max_output_tokens": 16, "temperature": 0.0,
                              "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert generation(final)["token_ids"] == generation(whole)["token_ids"]
    assert generation(final)["prompt_token_ids"] == generation(whole)["prompt_token_ids"]
    text_logprobs = [entry.logprob for entry in whole.output[0].content[0].logprobs]
    assert text_logprobs and text_logprobs == [lp.logprob for e in deltas for lp in e.logprobs]
    assert text_logprobs == generation(whole)["compact_logprobs"][:len(text_logprobs)]
    Response.model_validate(final.model_dump())


def test_function_call_round_trip_by_previous_response_id(client: openai.OpenAI, scripted: ScriptedEngine) -> None:
    """function_call -> function_call_output -> answer, the second request naming the first response only: its
    prompt is the first prompt and its sampled ids, extended (one sequence)."""
    tokenizer = scripted.tokenizer
    script(scripted, CALL_TEXT)
    first = client.responses.create(model="scripted", input="What is the weather in Paris?", tools=[WEATHER],
                                    instructions="Use tools.")
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    record = generation(first)
    assert tokenizer.decode(record["token_ids"][:-1]) == CALL_TEXT

    script(scripted, "It is sunny.")
    answer = client.responses.create(
        model="scripted", previous_response_id=first.id, tools=[WEATHER], instructions="Use tools.",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])
    assert answer.output_text == "It is sunny." and answer.previous_response_id == first.id
    prompt = generation(answer)["prompt_token_ids"]
    sequence = record["prompt_token_ids"] + record["token_ids"]
    assert prompt[:len(sequence)] == sequence
    assert "sunny, 21C" in tokenizer.decode(prompt[len(sequence):])

    script(scripted, "It is sunny.")  # the same conversation sent whole: the same prompt
    whole = client.responses.create(
        model="scripted", tools=[WEATHER], instructions="Use tools.",
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])
    assert generation(whole)["prompt_token_ids"] == prompt


def test_streamed_function_call(client: openai.OpenAI, scripted: ScriptedEngine) -> None:
    script(scripted, CALL_TEXT)
    events = list(client.responses.create(model="scripted", input="weather?", tools=[WEATHER], stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.id for item in done] == [item.id for item in final.output]
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    assert len(generation(final)["token_ids"]) == len(generation(final)["compact_logprobs"])


@pytest.mark.parametrize("stream", [False, True])
def test_the_record_names_the_policy_version_that_sampled_it(client: openai.OpenAI, scripted: ScriptedEngine,
                                                             stream: bool) -> None:
    script(scripted, "It is sunny.")
    with live_step(scripted, 3):
        if stream:
            events = list(client.responses.create(model="scripted", input="weather?", stream=True))
            response = events[-1].response  # response.completed's
        else:
            response = client.responses.create(model="scripted", input="weather?")
    assert generation(response)["policy_version"] == 3


def test_store_false_and_unknown_previous_response(client: openai.OpenAI, server: ServerHandle) -> None:
    kept = client.responses.create(model="m", input="hi", max_output_tokens=2, store=False)
    for missing in (kept.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.create(model="m", input="again", max_output_tokens=2, previous_response_id=missing)
        assert caught.value.body["param"] == "previous_response_id"
        assert caught.value.body["code"] == "previous_response_not_found"


def test_store_is_bounded(client: openai.OpenAI) -> None:
    """The store keeps 20,000 bytes of JSON (the fixture's bound): the oldest of many long ones is gone."""
    first = client.responses.create(model="m", input="x " * 2000, max_output_tokens=1)
    for _ in range(6):
        client.responses.create(model="m", input="y " * 2000, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="z", max_output_tokens=1, previous_response_id=first.id)


def post(server: ServerHandle, body: Any, key: str = KEY) -> httpx.Response:
    return httpx.post(server.base_url + "/responses", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=60)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3.0}, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}}}}, "text.format"),
])
def test_bad_input_is_a_clear_400(server: ServerHandle, body: dict[str, Any], param: str) -> None:
    response = post(server, {"model": "m", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param.split("[")[0] in error["message"] and "response_format" not in error["message"]


def test_a_count_refusal_names_input_and_the_servers_own_setting(server: ServerHandle) -> None:
    """The core's words for chat's `messages` become `input` where they name the field, not where they name
    create_app's keyword."""
    error = post(server, {"model": "m", "input": [{"role": "user", "content": "hi"}] * 3000}).json()["error"]
    assert error["param"] == "input" and error["message"].startswith("input holds 3000"), error
    assert "create_app(max_messages=" in error["message"], error


@pytest.fixture(scope="module")
def counting(engine: TransformersEngine) -> Iterator[ServerHandle]:
    with counting_server(engine.tokenizer) as handle:
        yield handle


def test_a_large_input_over_the_item_limit_is_refused_by_count(counting: ServerHandle) -> None:
    """One item too many in 330 kB: counted and refused before they are built, naming `input`."""
    items = COUNTED_MESSAGES + 1
    body = {"model": "scripted", "max_output_tokens": 1, "input": [{"role": "user", "content": "x" * 30_000}] * items}
    assert len(json.dumps(body)) > INLINE_PARSE_BYTES
    response, refused = refused_by_count(counting, lambda: httpx.post(f"{counting.base_url}/responses", json=body,
                                                                      timeout=60))
    assert response.status_code == 400, response.text[:300]
    assert refused == 1, "refused once built, not by its count"
    error = response.json()["error"]
    assert error["param"] == "input" and error["message"].startswith(f"input holds {items} items"), error


def test_wrong_key_unknown_model_and_big_body(server: ServerHandle) -> None:
    assert post(server, {"model": "m", "input": "hi"}, key="wrong").status_code == 401
    assert post(server, {"model": "nope", "input": "hi"}).status_code == 404
    assert post(server, {"model": "m", "input": "x" * 300_000}).status_code == 413
    missing = post(server, {"model": "m"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"
