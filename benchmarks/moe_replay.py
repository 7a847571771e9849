"""Routing replay on artrl/tiny-moe: how many sampled tokens the trainer would route otherwise, and what replay does.

Through the local server, 2 groups x 4 rollouts of 3 turns (12 tokens each, temperature 1); then two train calls
that only measure (learning rate 1e-12), with and without `moe_routing_replay`. Sampling and training run other
batch shapes (decode steps of several rows against packed rows), so in low precision some tokens' top-k differs.
One JSON line per dtype:

    python benchmarks/moe_replay.py [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from typing import Any

import artrl as art
from artrl.chat_format import message_of


async def _rollout(model: art.TrainableModel, client: Any, i: int) -> art.Trajectory:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Name a colour {i}."}]
    trajectory = art.Trajectory(messages_and_choices=list(messages), reward=float(i % 2))
    for turn in range(3):
        response = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                        max_tokens=12, temperature=1.0, seed=10 * i + turn)
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)
        messages.append(json.loads(json.dumps(message_of(choice))))
        nudge = {"role": "user", "content": "again"}
        messages.append(nudge)
        trajectory.messages_and_choices.append(nudge)
    return trajectory


async def measure(dtype: str, root: str) -> dict[str, Any]:
    model = art.TrainableModel(name="moe", project=dtype, base_model="artrl/tiny-moe",
                               _internal_config=art.InternalModelConfig(dtype=dtype))
    async with art.LocalBackend(path=root, show_progress=False) as backend:
        await model.register(backend)
        client = model.openai_client()
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(_rollout(model, client, 4 * g + k) for k in range(4)) for g in range(2)),
            pbar_desc=None)
        out: dict[str, Any] = {"bench": "moe_replay", "model": "artrl/tiny-moe", "dtype": dtype}
        for replay in (True, False):
            metrics = (await model.train(groups, config=art.TrainConfig(learning_rate=1e-12,
                                                                        moe_routing_replay=replay))).metrics
            out["with_replay" if replay else "without_replay"] = {
                k.removeprefix("train/"): v for k, v in metrics.items()
                if k.startswith("train/routing_") or "sampled_logprob_delta" in k}
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = p.parse_args()
    for dtype in args.dtype:
        with tempfile.TemporaryDirectory(prefix="artrl-moe-replay-") as root:
            print(json.dumps(asyncio.run(measure(dtype, root))), flush=True)


if __name__ == "__main__":
    main()
