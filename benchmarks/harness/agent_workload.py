"""The agent workload of `python benchmarks/bench.py pipeline`: multi-turn rollouts whose tool calls take time.

An episode starts from a system prompt of `prompt_words` words (the agent's tool manual) and the
task, then runs `turns` rounds of: the policy answers (one chat completion through the served
model, `max_tokens` at temperature 1, seeded), then a "tool" runs for `tool_latency_s` seconds
(an `asyncio.sleep`: the agent waits, the machine is free) and its result, `result_words` words,
comes back as the next user message. Later turns carry every earlier result: the trainer
processes all of it for every rollout, the engine only prefills it, so `result_words` sets how
training-heavy a step is. With `final_tokens`, the episode then ends as an agent's usually does:
one more answer of up to `final_tokens` tokens after the last tool result, with no tool after it. The
reward is graded from what was sampled, so groups have reward spread.

Choices, and what they simplify:

1. **The tool is a wait, not work.** Real tools (a search, a sandbox, a web request) mostly wait
   on something else; a sleep models that without competing with the trainer for the CPU, so the
   latency flag moves the rollout/training balance and nothing else.
2. **The observation is a user message**, not a `tool` message: the tiny model does not emit tool
   calls, and a `tool` message needs one to answer. Every turn's prompt still grows with the
   previous turns, as an agent's does.
3. **A graded, continuous reward** (the share of vowels among the letters sampled): a random model's
   groups then almost never have all-equal rewards, so ART's pipeline (which sets such groups
   aside) and the synchronous loop train the same groups. It teaches nothing useful; the bench
   measures time, not learning.
4. **Seeded per request** from (seed, scenario, rollout, turn): the synchronous loop and the
   pipeline send the same requests with the same seeds; what they sample differs only through the
   weights each request is served with.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from artrl.trajectories.data import Trajectory, TrajectoryGroup
from artrl.utils import choice_from_completion

VOWELS = frozenset("aeiou")


def vowel_share(texts: list[str | None]) -> float:
    """Share of vowels among the letters of `texts` (0.0 without letters): the workload's reward."""
    letters = [c for t in texts for c in (t or "").lower() if c.isalpha()]
    return sum(c in VOWELS for c in letters) / len(letters) if letters else 0.0


def request_seed(seed: int, *parts: int) -> int:
    """A reproducible sampling seed from the bench seed and a request's coordinates."""
    h = seed
    for p in parts:
        h = (h * 1_000_003 + p + 1) % (2**31 - 1)
    return h


@dataclass
class Intervals:
    """Start and end times (time.perf_counter) of a kind of work; `busy` is the time covered by any."""

    spans: list[tuple[float, float]] = field(default_factory=list)

    def add(self, start: float, end: float) -> None:
        self.spans.append((start, end))

    def overlap(self, other: "Intervals", start: float, end: float) -> float:
        """Seconds of [start, end] during which a span of this set and a span of `other` were both running."""
        both = Intervals(self.spans + other.spans)
        return self.busy(start, end) + other.busy(start, end) - both.busy(start, end)

    def busy(self, start: float, end: float) -> float:
        """Seconds of [start, end] during which at least one span was running (overlaps counted once)."""
        total, cursor = 0.0, start
        for s, e in sorted(self.spans):
            s, e = max(s, cursor), min(e, end)
            if e > s:
                total += e - s
                cursor = e
        return total


