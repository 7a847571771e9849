"""Structured outputs through the local server, on the untrained tiny model, with the `openai` client.

The tiny model writes gibberish (0 of 20 JSON replies parse without a grammar, checked below), so
every valid reply here is the grammar's doing. Each request gives `max_tokens` enough for the
replies it counts (a cut reply is `finish_reason: "length"` and is counted as a failure, never
skipped), and seeds make the counts repeatable.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

import artrl as art
from artrl.chat.format import message_of
from artrl.serve import GenerationRequest, ServedModels, ServerHandle, TransformersEngine, create_app, start_server
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.serve.structured import structured_output
from artrl.models.tiny import load_tiny

COLOUR = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}
COLOUR_FORMAT = {"type": "json_schema", "json_schema": {"name": "colour_count", "schema": COLOUR, "strict": True}}
FORECAST = {"type": "function", "function": {"name": "get_forecast", "description": "The weather forecast.",
                                             "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
ASK = [{"role": "user", "content": "What colour is the sky, and how many clouds are there? Answer in JSON."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return load_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(tiny: tuple[Any, Any]) -> Iterator[TransformersEngine]:
    model, tokenizer = tiny
    engine = TransformersEngine(model, tokenizer, max_batch_size=32)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine: TransformersEngine, tiny: tuple[Any, Any]) -> Iterator[ServerHandle]:
    models = ServedModels("m", engine)
    models.add("scripted", ScriptedEngine.from_text(tiny[1], "{}", max_model_len=8192))
    handle = start_server(create_app(models))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600)


def parsed(content: str | None) -> Any:
    try:
        return json.loads(content or "")
    except json.JSONDecodeError:
        return None


def valid(instance: Any, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_json_schema_replies_are_valid(client: openai.OpenAI) -> None:
    free = client.chat.completions.create(model="m", messages=ASK, n=20, seed=1, max_tokens=40)
    assert sum(parsed(c.message.content) is not None for c in free.choices) == 0  # gibberish unconstrained

    held = client.chat.completions.create(model="m", messages=ASK, n=20, seed=1, max_tokens=40,
                                          response_format=COLOUR_FORMAT)
    assert [c.finish_reason for c in held.choices] == ["stop"] * 20
    assert sum(valid(parsed(c.message.content), COLOUR) for c in held.choices) == 20
    # written as json.dumps writes it, the form tool-call arguments are rendered in
    assert all(c.message.content == json.dumps(parsed(c.message.content)) for c in held.choices)
    assert len({c.message.content for c in held.choices}) > 1  # sampled, not one forced answer


def test_json_schema_cut_by_max_tokens_is_length(client: openai.OpenAI) -> None:
    cut = client.chat.completions.create(model="m", messages=ASK, max_tokens=3, seed=1, response_format=COLOUR_FORMAT)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and parsed(choice.message.content) is None
    assert len(choice.model_extra["token_ids"]) == 3


@pytest.mark.slow
def test_json_object_replies_parse_as_objects(client: openai.OpenAI) -> None:
    # Any object: the untrained model writes long keys and strings before it samples a closing quote (these ten
    # take 3 to about 2000 tokens), so this one takes minutes on a CPU.
    reply = client.with_options(timeout=3600).chat.completions.create(
        model="m", messages=ASK, n=10, seed=0, max_tokens=4096, response_format={"type": "json_object"})
    assert [c.finish_reason for c in reply.choices] == ["stop"] * 10
    assert sum(isinstance(parsed(c.message.content), dict) for c in reply.choices) == 10


def test_tool_choice_required_calls_the_tool(client: openai.OpenAI) -> None:
    free = client.chat.completions.create(model="m", messages=ASK, tools=[FORECAST], n=10, seed=2, max_tokens=60)
    assert sum(bool(c.message.tool_calls) for c in free.choices) == 0

    reply = client.chat.completions.create(model="m", messages=ASK, tools=[FORECAST], tool_choice="required", n=10,
                                           seed=2, max_tokens=200)
    calls = 0
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.function.name == "get_forecast"
            calls += valid(json.loads(call.function.arguments), FORECAST["function"]["parameters"])
    assert sum(bool(c.message.tool_calls) for c in reply.choices) == 10
    assert calls == sum(len(c.message.tool_calls) for c in reply.choices)

    single = client.chat.completions.create(model="m", messages=ASK, tools=[FORECAST, CLOCK], tool_choice="required",
                                            parallel_tool_calls=False, n=10, seed=3, max_tokens=200)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for name, seed in (("get_time", 4), ("get_forecast", 5)):
        reply = client.chat.completions.create(
            model="m", messages=ASK, tools=[FORECAST, CLOCK], n=6, seed=seed, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": name}})
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls"
            assert [call.function.name for call in choice.message.tool_calls] == [name]
        if name == "get_time":  # no parameters: empty arguments
            assert {c.message.tool_calls[0].function.arguments for c in reply.choices} == {"{}"}


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),  # the faulty part, whatever tool_choice says
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_what_cannot_be_compiled_is_a_400(client: openai.OpenAI, engine: TransformersEngine,
                                          kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, **kwargs)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    # the decode worker is alive and serves the next request
    assert client.chat.completions.create(model="m", messages=ASK, max_tokens=2).choices[0].finish_reason == "length"


def test_an_engine_without_grammars_refuses_instead_of_ignoring(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="cannot hold a reply") as caught:
        client.chat.completions.create(model="scripted", messages=ASK, response_format={"type": "json_object"})
    assert caught.value.body["param"] == "response_format"
    assert client.chat.completions.create(model="scripted", messages=ASK, response_format={"type": "text"}).choices


def test_rows_without_a_grammar_are_untouched(engine: TransformersEngine, tiny: tuple[Any, Any]) -> None:
    """A seeded plain request samples the same tokens and logprobs whether its batch mates are held to a grammar."""
    tokenizer = tiny[1]
    prompt = list(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)["input_ids"])
    plain = GenerationRequest(prompt_ids=prompt, n=2, max_tokens=24, seed=11, temperature=0.9)
    structured = structured_output(COLOUR_FORMAT, None, None, None, None)

    async def batch(held: bool) -> tuple[list[Any], list[Any]]:
        other = GenerationRequest(prompt_ids=prompt[:-3], n=3, max_tokens=24, seed=12,
                                  structured=structured if held else None)
        with engine.model_lock:  # both are queued before the worker may start a batch: they share one
            tasks = [asyncio.ensure_future(engine.generate(plain)), asyncio.ensure_future(engine.generate(other))]
            await asyncio.sleep(0)  # let both calls reach the queue (a cached grammar compiles nothing)
            assert engine.pending_requests == 2
        return tuple(await asyncio.gather(*tasks))

    engine._grammars.compile(structured)  # cache it, as a first request with this schema would
    before = engine.batches_served
    free_plain, free_other = asyncio.run(batch(held=False))
    held_plain, held_other = asyncio.run(batch(held=True))
    assert engine.batches_served == before + 2
    assert [r.token_ids for r in held_plain] == [r.token_ids for r in free_plain]
    # equal up to float rounding: rows leave the batch when they finish, and a grammar changes when the other
    # rows finish, so the plain rows' later steps run in batches of other sizes
    for held_row, free_row in zip(held_plain, free_plain):
        assert max(abs(a - b) for a, b in zip(held_row.logprobs, free_row.logprobs)) < 1e-5
    text = [tokenizer.decode(r.token_ids[:-1]) for r in held_other]
    assert all(valid(parsed(t), COLOUR) for t in text) and not any(parsed(tokenizer.decode(r.token_ids))
                                                                    for r in free_other)


def test_constrained_replies_train_on_their_record(tmp_path: pathlib.Path, tok: Any) -> None:
    """The trainer's logprobs of grammar-held replies (a tool call, its result, a JSON answer) equal the sampled
    ones: the record carries the raw model logprobs, as unconstrained replies do (docs/token-record.md)."""

    async def rollout(model: art.TrainableModel, client: Any, k: int) -> art.Trajectory:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Forecast {k}, then the colour."}]
        trajectory = art.Trajectory(messages_and_choices=list(messages), tools=[FORECAST], reward=float(k % 3))
        call = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                    tools=[FORECAST], tool_choice="required", parallel_tool_calls=False,
                                                    max_tokens=100, seed=k)
        choice = call.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        result = {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny"}
        trajectory.messages_and_choices += [choice, result]
        messages += [json.loads(json.dumps(message_of(choice))), result]
        answer = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                      tools=[FORECAST], response_format=COLOUR_FORMAT,
                                                      max_tokens=100, seed=100 + k)
        assert valid(parsed(answer.choices[0].message.content), COLOUR)
        trajectory.messages_and_choices.append(answer.choices[0])
        return trajectory

    async def main() -> None:
        model = art.TrainableModel(name="held", project="structured", base_model="artrl/tiny")
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            await model.register(backend)
            client = model.openai_client()
            groups = [art.TrajectoryGroup([await rollout(model, client, 3 * g + k) for k in range(3)])
                      for g in range(2)]
            sampled = [m for g in groups for t in g for m in t.messages_and_choices if not isinstance(m, dict)]
            metrics = (await model.train(groups, config=art.TrainConfig(learning_rate=1e-12,
                                                                        grad_accumulation_sequences=None))).metrics
            assert metrics["data/record_turns"] == len(sampled) == 12 and metrics["data/rendered_turns"] == 0
            assert metrics["train/sampled_logprob_tokens"] == sum(len(c.model_extra["token_ids"]) for c in sampled)
            assert metrics["train/sampled_logprob_delta_max"] < 1e-3, metrics
            # the sampled call re-renders as the very ids sampled, so the answer's prompt extends its record; only a
            # call that ended with <|endoftext|> (an end id; the template closes turns with <|im_end|>) starts anew
            other_end = tok.convert_tokens_to_ids("<|endoftext|>")
            calls = [m for g in groups for t in g for m in t.messages_and_choices[1:2]]
            assert metrics["data/record_splits"] == sum(c.model_extra["token_ids"][-1] == other_end for c in calls)
            del backend

    asyncio.run(main())


# ---- recursive schemas: served when they can end, refused when they cannot; never an invalid "stop" ------

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from artrl.serve.schema_ends import unending_part  # noqa: E402

LEAVES = st.sampled_from([{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": 0, "maximum": 9},
                          {"type": "boolean"}, {"enum": ["a", "b"]}, {"$ref": "#/$defs/leaf"},
                          {"$ref": "#/$defs/node"}, {"$ref": "#"}])


def _schemas(leaf: st.SearchStrategy) -> st.SearchStrategy:
    """Objects and arrays of `leaf`s, a few levels deep; some of the leaves are references (maybe recursive)."""
    def grow(inner: st.SearchStrategy) -> st.SearchStrategy:
        objects = st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, min_size=1, max_size=3).flatmap(
            lambda props: st.builds(lambda required: {"type": "object", "properties": props,
                                                      "required": required, "additionalProperties": False},
                                    st.lists(st.sampled_from(sorted(props)), unique=True)))
        arrays = st.builds(lambda items, least: {"type": "array", "items": items, "minItems": least, "maxItems": 2},
                           inner, st.integers(0, 1))
        return objects | arrays
    return st.recursive(leaf, grow, max_leaves=4)


SCHEMAS = st.builds(
    lambda root, node: {**root, "$defs": {"leaf": {"type": "string", "maxLength": 4}, "node": node}}
    if isinstance(root, dict) and root.get("type") == "object" else
    {"type": "object", "properties": {"x": root}, "required": ["x"], "additionalProperties": False,
     "$defs": {"leaf": {"type": "string", "maxLength": 4}, "node": node}},
    _schemas(LEAVES), _schemas(LEAVES))

TREE = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "child": {"$ref": "#"}},
        "required": ["v"], "additionalProperties": False}
"""The issue's tree with an optional child: recursive, and it ends at a node without a child."""

