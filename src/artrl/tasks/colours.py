"""The colour quiz: "What colour is the banana?" -> "yellow".

A task small enough for the tiny random-init model (`artrl/tiny`) to learn on a
CPU in minutes, built so that SFT and RL each have a job:

1. **Facts.** 24 objects, four of each of six colours (each colour name is one
   token of the tiny tokenizer). The colours are facts to memorise; nothing in
   an object's name gives its colour away.
2. **Held-out phrasings.** Questions come from phrasing templates. Train
   scenarios (SFT data and RL rollouts) use `TRAIN_TEMPLATES`; validation asks
   about the same objects with `VAL_TEMPLATES`, which no training step sees.
3. **SFT imitates, RL optimises.** The warm-up answers (`sft_trajectories`) come
   in two styles, as if written by two annotators: the bare colour ("yellow")
   and a hedged one ("yellow, I think."), half and half, independent of the
   object and the phrasing. SFT learns the facts and copies both styles. The
   grader (`reward`) wants a one-word answer: 1.0 for exactly the right colour,
   `HEDGED_REWARD` when words follow it, `PARTIAL_REWARD` for a wrong colour, 0
   otherwise. RL, sampling 8 answers per question, learns that the bare answer
   pays, on every phrasing including the held-out ones, and sharpens the facts.

What it does not ask of RL: learning the colour of an object that no SFT
example shows. On this 1M-parameter random-init model, group-relative RL learns
behaviour shared by all prompts (a style, a default answer) within a few steps,
but not new prompt-dependent facts: objects left to RL drift to whichever
colour the batch rewards most often (see docs in `artrl.demo`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final, Literal

from ..trajectories.data import Trajectory
from ..utils import choice_from_completion

Split = Literal["train", "val"]

COLOURS: Final = ("red", "blue", "green", "yellow", "white", "black")

OBJECTS: Final[dict[str, str]] = {
    "tomato": "red", "cherry": "red", "strawberry": "red", "ruby": "red",
    "sky": "blue", "ocean": "blue", "sapphire": "blue", "jeans": "blue",
    "grass": "green", "leaf": "green", "frog": "green", "cucumber": "green",
    "banana": "yellow", "lemon": "yellow", "butter": "yellow", "canary": "yellow",
    "snow": "white", "milk": "white", "cloud": "white", "salt": "white",
    "coal": "black", "crow": "black", "ink": "black", "tyre": "black",
}
"""Object -> its colour. Four objects per colour."""

TRAIN_TEMPLATES: Final = (
    "What colour is the {obj}?",
    "Which colour is the {obj}?",
    "Name the colour of the {obj}.",
    "The {obj} is which colour?",
)
"""Phrasings used for SFT data and RL rollouts."""

VAL_TEMPLATES: Final = (
    "What is the colour of the {obj}?",
    "Tell me the colour of the {obj}.",
)
"""Phrasings used only for validation (held out from all training)."""

ANSWER_STYLES: Final = ("{colour}", "{colour}, I think.")
"""How the warm-up data answers; the pair (object i, template j) uses style (i + j) % 2."""

HEDGED_REWARD: Final = 0.3
"""Reward for the right colour followed by more words ("yellow, I think.")."""

PARTIAL_REWARD: Final = 0.1
"""Reward for an answer that starts with a colour that is not the right one."""

MAX_TOKENS: Final = 6
"""Completion budget: exactly "yellow, I think." and the end-of-turn token. A tighter budget keeps the
rare runaway answer short, and so its share of an RL step's (token-summed) loss small."""


@dataclass(frozen=True)
class Scenario:
    """One question: an object, the phrasing template, and the split it belongs to."""

    obj: str
    template: str
    split: Split

    @property
    def colour(self) -> str:
        return OBJECTS[self.obj]

    @property
    def prompt(self) -> str:
        return self.template.format(obj=self.obj)

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]


def scenarios(split: Split) -> list[Scenario]:
    """Every (object, template) pair of a split, in a fixed order: 96 train, 48 val."""
    templates = {"train": TRAIN_TEMPLATES, "val": VAL_TEMPLATES}.get(split)
    if templates is None:
        raise ValueError(f"split={split!r}; expected 'train' or 'val'")
    return [Scenario(obj, t, split) for t in templates for obj in OBJECTS]


def sft_answer(scenario: Scenario) -> str:
    """The warm-up answer to a train scenario, in the style its (object, template) pair draws."""
    if scenario.template not in TRAIN_TEMPLATES:
        raise ValueError(f"{scenario.prompt!r} is not a train phrasing; the warm-up never answers "
                         "validation questions")
    i = list(OBJECTS).index(scenario.obj)
    j = TRAIN_TEMPLATES.index(scenario.template)
    return ANSWER_STYLES[(i + j) % len(ANSWER_STYLES)].format(colour=scenario.colour)


def sft_trajectories() -> list[Trajectory]:
    """The warm-up data: every train scenario answered in its style (96 examples, fixed order)."""
    out = []
    for s in scenarios("train"):
        answer = sft_answer(s)
        out.append(Trajectory(messages_and_choices=[*s.messages(), {"role": "assistant", "content": answer}],
                              reward=reward(answer, s.colour), metadata={"object": s.obj, "template": s.template}))
    return out


_WORD = re.compile(r"[a-z]+")


def words(text: str | None) -> list[str]:
    """The runs of letters of `text`, lower-cased ("Yellow, I think." -> ["yellow", "i", "think"])."""
    return _WORD.findall((text or "").lower())


def reward(answer: str | None, colour: str) -> float:
    """1.0 for exactly the right colour; HEDGED_REWARD if words follow it; PARTIAL_REWARD for a wrong colour."""
    ws = words(answer)
    if ws == [colour]:
        return 1.0
    if ws[:1] == [colour]:
        return HEDGED_REWARD
    if ws[:1] and ws[0] in COLOURS:
        return PARTIAL_REWARD
    return 0.0


async def rollout(model: Any, scenario: Scenario, *, client: Any = None, temperature: float = 1.0,
                  seed: int | None = None) -> Trajectory:
    """Ask the served model one question and grade its answer.

    `model` is a registered `art.Model`; `client` an `openai.AsyncOpenAI` (default:
    `model.openai_client()`). `seed` makes the sampled answer reproducible.
    Metrics: `correct` (reward 1), `right_colour` (the first word is the right
    colour, hedged or not), `one_word`.
    """
    client = client or model.openai_client()
    messages = scenario.messages()
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=MAX_TOKENS, temperature=temperature,
        logprobs=True, seed=seed)
    return graded(messages, choice_from_completion(completion), scenario.colour,
                  {"object": scenario.obj, "template": scenario.template, "split": scenario.split})


def graded(messages: list[Any], choice: Any, colour: str, metadata: dict[str, Any]) -> Trajectory:
    """The trajectory of one answered question: its reward, metrics and `metadata` with the answer added."""
    answer = choice.message.content
    r = reward(answer, colour)
    ws = words(answer)
    metrics = {"correct": float(r == 1.0), "right_colour": float(ws[:1] == [colour]), "one_word": float(len(ws) == 1)}
    return Trajectory(messages_and_choices=[*messages, choice], reward=r, metrics=metrics,
                      metadata={**metadata, "answer": answer})
