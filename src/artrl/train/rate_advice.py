"""A learning rate far below what a built-in model needs is said once per model, with the rate that works.

ART's skills start RL at 1e-5 and SFT at a peak of 2e-4: rates for a pretrained model of billions of
parameters. artrl's built-in models are tiny and randomly initialised, and their LoRA learns at about 1e-3 to
1e-2 (`models.tiny.WORKING_LEARNING_RATES`, docs/getting-started.md); at a real model's rate the weights barely
move, and a few steps of reward look like noise. So the first train call of a built-in model in a process
whose learning rate (a schedule's peak, for SFT) is more than `FAR_BELOW` times under the low end of that range
is told so once (runtime/notices.py), with the rate to start from. Only the first call is read: a schedule's
tail is low by design. A model without a known figure (any Hugging Face model, `artrl/bench-100m`) is never
advised; nor is a rate of 0, which is a choice.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..runtime.notices import notice_once

FAR_BELOW = 10.0
"""How many times under the low end of a built-in model's working range a rate must be to be advised."""


def _rate(x: float) -> str:
    """1e-05 -> "1e-5", 0.00015 -> "1.5e-4": how the docs write a learning rate."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def low_rate_advice(base_model: str, kind: str, learning_rate: float | Sequence[float]) -> str | None:
    """The advice for a train call of `kind` ("rl" or "sft") on `base_model` at `learning_rate` (one rate or one
    per optimizer step), or None when the rate is in reach of what the model needs (or nothing is known of it)."""
    from ..models.tiny import WORKING_LEARNING_RATES

    working = WORKING_LEARNING_RATES.get(base_model)
    if working is None:
        return None
    low, high, start = working
    rates = [float(learning_rate)] if isinstance(learning_rate, (int, float)) else [float(r) for r in learning_rate]
    peak = max(rates, default=0.0)
    if peak <= 0 or peak * FAR_BELOW >= low:
        return None
    what = "learning_rate" if len(rates) == 1 else "the learning-rate schedule's peak"
    where = ("TrainConfig's, or backend.train's keyword" if kind == "rl"
             else "TrainSFTConfig's, or train_sft_from_file's peak_lr")
    return (f"{what} {_rate(peak)} is far below what {base_model} needs to learn: a tiny, randomly initialised "
            f"model's LoRA learns at about {_rate(low)} to {_rate(high)} (a pretrained model's rate barely moves "
            f"it), so its reward and loss will look like noise. Start from learning_rate={_rate(start)} ({where}); "
            "keep the low rate for a real model (docs/getting-started.md).")


def advise_learning_rate(base_model: str, kind: str, learning_rate: float | Sequence[float]) -> bool:
    """Say `low_rate_advice` once per base model in this process; True when it was said now."""
    advice = low_rate_advice(base_model, kind, learning_rate)
    return advice is not None and notice_once(f"train.low_learning_rate.{base_model}", advice)
