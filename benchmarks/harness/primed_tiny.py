"""The tiny model taught the answer format of ART's two pipeline programs, saved as a model directory.

The untrained `artrl/tiny` answers gibberish, so every rollout of ART's yes/no/maybe and
binary-prefix programs scores the same, every group has zero advantage and nothing trains
(the pipeline even stops on it, ART's "model collapse"). A few SFT calls on the programs'
own prompts teach it the answers' form, not the best answer:

* yes/no/maybe: each scenario answered, in turn, "maybe", "no", "yes" or "ok" (rewards 1, 0.75,
  0.5, 0), so a group's rewards spread and RL has something to prefer;
* binary prefix: one `make_guess` tool call with a short guess, in turn "1", "0", "11", "10"
  (shared prefix with the secret 0 to 2).

The merged model (adapter folded into the base weights) and its tokenizer are saved under
`out/model`, which the programs take as `BASE_MODEL`. The program module is passed in (its
scenarios, prompts and tool), so the recipe follows the program it primes for.
tests/test_art_pipeline_examples.py and benchmarks/pipeline_programs_learn.py use it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from types import ModuleType
from typing import Final

WORD_ANSWERS: Final = ("maybe", "no", "yes", "ok")
WORD_LEARNING_RATE: Final = 3e-3
WORD_CALLS: Final = 6
GUESSES: Final = ("1", "0", "11", "10")
GUESS_LEARNING_RATE: Final = 1e-2
GUESS_CALLS: Final = 8
GUESS_EXAMPLES: Final = 48


def sft_tiny(out: Path, data: list, learning_rate: float, calls: int) -> Path:
    """The tiny model after `calls` SFT calls on `data`, saved (adapter merged) as a plain model directory."""
    import artrl as art

    async def main() -> None:
        backend = art.LocalBackend(path=str(out / "runs"), show_progress=False)
        model = art.TrainableModel(name="prep", project="prep", base_model="artrl/tiny")
        await model.register(backend)
        for _ in range(calls):
            await model.train_sft(data, config=art.TrainSFTConfig(learning_rate=learning_rate, batch_size=16))
        session = backend._runs["prep"]
        session.trainer.model.merge_and_unload().save_pretrained(out / "model")
        session.trainer.tokenizer.save_pretrained(out / "model")
        backend.close()

    asyncio.run(main())
    return out / "model"


def word_data(program: ModuleType) -> list:
    """Each of the yes/no/maybe program's scenarios twice, answered with WORD_ANSWERS in turn."""
    import artrl as art

    answers = itertools.cycle(WORD_ANSWERS)
    return [art.Trajectory(messages_and_choices=[{"role": "user", "content": s["prompt"]},
                                                 {"role": "assistant", "content": next(answers)}], reward=0.0)
            for s in program.build_scenarios() for _ in range(2)]


def guess_data(program: ModuleType) -> list:
    """GUESS_EXAMPLES copies of the binary-prefix program's prompt answered by one tool call, GUESSES in turn."""
    import artrl as art

    guesses = itertools.cycle(GUESSES)

    def call(guess: str) -> dict:
        return {"id": "c1", "type": "function",
                "function": {"name": program.TOOL_NAME, "arguments": json.dumps({"guess": guess})}}

    return [art.Trajectory(messages_and_choices=[{"role": "system", "content": program.SYSTEM_PROMPT},
                                                 {"role": "user", "content": program.USER_PROMPT},
                                                 {"role": "assistant", "content": "",
                                                  "tool_calls": [call(next(guesses))]}],
                           tools=program.TOOLS, reward=0.0)
            for _ in range(GUESS_EXAMPLES)]


def word_model(out: Path, program: ModuleType) -> Path:
    """The tiny model primed for the yes/no/maybe program (`program`: its module)."""
    return sft_tiny(out, word_data(program), WORD_LEARNING_RATE, WORD_CALLS)


def guess_model(out: Path, program: ModuleType) -> Path:
    """The tiny model primed for the binary-prefix program (`program`: its module)."""
    return sft_tiny(out, guess_data(program), GUESS_LEARNING_RATE, GUESS_CALLS)
