"""RULER end to end over HTTP: a scripted judge for parsing and retries, and artrl's own server as the judge.

The scripted-judge tests run twice: through litellm (`litellm.acompletion`, RULER's route when litellm is
installed) and through the `openai` client (its route without litellm).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging

import pytest
from fastapi import FastAPI, Request

import artrl as art
from artrl.errors import ConfigError
from artrl.metrics import MetricsBuilder
from artrl.rewards import JudgeError, ruler, ruler_score_group
ruler_module = importlib.import_module("artrl.rewards.ruler")  # the module; `artrl.rewards.ruler` is the function
from artrl.rewards.judge import resolve
from artrl.serve.http.background import HEALTH_PATH, start_server


class ScriptedJudge:
    """An OpenAI-compatible endpoint that answers the queued replies in turn and records each request."""

    def __init__(self, replies: list[str], cost: float | None = None) -> None:
        self.replies, self.requests, self.cost = list(replies), [], cost
        app = FastAPI()

        @app.get(HEALTH_PATH)
        async def health() -> dict:
            return {"ok": True}

        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> dict:
            body = await request.json()
            self.requests.append(body)
            reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
            usage = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
            if self.cost is not None:
                usage["cost"] = self.cost
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"], "usage": usage,
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": reply}}]}

        self.server = start_server(app)

    def params(self) -> dict:
        return {"api_base": self.server.base_url, "api_key": "judge-key"}

    def __enter__(self) -> "ScriptedJudge":
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()


@pytest.fixture(params=["litellm", "openai"])
def route(request, monkeypatch) -> str:
    """Which client RULER calls its judge with: litellm's acompletion, or (litellm absent) the openai client."""
    if request.param == "litellm":
        pytest.importorskip("litellm")
        assert ruler_module.acompletion is not None
    else:
        monkeypatch.setattr(ruler_module, "acompletion", None)
    return request.param


def scores(*values: float, ids=None) -> str:
    ids = ids or [str(i) for i in range(1, len(values) + 1)]
    return json.dumps({"scores": [{"trajectory_id": i, "explanation": f"reason {i}", "score": v}
                                  for i, v in zip(ids, values)]})


SYSTEM = {"role": "system", "content": "You are a careful assistant."}


def group(*answers: str, rewards=None) -> art.TrajectoryGroup:
    rewards = rewards or [0.0] * len(answers)
    return art.TrajectoryGroup([art.Trajectory(messages_and_choices=[SYSTEM, {"role": "user", "content": "2+2?"},
                                                                     {"role": "assistant", "content": a}],
                                               reward=r, metrics={"m": 1}) for a, r in zip(answers, rewards)])


def test_scores_replace_rewards_and_arts_metrics_are_recorded(route):
    g = group("4", "five", "I don't know", rewards=[1.0, 0.0, 0.5])
    with ScriptedJudge([scores(0.9, 0.1, 0.3)]) as judge:
        out = asyncio.run(ruler_score_group(g, "hosted_vllm/judge", judge.params()))
    assert [t.reward for t in out.trajectories] == [0.9, 0.1, 0.3]
    assert [t.metrics["ruler_score"] for t in out.trajectories] == [0.9, 0.1, 0.3]
    assert [t.metrics["independent_reward"] for t in out.trajectories] == [1.0, 0.0, 0.5]
    assert out.trajectories[0].logs[-1] == "RULER explanation: reason 1"
    assert [t.reward for t in g.trajectories] == [1.0, 0.0, 0.5] and "ruler_score" not in g.trajectories[0].metrics
    (request,) = judge.requests  # one judge call per group
    assert request["model"] == "judge" and request["response_format"]["type"] == "json_schema"
    system, user = request["messages"]
    assert "achieves its goal" in system["content"]  # ART's default rubric
    # the shared prefix is sent once, then each trajectory's own part
    assert user["content"].count("careful assistant") == 1 and '<trajectory id="3">' in user["content"]


def test_lenient_parsing_fences_think_tags_numeric_and_shuffled_ids(route):
    reply = "<think>compare them</think>Here you go:\n```json\n" + scores(0.2, 0.8, ids=[2, 1]) + "\n```"
    with ScriptedJudge([reply]) as judge:
        got = asyncio.run(ruler([g.messages() for g in group("a", "b").trajectories], "judge",
                                judge.params()))
    assert [(s.trajectory_id, s.score) for s in got] == [("1", 0.8), ("2", 0.2)]


def test_an_unusable_reply_is_retried_with_what_was_wrong(route, caplog):
    with ScriptedJudge(["I think the first one is best.", scores(0.5), scores(0.7, 0.2)]) as judge:
        with caplog.at_level(logging.INFO, logger="artrl.rewards.ruler"):
            out = asyncio.run(ruler_score_group(group("a", "b"), "judge", judge.params()))
    assert [t.reward for t in out.trajectories] == [0.7, 0.2]
    assert len(judge.requests) == 3
    followup = judge.requests[1]["messages"]
    assert followup[-2] == {"role": "assistant", "content": "I think the first one is best."}
    assert "holds no JSON object" in followup[-1]["content"]
    assert "expected 2 scores" in judge.requests[2]["messages"][-1]["content"]
    assert "unusable" in caplog.text


def test_a_judge_that_never_gives_usable_scores_is_reported_per_group_never_a_zero(route, caplog):
    with ScriptedJudge(['{"scores": [{"trajectory_id": "1", "score": "high"}]}']) as judge:
        with pytest.raises(JudgeError, match=r"no usable scores for 2 trajectories in 3 attempts") as info:
            asyncio.run(ruler_score_group(group("a", "b"), "judge", judge.params()))
        assert "attempt 1:" in str(info.value) and len(judge.requests) == 3
        with caplog.at_level(logging.WARNING, logger="artrl.rewards.ruler"):
            dropped = asyncio.run(ruler_score_group(group("a", "b"), "judge", judge.params(),
                                                    swallow_exceptions=True, max_attempts=2))
    assert dropped is None  # ART's contract: the caller drops the group
    assert "dropped (swallow_exceptions=True)" in caplog.text and len(judge.requests) == 5


