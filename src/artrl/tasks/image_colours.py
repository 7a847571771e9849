"""The image colour quiz: an image and "What colour is this?" -> "red". The vision-language tiny model's task.

The text colour quiz (`artrl.tasks.colours`) with the object replaced by a picture, for `artrl/tiny-vl`:

1. **Pictures.** 56 x 56 images made with Pillow (4 image tokens each): a solid colour, or a pattern of
   the colour on white or black (stripes, a checkerboard, a centred square). Six colours, one token each
   in the tiny tokenizer. Each picture's shade is the colour jittered by up to `SHADE_JITTER` per channel,
   drawn from the scenario's own seed.
2. **Held-out pictures and phrasings.** Train scenarios use `TRAIN_PATTERNS` and `TRAIN_TEMPLATES`;
   validation asks about `VAL_PATTERNS`, in other shades, with `VAL_TEMPLATES`: no training step sees a
   validation picture or phrasing.
3. **SFT imitates, RL optimises**, as in the text quiz: the warm-up answers come bare ("red") or hedged
   ("red, I think.") half and half, the grader (`colours.reward`) pays 1.0 for the bare right colour, 0.3
   for a hedged one, 0.1 for a wrong colour. The vision tower is random and frozen (LoRA adapts the
   language model only), so what the model learns to read is the tower's random features of each colour.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Final, Literal

from PIL import Image, ImageDraw

from ..chat.images import data_url
from ..trajectories.data import Trajectory
from ..utils import choice_from_completion
from .colours import ANSWER_STYLES, MAX_TOKENS, graded, reward

Split = Literal["train", "val"]

RGB: Final[dict[str, tuple[int, int, int]]] = {
    "red": (210, 40, 40), "blue": (40, 70, 210), "green": (40, 170, 60),
    "yellow": (235, 215, 50), "white": (245, 245, 245), "black": (20, 20, 20),
}
"""Colour name -> its base RGB (each name is one token of the tiny tokenizer)."""

SIZE: Final = 56
SHADE_JITTER: Final = 25
"""Largest change per channel of a picture's shade from its colour's base RGB."""

TRAIN_PATTERNS: Final = ("solid", "stripes", "checks")
VAL_PATTERNS: Final = ("solid", "square")
"""Pictures of training and validation (a validation solid is another shade than any training one)."""

TRAIN_TEMPLATES: Final = ("What colour is this?", "Which colour is shown?", "Name the colour of this picture.")
VAL_TEMPLATES: Final = ("What colour do you see?", "Tell me the colour of this image.")

SHADES_PER_PATTERN: Final = 2
"""Shades of each (colour, pattern) pair: train 6 x 3 x 2 pictures x 3 phrasings = 108 scenarios; val 48."""


@dataclass(frozen=True)
class Scenario:
    """One question: a colour, how its picture is drawn, the phrasing, and the split."""

    colour: str
    pattern: str
    shade: int
    template: str
    split: Split

    def image(self) -> Image.Image:
        """The picture (deterministic: its shade comes from the scenario's own seed)."""
        rng = random.Random(f"{self.split}:{self.colour}:{self.pattern}:{self.shade}")
        rgb = tuple(max(0, min(255, c + rng.randint(-SHADE_JITTER, SHADE_JITTER))) for c in RGB[self.colour])
        ground = (0, 0, 0) if self.colour in ("white", "yellow") else (255, 255, 255)
        if self.pattern == "solid":
            return Image.new("RGB", (SIZE, SIZE), rgb)
        image = Image.new("RGB", (SIZE, SIZE), ground)
        draw = ImageDraw.Draw(image)
        step = SIZE // 4
        if self.pattern == "stripes":
            for y in range(0, SIZE, step):
                draw.rectangle((0, y, SIZE, y + step // 2 + 2), fill=rgb)
        elif self.pattern == "checks":
            for y in range(0, SIZE, step):
                for x in range(0, SIZE, step):
                    if (x // step + y // step) % 2 == 0:
                        draw.rectangle((x, y, x + step - 1, y + step - 1), fill=rgb)
        elif self.pattern == "square":
            draw.rectangle((step // 2, step // 2, SIZE - step // 2, SIZE - step // 2), fill=rgb)
        else:
            raise ValueError(f"pattern {self.pattern!r}; expected one of {TRAIN_PATTERNS + VAL_PATTERNS}")
        return image

    def messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(self.image())}},
                                             {"type": "text", "text": self.template}]}]


def scenarios(split: Split) -> list[Scenario]:
    """Every (colour, pattern, shade, phrasing) of a split, in a fixed order: 108 train, 48 val."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}; expected 'train' or 'val'")
    patterns, templates = (TRAIN_PATTERNS, TRAIN_TEMPLATES) if split == "train" else (VAL_PATTERNS, VAL_TEMPLATES)
    return [Scenario(colour, pattern, shade, template, split) for template in templates for pattern in patterns
            for shade in range(SHADES_PER_PATTERN) for colour in RGB]


def sft_answer(scenario: Scenario) -> str:
    """The warm-up answer of a train scenario: bare or hedged, half and half, independent of the colour."""
    if scenario.split != "train":
        raise ValueError("the warm-up never answers validation questions")
    k = list(RGB).index(scenario.colour) + TRAIN_TEMPLATES.index(scenario.template) + scenario.shade
    return ANSWER_STYLES[k % len(ANSWER_STYLES)].format(colour=scenario.colour)


def sft_trajectories() -> list[Trajectory]:
    """The warm-up data: every train scenario answered in its style (108 examples, fixed order)."""
    out = []
    for s in scenarios("train"):
        answer = sft_answer(s)
        out.append(Trajectory(messages_and_choices=[*s.messages(), {"role": "assistant", "content": answer}],
                              reward=reward(answer, s.colour),
                              metadata={"colour": s.colour, "pattern": s.pattern, "template": s.template}))
    return out


async def rollout(model: Any, scenario: Scenario, *, client: Any = None, temperature: float = 1.0,
                  seed: int | None = None) -> Trajectory:
    """Show the served model the picture, ask, and grade the answer (metrics as `colours.rollout`)."""
    client = client or model.openai_client()
    messages = scenario.messages()
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=MAX_TOKENS, temperature=temperature,
        seed=seed)
    return graded(messages, choice_from_completion(completion), scenario.colour,
                  {"colour": scenario.colour, "pattern": scenario.pattern, "split": scenario.split})
