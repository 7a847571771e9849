"""What artrl says reaches the screen as ART's prints do, unless the program set up logging; and a call that
trains nothing says why in a user's words.

An ART program (its imports unedited) runs in a fresh interpreter: with no logging set up, the untrained-model
notice and each call's summary line reach stderr once each; with `logging.basicConfig(...)` the program's setup
alone decides (WARNING: neither shows; INFO: each once, in the program's format).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import asyncio, logging, sys

    import art
    from art.local import LocalBackend

    if sys.argv[1] != "none":
        logging.basicConfig(level=getattr(logging, sys.argv[1]), format="CONFIGURED %(message)s")


    def group(prompt, rewards):
        return art.TrajectoryGroup([art.Trajectory(messages_and_choices=[
            {"role": "user", "content": prompt}, {"role": "assistant", "content": f"answer {i}"}], reward=r)
            for i, r in enumerate(rewards)])


    async def main():
        backend = LocalBackend(path="./.art")
        model = art.TrainableModel(name="agent", project="p", base_model="artrl/tiny")
        await model.register(backend)
        config = art.TrainConfig(learning_rate=5e-3, allow_training_without_logprobs=True)
        await model.train([group("a", [0.0, 1.0]), group("b", [1.0, 0.5])], config=config)
        await model.train([group("a", [0.0, 0.0]), group("b", [0.0, 0.0])], config=config)  # the reward never set
        await model.train([], config=config)  # every group dropped (a judge's swallow_exceptions=True)
        print("step", await model.get_step())
        await backend.close()

    asyncio.run(main())
""")


def run_program(tmp_path, logging_setup: str) -> subprocess.CompletedProcess:
    (tmp_path / "program.py").write_text(PROGRAM)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "program.py", logging_setup], cwd=tmp_path, capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_with_no_logging_set_up_the_notices_and_summaries_reach_stderr_once_and_empty_calls_say_why(tmp_path):
    out = run_program(tmp_path, "none")
    err = out.stderr
    assert err.count("artrl/tiny is untrained") == 1
    assert err.count("RL: packed") == 1  # the first call's summary line
    assert err.count("every rollout in each group had the same reward (0 in 2 groups)") == 1
    assert "Was the reward set" in err
    # an empty list trains nothing and advances the step, as in ART (its 2048 example gets here), saying so
    assert err.count("model.train was given an empty list of trajectory groups") == 1
    assert out.stdout.strip().splitlines()[-1] == "step 3"  # the tied and the empty call advanced, as in ART


@pytest.mark.parametrize("level", ["WARNING", "INFO"])
def test_a_program_that_sets_up_logging_keeps_control(tmp_path, level):
    err = run_program(tmp_path, level).stderr
    shown = level == "INFO"
    assert err.count("CONFIGURED artrl/tiny is untrained") == int(shown)
    assert err.count("RL: packed") == err.count("CONFIGURED RL: packed") == int(shown)  # never twice
    assert err.count("the same reward (0 in 2 groups)") == err.count("CONFIGURED agent step 2: nothing") == 1
