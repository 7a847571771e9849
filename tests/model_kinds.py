"""The kinds of model every end-to-end property is checked on: the tiny model as it is, with quantised base weights,
the tiny mixture-of-experts model, and the tiny vision-language model in full precision and on 4-bit weights
(whose tests give it image-bearing data: `vision_content`). Each kind is (base_model, InternalModelConfig
fields). 4-bit computes in float32 here so that float noise stays at the dense model's level and the same
tolerances hold."""

from __future__ import annotations

from typing import Any

KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("artrl/tiny", {}),
    "4bit": ("artrl/tiny", {"load_in_4bit": True, "dtype": "float32"}),
    "moe": ("artrl/tiny-moe", {}),
    "vision": ("artrl/tiny-vl", {}),
    # the language model 4-bit, the vision tower and projector whole (models/quantization.py)
    "vision-4bit": ("artrl/tiny-vl", {"load_in_4bit": True, "dtype": "float32"}),
}

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def image_url(colour: str, size: tuple[int, int] = (56, 56)) -> str:
    """A solid image as a PNG data URL."""
    from PIL import Image

    from artrl.chat.images import data_url

    return data_url(Image.new("RGB", size, COLOURS[colour]))


def vision_content(text: str, colour: str, size: tuple[int, int] = (56, 56)) -> list[dict[str, Any]]:
    """A user message's content: the text, then a solid image."""
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image_url(colour, size)}}]


async def colour_rollout(model: Any, client: Any, i: int, turns: int = 3, content: Any = None) -> Any:
    """A `turns`-turn conversation with `model` through `client` (seeded sampling, "And another?" between turns),
    as a trajectory of its sampled Choices, rewarded i % 3; `content`: the first user turn's (default: a question
    naming colour number i)."""
    import json

    import artrl as art
    from artrl.chat.format import message_of

    messages: list[dict[str, Any]] = [{"role": "user", "content": content or f"Name colour number {i}."}]
    trajectory = art.Trajectory(messages_and_choices=list(messages), reward=float(i % 3))
    for turn in range(turns):
        response = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                        max_tokens=12, temperature=1.0, seed=100 * i + turn)
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)
        messages.append(json.loads(json.dumps(message_of(choice))))
        nudge = {"role": "user", "content": "And another?"}
        messages.append(nudge)
        trajectory.messages_and_choices.append(nudge)
    return trajectory
