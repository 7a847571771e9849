"""The CPU decode worker sets its own thread count without touching the caller's (the trainer's)."""

from __future__ import annotations

import asyncio

import torch

from artrl.serve import GenerationRequest, TransformersEngine
from artrl.models.loading import load_model
from artrl.config.model import InternalModelConfig


def test_decode_threads_leave_the_caller_alone(tiny_path):
    model, tok = load_model(str(tiny_path), InternalModelConfig(seed=0))
    before = torch.get_num_threads()
    wanted = 1 if before > 1 else 2
    inside: list[int] = []
    hook = model.register_forward_hook(lambda *args: inside.append(torch.get_num_threads()))
    engine = TransformersEngine(model, tok, num_threads=wanted)
    try:
        asyncio.run(engine.generate(GenerationRequest(prompt_ids=tok("hello", add_special_tokens=False).input_ids,
                                                      max_tokens=2, temperature=0.0)))
    finally:
        engine.close()
        hook.remove()
    assert inside and set(inside) == {wanted}  # the decode worker ran with its own count
    assert torch.get_num_threads() == before  # the calling thread kept its own
