"""`POST /v1/messages` (Anthropic Messages) through the real `anthropic` client: replies, streams, a tool round
trip, the token record, and the errors chat gives, in Anthropic's shape.

The tiny model ("m", built-in engine, live streaming) answers text; a scripted engine ("scripted") answers what a
test sets, for tool calls the untrained tiny model never writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from artrl.serve import ServedModels, ServerHandle, TransformersEngine, create_app, start_server
from artrl.serve.errors import EngineClosedError
from artrl.serve.engines.base import GenerationRequest, GenerationResult
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.serve.http.request import INLINE_PARSE_BYTES
from engine_helpers import one_thread_engine, recompute
from protocol_helpers import COUNTED_MESSAGES, counting_server, live_step, refused_by_count

KEY = "sk-protocols"
TOLERANCE = 1e-4
WEATHER = {"name": "get_weather", "description": "Get the weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    with one_thread_engine(max_batch_size=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def scripted(engine: TransformersEngine) -> ScriptedEngine:
    return ScriptedEngine.from_text(engine.tokenizer, CALL_TEXT, max_model_len=8192)


class ClosedEngine(ScriptedEngine):
    """An engine whose program is exiting: every request fails as a closed engine's do."""

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        raise EngineClosedError("the engine was closed")


@pytest.fixture(scope="module")
def server(engine: TransformersEngine, scripted: ScriptedEngine) -> Iterator[ServerHandle]:
    models = ServedModels("m", engine)
    models.add("scripted", scripted)
    models.add("closed", ClosedEngine(engine.tokenizer))
    with start_server(create_app(models, api_key=KEY, max_body_bytes=200_000)) as handle:
        yield handle


@pytest.fixture(scope="module")
def root(server: ServerHandle) -> str:
    return server.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(root: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=root, api_key=KEY, max_retries=0, timeout=120)


def script(engine: ScriptedEngine, text: str) -> None:
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids + [engine.tokenizer.eos_token_id]
    engine.next = (ids, [-0.5] * len(ids))


def record(message: Any) -> tuple[list[int], list[int], list[float]]:
    extra = message.model_extra
    return extra["prompt_token_ids"], extra["token_ids"], extra["logprobs"]


def test_reply_carries_a_token_record_that_is_the_text_and_the_models_logprobs(
        client: anthropic.Anthropic, engine: TransformersEngine) -> None:
    tokenizer = engine.tokenizer
    message = client.messages.create(model="m", max_tokens=12, system="Be brief.", extra_body={"temperature": 0.0},
                                     messages=[{"role": "user", "content": "Say hi"}])
    prompt, sampled, logprobs = record(message)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    assert prompt == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    assert message.type == "message" and message.role == "assistant" and message.model == "m"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens == len(prompt) and message.usage.output_tokens == len(sampled)
    body = sampled[:-1] if sampled[-1] in engine.end_of_turn_ids else sampled
    (block,) = message.content
    assert block.type == "text" and block.text == tokenizer.decode(body)
    assert len(logprobs) == len(sampled) > 0
    expected = recompute(engine.model, prompt, sampled)
    assert max(abs(a - b) for a, b in zip(logprobs, expected)) < TOLERANCE


def test_stream_events_add_up_to_the_reply_and_carry_the_record(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 16, "extra_body": {"temperature": 0.0},
                              "messages": [{"role": "user", "content": "Tell me a story"}]}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_delta" in kinds and "message_delta" in kinds
    start = events[0].message.model_extra
    delta = next(e for e in events if e.type == "message_delta").model_extra
    assert start["prompt_token_ids"] == record(whole)[0]
    assert (delta["prompt_token_ids"], delta["token_ids"], delta["logprobs"]) == record(whole)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequence_is_named(client: anthropic.Anthropic, scripted: ScriptedEngine) -> None:
    script(scripted, "one two three four")
    message = client.messages.create(model="scripted", max_tokens=30, stop_sequences=["three"],
                                     messages=[{"role": "user", "content": "count"}])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "three"
    assert message.content[0].text == "one two "
    _, sampled, logprobs = record(message)
    assert scripted.tokenizer.decode(sampled).endswith("three") and len(logprobs) == len(sampled)


