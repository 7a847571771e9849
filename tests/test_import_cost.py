"""What `import artrl`, `artrl --help` and `artrl runs show` load: not torch, transformers or peft.

ART's `import art` costs a user nothing before a model is loaded; neither may ours. Each check runs in a fresh
interpreter (this one has loaded torch long ago) and lists the heavy modules it finds in `sys.modules`.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

import artrl

HEAVY = ("torch", "transformers", "peft")
_REPORT = f"import sys; print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules))"


def _fresh(code: str, *, env: dict[str, str] | None = None, merged: bool = False) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; `merged`: standard error into standard output, in the order written."""
    run = subprocess.run([sys.executable, "-c", f"{code}\n{_REPORT}"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _loaded(run: subprocess.CompletedProcess, stage: str = "") -> list[str]:
    (line,) = [x for x in run.stdout.splitlines() if x.startswith(f"LOADED{stage} ")]
    return ast.literal_eval(line.removeprefix(f"LOADED{stage} "))


FIRST_STEPS = """
import sys
import artrl
from artrl import {names}
import artrl.dev, artrl.utils, artrl.rewards, artrl.pipeline_trainer, artrl.pipeline_tuner
assert artrl.TrainableModel and artrl.LocalBackend and artrl.utils.iterate_dataset

def report(stage):
    print(f"LOADED-{{stage}}", sorted(m for m in {heavy!r} if m in sys.modules), flush=True)

report("import")
from artrl.cli import main
for argv in (["--help"], ["demo", "--help"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0
    print("END-OF-HELP", flush=True)
    report(argv[0])
"""


@pytest.fixture(scope="module")
def first_steps() -> subprocess.CompletedProcess:
    """One fresh interpreter takes a newcomer's first steps in turn and lists the heavy modules after each: the
    import of every public name, `artrl --help`, `artrl demo --help` (a stage that loaded torch shows it at its
    own line and every later one)."""
    return _fresh(FIRST_STEPS.format(names=", ".join(artrl.__all__), heavy=HEAVY))


def test_import_artrl_and_every_public_name_load_no_torch(first_steps):
    assert _loaded(first_steps, "-import") == []


def test_artrl_help_loads_no_torch_and_lists_every_command(first_steps):
    top_help = first_steps.stdout.split("END-OF-HELP")[0]
    assert all(c in top_help for c in ("demo", "serve", "runs", "bench", "SFT warm-up then RL"))
    assert _loaded(first_steps, "---help") == []


def test_a_subcommands_help_has_its_arguments(first_steps):
    """`artrl demo --help` still shows the demo's own arguments, built only for that command."""
    demo_help = first_steps.stdout.split("END-OF-HELP")[1]
    assert "--rl-steps" in demo_help and "--pipeline" in demo_help
    assert _loaded(first_steps, "-demo") == []


def test_runs_show_prints_its_table_first_and_loads_no_torch(tmp_path):
    """The table is the first thing on the screen: no matplotlib font-cache line before it (a fresh
    MPLCONFIGDIR makes matplotlib build its cache, as on a new machine), and torch is never loaded."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": 0, "split": "val", "val/reward": 0.25},
            {"step": 1, "split": "train", "kind": "rl", "train/reward": 0.5, "loss/train": 0.1}]
    (run_dir / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = _fresh(f"from artrl.cli import main\nassert main(['runs', 'show', {str(run_dir)!r}]) == 0",
                 env={"MPLCONFIGDIR": str(tmp_path / "mpl")}, merged=True)
    out = run.stdout.splitlines()
    assert out[0].split()[:2] == ["step", "kind"], run.stdout
    assert out[1].split() == ["0", "-", "-", "0.250", "-", "-"] and out[2].split()[:3] == ["1", "rl", "0.500"]
    assert "fontManager" not in run.stdout, run.stdout  # matplotlib's INFO line is not artrl's to show
    assert "plot: " in run.stdout and (run_dir / "history.png").is_file()
    assert _loaded(run) == []
