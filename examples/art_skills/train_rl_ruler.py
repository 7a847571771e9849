"""The colour quiz's RL script with RULER as the reward, written as ART 0.5.23's `train-rl` skill has a user
write it when the answer to "Reward choice" is the skill's default, RULER, with its recommended judge.

It reuses the existing rollout (train_rl.py), as the skill asks: RULER rescores each group with
`after_each=lambda group: ruler_score_group(...)`, and OPENAI_API_KEY is checked at start-up. The judge is a
hosted model: without the network, the run stops at the first group with one line naming the judge, its
endpoint and the offline way out.

    OPENAI_API_KEY=... python train_rl_ruler.py [--judge-model openai/gpt-5.4]
"""

import argparse
import asyncio
import os
import sys

import art
from art.local import LocalBackend
from art.rewards import ruler_score_group
from art.utils.iterate_dataset import iterate_dataset

from train_rl import TRAIN_SCENARIOS, rollout


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--judge-model", default="openai/gpt-5.4")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--rollouts-per-group", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    return p.parse_args()


async def main() -> None:
    args = parse_args()
    if not os.environ.get("OPENAI_API_KEY"):
        sys.exit("OPENAI_API_KEY is not set: RULER's judge needs it")
    backend = LocalBackend()
    model = art.TrainableModel(
        name="quiz-rl-ruler-001",
        project="colour-quiz",
        base_model="artrl/tiny",
    )
    await model.register(backend)

    for batch in iterate_dataset(
        TRAIN_SCENARIOS,
        groups_per_step=args.groups_per_step,
        num_epochs=args.num_epochs,
        initial_step=await model.get_step(),
    ):
        train_groups = await art.gather_trajectory_groups(
            [
                art.TrajectoryGroup(
                    (rollout(model, scenario, args) for _ in range(args.rollouts_per_group)),
                    metadata={"scenario_id": scenario.id},
                )
                for scenario in batch.items
            ],
            after_each=lambda group: ruler_score_group(
                group,
                judge_model=args.judge_model,
            ),
            max_exceptions=args.rollouts_per_group * len(batch.items),
        )

        train_result = await backend.train(
            model,
            train_groups,
            learning_rate=args.learning_rate,
        )

        await model.log(
            train_groups,
            metrics=train_result.metrics,
            step=train_result.step,
            split="train",
        )

    print(f"Final inference model: {model.get_inference_name()} (step {await model.get_step()})")
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