@pytest.mark.parametrize("stream", [False, True])
def test_the_record_names_the_policy_version_that_sampled_it(client: anthropic.Anthropic, scripted: ScriptedEngine,
                                                             stream: bool) -> None:
    script(scripted, "It is sunny.")
    kwargs: dict[str, Any] = {"model": "scripted", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    with live_step(scripted, 3):
        if stream:
            with client.messages.stream(**kwargs) as events:
                extra = next(e for e in events if e.type == "message_delta").model_extra
        else:
            extra = client.messages.create(**kwargs).model_extra
    assert extra["policy_version"] == 3


def test_max_tokens_stop_reason(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="m", max_tokens=2, extra_body={"temperature": 0.0},
                                     messages=[{"role": "user", "content": "Hello"}])
    assert message.stop_reason == "max_tokens" and len(record(message)[1]) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip_extends_the_record(client: anthropic.Anthropic, scripted: ScriptedEngine,
                                            stream: bool) -> None:
    """tool_use -> tool_result -> answer: the second prompt is the first prompt and its sampled ids, extended."""
    tokenizer = scripted.tokenizer
    script(scripted, CALL_TEXT)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs: dict[str, Any] = {"model": "scripted", "max_tokens": 100, "tools": [WEATHER], "messages": ask}
    if stream:  # the SDK's assembled message keeps the top-level record of message_start / message_delta only
        with client.messages.stream(**kwargs) as events:
            delta = next(e for e in events if e.type == "message_delta").model_extra
            first = events.get_final_message()
        prompt, sampled, logprobs = delta["prompt_token_ids"], delta["token_ids"], delta["logprobs"]
    else:
        first = client.messages.create(**kwargs)
        prompt, sampled, logprobs = record(first)
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.type == "text" and text.text == "Let me check."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert len(logprobs) == len(sampled) and tokenizer.decode(sampled[:-1]) == CALL_TEXT
    assert "get_weather" in tokenizer.decode(prompt)  # the tool was offered in the prompt

    script(scripted, "It is sunny.")
    answer = client.messages.create(
        model="scripted", max_tokens=100, tools=[WEATHER],
        messages=[*ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "sunny, 21C"}]}])
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "It is sunny."
    next_prompt = record(answer)[0]
    assert next_prompt[:len(prompt) + len(sampled)] == prompt + sampled  # one sequence: the record extends
    assert "sunny, 21C" in tokenizer.decode(next_prompt[len(prompt) + len(sampled):])


@pytest.mark.parametrize("sent_back", ["", []])
def test_an_empty_reply_sent_back_empty_extends_the_record(client: anthropic.Anthropic, scripted: ScriptedEngine,
                                                           sent_back: Any) -> None:
    """A turn that ended at once (no content blocks) comes back as "" or []: the next prompt still holds its
    sampled end-of-turn id, so the two turns stay one sequence."""
    script(scripted, "")
    ask = [{"role": "user", "content": "Say nothing."}]
    first = client.messages.create(model="scripted", max_tokens=10, messages=ask)
    assert first.content == [] and first.stop_reason == "end_turn"
    prompt, sampled, _ = record(first)
    assert sampled == [scripted.tokenizer.eos_token_id]
    script(scripted, "Fine.")
    then = client.messages.create(model="scripted", max_tokens=10, messages=[
        *ask, {"role": "assistant", "content": sent_back}, {"role": "user", "content": "And now?"}])
    next_prompt = record(then)[0]
    assert next_prompt[:len(prompt) + len(sampled)] == prompt + sampled


def test_streamed_tool_use_equals_the_reply(client: anthropic.Anthropic, scripted: ScriptedEngine) -> None:
    script(scripted, CALL_TEXT)
    kwargs: dict[str, Any] = {"model": "scripted", "max_tokens": 100, "tools": [WEATHER],
                              "messages": [{"role": "user", "content": "weather?"}]}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    strip = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in final.content]
    assert strip == [{k: v for k, v in b.model_dump().items() if k != "id"} for b in whole.content]
    delta = next(e for e in events if e.type == "message_delta").model_extra
    assert delta["token_ids"] == record(whole)[1] and len(delta["logprobs"]) == len(delta["token_ids"])


