"""Learning-rate schedules: one value per step, warm-up, decay to the floor."""

import pytest

from artrl import schedules
from artrl.errors import ConfigError


def test_shapes():
    assert schedules.constant(1e-3, 3) == [1e-3] * 3
    assert schedules.linear(1e-2, 5) == pytest.approx([0.01, 0.008, 0.006, 0.004, 0.002])
    cos = schedules.cosine(1e-2, 6, warmup=1, min_lr=1e-3)
    assert len(cos) == 6 and cos[0] == pytest.approx(0.005) and cos[1] == pytest.approx(0.01)
    assert all(a >= b for a, b in zip(cos[1:], cos[2:])) and min(cos) >= 1e-3


def test_bad_arguments():
    with pytest.raises(ConfigError, match="warmup=5 must be between 0 and steps=3"):
        schedules.cosine(1e-3, 3, warmup=5)
    with pytest.raises(ConfigError, match="steps >= 1"):
        schedules.linear(1e-3, 0)
