"""The ART training loop, unchanged, on the colour quiz (`artrl.tasks.colours`).

    python examples/rl_loop.py --steps 10

Register a model with a LocalBackend (it resumes from its latest checkpoint),
then per step: gather a group of 8 rollouts for each question through the
model's OpenAI-compatible endpoint, delete old checkpoints, train on the groups.
A validation pass on held-out phrasings is logged at the end (`val/reward`).

Run examples/sft_then_rl.py first: the model is shared with it (same --path
and --name). On the untrained tiny model almost no answer names a colour, so
every answer in a group earns the same reward and the group has no advantage to
learn from; such a step still advances, with the same weights (as in ART), and
the log says "nothing was trained" for it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time

import artrl as art
from artrl.tasks import colours

log = logging.getLogger("rl_loop")


async def rollout(model: art.TrainableModel, client, scenario: colours.Scenario) -> art.Trajectory:
    # The rollout a user writes: ask through the OpenAI client, grade the answer (see colours.rollout).
    return await colours.rollout(model, scenario, client=client)


async def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    model = art.TrainableModel(name=args.name, project="artrl-examples", base_model="artrl/tiny")
    backend = art.LocalBackend(path=args.path)
    await model.register(backend)
    client = model.openai_client()  # one client for every rollout: a new client per request is ~3x slower
    rng = random.Random(args.seed)
    train_scenarios = colours.scenarios("train")
    start = await model.get_step()
    log.info("model %s at step %d; %d RL steps of %d questions x 8 rollouts", model.name, start, args.steps,
             args.questions)
    try:
        for step in range(start, start + args.steps):
            scenarios = rng.sample(train_scenarios, args.questions)
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, client, s) for _ in range(8)) for s in scenarios),
                pbar_desc=f"gather step {step}")
            await model.delete_checkpoints()
            # ART's dev option: advantages not divided by the group std (steadier here; see artrl/demo.py)
            result = await model.train(groups, config=art.TrainConfig(learning_rate=args.lr),
                                       _config=art.dev.TrainConfig(scale_rewards=False))
            rewards = [t.reward for g in groups for t in g.trajectories]
            log.info("step %d -> %d: mean train reward %.3f", step, result.step, sum(rewards) / len(rewards))
        val = await asyncio.gather(*(rollout(model, client, s)
                                     for s in colours.scenarios("val") for _ in range(2)))
        record = await model.log(list(val), split="val")
        log.info("step %d: validation reward %.3f (held-out phrasings); %.0f s in all", await model.get_step(),
                 record["val/reward"], time.perf_counter() - started)
    finally:
        backend.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="RL steps to run (default 10)")
    p.add_argument("--questions", type=int, default=32, help="questions per step, 8 rollouts each (default 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--path", default="./.art", help="LocalBackend directory (default ./.art)")
    p.add_argument("--name", default="colours", help="model name (default colours, shared with sft_then_rl.py)")
    p.add_argument("--seed", type=int, default=0, help="seed of the question order")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "uvicorn", "uvicorn.access", "uvicorn.error"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(main(p.parse_args()))