def test_output_config_schema_is_enforced(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    message = client.messages.create(model="m", max_tokens=40, extra_body={"temperature": 0.0},
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     messages=[{"role": "user", "content": "ok?"}])
    assert message.stop_reason == "end_turn"  # the schema holds no string: the reply is short and ends
    assert isinstance(json.loads(message.content[0].text)["ok"], bool)


def test_tool_choice_any_is_enforced(client: anthropic.Anthropic) -> None:
    """`any` is chat's "required": the grammar makes the tiny model call the tool (a schema without free text, so
    the call is short and ends)."""
    units = {"name": "set_units", "description": "Pick the units.",
             "input_schema": {"type": "object", "properties": {"celsius": {"type": "boolean"}},
                              "required": ["celsius"], "additionalProperties": False}}
    message = client.messages.create(model="m", max_tokens=80, tools=[units],
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                     extra_body={"temperature": 0.0},
                                     messages=[{"role": "user", "content": "weather?"}])
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    (use,) = uses  # disable_parallel_tool_use: one call
    assert use.name == "set_units" and isinstance(use.input["celsius"], bool)


# ---- errors: the same refusals as chat, in Anthropic's shape ---------------------------------


def post(root: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(root + "/v1/messages", json=body, headers={"x-api-key": KEY, **(headers or {})}, timeout=60)


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_missing_max_tokens_is_a_400_naming_it(root: str) -> None:
    message = anthropic_error(post(root, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                              400, "invalid_request_error")
    assert "max_tokens" in message


@pytest.mark.parametrize("body, named", [
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": 5}, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3.0}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305",
                                                                   "name": "web_search"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool", "name": "nope"},
      "tools": [WEATHER]}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "output_config": {"format": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}}}},
     "output_config.format"),
])
def test_bad_input_is_a_clear_400(root: str, body: dict[str, Any], named: str) -> None:
    message = anthropic_error(post(root, {"model": "m", "max_tokens": 8, **body}), 400, "invalid_request_error")
    assert named in message and "response_format" not in message


@pytest.fixture(scope="module")
def counting(engine: TransformersEngine) -> Iterator[ServerHandle]:
    with counting_server(engine.tokenizer) as handle:
        yield handle


def test_large_messages_over_the_limit_are_refused_by_count(counting: ServerHandle) -> None:
    """One message too many in 300 kB: counted and refused before they are built, in Anthropic's shape."""
    turns = [{"role": "user", "content": "x" * 60_000}, {"role": "assistant", "content": "ok"}] * 5
    body = {"model": "scripted", "max_tokens": 1, "messages": [*turns, {"role": "user", "content": "x"}]}
    assert len(body["messages"]) == COUNTED_MESSAGES + 1 and len(json.dumps(body)) > INLINE_PARSE_BYTES
    response, refused = refused_by_count(counting, lambda: post(counting.base_url.removesuffix("/v1"), body))
    message = anthropic_error(response, 400, "invalid_request_error")
    assert message.startswith(f"messages holds {COUNTED_MESSAGES + 1} messages"), message
    assert refused == 1, "refused once built, not by its count"


def test_unknown_model_wrong_key_and_big_body(root: str) -> None:
    anthropic_error(post(root, {"model": "nope", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
                    404, "not_found_error")
    wrong = post(root, {"model": "m", "max_tokens": 8, "messages": []}, headers={"x-api-key": "wrong"})
    anthropic_error(wrong, 401, "authentication_error")
    bearer = httpx.post(root + "/v1/messages", json={"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}]}, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200, bearer.text
    big = post(root, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 300_000}]})
    anthropic_error(big, 413, "request_too_large")
    assert post(root, {"model": "m", "max_tokens": 8, "messages": "hi"}).json()["type"] == "error"


def test_a_base_url_with_v1_is_a_404_that_says_to_drop_it(root: str) -> None:
    """The anthropic SDK appends /v1/messages to its base URL: given the OpenAI-style base URL (ending in /v1) it
    posts to /v1/v1/messages, and the 404 says what to send instead, in Anthropic's shape."""
    sdk = anthropic.Anthropic(base_url=root + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError, match="without /v1") as raised:
        sdk.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["type"] == "error" and "/v1/messages" in raised.value.body["error"]["message"]
    other = httpx.post(root + "/v1/nothing", json={}, headers={"x-api-key": KEY}, timeout=60)
    assert other.status_code == 404 and "/v1/chat/completions" in other.json()["error"]["message"]


def test_sdk_raises_its_own_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="m", max_tokens=10**6, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=str(client.base_url), api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


def test_chat_route_keeps_openai_errors(root: str) -> None:
    response = httpx.post(root + "/v1/chat/completions", json={"model": "nope", "messages": []},
                          headers={"x-api-key": KEY}, timeout=60)
    assert response.status_code in (400, 404) and "error" in response.json() and "type" not in response.json()
    assert json.loads(response.text)["error"]["param"] is not None


@pytest.mark.parametrize("stream", [False, True])
def test_a_closed_engine_is_an_anthropic_overloaded_error(root: str, stream: bool) -> None:
    response = post(root, {"model": "closed", "max_tokens": 4, "stream": stream,
                           "messages": [{"role": "user", "content": "hi"}]})
    assert "closed" in anthropic_error(response, 503, "overloaded_error")
