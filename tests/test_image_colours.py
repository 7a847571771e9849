"""The image colour quiz (artrl.tasks.image_colours) and its worked example (examples/image_colour_quiz.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
from collections import Counter

import numpy as np
import pytest

from artrl.chat.images import MediaPolicy, load_image
from artrl.tasks import image_colours

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "image_colour_quiz.py"


def test_train_and_validation_pictures_and_phrasings_are_disjoint():
    train, val = image_colours.scenarios("train"), image_colours.scenarios("val")
    assert (len(train), len(val)) == (108, 48)
    assert not {s.template for s in train} & {s.template for s in val}
    train_pictures = {s.image().tobytes() for s in train}
    assert not train_pictures & {s.image().tobytes() for s in val}
    assert len(train_pictures) == 6 * 3 * 2  # each (colour, pattern, shade) its own picture
    assert Counter(s.colour for s in val) == {c: 8 for c in image_colours.RGB}


def test_each_picture_shows_its_colour_and_travels_as_a_png_data_url():
    for s in image_colours.scenarios("val")[:12]:
        url = s.messages()[0]["content"][0]["image_url"]["url"]
        image = load_image(url, MediaPolicy(), "x").image
        pixels = Counter(map(tuple, np.asarray(image.convert("RGB")).reshape(-1, 3).tolist()))
        near = [p for p in pixels if all(abs(a - b) <= image_colours.SHADE_JITTER
                                         for a, b in zip(p, image_colours.RGB[s.colour]))]
        assert sum(pixels[p] for p in near) >= 0.25 * image.width * image.height, s


def test_the_warm_up_answers_bare_and_hedged_half_and_half_whatever_the_colour():
    data = image_colours.sft_trajectories()
    answers = [t.messages_and_choices[-1]["content"] for t in data]
    hedged = [a for a in answers if a.endswith(", I think.")]
    assert len(hedged) == len(data) // 2
    assert Counter(a.split(",")[0] for a in hedged) == {c: 9 for c in image_colours.RGB}
    with pytest.raises(ValueError, match="never answers validation"):
        image_colours.sft_answer(image_colours.scenarios("val")[0])


@pytest.mark.slow
def test_the_example_learns_to_read_the_pictures(tmp_path):
    spec = importlib.util.spec_from_file_location("image_colour_quiz", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--path", str(tmp_path), "--sft-epochs", "8", "--steps", "3", "--questions", "8",
                              "--val-every", "3", "--val-samples", "1"])
    before, after_sft, after_rl = asyncio.run(module.main(args))
    # six colours: naming the right one by chance is 1 in 6; the untrained model names none
    assert before < 0.1 and after_sft > 0.3 and after_rl > 0.3, (before, after_sft, after_rl)
    assert (tmp_path / "artrl-examples" / "models" / "image-quiz" / "rewards.png").is_file()
