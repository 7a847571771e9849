"""benchmarks/art_examples.py, the runner of ART's example programs, on a synthetic ART tree written here.

ART's source is not available in CI, so the tests build a small "ART tree" (a
script with a helper module, and a notebook with magics and top-level await)
and run the runner's machinery on it: extraction, the zero-edit run (`artrl run`), the
edits (each must match), the offline subprocess, and the check of the run
directory. With `ART_SOURCE=/path/to/ART` set, the real examples' edits are
checked against that tree too (prepared, not run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

RUNNER_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "art_examples.py"


def _load_runner():
    spec = importlib.util.spec_from_file_location("art_examples", RUNNER_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["art_examples"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


runner = _load_runner()
Edit, Example = runner.Edit, runner.Example

BASE = "Qwen/Qwen2.5-0.5B-Instruct"

SCRIPT = '''\
import asyncio

from helper import score

import art
from art.local import LocalBackend

STEPS = 50


async def rollout(model: art.TrainableModel, i: int) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": f"Say something about {i}."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=256)
    choice = completion.choices[0]
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=score(choice.message.content))


async def main():
    model = art.TrainableModel(name="toy", project="toy", base_model="Qwen/Qwen2.5-0.5B-Instruct")
    with LocalBackend() as backend:
        await model.register(backend)
        for _ in range(await model.get_step(), STEPS):
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, i) for _ in range(4)) for i in range(2)), pbar_desc=None)
            result = await backend.train(model, groups, learning_rate=1e-4)
            await model.log(groups, metrics=result.metrics, step=result.step, split="train")


if __name__ == "__main__":
    asyncio.run(main())
'''

HELPER = '''\
def score(text):
    return float(len(text or "") % 5)  # the untrained model's replies differ in length: a reward spread
'''

NOTEBOOK_CELLS = [
    ("code", "%load_ext autoreload\n%autoreload 2"),
    ("code", "%%html\n<style>\n.x { color: red; }\n</style>"),
    ("markdown", "# A notebook\n`import art` in markdown is not code."),
    ("code", ["!pip install openpipe-art\n", "import art\n", "from art.local import LocalBackend\n", "\n",
              f'model = art.TrainableModel(name="nb", project="toy", base_model="{BASE}")\n',
              "backend = LocalBackend()\n", "await model.register(backend)\n", "client = model.openai_client()"]),
    ("code", textwrap.dedent('''\
        async def rollout(i):
            messages = [{"role": "user", "content": f"Pick a number, {i}."}]
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_completion_tokens=512)
            choice = completion.choices[0]
            return art.Trajectory(messages_and_choices=[*messages, choice], reward=len(choice.message.content) % 3)


        for _ in range(await model.get_step(), 1_000):
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(i) for _ in range(4)) for i in range(2)], pbar_desc="gather")
            result = await backend.train(model, groups, learning_rate=1e-4)
            await model.log(groups, metrics=result.metrics, step=result.step, split="train")
        %time print("magic at the end")''')),
]


def write_notebook(path: Path, cells) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cells": [{"cell_type": kind, "metadata": {}, "source": source}
                                          for kind, source in cells], "nbformat": 4, "nbformat_minor": 5}))


@pytest.fixture()
def art_tree(tmp_path: Path) -> Path:
    """A small ART source tree: examples/toy/train.py with its helper, and examples/toy-notebook.ipynb."""
    root = tmp_path / "ART"
    (root / "examples" / "toy").mkdir(parents=True)
    (root / "examples" / "toy" / "train.py").write_text(SCRIPT)
    (root / "examples" / "toy" / "helper.py").write_text(HELPER)
    write_notebook(root / "examples" / "toy-notebook.ipynb", NOTEBOOK_CELLS)
    return root


SCRIPT_EXAMPLE = Example(
    name="toy", main="examples/toy/train.py", helpers=("examples/toy/helper.py",), steps=2,
    edits=(Edit(runner._lit(f'"{BASE}"'), '"artrl/tiny"', "base model", "model", None, 1),
           Edit(r"^STEPS = 50$", "STEPS = 2", "2 steps", "size", None, 1),
           Edit(r"max_tokens=256", "max_tokens=8", "8 tokens", "size", None, 1)))
NOTEBOOK_EXAMPLE = Example(
    name="toy-notebook", main="examples/toy-notebook.ipynb", steps=1,
    edits=(Edit(runner._lit(f'"{BASE}"'), '"artrl/tiny"', "base model", "model", None, 1),
           Edit(runner._lit("1_000"), "1", "1 step", "size", None, 1),
           Edit(r"max_completion_tokens=512", "max_completion_tokens=8", "8 tokens", "size", None, 1)))


# --------------------------------------------------------------------------- extraction and edits (no model)

def test_arts_imports_are_counted_and_left_as_written():
    text = ("import art\nfrom art.local import LocalBackend\nfrom art import dev\n    import art\nimport art.utils\n"
            "import art as a\nimport artistic\nfrom artwork import x\n")
    assert runner.art_imports(text) == 6
    assert runner.art_imports("import artrl as art\nprint('import art')\n") == 0


def test_every_edit_must_match_as_often_as_declared():
    edits = [Edit("STEPS = 50", "STEPS = 2", "two steps", "size")]
    assert runner.apply_edits("STEPS = 50\n", edits, "x.py") == "STEPS = 2\n"
    with pytest.raises(runner.EditError, match=r"x.py: edit pattern 'STEPS = 50' \(two steps\) matched 0 time"):
        runner.apply_edits("STEPS = 40\n", edits, "x.py")
    twice = [Edit("range\\(8\\)", "range(2)", "fewer games", "size", count=1)]
    with pytest.raises(runner.EditError, match="matched 2 time.*expected 1 time"):
        runner.apply_edits("range(8) range(8)", twice, "nb")
    with pytest.raises(ValueError, match="kind 'rewrite'"):
        Edit("a", "b", "not an allowed kind of edit", "rewrite")


def test_notebook_code_keeps_code_cells_in_order_without_magics(art_tree):
    code = runner.notebook_code(art_tree / "examples" / "toy-notebook.ipynb")
    assert not [line for line in code.splitlines() if line.lstrip().startswith(("%", "!"))]
    assert "<style>" not in code
    assert "in markdown" not in code
    assert code.index("import art\n") < code.index("await model.register(backend)") < code.index("async def rollout")
    assert code.count("# %% [cell") == 2  # the magic-only cell and the %%html cell are gone
    compile(code, "nb", "exec", flags=__import__("ast").PyCF_ALLOW_TOP_LEVEL_AWAIT)
    with pytest.raises(runner.EditError, match="not a readable notebook"):
        (art_tree / "bad.ipynb").write_text("{not json")
        runner.notebook_code(art_tree / "bad.ipynb")


def test_prepare_writes_the_edited_example_with_its_helpers(art_tree, tmp_path):
    prepared = runner.prepare(SCRIPT_EXAMPLE, art_tree, tmp_path / "scratch" / "toy")
    main = tmp_path / "scratch" / "toy" / "examples" / "toy" / "train.py"
    text = main.read_text()
    assert text.startswith(SCRIPT.split("STEPS")[0])  # ART's imports as written: the run resolves them
    assert "artrl" not in text.replace('"artrl/tiny"', "")
    assert 'base_model="artrl/tiny"' in text and "STEPS = 2" in text and "max_tokens=8" in text
    assert (main.parent / "helper.py").read_text() == HELPER
    assert prepared.cwd == main.parent and prepared.command[-1] == str(main) and prepared.art_imports == 2
    assert prepared.command[:-1] == [sys.executable, "-u", "-m", "artrl", "run"]  # the zero-edit route
    nb = runner.prepare(NOTEBOOK_EXAMPLE, art_tree, tmp_path / "scratch" / "nb")
    assert nb.command[:-2] == prepared.command[:-1]
    assert Path(nb.command[-2]).name == runner.NOTEBOOK_LAUNCHER and nb.command[-1].endswith("toy-notebook.py")
    assert (art_tree / "examples" / "toy" / "train.py").read_text() == SCRIPT  # the ART tree is untouched
    other = runner.prepare(SCRIPT_EXAMPLE, art_tree, tmp_path / "scratch" / "other", base_model="/models/qwen-0.5b")
    assert 'base_model="/models/qwen-0.5b"' in Path(other.command[-1]).read_text()
    assert [e["replacement"] for e in other.edits if e["kind"] == "model"] == ['"/models/qwen-0.5b"']


def test_relative_paths_are_resolved_before_the_run_changes_directory(art_tree, tmp_path, monkeypatch):
    monkeypatch.chdir(art_tree.parent)
    prepared = runner.prepare(NOTEBOOK_EXAMPLE, Path("ART"), Path("scratch-rel"))
    assert prepared.cwd.is_absolute() and all(Path(part).is_absolute() for part in prepared.command[-2:])


def test_prepare_refuses_what_does_not_fit(art_tree, tmp_path):
    missing = Example(name="m", main="examples/nope.py")
    with pytest.raises(runner.EditError, match="nope.py does not exist; is .* the root of ART's source tree"):
        runner.prepare(missing, art_tree, tmp_path / "s")
    foreign = Example(name="f", main="examples/toy/train.py",
                      edits=(Edit("x", "y", "edit of a file the example does not list", "size", "examples/other.py"),))
    with pytest.raises(runner.EditError, match="not the example's: \\['examples/other.py'\\]"):
        runner.prepare(foreign, art_tree, tmp_path / "s")
    (art_tree / "examples" / "plain.py").write_text("print('no ART here')\n")
    with pytest.raises(runner.EditError, match="no `import art`"):
        runner.prepare(Example(name="p", main="examples/plain.py"), art_tree, tmp_path / "s")


def test_arts_examples_are_listed_with_allowed_edits_only():
    names = [e.name for e in runner.EXAMPLES]
    assert names == ["tic_tac_toe", "2048", "temporal_clue", "temporal-clue-7b", "temporal-clue-7b-async",
                     "prisoners-dilemma", "rock-paper-tool-use"]
    for example in runner.EXAMPLES:
        assert example.steps >= 1 and example.skip is None
        for edit in example.edits:
            assert edit.kind in runner.EDIT_KINDS and edit.why
            assert edit.file in (None, example.main, *example.helpers)
            if edit.kind == "model":
                assert edit.replacement == '"artrl/tiny"'


def test_first_error_is_the_exception_line_of_the_last_traceback():
    log = ("gather: 100%\nTraceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'a'\n"
           "\nDuring handling...\nTraceback (most recent call last):\n  File \"y.py\", line 2\n"
           "artrl.errors.ConfigError: model 'm' is not registered\n")
    assert runner.first_error(log) == "artrl.errors.ConfigError: model 'm' is not registered"
    assert runner.first_error("killed\n\n") == "killed"
    assert runner.first_error("") == ""


def test_the_subprocess_environment_is_offline():
    env = runner.offline_env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["WANDB_MODE"] == "disabled"
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"  # litellm would fetch its price map at import
    assert env["HTTPS_PROXY"] == runner.CLOSED_PORT_PROXY and "127.0.0.1" in env["NO_PROXY"]
    assert not set(runner.DROPPED_ENV) & set(env)


# --------------------------------------------------------------------------- runs (subprocesses)

def test_failures_are_reported_with_their_error_line(art_tree, tmp_path):
    examples = art_tree / "examples"
    (examples / "boom.py").write_text("import art\nraise ValueError('boom at step 0')\n")
    (examples / "idle.py").write_text("import art\nprint('nothing trained')\n")
    (examples / "slow.py").write_text("import art\nimport time\ntime.sleep(120)\n")
    (examples / "stale.py").write_text("import art\nSTEPS = 9\n")
    boom = runner.run_example(Example(name="boom", main="examples/boom.py"), art_tree, tmp_path / "w", timeout=120)
    assert (boom.result, boom.steps) == ("fail", 0)
    assert boom.error.startswith("exit 1: ValueError: boom at step 0")
    assert Path(boom.log).read_text().count("Traceback") == 1
    idle = runner.run_example(Example(name="idle", main="examples/idle.py"), art_tree, tmp_path / "w", timeout=120)
    assert idle.result == "fail" and "exit 0 but no run directory" in idle.error
    slow = runner.run_example(Example(name="slow", main="examples/slow.py"), art_tree, tmp_path / "w", timeout=3)
    assert slow.result == "timeout" and slow.seconds < 60
    stale = Example(name="stale", main="examples/stale.py", edits=(Edit("STEPS = 50", "STEPS = 2", "2", "size"),))
    assert runner.run_example(stale, art_tree, tmp_path / "w", timeout=120).result == "edit-error"
    skipped = runner.run_example(Example(name="s", main="x.py", skip="needs a GPU by nature"), art_tree,
                                 tmp_path / "w", timeout=1)
    assert (skipped.result, skipped.error) == ("skip", "needs a GPU by nature")


def test_inspect_runs_reads_complete_checkpoints_and_train_rows(tmp_path):
    run = tmp_path / ".art" / "p" / "models" / "m"
    for step, complete in ((1, True), (2, True), (3, False)):
        (run / "checkpoints" / f"{step:04d}").mkdir(parents=True)
        if complete:
            (run / "checkpoints" / f"{step:04d}" / "COMPLETE").write_text("")
    rows = [{"step": 1, "split": "train", "data/step_num_groups_trainable": 1.0, "data/step_num_groups_submitted": 2.0},
            {"step": 1, "split": "val", "data/step_num_groups_submitted": 5.0},
            {"step": 2, "split": "train", "data/step_num_groups_trainable": 0.0, "data/step_num_groups_submitted": 2.0}]
    (run / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    [found] = runner.inspect_runs(tmp_path)
    assert (found.step, found.train_rows, found.groups_trained, found.groups_logged) == (2, 2, 1, 4)
    assert runner.inspect_runs(tmp_path / "elsewhere") == []


@pytest.mark.slow
def test_a_script_and_a_notebook_train_through_the_runner(art_tree, tmp_path):
    """The whole path on the tiny model: both pass, each step reached, and the reward spread reaches training."""
    out = tmp_path / "results.json"
    workdir = tmp_path / "w"
    original = runner.EXAMPLES
    runner.EXAMPLES = (SCRIPT_EXAMPLE, NOTEBOOK_EXAMPLE)
    try:
        rc = runner.main([str(art_tree), "--timeout", "400", "--out", str(out), "--workdir", str(workdir)])
    finally:
        runner.EXAMPLES = original
    report = json.loads(out.read_text())
    results = {r["name"]: r for r in report["examples"]}
    for name, steps in (("toy", 2), ("toy-notebook", 1)):
        r = results[name]
        assert (r["result"], r["steps"], r["expected_steps"]) == ("pass", steps, steps), Path(r["log"]).read_text()
        assert r["train_rows"] == steps and r["groups_logged"] == 2 * steps and r["groups_trained"] >= 1
    assert rc == 0
    nb_log = Path(results["toy-notebook"]["log"]).read_text()
    assert "magic at the end" not in nb_log  # the %time line was dropped, not run
    # each run starts fresh: a second run of the script reaches the same steps, not "nothing left to do"
    again = runner.run_example(SCRIPT_EXAMPLE, art_tree, workdir, timeout=400)
    assert (again.result, again.steps) == ("pass", 2)


@pytest.mark.skipif(not os.environ.get("ART_SOURCE"), reason="set ART_SOURCE to ART's source tree to check the "
                    "real examples' edits against it (ART's source is not available in CI)")
def test_every_edit_matches_arts_real_examples(tmp_path):
    for example in runner.EXAMPLES:
        runner.prepare(example, Path(os.environ["ART_SOURCE"]), tmp_path / example.name)
