"""SFT warm-up, then RL, on the colour quiz (`artrl.tasks.colours`) with the tiny model.

    python examples/sft_then_rl.py --steps 20

1. `train_sft` on the warm-up data (every train question, answered "yellow" or
   "yellow, I think." half and half), with a cosine learning-rate schedule.
2. RL: per step, 8 rollouts per question, `delete_checkpoints`, `train`. The
   grader pays 1.0 for a one-word answer only, so RL turns the hedged half of
   the answers into bare ones.
3. Validation (held-out phrasings) before RL and every few steps, logged as
   `val/reward` in the run's history.jsonl.

The model resumes from its latest checkpoint (ART's behaviour): a second run
with the same --path and --name skips the warm-up and continues RL. Use
`artrl demo` for a fresh run with a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time

import artrl as art
from artrl.tasks import colours

log = logging.getLogger("sft_then_rl")


async def validate(model: art.TrainableModel, client) -> float:
    """Two sampled answers to each held-out question, logged as split 'val'."""
    trajectories = await asyncio.gather(*(colours.rollout(model, s, client=client)
                                          for s in colours.scenarios("val") for _ in range(2)))
    record = await model.log(list(trajectories), split="val")
    return record["val/reward"]


async def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    model = art.TrainableModel(name=args.name, project="artrl-examples", base_model="artrl/tiny")
    backend = art.LocalBackend(path=args.path)
    await model.register(backend)
    client = model.openai_client()  # one client for every rollout: a new client per request is ~3x slower
    rng = random.Random(args.seed)
    try:
        if await model.get_step() == 0:
            log.info("step 0: validation reward %.3f (untrained)", await validate(model, client))
            examples = colours.sft_trajectories()
            data = [t for _ in range(args.sft_epochs) for t in rng.sample(examples, len(examples))]
            n_steps = -(-len(data) // 8)
            await model.train_sft(data, config=art.TrainSFTConfig(
                learning_rate=art.schedules.cosine(1e-2, n_steps), batch_size=8))
        else:
            log.info("resuming %s at step %d: skipping the warm-up", model.name, await model.get_step())
        log.info("step %d: validation reward %.3f (before RL)", await model.get_step(), await validate(model, client))

        train_scenarios = colours.scenarios("train")
        start = await model.get_step()
        for i, step in enumerate(range(start, start + args.steps)):
            scenarios = rng.sample(train_scenarios, args.questions)
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(colours.rollout(model, s, client=client) for _ in range(8)) for s in scenarios),
                pbar_desc=f"gather step {step}")
            await model.delete_checkpoints()
            # ART's dev option: advantages not divided by the group std (steadier here; see artrl/demo.py)
            result = await model.train(groups, config=art.TrainConfig(learning_rate=args.lr),
                                       _config=art.dev.TrainConfig(scale_rewards=False))
            rewards = [t.reward for g in groups for t in g.trajectories]
            line = f"step {step} -> {result.step}: mean train reward {sum(rewards) / len(rewards):.3f}"
            if (i + 1) % 5 == 0 or i + 1 == args.steps:
                line += f"; validation reward {await validate(model, client):.3f}"
            log.info(line)
        log.info("done in %.0f s; history in %s", time.perf_counter() - started,
                 backend.path / "artrl-examples" / "models" / model.name / "history.jsonl")
    finally:
        backend.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="RL steps (default 20)")
    p.add_argument("--sft-epochs", type=int, default=20, help="passes over the 96 warm-up examples (default 20)")
    p.add_argument("--questions", type=int, default=32, help="questions per RL step, 8 rollouts each (default 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="RL learning rate (default 3e-3)")
    p.add_argument("--path", default="./.art", help="LocalBackend directory (default ./.art)")
    p.add_argument("--name", default="colours", help="model name (default colours, shared with rl_loop.py)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "uvicorn", "uvicorn.access", "uvicorn.error"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(main(p.parse_args()))
