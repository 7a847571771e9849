"""Structured outputs with the vLLM engine, through the real server, on the untrained tiny model.

The forms of tests/test_structured_outputs.py (json_schema strict with an enum and an integer,
json_object, tool_choice "required" and a named function, a schema that cannot be compiled)
with `inference_engine="vllm"`: vLLM's sampler runs artrl's grammar (serve/engines/vllm_grammar.py), so
the replies are in the built-in engine's language (`json.dumps` spacing, the template's tool
calls). The token record stays raw: constrained replies train with
`train/sampled_logprob_delta_max` < 1e-3, and their logprobs are a plain forward's, where
vLLM's own structured outputs would have reported the masked ones. One backend (one vLLM
start) serves the whole module; seeds make the counts repeatable.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

import artrl as art
from artrl.chat.format import message_of
from artrl.serve.engines.base import BASE_WEIGHTS, GenerationRequest
from artrl.serve.structured import structured_output

from test_structured_outputs import ASK, CLOCK, COLOUR, COLOUR_FORMAT, FORECAST, parsed, valid

pytestmark = pytest.mark.vllm


class Served:
    def __init__(self, model: art.TrainableModel, backend: art.LocalBackend) -> None:
        self.model, self.backend = model, backend
        self.name = model.get_inference_name()
        self.client = openai.OpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key,
                                    max_retries=0, timeout=600)
        self.engine = backend._runs[model.name].engine

    def create(self, **kwargs: Any) -> Any:
        return self.client.chat.completions.create(model=self.name, messages=kwargs.pop("messages", ASK), **kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_path: pathlib.Path) -> Iterator[Served]:
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("vllm-structured")), show_progress=False)
    model = art.TrainableModel(name="held", project="structured", base_model=str(tiny_path),
                               _internal_config={"inference_engine": "vllm"})
    asyncio.run(model.register(backend))
    try:
        yield Served(model, backend)
    finally:
        backend.close()


def test_json_schema_replies_are_valid(served: Served) -> None:
    assert type(served.engine).__name__ == "VLLMEngine" and served.engine.structured_outputs
    free = served.create(n=10, seed=1, max_tokens=40)
    assert sum(parsed(c.message.content) is not None for c in free.choices) == 0  # gibberish unconstrained

    held = served.create(n=20, seed=1, max_tokens=40, response_format=COLOUR_FORMAT)
    assert [c.finish_reason for c in held.choices] == ["stop"] * 20
    assert sum(valid(parsed(c.message.content), COLOUR) for c in held.choices) == 20
    # the built-in engine's language: json.dumps spacing (vLLM's default xgrammar JSON allows any whitespace)
    assert all(c.message.content == json.dumps(parsed(c.message.content)) for c in held.choices)
    assert len({c.message.content for c in held.choices}) > 1  # sampled, not one forced answer


def test_json_object_replies_parse_as_objects(served: Served) -> None:
    reply = served.create(n=4, seed=9, max_tokens=1024, response_format={"type": "json_object"})
    assert [c.finish_reason for c in reply.choices] == ["stop"] * 4
    assert sum(isinstance(parsed(c.message.content), dict) for c in reply.choices) == 4


def test_tool_choice_required_calls_the_tool(served: Served) -> None:
    free = served.create(tools=[FORECAST], n=6, seed=2, max_tokens=60)
    assert sum(bool(c.message.tool_calls) for c in free.choices) == 0

    reply = served.create(tools=[FORECAST], tool_choice="required", n=10, seed=3, max_tokens=200)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name == "get_forecast"
            assert valid(json.loads(call.function.arguments), FORECAST["function"]["parameters"])

    single = served.create(tools=[FORECAST, CLOCK], tool_choice="required", parallel_tool_calls=False, n=6, seed=4,
                           max_tokens=200)
    assert all(c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 for c in single.choices)


def test_a_named_function_is_the_one_called(served: Served) -> None:
    for name, seed in (("get_time", 4), ("get_forecast", 5)):
        reply = served.create(tools=[FORECAST, CLOCK], n=3, seed=seed, max_tokens=200,
                              tool_choice={"type": "function", "function": {"name": name}})
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls"
            assert [call.function.name for call in choice.message.tool_calls] == [name]
        if name == "get_time":  # no parameters: empty arguments
            assert {c.message.tool_calls[0].function.arguments for c in reply.choices} == {"{}"}


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "cannot be compiled into a grammar"),
    # a tool's schema is checked before tool_choice is read: the faulty part is named, whatever tool_choice says
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters", r"tools\[0\] \('f'\) parameters are not a JSON schema"),
])
def test_what_cannot_be_compiled_is_a_400(served: Served, kwargs: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        served.create(max_tokens=4, **kwargs)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert served.create(max_tokens=2).choices[0].finish_reason == "length"  # vLLM serves on


def test_a_grammar_vllms_worker_cannot_compile_ends_the_row_not_vllm(served: Served, tok: Any) -> None:
    """The engine compiles every grammar before vLLM sees it; should the worker still fail to, the row may only end
    (serve/engines/vllm_grammar.py, point 3) and vLLM serves on."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from artrl.serve.engines.vllm_grammar import GRAMMAR_ARG

    engine = served.engine
    ends = sorted(engine.end_of_turn_ids)
    prompt = list(tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)["input_ids"])

    async def broken() -> Any:
        final = None
        params = SamplingParams(max_tokens=8, seed=1, stop_token_ids=ends, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY,
                                extra_args={GRAMMAR_ARG: {"grammar": "start: json\njson: %json {\"type\": \"bogus\"}",
                                                          "end_ids": ends}})
        async for output in engine._llm.generate(TokensPrompt(prompt_token_ids=prompt), params, uuid.uuid4().hex):
            final = output
        assert final is not None
        return final.outputs[0]

    ended = engine._call(broken())
    assert ended.finish_reason == "stop" and len(ended.token_ids) == 1 and ended.token_ids[0] in ends
    assert served.create(max_tokens=2).choices[0].finish_reason == "length"


