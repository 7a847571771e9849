"""An agent that sees: SFT warm-up, then RL, on the image colour quiz (`artrl.tasks.image_colours`) with the
built-in vision-language model `artrl/tiny-vl`, offline, on a CPU, in minutes.

    python examples/image_colour_quiz.py            # about 7 minutes on a 2-core CPU
    python examples/image_colour_quiz.py --quick    # a smoke run, well under a minute

Each question is a 56 x 56 picture (a solid colour, stripes, checks or a square, made with Pillow) sent
as an OpenAI `image_url` part (a PNG data URL) with "What colour is this?". The ART loop is unchanged:

1. validation (held-out pictures and phrasings, 2 sampled answers each, seeded): the untrained model;
2. `train_sft` on the warm-up data (every train question answered "red" or "red, I think.", half and
   half), a cosine learning-rate schedule;
3. RL: per step, 8 rollouts per question through the local server (which runs the model's image
   processor and vision tower), `delete_checkpoints`, `train`. The grader pays 1.0 for a one-word answer
   only, so RL turns the hedged half of the answers into bare ones. Validation every few steps.

The run directory (`<path>/artrl-examples/models/image-quiz`, replaced at each run) gets the history
and `rewards.png`: train and validation reward per step, as `artrl demo` draws them (`artrl runs show`
reads the same history). docs/models.md shows the figures of a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import time
from pathlib import Path

import artrl as art
from artrl import schedules
from artrl.commands import runs
from artrl.run import storage
from artrl.tasks import image_colours

log = logging.getLogger("image_colour_quiz")

PROJECT, NAME, GROUP = "artrl-examples", "image-quiz", 8


def seed_of(*parts: int) -> int:
    """A reproducible sampling seed per request."""
    h = 0
    for p in parts:
        h = (h * 1_000_003 + p + 1) % (2**31 - 1)
    return h


async def validate(model: art.TrainableModel, client, samples: int) -> dict[str, float]:
    """`samples` seeded answers to each held-out question, logged as split 'val'; returns the mean reward and the
    shares of right colours and one-word answers."""
    trajectories = await asyncio.gather(*(image_colours.rollout(model, s, client=client, seed=seed_of(0, i, k))
                                          for i, s in enumerate(image_colours.scenarios("val"))
                                          for k in range(samples)))
    record = await model.log(list(trajectories), split="val")
    right = sum(t.metrics["right_colour"] for t in trajectories) / len(trajectories)
    one_word = sum(t.metrics["one_word"] for t in trajectories) / len(trajectories)
    log.info("step %d: validation reward %.3f (right colour %.0f%%, one-word answers %.0f%%)",
             await model.get_step(), record["val/reward"], 100 * right, 100 * one_word)
    return {"reward": record["val/reward"], "right_colour": right, "one_word": one_word}


async def main(args: argparse.Namespace) -> tuple[float, float, float]:
    """Run the quiz; returns the validation reward untrained, after SFT and after RL."""
    started = time.perf_counter()
    run = storage.run_dir(Path(args.path), PROJECT, NAME)
    if run.exists() and (run / storage.MODEL_FILE).exists():
        shutil.rmtree(run)  # a fresh model each run: the history and plot describe one run
    model = art.TrainableModel(name=NAME, project=PROJECT, base_model="artrl/tiny-vl",
                               _internal_config=art.InternalModelConfig(seed=args.seed))
    backend = art.LocalBackend(path=args.path, show_progress=False)
    await model.register(backend)
    client = model.openai_client()
    rng = random.Random(args.seed)
    try:
        before = await validate(model, client, args.val_samples)
        examples = image_colours.sft_trajectories()
        data = [t for _ in range(args.sft_epochs) for t in rng.sample(examples, len(examples))]
        n_steps = -(-len(data) // 8)
        await model.train_sft(data, config=art.TrainSFTConfig(
            learning_rate=schedules.cosine(args.sft_lr, n_steps), batch_size=8))
        after_sft = await validate(model, client, args.val_samples)

        questions = image_colours.scenarios("train")
        rates = schedules.cosine(args.rl_lr, args.steps, min_lr=args.rl_lr / 10) if args.steps else []
        after_rl = after_sft
        for i in range(args.steps):
            step = await model.get_step()
            asked = rng.sample(questions, args.questions)
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(image_colours.rollout(model, q, client=client, seed=seed_of(step, g, k))
                                     for k in range(GROUP)) for g, q in enumerate(asked)), pbar_desc=None)
            await model.delete_checkpoints()
            # ART's dev option, as artrl demo: advantages not divided by the group std
            await model.train(groups, config=art.TrainConfig(learning_rate=rates[i]),
                              _config=art.dev.TrainConfig(scale_rewards=False))
            rewards = [t.reward for g in groups for t in g]
            log.info("RL step %d/%d: train reward %.3f", i + 1, args.steps, sum(rewards) / len(rewards))
            if (i + 1) % args.val_every == 0 or i + 1 == args.steps:
                after_rl = await validate(model, client, args.val_samples)
        await model.delete_checkpoints()
    finally:
        backend.close()
    plot = runs.plot_run(runs.step_table(runs.load_history(run)), run / "rewards.png",
                         f"image colour quiz, artrl/tiny-vl, seed {args.seed}")
    wall = time.perf_counter() - started
    print(f"\nvalidation reward: untrained {before['reward']:.3f}, after SFT {after_sft['reward']:.3f}, after RL "
          f"{after_rl['reward']:.3f} ({after_rl['reward'] - after_sft['reward']:+.3f} from RL); {wall:.0f} s; plot {plot}")
    if args.json:
        result = {"untrained": before, "after_sft": after_sft, "after_rl": after_rl, "wall_s": round(wall, 1),
                  "args": {k: v for k, v in vars(args).items() if k not in ("path", "json")}}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return before["reward"], after_sft["reward"], after_rl["reward"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default="./.art", help="LocalBackend directory (default ./.art)")
    p.add_argument("--steps", type=int, default=30, help="RL steps (default 30)")
    p.add_argument("--questions", type=int, default=16, help="questions per RL step, 8 rollouts each (default 16)")
    p.add_argument("--sft-epochs", type=int, default=20, help="passes over the 108 warm-up examples (default 20)")
    p.add_argument("--sft-lr", type=float, default=1e-2, help="peak SFT learning rate (default 1e-2)")
    p.add_argument("--rl-lr", type=float, default=3e-3, help="first RL learning rate, cosine to a tenth (default 3e-3)")
    p.add_argument("--val-every", type=int, default=5, help="validate every this many RL steps (default 5)")
    p.add_argument("--val-samples", type=int, default=2, help="answers per validation question (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the run's figures (validation reward, right colours and "
                   "one-word answers untrained, after SFT and after RL; seconds) to this file")
    p.add_argument("--quick", action="store_true", help="2 SFT epochs, 2 RL steps of 4 questions (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.questions, args.sft_epochs, args.val_every, args.val_samples = 2, 4, 2, 1, 1
    return args


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "httpx2", "httpcore", "uvicorn", "uvicorn.access", "uvicorn.error", "openai", "matplotlib",
                  "artrl.local.backend", "artrl.serve.http.background", "artrl.models.loading"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(main(parse_args()))
