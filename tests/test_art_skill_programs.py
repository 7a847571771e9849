"""ART 0.5.23's skill-written programs run on artrl with no line changed, and say what they do as ART's print.

examples/art_skills/ holds an RL and an SFT program written as ART's own skills (`.agents/skills/train-rl` and
`train-sft/SKILL.md` in ART 0.5.23's sdist) have a user write them: `import art`, `from art.local import
LocalBackend`, `from art.utils...`, the skills' default hyperparameters, `artrl/tiny` as the base model the
user chose. Each is copied as it is into a scratch folder and run in a fresh interpreter that sets up no
logging, with stderr a pipe (as a log file is), offline: the SFT program with plain `python` (`import art` is
artrl where openpipe-art is absent), the RL one with `artrl run` (the route where it is installed). What a user
must see reaches stderr once each, as plain lines: no carriage return, no cursor code. The RL program with the
skill's default reward, RULER with a hosted judge, needs the network by nature: offline it is shown to stop
with one line that names its judge and the way out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from artrl.run import storage

SKILLS = Path(__file__).resolve().parents[1] / "examples" / "art_skills"
UNTRAINED = "artrl/tiny is untrained"
LOW_RATE = "is far below what artrl/tiny needs to learn"


CLOSED_PORT = "http://127.0.0.1:9"  # nothing listens: the internet is unreachable, loopback is not proxied
DROPPED = ("ARTRL_ART", "PYTHONPATH", "OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_BASE")


def run_program(tmp_path: Path, head: list[str], program: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    for path in SKILLS.iterdir():
        if path.is_file():
            shutil.copy2(path, tmp_path / path.name)
    assert (tmp_path / program).read_bytes() == (SKILLS / program).read_bytes()  # no line changed
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", LITELLM_LOCAL_MODEL_COST_MAP="True",
               NO_PROXY="localhost,127.0.0.1,::1", no_proxy="localhost,127.0.0.1,::1", **extra)
    env.update(dict.fromkeys(("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"),
                             CLOSED_PORT))
    return subprocess.run([*head, program, *args], cwd=tmp_path, capture_output=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=600)


def plain_lines(stderr: bytes) -> list[str]:
    assert b"\r" not in stderr and b"\x1b" not in stderr, stderr[-3000:]
    return stderr.decode().splitlines()


def checkpoints(run: Path) -> list[int]:
    return sorted(int(p.name) for p in (run / storage.CHECKPOINTS_DIR).iterdir()
                  if (p / storage.COMPLETE_MARKER).exists())


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / storage.HISTORY_FILE).read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("program", ["train_rl.py", "train_rl_ruler.py", "sft_train.py"])
def test_the_programs_are_arts_own_imports_and_calls(program):
    code = (SKILLS / program).read_text()
    assert not re.search(r"^\s*(import|from)\s+artrl\b", code, flags=re.M)
    assert re.search(r"^import art$", code, flags=re.M) and "from art.local import LocalBackend" in code
    assert "await backend.close()" in code  # as both skills require


def test_the_sft_skill_program_runs_unedited_with_plain_python(tmp_path):
    out = run_program(tmp_path, [sys.executable], "sft_train.py")
    lines = plain_lines(out.stderr)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert "SFT TRAINING COMPLETE" in out.stdout.decode() and "Training step:  1" in out.stdout.decode()
    run = tmp_path / ".art" / "sft-project" / "models" / "colour-quiz-001"
    assert checkpoints(run)[-1] == 1
    assert [r["kind"] for r in history(run) if r.get("split") == "train"] == ["sft"]
    said = "\n".join(lines)
    assert said.count(UNTRAINED) == 1
    assert len([x for x in lines if x.startswith("SFT: packed 8 sequences")]) == 1  # the per-call summary
    assert said.count("sft_data.jsonl has 8 rows") == 1  # verbose=True's output
    assert said.count("gpu_memory_utilization=0.7 has no effect") == 1  # the skill's LocalBackend setup
    assert LOW_RATE not in said  # train_sft_from_file's peak 2e-4 is within ten times of what the model needs


def test_the_rl_skill_program_runs_unedited_through_artrl_run(tmp_path):
    artrl = str(Path(sys.executable).with_name("artrl"))
    out = run_program(tmp_path, [artrl, "run"], "train_rl.py", "--max-tokens", "8")
    lines = plain_lines(out.stderr)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert "Final inference model: quiz-rl-001 (step 3)" in out.stdout.decode()
    run = tmp_path / ".art" / "colour-quiz" / "models" / "quiz-rl-001"
    assert checkpoints(run)[-1] == 3
    rows = history(run)
    assert [r["step"] for r in rows if r.get("split") == "train"] == [1, 2, 3]
    assert [r["step"] for r in rows if r.get("split") == "val"] == [2]
    said = "\n".join(lines)
    assert said.count(UNTRAINED) == 1
    assert len([x for x in lines if x.startswith("RL: ")]) == 3  # one summary per train call
    # the skill's learning rate on the tiny model: said once for the three calls, with the rate that works
    assert said.count(LOW_RATE) == 1
    [advice] = [x for x in lines if LOW_RATE in x]
    assert advice.startswith("learning_rate 1e-5 is far below") and "Start from learning_rate=5e-3" in advice
    assert len([x for x in lines if x.startswith("gather: 100%")]) == 4  # 3 train gathers, 1 validation


def test_the_ruler_skill_program_stops_offline_with_one_line_naming_its_judge(tmp_path):
    """The skill's default reward is RULER with a hosted judge: offline (with a key, as the program checks at
    start-up) it cannot run, and it stops at the first group with the judge's model, endpoint and the way out
    on the error line, training nothing. It counts as skipped where a run needs the network."""
    out = run_program(tmp_path, [sys.executable], "train_rl_ruler.py", "--max-tokens", "8",
                      OPENAI_API_KEY="sk-offline-test")
    assert out.returncode == 1, out.stderr.decode()[-3000:]
    last = out.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("artrl.rewards.ruler.JudgeUnreachableError: RULER's judge 'openai/gpt-5.4' at "), last
    assert "could not be reached" in last and 'judge_model="hosted_vllm/" + model.base_model' in last
    run = tmp_path / ".art" / "colour-quiz" / "models" / "quiz-rl-ruler-001"
    assert checkpoints(run) == [0]  # nothing trained
