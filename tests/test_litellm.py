"""With litellm installed: RULER calls its judge through `litellm.acompletion` as ART does, costs included, and
`artrl.utils.litellm.convert_litellm_choice_to_openai` is ART's. Offline: litellm's own `mock_response`, or a
local HTTP judge (test_ruler.py's ScriptedJudge)."""

from __future__ import annotations

import asyncio
import importlib
import json

import pytest

litellm = pytest.importorskip("litellm")

from openai.types.chat.chat_completion import ChatCompletion  # noqa: E402

import artrl as art  # noqa: E402
from artrl.metrics import MetricsBuilder  # noqa: E402
from artrl.rewards import ruler, ruler_score_group  # noqa: E402
ruler_module = importlib.import_module("artrl.rewards.ruler")
from artrl.utils.litellm import convert_litellm_choice_to_openai  # noqa: E402

from test_ruler import ScriptedJudge, group, scores  # noqa: E402

MESSAGES = [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": a}] for a in ("4", "5")]


def test_the_request_is_arts_and_extra_litellm_params_go_to_litellm():
    with ScriptedJudge([scores(0.9, 0.1)]) as judge:
        got = asyncio.run(ruler(MESSAGES, "hosted_vllm/judge", {**judge.params(), "temperature": 0.3,
                                                                "num_retries": 1}))
    assert [s.score for s in got] == [0.9, 0.1]
    (request,) = judge.requests
    assert (request["model"], request["temperature"]) == ("judge", 0.3)  # litellm drops its provider prefix
    assert request["response_format"]["type"] == "json_schema"  # ART's `response_format=Response`
    assert set(request["response_format"]["json_schema"]["schema"]["properties"]) == {"scores"}


def test_a_name_litellm_cannot_place_goes_to_the_given_endpoint_as_an_openai_model():
    with ScriptedJudge([scores(0.2, 0.8)]) as judge:
        got = asyncio.run(ruler(MESSAGES, "Qwen/Qwen3-8B", judge.params()))  # no litellm provider, unknown model
    assert [s.score for s in got] == [0.2, 0.8] and judge.requests[0]["model"] == "Qwen/Qwen3-8B"


class Recorder:
    """litellm's acompletion, keeping each response it returns."""

    def __init__(self) -> None:
        self.responses: list = []

    async def __call__(self, **kwargs):
        response = await litellm.acompletion(**kwargs)
        self.responses.append(response)
        return response


def judged_cost(monkeypatch, judge_model: str, reply: str, builder: MetricsBuilder) -> tuple[dict, list]:
    calls = Recorder()
    monkeypatch.setattr(ruler_module, "acompletion", calls)
    with builder.activate_context():
        asyncio.run(ruler_score_group(group("a", "b"), judge_model, {"mock_response": reply}))
    return asyncio.run(builder.flush()), calls.responses


def test_litellm_prices_the_judge_when_the_response_carries_no_cost(monkeypatch):
    flushed, (response,) = judged_cost(monkeypatch, "openai/gpt-4.1", scores(0.9, 0.1), MetricsBuilder("train"))
    info = litellm.get_model_info("openai/gpt-4.1")
    expected = (response.usage.prompt_tokens * info["input_cost_per_token"]
                + response.usage.completion_tokens * info["output_cost_per_token"])
    assert expected > 0 and flushed["costs/train/judge/ruler"] == pytest.approx(expected)
    assert flushed["costs/train/judge"] == flushed["costs/all"] == flushed["costs/train/judge/ruler"]


def test_registered_prices_win_and_a_model_litellm_prices_at_zero_records_no_cost(monkeypatch):
    builder = MetricsBuilder("eval")
    builder.register_model_pricing("openai/gpt-4.1", prompt_per_million=1.0, completion_per_million=1.0)
    flushed, (response,) = judged_cost(monkeypatch, "openai/gpt-4.1", scores(0.5, 0.5), builder)
    assert flushed["costs/eval/judge/ruler"] == pytest.approx(response.usage.total_tokens / 1e6)
    flushed, _ = judged_cost(monkeypatch, "ollama/qwen3:32b", scores(0.5, 0.5), MetricsBuilder("eval"))
    assert not any(k.startswith("costs/") for k in flushed)


def test_a_response_without_litellms_figure_is_priced_from_litellms_price_map(monkeypatch):
    """ART's own tests hand RULER a plain response object; litellm's map prices its usage as ART's table does."""
    async def fake(**kwargs):
        return ChatCompletion.model_validate({
            "id": "x", "object": "chat.completion", "created": 0, "model": "gpt-4.1",
            "usage": {"prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150,
                      "prompt_tokens_details": {"cached_tokens": 40}},
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": scores(0.9)}}]})

    monkeypatch.setattr(ruler_module, "acompletion", fake)
    builder = MetricsBuilder("train")
    with builder.activate_context():
        asyncio.run(ruler([MESSAGES[0]], "openai/gpt-4.1"))
    info = litellm.get_model_info("openai/gpt-4.1")
    expected = 60 * info["input_cost_per_token"] + 40 * info["cache_read_input_token_cost"] \
        + 50 * info["output_cost_per_token"]
    assert asyncio.run(builder.flush())["costs/train/judge/ruler"] == pytest.approx(expected)


def test_a_litellm_choice_converts_to_an_openai_choice_with_its_token_record():
    from litellm.types.utils import Choices

    choice = Choices(finish_reason="tool_calls", index=0, message={
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        logprobs={"content": [{"token": "a", "logprob": -0.5, "bytes": [97],
                               "top_logprobs": [{"token": "b", "logprob": -1.0, "bytes": [98]}]}]},
        provider_specific_fields={"token_ids": [5, 6], "prompt_token_ids": [1, 2, 3]})
    out = convert_litellm_choice_to_openai(choice)
    assert (out.finish_reason, out.index, out.message.role, out.message.content) == ("tool_calls", 0, "assistant",
                                                                                     None)
    (call,) = out.message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("call_1", "get_weather",
                                                                                  {"city": "Oslo"})
    (token,) = out.logprobs.content
    assert (token.token, token.logprob, token.bytes, token.top_logprobs[0].token) == ("a", -0.5, [97], "b")
    assert (out.model_extra["token_ids"], out.model_extra["prompt_token_ids"]) == ([5, 6], [1, 2, 3])
    art.Trajectory(messages_and_choices=[{"role": "user", "content": "weather?"}, out])  # a trajectory takes it


def test_litellms_mock_response_converts_and_bad_choices_are_refused():
    from litellm.types.utils import Choices, StreamingChoices

    response = asyncio.run(litellm.acompletion(model="openai/gpt-4.1", messages=[{"role": "user", "content": "hi"}],
                                               mock_response="hello"))
    out = convert_litellm_choice_to_openai(response.choices[0])
    assert (out.message.content, out.logprobs, out.message.tool_calls) == ("hello", None, None)
    with pytest.raises(TypeError, match="streamed one"):
        convert_litellm_choice_to_openai(StreamingChoices())
    with pytest.raises(TypeError, match="got dict"):
        convert_litellm_choice_to_openai({"message": {"role": "assistant"}})
    with pytest.raises(ValueError, match="role 'user'"):
        convert_litellm_choice_to_openai(Choices(message={"role": "user", "content": "x"}))
