"""A program that raises while generation is in flight exits with its own status, never SIGABRT.

Before artrl/runtime/shutdown.py, such a program died with "terminate called without an active exception"
(exit 134) in about half of the runs: the decode worker, a daemon thread inside torch's C++ code, was
ended by CPython's finalisation. Each run is a fresh interpreter that exits only once the decode worker is
inside a batch's decode loop (it prints a marker then); 8 runs make a regression visible.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RUNS = 8

SCRIPT = textwrap.dedent('''
    import asyncio, sys
    import artrl as art

    async def rollout(model, client):
        return await client.chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "Say a colour."}],
            max_tokens=64, temperature=1.0)

    async def main(path, how):
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny")
        backend = art.LocalBackend(path=path, show_progress=False)
        await model.register(backend)
        client = model.openai_client()
        engine = backend._runs["m"].engine  # the one internal this script reads: the decode worker's step count
        tasks = [asyncio.create_task(rollout(model, client)) for _ in range(16)]
        while engine.decode_steps < 2:  # wait until the decode worker is inside the batch's decode loop
            await asyncio.sleep(0.01)
        # a row may draw its end-of-turn token early (temperature 1), but 16 rows of up to 64 tokens are not
        # all finished after two decode steps: the decode worker is still inside the batch
        assert not all(t.done() for t in tasks)
        print("MID-GENERATION", flush=True)
        if how == "raise":
            raise RuntimeError("boom mid-rollout")

    asyncio.run(main(sys.argv[1], sys.argv[2]))
''')


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "return"])
def test_exit_while_generating_is_clean(tmp_path, how):
    script = tmp_path / "mid_rollout.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    runs = RUNS if how == "raise" else RUNS // 2
    codes = []
    for i in range(runs):
        proc = subprocess.run([sys.executable, str(script), str(tmp_path / f"run{i}"), how], capture_output=True,
                              text=True, env=env, timeout=300)
        codes.append(proc.returncode)
        assert "MID-GENERATION" in proc.stdout, proc.stderr[-2000:]  # the exit below raced a running decode
        assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
        if how == "raise":
            assert proc.returncode == 1, proc.stderr[-2000:]
            assert proc.stderr.rstrip().endswith("RuntimeError: boom mid-rollout"), proc.stderr[-2000:]
        else:
            assert proc.returncode == 0, proc.stderr[-2000:]
    assert codes == [1 if how == "raise" else 0] * runs
