"""RL as a user's loop runs it: concurrent rollouts through the local server, the bare model name.

`python benchmarks/bench.py learn` samples one request at a time so that its figures do not depend on timing. A
user's loop does not: it gathers every rollout of a step at once (`art.gather_trajectory_groups`),
the engine batches them however they arrive, and the client asks for `model.name`. This script is
that loop on a task the project never trained for, so a change that shows only there (batched
decoding, the bare name's version, the client) is measured too:

* the reward is the share of vowel characters (a, e, i, o, u, either case) among all characters
  of a reply of at most 16 tokens, 0 for an empty one;
* each step samples 8 replies to each of 6 short prompts, one request per reply, all 48 at once,
  temperature 1, each request seeded from (seed, step, prompt, sample);
* then `model.train(groups, config=TrainConfig(learning_rate=3e-2))`, 20 steps;
* gain = mean step reward of the last 5 steps minus that of the first 5.

Prints one JSON line per run: the seed, every step's mean reward, the gain and the largest
`train/sampled_logprob_delta_max` of the run (the served policy against the trained one). The
batches depend on timing, so two runs of one seed agree only until float noise makes a sample
differ; compare means over many seeds (docs/performance.md, "Learning per rollout").

    PYTHONPATH=src python benchmarks/learn_concurrent.py --seeds 0 1 2 >> learn-concurrent.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import sys
import tempfile
from pathlib import Path

import artrl as art

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.harness
from benchmarks.harness.learn_tasks import GENERIC_PROMPTS  # noqa: E402

PROMPTS = GENERIC_PROMPTS[:6]
SAMPLES = 8
STEPS = 20
MAX_TOKENS = 16
LEARNING_RATE = 3e-2
WINDOW = 5


def vowel_share(text: str | None) -> float:
    """Share of vowel characters among all characters of `text` ("Ae b" -> 0.5; "" -> 0.0)."""
    text = text or ""
    return sum(c in "aeiouAEIOU" for c in text) / len(text) if text else 0.0


async def run(seed: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        backend = art.LocalBackend(path=d, show_progress=False)
        model = art.TrainableModel(name="vowels", project="learn", base_model="artrl/tiny",
                                   _internal_config=art.dev.InternalModelConfig(seed=seed))
        await model.register(backend)
        client = model.openai_client()
        rewards = []
        for step in range(steps):
            async def rollout(i: int, k: int) -> art.Trajectory:
                messages = [{"role": "user", "content": PROMPTS[i]}]
                completion = await client.chat.completions.create(
                    model=model.name, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, logprobs=True,
                    seed=seed * 100_000 + step * 1000 + i * 10 + k)
                choice = completion.choices[0]
                return art.Trajectory(messages_and_choices=[*messages, choice], reward=vowel_share(choice.message.content))

            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(i, k) for k in range(SAMPLES)) for i in range(len(PROMPTS))],
                pbar_desc=None)
            rewards.append(sum(t.reward for g in groups for t in g.trajectories) / (len(PROMPTS) * SAMPLES))
            await model.train(groups, config=art.TrainConfig(learning_rate=LEARNING_RATE))
        deltas = [json.loads(line).get("train/sampled_logprob_delta_max")
                  for f in glob.glob(f"{d}/**/history.jsonl", recursive=True) for line in open(f)]
        await backend.close()
    w = min(WINDOW, steps // 2)
    return {"seed": seed, "steps": steps, "rewards": [round(r, 4) for r in rewards],
            "gain": round(sum(rewards[-w:]) / w - sum(rewards[:w]) / w, 4),
            "delta_max": max((x for x in deltas if x is not None), default=None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=STEPS)
    args = p.parse_args()
    for seed in args.seeds:
        print(json.dumps(asyncio.run(run(seed, args.steps))), flush=True)


if __name__ == "__main__":
    main()