UNENDING = {
    "itself": {"$ref": "#"},
    "required_self_property": {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]},
    "required_self": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "non_empty_array_of_itself": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "optional_property_that_cannot_end": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/bad"}, "y": {"type": "integer"}}, "required": ["y"],
        "$defs": {"bad": {"type": "object", "properties": {"z": {"$ref": "#/$defs/bad"}}, "required": ["z"]}}},
    "two_definitions_in_a_cycle": {
        "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                  "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 2}}, "$ref": "#/$defs/a"},
}


@pytest.mark.parametrize("name", sorted(UNENDING))
def test_a_recursive_schema_that_cannot_end_is_refused(client: openai.OpenAI, name: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=20, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": UNENDING[name]}})
    assert info.value.body["param"] == "response_format" and "cannot end" in info.value.body["message"]


def test_a_recursive_tool_schema_that_cannot_end_is_refused(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": UNENDING["required_self"]}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=20, tools=[tool], tool_choice="required")
    assert info.value.body["param"] == "tools[0].function.parameters" and "cannot end" in info.value.body["message"]


def test_a_recursive_schema_that_can_end_gives_valid_json(client: openai.OpenAI) -> None:
    """The tree with an optional child: every reply stops, and every one is a tree valid for the schema; some go
    deeper than one node (the recursion is used, not only its end)."""
    reply = client.chat.completions.create(model="m", messages=ASK, n=8, seed=3, max_tokens=200, response_format={
        "type": "json_schema", "json_schema": {"name": "tree", "schema": TREE}})
    trees = [parsed(c.message.content) for c in reply.choices]
    assert [c.finish_reason for c in reply.choices] == ["stop"] * 8, [c.message.content for c in reply.choices]
    assert all(valid(tree, TREE) for tree in trees), trees
    assert any("child" in tree for tree in trees), trees


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_every_reply_that_stops_is_valid_for_its_schema(client: openai.OpenAI, schema: dict[str, Any],
                                                        seed: int) -> None:
    """Random schemas, some recursive through $defs or "#": refused with a 400 when a part cannot end, else
    served, and every stopped reply is valid."""
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    try:
        reply = client.chat.completions.create(model="m", messages=ASK, n=3, seed=seed, max_tokens=48,
                                               response_format=response_format)
    except openai.BadRequestError as error:
        assert unending_part(schema) is not None, error.body
        assert "cannot end" in error.body["message"]
        event("refused: a part cannot end")
        return
    assert unending_part(schema) is None
    event("served, refers to node or root" if '"#' in json.dumps(schema).replace('"#/$defs/leaf"', "") else "served, flat")
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert valid(parsed(choice.message.content), schema), (choice.message.content, schema)
