"""The README's loop runs as printed, and what it prints says what it shows.

The block under "## The loop" is copied into a file (only its step count cut from 20 to 3) and run as a user
would: the per-call summary line must show (the snippet sets up logging), the delete_checkpoints warning about
a missing val/reward must come once, not every step, and the log must say that the untrained tiny model will
not show learning, and where the path that does is.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_loop() -> str:
    text = README.read_text()
    start = text.index("```python\n", text.index("## The loop")) + len("```python\n")
    return text[start:text.index("```\n", start)]


def test_the_readme_loop_runs_as_printed_and_says_what_it_shows(tmp_path):
    code = readme_loop()
    assert code.count(", 20):") == 1, "the test cuts the loop's 20 steps to 3: keep `range(..., 20):` in it"
    (tmp_path / "loop.py").write_text(code.replace(", 20):", ", 3):"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "loop.py"], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [line.split(":")[0] for line in run.stdout.splitlines()] == ["step 1", "step 2", "step 3"]
    log = run.stderr
    assert log.count("RL: packed") == 3  # the per-call summary line, once per step
    assert log.count("no logged step has 'val/reward'") == 1  # once per run, not every step
    assert "artrl/tiny is untrained" in log and "examples/sft_then_rl.py" in log
    assert "rl step 3: 100%" in log  # the trainer's bar leaves its last state in a redirected log
    # one INFO line per train call: the per-step housekeeping says itself once, then goes to DEBUG
    assert log.count("deleted checkpoints") == 1 and log.count("Serving policy version") == 1
    said = [line.split(" ", 2)[2] for line in log.splitlines() if re.match(r"\d\d:\d\d:\d\d artrl\.", line)]
    rl_lines = [i for i, line in enumerate(said) if line.startswith("RL: packed")]
    assert all(line.startswith("RL: packed") for line in said[rl_lines[1]:]), said[rl_lines[1]:]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_").replace(" ", "-")


def test_the_first_hours_links_lead_somewhere():
    """README.md and every page of docs/ (the README is mostly links to them): every relative link names a file
    that exists, and its #anchor a heading of that file."""
    import re

    for page in (README, *sorted((README.parent / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: link to {target} names no file"
            if anchor:
                headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
                assert anchor in headings, f"{page.name}: link to {target}: no such heading in {file.name}"


def test_ci_runs_the_readmes_test_command():
    """The README's second command is the first stage of .ci/run, as the README says."""
    text = README.read_text()
    start = text.index("```bash\n", text.index("Set up and run the tests")) + len("```bash\n")
    command = text[start:text.index("```", start)].strip()
    pytest_call = command[command.index(".venv/bin/python -m pytest"):]
    ci = [line.strip() for line in (README.parent / ".ci" / "run").read_text().splitlines()]
    assert pytest_call in ci, (pytest_call, ci)
    assert '.venv/bin/python -m pip install --quiet -e ".[cpu,test]"' in ci  # the same install, quietly