def test_rows_without_a_grammar_are_untouched(served: Served, tok: Any) -> None:
    """A seeded plain request samples the same tokens and logprobs alone as among constrained rows of one batch."""
    engine = served.engine
    prompt = list(tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)["input_ids"])
    plain = GenerationRequest(prompt, n=3, max_tokens=24, seed=11, temperature=0.9)
    held = GenerationRequest(prompt[:-3], n=3, max_tokens=24, seed=12,
                             structured=structured_output(COLOUR_FORMAT, None, None, None, None))

    async def together() -> tuple[Any, Any]:
        return tuple(await asyncio.gather(engine.generate(held), engine.generate(plain)))

    alone = asyncio.run(engine.generate(plain))
    constrained, among = asyncio.run(together())
    assert [r.token_ids for r in among] == [r.token_ids for r in alone]
    assert torch.allclose(torch.tensor([lp for r in among for lp in r.logprobs]),
                          torch.tensor([lp for r in alone for lp in r.logprobs]), atol=1e-5)
    assert all(valid(parsed(tok.decode(r.token_ids[:-1])), COLOUR) for r in constrained)
    assert not any(parsed(tok.decode(r.token_ids[:-1])) for r in alone)


def test_constrained_logprobs_are_the_raw_ones(served: Served, tiny_path: pathlib.Path, tok: Any) -> None:
    """A plain forward's log-softmax at every step, top logprobs included (they may name tokens the grammar
    forbade); vLLM's own structured outputs report the masked distribution's (why serve/engines/vllm_grammar.py)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    engine = served.engine
    prompt = list(tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)["input_ids"])
    structured = structured_output(COLOUR_FORMAT, None, None, None, None)
    # greedy: where the grammar forbids the model's favourite, the sampled token is not the top one
    results = asyncio.run(engine.generate(GenerationRequest(prompt, n=1, max_tokens=40, temperature=0.0,
                                                            top_logprobs=3, adapter=BASE_WEIGHTS,
                                                            structured=structured)))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32).eval()

    def raw(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = base(input_ids=torch.tensor([prompt + ids])).logits[0].float()  # [seq, vocab]
        return logits[len(prompt) - 1 : -1].log_softmax(-1)  # [len(ids), vocab]

    (result,) = results
    assert valid(parsed(tok.decode(result.token_ids[:-1])), COLOUR)
    expected = raw(result.token_ids)
    sampled = expected[torch.arange(len(result.token_ids)), torch.tensor(result.token_ids)]
    assert torch.allclose(torch.tensor(result.logprobs), sampled, atol=1e-4)
    assert result.top_logprobs is not None
    for step, top in zip(expected, result.top_logprobs):
        assert [t for t, _ in top] == step.topk(3).indices.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in top]), step.topk(3).values, atol=1e-4)
    overruled = sum(top[0][0] != t for t, top in zip(result.token_ids, result.top_logprobs))
    assert overruled > 0  # top logprobs name tokens the grammar forbade

    async def vllms_own() -> Any:
        final = None
        params = SamplingParams(max_tokens=40, seed=9, logprobs=0, stop_token_ids=sorted(engine.end_of_turn_ids),
                                output_kind=RequestOutputKind.FINAL_ONLY,
                                structured_outputs=StructuredOutputsParams(
                                    grammar=engine._grammars.compile(structured).lark))
        async for output in engine._llm.generate(TokensPrompt(prompt_token_ids=prompt), params, uuid.uuid4().hex):
            final = output
        assert final is not None
        return final.outputs[0]

    own = engine._call(vllms_own())
    ids = list(own.token_ids)
    assert valid(parsed(tok.decode(ids[:-1])), COLOUR)
    masked = torch.tensor([step[t].logprob for t, step in zip(ids, own.logprobs)])
    gap = masked - raw(ids)[torch.arange(len(ids)), torch.tensor(ids)]
    assert gap.min() > -1e-4 and gap.max() > 1.0, gap  # log of the allowed mass, added back: not the raw logprob


def test_constrained_replies_train_on_their_record(served: Served, tok: Any) -> None:
    """A forced tool call, its result and a schema-held answer per trajectory: the trainer's logprobs of the
    sampled tokens equal vLLM's (docs/token-record.md)."""
    model, client = served.model, served.model.openai_client()

    async def rollout(k: int) -> art.Trajectory:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Forecast {k}, then the colour."}]
        trajectory = art.Trajectory(messages_and_choices=list(messages), tools=[FORECAST], reward=float(k % 3))
        call = await client.chat.completions.create(model=served.name, messages=messages, tools=[FORECAST],
                                                    tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                                    seed=k)
        choice = call.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        result = {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny"}
        trajectory.messages_and_choices += [choice, result]
        messages += [json.loads(json.dumps(message_of(choice))), result]
        answer = await client.chat.completions.create(model=served.name, messages=messages, tools=[FORECAST],
                                                      response_format=COLOUR_FORMAT, max_tokens=100, seed=100 + k)
        assert valid(parsed(answer.choices[0].message.content), COLOUR)
        trajectory.messages_and_choices.append(answer.choices[0])
        return trajectory

    async def main() -> dict[str, float]:
        groups = [art.TrajectoryGroup(await asyncio.gather(*(rollout(3 * g + k) for k in range(3)))) for g in range(2)]
        sampled = [m for g in groups for t in g for m in t.messages_and_choices if not isinstance(m, dict)]
        metrics = (await model.train(groups, config=art.TrainConfig(learning_rate=1e-12,
                                                                    grad_accumulation_sequences=None))).metrics
        assert metrics["data/record_turns"] == len(sampled) == 12 and metrics["data/rendered_turns"] == 0
        assert metrics["train/sampled_logprob_tokens"] == sum(len(c.model_extra["token_ids"]) for c in sampled)
        return metrics

    metrics = asyncio.run(main())
    assert metrics["train/sampled_logprob_delta_max"] < 1e-3, metrics


def test_a_streamed_reply_is_the_non_streamed_one(served: Served) -> None:
    """`stream=true` on the vLLM engine: the chunks add up to the seeded non-streamed reply and carry its record."""
    kwargs = {"n": 2, "seed": 3, "max_tokens": 16, "logprobs": True}
    whole = served.create(**kwargs)
    chunks = list(served.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(m.delta.content or "" for m in mine) == choice.message.content
        assert mine[-1].finish_reason == choice.finish_reason
        assert mine[-1].model_extra["token_ids"] == choice.model_extra["token_ids"]
        assert mine[-1].model_extra["prompt_token_ids"] == choice.model_extra["prompt_token_ids"]
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
