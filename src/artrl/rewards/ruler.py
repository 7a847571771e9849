"""RULER: a judge model scores a group's trajectories relative to each other (`art.rewards`).

Same arguments and meaning as ART 0.5.x: `ruler(message_lists, judge_model,
extra_litellm_params, rubric, tools, debug=)` makes ONE judge call per group
and returns a `TrajectoryScore` per trajectory; `ruler_score_group(group, ...)`
returns a new group whose rewards are the judge's scores, the old reward kept
in `metrics["independent_reward"]`, the score in `metrics["ruler_score"]`, the
explanation in the trajectory's logs. The shared prefix of the trajectories
(system prompt, task) is sent once; identical trajectories are sent once and
get one score. When a `MetricsBuilder` is active (`model.activate_metrics_context`)
the judge's cost lands in `costs/<context>/judge/ruler`, when the response
carries it, prices are registered (metrics.py) or litellm prices the judge.

What we do differently, and why:

1. **litellm when installed, else any OpenAI-compatible judge.** With litellm
   (`pip install "artrl[litellm]"`) the judge is called with `litellm.acompletion`
   as ART calls it, its cost priced by litellm where the response carries none
   (litellm_judge.py). Without it, the `openai` client calls the endpoint that
   ART's `provider/model` names and `extra_litellm_params` point to (judge.py).
2. **A reply that cannot be used is retried, then reported.** ART validates the
   judge's JSON once and raises. We parse leniently (code fences, text around
   the JSON, reasoning in <think> tags, ids as numbers), and a reply that still
   does not give one finite score per trajectory is answered with what was
   wrong and asked again, up to `max_attempts` calls. Then `JudgeError` names
   the group, the attempts and the last reply; with `swallow_exceptions=True`
   the group is None (as in ART: the caller drops it) and a warning says why.
   No trajectory ever gets a silent 0.
3. **Scores follow their ids.** When the judge returns the ids 1..n in another
   order, scores are matched by id (ART matches by position).
4. The returned group keeps the input group's metadata, metrics, logs and
   exceptions (ART 0.5.17 drops them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from textwrap import dedent
from typing import Any

import pydantic

from ..errors import ArtrlError
from ..chat.format import message_of
from ..trajectories.data import Trajectory, TrajectoryGroup
from ..trajectories.history import one_chat_conversation
from .judge import resolve
from .litellm_judge import litellm_prices, litellm_request, litellm_response_cost, load_litellm

log = logging.getLogger(__name__)

DEFAULT_JUDGE = "openai/o3"
DEFAULT_MAX_ATTEMPTS = 3
COST_SOURCE = "judge/ruler"

DEFAULT_RUBRIC = dedent(
    """
        - A trajectory that achieves its goal should always get a significantly higher score than a trajectory that does not achieve its goal.
        - A trajectory that achieves its goal more efficiently (eg. by avoiding unproductive detours) should get a higher score than a trajectory that achieves its goal less efficiently.
        - If one trajectory is only slightly better than another, the difference in scores should be small. If it is significantly better, the difference in scores should be large.
        - You may give some partial credit for a trajectory that makes progress towards its goal but does not complete it.
    """  # noqa: E501
)
"""ART's default rubric: generic, since the judge reads the task from the trajectories' own prompts."""


class TrajectoryScore(pydantic.BaseModel):
    """The judge's score for one trajectory."""

    trajectory_id: str = pydantic.Field(description="The id of the trajectory being scored.")
    explanation: str = pydantic.Field(description="A short description of the trajectory's performance.")
    score: float = pydantic.Field(description="A score between 0 and 1.")

    @pydantic.field_validator("trajectory_id", mode="before")
    @classmethod
    def _id_as_text(cls, v: Any) -> str:
        return str(v)


class Response(pydantic.BaseModel):
    """What the judge must answer."""

    scores: list[TrajectoryScore] = pydantic.Field(description="The scores for each trajectory.")


class JudgeError(ArtrlError, ValueError):
    """The judge gave no usable scores for a group after every attempt."""


