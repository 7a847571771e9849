"""A learning rate far below what a built-in model needs is said once per model, with the rate that works
(train/rate_advice.py); a sane rate, a rate of 0 and a model with no known figure (a Hugging Face model) are
not advised. The whole path (three train calls of ART's skill program, one notice on stderr) is in
tests/test_art_skill_programs.py."""

from __future__ import annotations

import logging

import pytest

from artrl.models.tiny import WORKING_LEARNING_RATES
from artrl.runtime import notices
from artrl.train.rate_advice import FAR_BELOW, advise_learning_rate, low_rate_advice


@pytest.mark.parametrize("base_model, kind, rate, advised", [
    ("artrl/tiny", "rl", 1e-5, True),              # ART's train-rl skill default
    ("artrl/tiny", "rl", 5e-6, True),              # TrainConfig's default (ART's)
    ("artrl/tiny", "sft", 5e-5, True),             # TrainSFTConfig's default (ART's)
    ("artrl/tiny", "sft", [5e-5, 2.5e-5, 0.0], True),
    ("artrl/tiny", "rl", 9e-5, True),              # just under a tenth of the working range's low end
    ("artrl/tiny", "rl", 1e-4, False),             # a tenth of it: close enough to be a choice
    ("artrl/tiny", "sft", [2e-4, 1e-4, 0.0], False),  # train_sft_from_file's default peak
    ("artrl/tiny", "rl", 5e-3, False),             # the README's loop
    ("artrl/tiny", "rl", 0.0, False),              # no update asked for: a choice, not a mistake
    ("artrl/tiny-moe", "rl", 1e-5, True),
    ("artrl/tiny-vl", "sft", 1e-5, True),
    ("artrl/bench-100m", "rl", 1e-9, False),       # no measured figure for it
    ("Qwen/Qwen3-0.6B", "rl", 1e-9, False),        # a real model: its rate is the user's business
    ("/models/my-qwen", "sft", 1e-7, False),
])
def test_which_rates_are_advised(base_model, kind, rate, advised):
    assert (low_rate_advice(base_model, kind, rate) is not None) == advised


def test_the_advice_names_the_rate_the_range_and_where_to_set_it():
    low, high, start = WORKING_LEARNING_RATES["artrl/tiny"]
    assert low / FAR_BELOW <= 1e-4 and low <= start <= high  # the README's figure, 5e-3, is in the range
    rl = low_rate_advice("artrl/tiny", "rl", 1e-5)
    assert rl.startswith("learning_rate 1e-5 is far below what artrl/tiny needs to learn")
    assert "about 1e-3 to 1e-2" in rl and "Start from learning_rate=5e-3 (TrainConfig's" in rl
    sft = low_rate_advice("artrl/tiny", "sft", [5e-5, 1.5e-5])
    assert sft.startswith("the learning-rate schedule's peak 5e-5 is far below") and "peak_lr" in sft


def test_it_is_said_once_per_base_model(caplog):
    notices.forget()
    with caplog.at_level(logging.WARNING, logger=notices.NOTICES_LOGGER):
        said = [advise_learning_rate("artrl/tiny", "rl", 1e-5), advise_learning_rate("artrl/tiny", "sft", 1e-6),
                advise_learning_rate("artrl/tiny", "rl", 5e-3), advise_learning_rate("Qwen/Qwen3-0.6B", "rl", 1e-9),
                advise_learning_rate("artrl/tiny-moe", "rl", 1e-5)]
    assert said == [True, False, False, False, True]
    assert [r.getMessage().split(" is far below what ")[1].split()[0] for r in caplog.records] == \
        ["artrl/tiny", "artrl/tiny-moe"]
    notices.forget()
