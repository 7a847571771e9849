"""RL training script for a colour quiz, written as ART 0.5.23's `train-rl` skill has a user write it.

The wizard's answers: replayable (the questions are fixed), single-turn, programmatic reward (the
answer is checkable with code: does it name the colour), training and validation splits from the
lists below, base model artrl/tiny, project "colour-quiz", run name "quiz-rl-001", LocalBackend,
the skill's default hyperparameters (learning rate 1e-5, 4 rollouts per group, 2 groups per step),
fixed-dataset epoch loop with `iterate_dataset`. Nothing here is artrl's: it is an ART program.

    python train_rl.py [--learning-rate 1e-5] [--num-epochs 1] [--max-tokens 32]
"""

import argparse
import asyncio
from dataclasses import dataclass

import openai

import art
from art import TrainableModel
from art.local import LocalBackend
from art.utils.iterate_dataset import iterate_dataset


@dataclass
class Scenario:
    id: str
    question: str
    answer: str


TRAIN_SCENARIOS = [
    Scenario("banana", "What colour is a ripe banana?", "yellow"),
    Scenario("grass", "What colour is fresh grass?", "green"),
    Scenario("sky", "What colour is a clear daytime sky?", "blue"),
    Scenario("snow", "What colour is snow?", "white"),
    Scenario("coal", "What colour is coal?", "black"),
    Scenario("tomato", "What colour is a ripe tomato?", "red"),
]
VALIDATION_SCENARIOS = [
    Scenario("lemon", "What colour is a lemon?", "yellow"),
    Scenario("cherry", "What colour is a cherry?", "red"),
]
SYSTEM_PROMPT = "Answer with one word: the colour."


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--rollouts-per-group", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--validate-every", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    return p.parse_args()


def should_validate(step: int, args: argparse.Namespace) -> bool:
    return step % args.validate_every == 0


async def rollout(model: TrainableModel, scenario: Scenario, args: argparse.Namespace) -> art.Trajectory:
    messages: art.Messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": scenario.question},
    ]
    trajectory = art.Trajectory(messages_and_choices=messages, reward=0.0, metadata={"scenario_id": scenario.id})
    try:
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(),
            messages=messages,
            max_completion_tokens=args.max_tokens,
        )
    except openai.APIError as e:
        trajectory.metrics["inference_error"] = 1
        trajectory.log(f"inference failed: {e}")
        return trajectory
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    words = (choice.message.content or "").lower().replace(".", " ").split()
    correct = scenario.answer in words
    trajectory.reward = 1.0 if correct else 0.0
    trajectory.metrics["correct"] = correct
    trajectory.metrics["inference_error"] = 0
    return trajectory


async def main() -> None:
    args = parse_args()
    backend = LocalBackend()
    model = art.TrainableModel(
        name="quiz-rl-001",
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

        if should_validate(train_result.step, args):
            val_groups = await art.gather_trajectory_groups(
                [
                    art.TrajectoryGroup(
                        (rollout(model, scenario, args) for _ in range(args.rollouts_per_group)),
                        metadata={"scenario_id": scenario.id},
                    )
                    for scenario in VALIDATION_SCENARIOS
                ],
                max_exceptions=args.rollouts_per_group * len(VALIDATION_SCENARIOS),
            )
            rewards = [t.reward for group in val_groups for t in group.trajectories]
            await model.log(
                val_groups,
                metrics={"reward": sum(rewards) / max(len(rewards), 1)},
                step=train_result.step,
                split="val",
            )
            await model.delete_checkpoints()

    print(f"Final inference model: {model.get_inference_name()} (step {await model.get_step()})")
    print("Usage: model.openai_client().chat.completions.create("
          f"model={model.get_inference_name()!r}, messages=[...])")
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