class JudgeUnreachableError(JudgeError):
    """The judge's endpoint could not be reached (or refused the key): one line with the model, the endpoint and
    what to do; the client's own error is `.cause` (not chained: its 40 lines of retries say nothing more)."""

    def __init__(self, judge_model: str, endpoint: str, cause: BaseException) -> None:
        self.cause = cause
        refused = type(cause).__name__ in ("AuthenticationError", "PermissionDeniedError")
        what = "refused the API key" if refused else "could not be reached"
        super().__init__(
            f"RULER's judge {judge_model!r} at {endpoint} {what} ({type(cause).__name__}: {str(cause)[:200]}). "
            "Check the network and the provider's API key, or judge with a model you serve: offline, "
            "judge_model=\"hosted_vllm/\" + model.base_model, extra_litellm_params={\"api_base\": "
            "model.inference_base_url, \"api_key\": model.inference_api_key} (docs/art-examples.md).")


def _unreachable(error: BaseException) -> bool:
    """Whether a judge call failed for want of a connection or a key (openai's and litellm's errors alike)."""
    try:
        import openai
    except ImportError:  # pragma: no cover  (openai is a dependency)
        return False
    kinds = (openai.APIConnectionError, openai.AuthenticationError, openai.PermissionDeniedError)
    seen: set[int] = set()
    while error is not None and id(error) not in seen:  # litellm re-raises openai's error as its own, chained
        seen.add(id(error))
        if isinstance(error, kinds) or "Connection error" in str(error)[:300]:
            return True
        error = error.__cause__ or error.__context__
    return False


# --------------------------------------------------------------------------- prompt


def _common_prefix(message_lists: list[list[Any]]) -> int:
    n = 0
    for i, msg in enumerate(message_lists[0]):
        if all(len(m) > i and m[i] == msg for m in message_lists):
            n += 1
        else:
            break
    return n


def judge_messages(message_lists: list[list[Any]], rubric: str, tools: list | None) -> tuple[list[dict], int]:
    """(the judge's chat messages, how many trajectories it is shown: 1 when all are identical)."""
    prefix = _common_prefix(message_lists)
    identical = all(len(m) == prefix for m in message_lists)
    if identical and len(message_lists) > 1:
        log.warning("RULER: all %d trajectories are identical; the judge scores one of them, absolutely",
                    len(message_lists))
    text = ""
    if prefix and not identical:
        text += f"<context>\n{json.dumps(message_lists[0][:prefix], default=str)}\n</context>\n\n"
    if tools:
        text += f"<available_tools>\n{json.dumps(tools, default=str)}\n</available_tools>\n\n"
    shown = [message_lists[0]] if identical else [m[prefix:] for m in message_lists]
    text += "Trajectories:\n\n" + "\n\n".join(
        f'<trajectory id="{i}">\n{json.dumps(m, default=str)}\n</trajectory>' for i, m in enumerate(shown, 1))
    system = dedent(f"""
        All of the trajectories below have been given the same goal. Your job is to consider each of them and give them a score between 0 and 1. Take into consideration your best judgement of the agent's goal.

        Grading standards:
        {rubric}

        Reply with only a JSON object of this form, one entry per trajectory id:
        {{"scores": [{{"trajectory_id": "1", "explanation": "...", "score": 0.5}}, ...]}}
        """)  # noqa: E501
    return [{"role": "system", "content": system}, {"role": "user", "content": text}], len(shown)


# --------------------------------------------------------------------------- parsing


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def _json_candidates(content: str) -> list[str]:
    text = _THINK.sub("", content).strip()
    out = [text, *(m.strip() for m in _FENCE.findall(text))]
    for open_, close in (("{", "}"), ("[", "]")):
        a, b = text.find(open_), text.rfind(close)
        if 0 <= a < b:
            out.append(text[a:b + 1])
    return out


