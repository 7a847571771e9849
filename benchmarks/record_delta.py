"""Does the trainer see the context each sampled turn was sampled from? (docs/token-record.md)

Twenty two-turn rollouts through the local server on the tiny model; each trajectory is
tokenized as a train call would, and its sampled tokens are scored by the trainer (same
weights, no update). Prints how many trajectories have a sampled token whose trainer logprob
differs from the sampled one by more than 1e-3 (float noise is ~1e-5). Counts only; runs
against whichever artrl is on the path, so it compares versions:

    PYTHONPATH=src python benchmarks/record_delta.py
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

import torch

import artrl as art
from artrl.preprocess.pack import pack
from artrl.trajectories.tokenization import tokenize_groups

ROLLOUTS = 20
TOLERANCE = 1e-3


async def rollout(model: art.TrainableModel, client: Any, i: int) -> art.Trajectory:
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"Question {i}?"}]
    items: list[Any] = list(messages)
    for turn in range(2):
        response = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                        max_tokens=16, temperature=1.0, logprobs=True)
        choice = response.choices[0]
        follow_up = {"role": "user", "content": f"And then {turn}?"}
        messages += [{"role": "assistant", "content": choice.message.content}, follow_up]
        items += [choice, follow_up]
    return art.Trajectory(messages_and_choices=items, reward=float(i % 2))


async def main() -> None:
    model = art.TrainableModel(name="x", project="p", base_model="artrl/tiny")
    backend = art.LocalBackend(path=tempfile.mkdtemp(), show_progress=False)
    await model.register(backend)
    client = model.openai_client()
    trajectories = [await rollout(model, client, i) for i in range(ROLLOUTS)]
    trainer = backend._runs["x"].trainer
    off = 0
    for t in trajectories:
        pair = art.TrajectoryGroup([t, t.model_copy(update={"reward": t.reward + 1})])  # a non-zero advantage
        sequences = [s for s in tokenize_groups([pair], trainer.tokenizer).sequences if s.trajectory_index == 0]
        packed = pack([sequences], max_length=trainer.max_length, share_prompts=False)
        tb = trainer.forward_tokens(packed.select(range(packed.num_rows)), grad=False)
        known = ~torch.isnan(tb.old_logprobs)  # [n]
        off += float((tb.logprobs - tb.old_logprobs)[known].abs().max()) > TOLERANCE
    print(f"{off} of {ROLLOUTS} two-turn trajectories have a sampled token whose trainer logprob differs "
          f"from the sampled one by more than {TOLERANCE}")
    backend.close()


if __name__ == "__main__":
    asyncio.run(main())
