"""Routing replay on artrl/tiny-moe: how many sampled tokens the trainer would route otherwise, and what replay does.

Through the local server, 2 groups x 4 rollouts of 3 turns (12 tokens each, temperature 1); then two train calls
that only measure (learning rate 1e-12), with and without `moe_routing_replay`. Sampling and training run other
batch shapes (decode steps of several rows against packed rows), so in low precision some tokens' top-k differs.
`first_token` splits the replayed delta (|trainer - sampled| logprob, the first optimizer step's micro-batches)
between each turn's first sampled token (predicted at the prompt's last position) and the others, with the records
as the server returned them (`recorded`) and without their prompt's-last-position field (`without_prompt_last`:
that position routes freely, as records of older servers). One JSON line per dtype:

    python benchmarks/moe_replay.py [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import tempfile
from typing import Any

import torch

import artrl as art
from artrl.chat.format import message_of
from artrl.models import moe


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
        trainer = backend._runs[model.name].trainer
        stripped = copy.deepcopy(groups)
        for group in stripped:
            for trajectory in group.trajectories:
                for item in trajectory.messages_and_choices:
                    if not isinstance(item, dict):
                        item.model_extra[moe.RECORD_KEY].pop(moe.PROMPT_LAST_KEY, None)
        out["first_token"] = {"recorded": _split_delta(trainer, groups),
                              "without_prompt_last": _split_delta(trainer, stripped)}
        return out


def _split_delta(trainer: Any, groups: list[art.TrajectoryGroup]) -> dict[str, float]:
    """Max and mean |trainer - sampled| logprob under replay over the first optimizer step's micro-batches, each
    turn's first sampled token apart from the others."""
    from artrl.train.rl import prepare_rl

    call = prepare_rl(trainer.build_context(), groups, art.TrainConfig(learning_rate=1e-12))
    first, other = [], []
    with torch.no_grad():
        for mb in call.plan.steps[0].micro_batches:
            sub = call.packed.select(mb.rows, mb.width)
            with trainer.routed(sub, replay=True):
                tb = trainer.forward_tokens(sub, grad=False)
            b, t = sub.trainable_mask.nonzero(as_tuple=True)
            is_first = ~sub.trainable_mask[b, sub.prev_index[b, t]]  # the slot before it holds a prompt token
            delta = (tb.logprobs.float() - tb.old_logprobs.float()).abs().cpu()
            first.append(delta[is_first])
            other.append(delta[~is_first])
    f, o = torch.cat(first), torch.cat(other)
    return {"first_tokens": f.numel(), "first_delta_max": float(f.max()), "first_delta_mean": float(f.mean()),
            "other_tokens": o.numel(), "other_delta_max": float(o.max()), "other_delta_mean": float(o.mean())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = p.parse_args()
    for dtype in args.dtype:
        with tempfile.TemporaryDirectory(prefix="artrl-moe-replay-") as root:
            print(json.dumps(asyncio.run(measure(dtype, root))), flush=True)


if __name__ == "__main__":
    main()