def parse_scores(content: str | None, expected: int) -> list[TrajectoryScore]:
    """The judge's reply as `expected` scores in trajectory order; ValueError says what is wrong."""
    if not content or not content.strip():
        raise ValueError("the reply is empty")
    data: Any = None
    for candidate in _json_candidates(content):
        try:
            data = json.loads(candidate)
            break
        except ValueError:
            continue
    if data is None:
        raise ValueError("the reply holds no JSON object")
    if isinstance(data, list):
        data = {"scores": data}
    try:
        scores = Response.model_validate(data).scores
    except pydantic.ValidationError as e:
        raise ValueError(f"the JSON does not match {{'scores': [{{trajectory_id, explanation, score}}]}}: "
                         f"{e.errors()[0]['msg']} at {'.'.join(map(str, e.errors()[0]['loc']))}") from e
    if len(scores) != expected:
        raise ValueError(f"expected {expected} scores (trajectory ids 1..{expected}), got {len(scores)}")
    bad = [s.trajectory_id for s in scores if not math.isfinite(s.score)]
    if bad:
        raise ValueError(f"scores of trajectories {bad} are not finite numbers")
    ids = [s.trajectory_id.strip() for s in scores]
    wanted = [str(i) for i in range(1, expected + 1)]
    if sorted(ids, key=lambda x: (len(x), x)) == wanted and ids != wanted:
        scores = sorted(scores, key=lambda s: int(s.trajectory_id.strip()))
    return scores


# --------------------------------------------------------------------------- calls


def __getattr__(name: str) -> Any:
    """ART's module names `acompletion` and `ModelResponse` (litellm's; None without litellm), loaded on first
    use so that `import artrl` does not import litellm. Setting `acompletion` replaces the judge call, as
    ART's own tests do; setting it to None makes RULER use the OpenAI-compatible judge."""
    if name in ("acompletion", "ModelResponse"):
        globals().update(load_litellm())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _record_cost(judge_model: str, provider: str | None, response: Any, *, via_litellm: bool) -> None:
    from ..metrics import MetricsBuilder

    try:
        builder = MetricsBuilder.get_active()
    except LookupError:
        return
    try:  # the cost the response carries, or the prices the builder knows (registered, built in, litellm's)
        cost = builder.price_response(response, provider=provider, model_name=judge_model)
    except ValueError:
        if not via_litellm:
            return  # no price known for this judge: no cost recorded, as ART does for unpriced models
    else:
        if cost > 0:  # a judge priced at zero (a local model litellm maps, e.g. ollama/...) records no cost, as ART
            builder.add_cost(f"{builder.cost_context}/{COST_SOURCE}", cost)
        return
    cost = litellm_response_cost(response)
    if cost is not None:
        builder.add_cost(f"{builder.cost_context}/{COST_SOURCE}", cost)
        return
    prices = litellm_prices(judge_model)
    if prices is not None:
        try:
            builder.add_response_cost(COST_SOURCE, response, provider=provider, model_name=judge_model, **prices)
        except ValueError:
            pass  # the response reports no usage to price