@dataclass(frozen=True)
class AgentWorkload:
    """The episodes' shape: turns, the tool's latency, the completion budget, rollouts per group."""

    turns: int = 2
    tool_latency_s: float = 0.5
    max_tokens: int = 8
    rollouts_per_group: int = 4
    prompt_words: int = 200
    """Words of the system prompt (the agent's tool manual) every turn's prompt starts with."""
    result_words: int = 0
    """Words of each tool result after the first line (what a search or a file read returns)."""
    seed: int = 0
    final_tokens: int = 0
    """Completion budget of a final answer after the last tool result, with no tool after it (0: none; the
    episode ends with its last tool call). It puts the bulk of an episode's tokens at its end, where a long
    answer after the tools puts them."""

    def tool_result(self, turn: int) -> str:
        body = " ".join(f"line{(turn * 31 + i) % 97}" for i in range(self.result_words))
        return f"Tool result {turn}: done. Continue." + (f"\n{body}" if body else "")

    def system_prompt(self) -> str:
        """The tool manual: `prompt_words` words, the same for every scenario (as an agent's is)."""
        words = ["search", "open", "read", "file", "query", "result", "page", "tool", "call", "answer", "list",
                 "the", "a", "of", "to", "with", "returns", "takes", "argument", "string"]
        return "Tools: " + " ".join(words[(i * 7 + i // len(words)) % len(words)] for i in range(self.prompt_words))

    def scenarios(self, n: int) -> list[dict[str, Any]]:
        """`n` scenarios (ART's pipeline takes dicts; `metadata.scenario_id` reaches the group's metadata)."""
        return [{"id": i, "task": f"Task {i}: describe item number {i} in a few words.",
                 "metadata": {"scenario_id": i}} for i in range(n)]


class AgentRollouts:
    """Runs the workload's episodes and records when rollouts run (`intervals`).

    `rollout_group` has the signature of ART's `RolloutFn` (model, scenario, config) -> TrajectoryGroup,
    so the synchronous loop and `PipelineTrainer` call the same function.
    """

    def __init__(self, workload: AgentWorkload) -> None:
        self.workload = workload
        self.intervals = Intervals()
        """When rollout groups were in flight."""
        self.requests = Intervals()
        """When model requests were in flight (decoding, or waiting for the engine)."""

    async def rollout(self, model: Any, scenario: dict[str, Any], index: int) -> Trajectory:
        w = self.workload
        client = model.openai_client()
        messages: list[dict[str, Any]] = [{"role": "system", "content": w.system_prompt()},
                                          {"role": "user", "content": scenario["task"]}]  # what is sent
        record: list[Any] = list(messages)  # what is trained: the same, with the sampled Choices
        answers: list[str | None] = []
        for turn in range(w.turns + (1 if w.final_tokens else 0)):
            final = turn == w.turns  # the answer after the last tool result (with final_tokens only)
            if turn:
                observation = {"role": "user", "content": w.tool_result(turn)}
                messages.append(observation)
                record.append(observation)
            sent = time.perf_counter()
            try:
                completion = await client.chat.completions.create(
                    model=model.get_inference_name(), messages=messages,
                    max_tokens=w.final_tokens if final else w.max_tokens, temperature=1.0,
                    logprobs=True, seed=request_seed(w.seed, scenario["id"], index, turn))
            finally:
                self.requests.add(sent, time.perf_counter())
            choice = choice_from_completion(completion)
            record.append(choice)
            messages.append({"role": "assistant", "content": choice.message.content or ""})
            answers.append(choice.message.content)
            if w.tool_latency_s > 0 and not final:
                await asyncio.sleep(w.tool_latency_s)  # the tool runs (choice 1 of the module docstring)
        return Trajectory(messages_and_choices=record, reward=vowel_share(answers),
                          metadata={"scenario_id": scenario["id"], "rollout": index})

    async def rollout_group(self, model: Any, scenario: dict[str, Any], config: Any = None) -> TrajectoryGroup:
        """One group of `rollouts_per_group` episodes of `scenario` (ART's RolloutFn; `config` is unused)."""
        start = time.perf_counter()
        try:
            trajectories = await asyncio.gather(*(self.rollout(model, scenario, k)
                                                  for k in range(self.workload.rollouts_per_group)))
        finally:
            self.intervals.add(start, time.perf_counter())
        return TrajectoryGroup(trajectories)