def test_identical_trajectories_are_judged_once_and_share_the_score(route):
    with ScriptedJudge([scores(0.6)]) as judge:
        got = asyncio.run(ruler([g.messages() for g in group("same", "same", "same").trajectories], "judge",
                                judge.params()))
    assert [(s.trajectory_id, s.score) for s in got] == [("1", 0.6), ("2", 0.6), ("3", 0.6)]
    assert judge.requests[0]["messages"][1]["content"].count("<trajectory") == 1


def test_the_judges_cost_goes_to_the_active_metrics_builder(route):
    builder = MetricsBuilder(cost_context="train")
    with ScriptedJudge([scores(0.4, 0.6)], cost=0.002) as judge, builder.activate_context():
        asyncio.run(ruler_score_group(group("a", "b"), "openai/judge", judge.params()))
    flushed = asyncio.run(builder.flush())
    assert flushed["costs/train/judge/ruler"] == pytest.approx(0.002) and flushed["costs/all"] == pytest.approx(0.002)


def test_provider_strings_and_litellm_params_map_onto_endpoints(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    e = resolve("openai/o4-mini", {"temperature": 0.2, "num_retries": 5})
    assert (e.base_url, e.model, e.api_key, e.request, e.max_retries) == (
        "https://api.openai.com/v1", "o4-mini", "sk-test", {"temperature": 0.2}, 5)
    assert resolve("gpt-4.1").model == "gpt-4.1"  # a bare OpenAI name, inferred as litellm does
    e = resolve("openrouter/openai/gpt-4.1-mini", {"api_key": "or"})
    assert (e.base_url, e.model) == ("https://openrouter.ai/api/v1", "openai/gpt-4.1-mini")
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="ANTHROPIC_API_KEY"):
        resolve("anthropic/claude-sonnet-4-5")
    with pytest.raises(ConfigError, match="names no provider"):
        resolve("my-judge")
    with pytest.raises(ConfigError, match="not an OpenAI request field"):
        resolve("openai/o3", {"temprature": 1})


def test_artrls_own_server_as_the_judge_retries_then_reports(tmp_path, caplog):
    """The tiny model cannot write the judge's JSON: three calls to the real server, then a JudgeError."""

    async def main():
        judge = art.TrainableModel(name="judge", project="p", base_model="artrl/tiny")
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        await judge.register(backend)
        try:
            params = {"api_base": judge.inference_base_url, "api_key": judge.inference_api_key,
                      "max_tokens": 16, "temperature": 0}
            with pytest.raises(JudgeError, match="in 3 attempts") as info:
                await ruler_score_group(group("4", "5"), judge.get_inference_name(), params)
            dropped = await ruler_score_group(group("4", "5"), f"hosted_vllm/{judge.get_inference_name()}",
                                              params, swallow_exceptions=True, max_attempts=1)
            return info.value, dropped
        finally:
            backend.close()

    with caplog.at_level(logging.INFO, logger="artrl.rewards.ruler"):
        error, dropped = asyncio.run(main())
    assert dropped is None
    assert [f"judge reply {i}/3 unusable" in caplog.text for i in (1, 2, 3)] == [True] * 3
    assert "last reply:" in str(error)


def captured(answer: str) -> art.Trajectory:
    """A trajectory as a capture scope records it: one chat completion exchange."""
    from datetime import datetime, timezone

    from artrl.trajectories.exchanges import build_exchange

    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}]}
    now = datetime.now(timezone.utc)
    t = art.Trajectory()
    t.exchanges.append(build_exchange("chat_completions", {"model": "m", "messages": [SYSTEM, {"role": "user",
                                                                                              "content": "2+2?"}]},
                                      json.dumps(body).encode(), start_time=now, end_time=now))
    return t


def test_captured_trajectories_are_judged_on_their_conversation(route):
    g = art.TrajectoryGroup([captured("4"), captured("five")])
    assert g.trajectories[0].messages()[-1] == {"role": "assistant", "content": "4"}
    with ScriptedJudge([scores(0.9, 0.1)]) as judge:
        out = asyncio.run(ruler_score_group(g, "hosted_vllm/judge", judge.params()))
    assert [t.reward for t in out.trajectories] == [0.9, 0.1]
    (request,) = judge.requests
    user = request["messages"][1]["content"]
    assert "careful assistant" in user and "five" in user


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


@pytest.mark.parametrize("via", ["litellm", "openai"])
def test_an_unreachable_judge_says_which_judge_where_and_what_to_do(monkeypatch, via):
    if via == "openai":
        monkeypatch.setattr(ruler_module, "acompletion", None)
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": a}], reward=0.0) for a in ("a", "b")])
    with pytest.raises(ruler_module.JudgeUnreachableError) as caught:
        asyncio.run(ruler_score_group(group, "openai/o4-mini", {"api_base": url, "api_key": "k", "num_retries": 0}))
    message = str(caught.value)
    assert "'openai/o4-mini'" in message and url in message and "could not be reached" in message
    assert "hosted_vllm/" in message and "docs/art-examples.md" in message and "\n" not in message
    assert caught.value.__cause__ is None and caught.value.cause is not None  # no chained wall; the cause kept
    assert isinstance(caught.value, JudgeError)  # code catching ART's judge failures still catches it