async def ruler(message_lists: list[list[Any]], judge_model: str = DEFAULT_JUDGE,
                extra_litellm_params: dict | None = None, rubric: str = DEFAULT_RUBRIC, tools: list | None = None,
                *, debug: bool = False, max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> list[TrajectoryScore]:
    """Score each trajectory (a list of chat messages) relative to the others: ONE judge call per
    group, more only when a reply cannot be used (at most `max_attempts`). Raises JudgeError then."""
    if not message_lists:
        return []
    if max_attempts < 1:
        raise ValueError(f"max_attempts={max_attempts}; it must be >= 1")
    messages, shown = judge_messages([[message_of(m) for m in ms] for ms in message_lists], rubric, tools)
    complete = globals()["acompletion"] if "acompletion" in globals() else __getattr__("acompletion")
    if complete is not None:  # litellm, as ART calls it (litellm_judge.py)
        request, provider = litellm_request(judge_model, extra_litellm_params)
        request["response_format"] = Response
        client = contextlib.nullcontext()

        async def ask(messages: list[dict]) -> Any:
            return await complete(messages=messages, **request)
        where = str(request.get("api_base") or request.get("base_url") or f"{provider or 'its provider'}'s API")
    else:  # any OpenAI-compatible endpoint (judge.py)
        endpoint = resolve(judge_model, extra_litellm_params)
        provider = endpoint.provider
        request = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "Response", "schema": Response.model_json_schema()}}, **endpoint.request}
        client = endpoint.client()

        async def ask(messages: list[dict]) -> Any:
            return await client.chat.completions.create(model=endpoint.model, messages=messages, **request)
        where = endpoint.base_url
    problems: list[str] = []
    content: str | None = None
    async with client:
        for attempt in range(1, max_attempts + 1):
            try:
                response = await ask(messages)
            except Exception as e:
                if _unreachable(e):
                    raise JudgeUnreachableError(judge_model, where, e) from None
                raise
            _record_cost(judge_model, provider, response, via_litellm=complete is not None)
            content = response.choices[0].message.content if response.choices else None
            if debug:
                log.info("RULER judge reply (attempt %d/%d):\n%s", attempt, max_attempts, content)
            try:
                scores = parse_scores(content, shown)
                break
            except ValueError as e:
                problems.append(f"attempt {attempt}: {e}")
                log.info("RULER: judge reply %d/%d unusable (%s)%s", attempt, max_attempts, e,
                         "; asking again" if attempt < max_attempts else "")
                messages = [*messages, {"role": "assistant", "content": content or ""},
                            {"role": "user", "content": f"Your reply could not be used: {e}. Reply again with "
                             f"only the JSON object, one score per trajectory id 1..{shown}."}]
        else:
            raise JudgeError(f"the judge {judge_model!r} gave no usable scores for {len(message_lists)} "
                             f"trajectories in {max_attempts} attempts ({'; '.join(problems)}); last reply: "
                             f"{(content or '')[:300]!r}")
    if shown == 1 and len(message_lists) > 1:
        return [scores[0].model_copy(update={"trajectory_id": str(i)}) for i in range(1, len(message_lists) + 1)]
    return scores


def _conversation(t: Trajectory) -> Any:
    """What the judge reads of a trajectory: its conversation (for captured exchanges, their one chat
    conversation, as ART's `trajectory.history()`)."""
    return one_chat_conversation(t.exchanges) if t.exchanges else t


def _copy(t: Trajectory) -> Trajectory:
    new = t.model_copy()
    new.messages_and_choices = list(t.messages_and_choices)
    new.metrics, new.metadata, new.logs = dict(t.metrics), dict(t.metadata), list(t.logs)
    return new


async def ruler_score_group(group: TrajectoryGroup, judge_model: str = DEFAULT_JUDGE,
                            extra_litellm_params: dict | None = None, rubric: str = DEFAULT_RUBRIC, *,
                            swallow_exceptions: bool = False, debug: bool = False,
                            max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> TrajectoryGroup | None:
    """A new group whose rewards are RULER scores (see the module docstring); None when the judge
    failed and `swallow_exceptions` (the group should then be dropped, as `gather`'s `after_each` does)."""
    for i, t in enumerate(group.trajectories):
        if t.additional_histories:
            raise ValueError(f"trajectory {i} has additional_histories; RULER does not score them yet (as in ART)")
    trajectories = [_copy(t) for t in group.trajectories]
    if not trajectories:
        return group
    conversations = [_conversation(t) for t in trajectories]
    for t in trajectories:
        t.metrics["independent_reward"] = t.reward
    try:
        scores = await ruler([c.messages_and_choices for c in conversations], judge_model, extra_litellm_params,
                             rubric, conversations[0].tools, debug=debug, max_attempts=max_attempts)
    except Exception as e:
        if swallow_exceptions:
            log.warning("RULER: the group of %d trajectories is dropped (swallow_exceptions=True): %s: %s",
                        len(trajectories), type(e).__name__, e)
            return None
        raise
    for t, s in zip(trajectories, scores):
        t.metrics["ruler_score"] = s.score
        t.reward = s.score
        t.log(f"RULER explanation: {s.explanation}")
    fields = {k: type(getattr(group, k))(getattr(group, k)) for k in ("metadata", "metrics", "logs")
              if k in TrajectoryGroup.model_fields}
    out = TrajectoryGroup(trajectories, **fields)
    out.exceptions = list(group.exceptions)
    return out
