"""Learning-rate schedules as plain lists, one value per optimizer step.

Use with `TrainSFTConfig(learning_rate=cosine(2e-4, n_steps, warmup=2))`; a list
must have exactly one value per optimizer step of the call.
"""

from __future__ import annotations

import math

from ..errors import ConfigError


def _check(peak: float, steps: int, warmup: int) -> None:
    if steps < 1:
        raise ConfigError(f"a schedule needs steps >= 1, got {steps}")
    if not 0 <= warmup <= steps:
        raise ConfigError(f"warmup={warmup} must be between 0 and steps={steps}")
    if peak <= 0:
        raise ConfigError(f"peak learning rate must be > 0, got {peak}")


def _warm(peak: float, i: int, warmup: int) -> float:
    return peak * (i + 1) / (warmup + 1)


def constant(lr: float, steps: int, warmup: int = 0) -> list[float]:
    _check(lr, steps, warmup)
    return [_warm(lr, i, warmup) if i < warmup else lr for i in range(steps)]


def _decaying(peak: float, steps: int, warmup: int, floor: float, shape) -> list[float]:
    """Linear warm-up, then peak * shape(fraction of the decay done), never below `floor`."""
    _check(peak, steps, warmup)
    decay = steps - warmup
    return [_warm(peak, i, warmup) if i < warmup else max(shape((i - warmup) / decay), floor)
            for i in range(steps)]


def linear(peak: float, steps: int, warmup: int = 0, end: float = 0.0) -> list[float]:
    """Warm up linearly, then decay linearly from peak towards `end` (floor: `end`, or peak / 1000 if 0)."""
    return _decaying(peak, steps, warmup, end if end > 0 else peak * 1e-3, lambda f: peak + (end - peak) * f)


def cosine(peak: float, steps: int, warmup: int = 0, min_lr: float = 0.0) -> list[float]:
    """Warm up linearly, then cosine from peak down towards `min_lr` (floor: min_lr, or peak / 1000 if 0)."""
    return _decaying(peak, steps, warmup, min_lr or peak * 1e-3,
                     lambda f: min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * f)))
