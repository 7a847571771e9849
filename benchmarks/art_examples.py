"""Run OpenPipe ART's own example training programs on artrl, from an ART source tree.

    python benchmarks/art_examples.py /path/to/ART [--only NAME ...] [--timeout S] [--out results.json]
                                      [--workdir DIR] [--base-model NAME_OR_PATH]

For each example below, the runner takes its code from the ART tree given (a
notebook's code cells in order, with shell and magic lines such as `!pip ...`
and `%...` dropped), applies that example's edits, writes it with its helper
files into a scratch directory (same layout as in ART, so relative paths to
data files hold) and runs it in a subprocess through the zero-edit route a user
takes, `python -m artrl run program.py` (`import art` and every `from art.x
import y` are artrl's modules of the same path, whether or not openpipe-art is
installed; no import is rewritten): the same Python, offline
(`HF_HUB_OFFLINE=1`, `WANDB_MODE=disabled`, litellm's shipped price map, every
proxy variable pointing at a closed local port so nothing can reach the
internet, loopback excepted), with a timeout. A notebook runs as Jupyter runs it: all cells in one event loop,
top-level `await` allowed.

An example passes when its training loop ran to the end: it exited 0, and
the run directory it wrote (`.art/<project>/models/<name>/`) holds complete
checkpoints up to the step its shrunken loop reaches and `history.jsonl` has
"train" rows. The exit code alone is not enough. For each run the table also
says how many of the logged train groups had something to learn from (a group
whose rewards are all equal has zero advantage and gives no gradient; as in
ART, such a step still advances and writes a checkpoint). The untrained tiny
model speaks gibberish, so most examples earn every rollout the same reward:
their steps advance with the same weights, and the note column says so.

The edits are data (`EXAMPLES`): a list of (pattern, replacement, why) per
example, applied as regular expressions, each of which must match (a pattern
that no longer matches ART's code fails loudly, naming it). Only three kinds
exist (`EDIT_KINDS`): the base model (-> "artrl/tiny"), loop sizes (steps,
groups, rollouts, max tokens), and switching off what needs the network by
nature (W&B's weave tracing, S3 backups). Where an example plays against or is
judged by a hosted model, the edit points it at artrl's own local server
instead. An example that cannot run without the network or a GPU by nature is
listed with an explicit `skip` and its reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

TINY = "artrl/tiny"
EDIT_KINDS = {
    "model": "the base model, replaced by the offline tiny model",
    "size": "a loop size (steps, groups, rollouts, max tokens) made smaller",
    "network": "a part that needs the network by nature, switched off or pointed at artrl's local server",
}
RUN_ROOT = ".art"  # ART's LocalBackend() default path, relative to the working directory
LOG_FILE = "run.log"
NOTEBOOK_LAUNCHER = "run_notebook.py"
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
CLOSED_PORT_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once
ARTRL_RUN = (sys.executable, "-u", "-m", "artrl", "run")
"""How an example runs: unedited, `art` resolved to artrl for that process (src/_artrl_art.py)."""
DROPPED_ENV = ("BACKUP_BUCKET", "OPENAI_API_KEY", "OPENROUTER_API_KEY", "WANDB_API_KEY", "TOGETHER_API_KEY")


class EditError(RuntimeError):
    """An edit did not match the example's code: ART changed, so the edit list must be reviewed."""


@dataclass(frozen=True)
class Edit:
    """One textual edit: `re.sub(pattern, replacement, text, flags=re.MULTILINE)`.

    `file` is the path in the ART tree of the file it applies to (None: the example's main file);
    `count` the exact number of matches expected (None: at least one).
    """

    pattern: str
    replacement: str
    why: str
    kind: str
    file: str | None = None
    count: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in EDIT_KINDS:
            raise ValueError(f"edit {self.pattern!r} has kind {self.kind!r}; allowed kinds: {sorted(EDIT_KINDS)}")


@dataclass(frozen=True)
class Example:
    """One ART example program: where it is in the ART tree, its helper files, its edits and the steps it trains."""

    name: str
    main: str  # a .py script or a .ipynb notebook, relative to the ART root
    helpers: tuple[str, ...] = ()  # other files (or directories) it needs, relative to the ART root
    edits: tuple[Edit, ...] = ()
    steps: int = 1  # the trainable model's step after the shrunken loop, starting from a fresh run
    skip: str | None = None  # why it cannot run here (network or GPU by nature); None: it runs


def _lit(text: str) -> str:
    return re.escape(text)


def _weave(file: str, decorator: bool) -> tuple[Edit, ...]:
    why = "weave traces to W&B's hosted service (network by nature)"
    edits = (Edit(r"^import weave\n", "", why, "network", file, 1),)
    if decorator:
        edits += (Edit(r"^@weave\.op\n", "", why, "network", file, 1),)
    return edits


def _base_model(old: str, count: int = 1, file: str | None = None) -> Edit:
    return Edit(_lit(f'"{old}"'), f'"{TINY}"', f"base model {old} -> the offline tiny model", "model", file, count)


def _size(pattern: str, replacement: str, why: str, count: int | None = 1, file: str | None = None) -> Edit:
    return Edit(pattern, replacement, why, "size", file, count)


_NO_EOS = ("the untrained tiny model rarely ends a turn by itself, so every completion runs to its token limit: "
           "a small limit keeps a CPU run short")
_TEMPORAL_CLUE_SIZES = (
    _size(_lit("val_puzzles = puzzles[:64]"), "val_puzzles = puzzles[:2]", "2 validation puzzles instead of 64"),
)

EXAMPLES: tuple[Example, ...] = (
    Example(
        name="tic_tac_toe",
        main="examples/tic_tac_toe/tic-tac-toe.py",
        helpers=("examples/tic_tac_toe/rollout.py", "examples/tic_tac_toe/game_utils.py"),
        steps=2,
        edits=(
            *_weave("examples/tic_tac_toe/tic-tac-toe.py", decorator=False),
            Edit(r"^weave\.init\(.*\)\n", "", "weave.init logs in to W&B's hosted tracing (network by nature)",
                 "network", None, 1),
            *_weave("examples/tic_tac_toe/rollout.py", decorator=True),
            _base_model("meta-llama/Meta-Llama-3.1-8B-Instruct"),
            _size(r"^STEP = 50$", "STEP = 2", "2 training steps instead of 50"),
            _size(_lit("for _ in range(96)"), "for _ in range(8)", "8 games per step instead of 96"),
            Edit(r"^ *await backend\._experimental_push_to_s3\(model\)\n", "",
                 "pushes every step to an S3 bucket (network by nature; ART raises KeyError without BACKUP_BUCKET)",
                 "network", None, 1),
        ),
    ),
    Example(
        name="2048",
        main="examples/2048/train.py",
        helpers=("examples/2048/rollout.py", "examples/2048/utils.py"),
        steps=2,
        edits=(
            *_weave("examples/2048/rollout.py", decorator=True),
            _base_model("Qwen/Qwen2.5-3B-Instruct"),
            _size(r"^TRAIN_STEPS = 40$", "TRAIN_STEPS = 2", "2 training steps instead of 40"),
            _size(r"^SIMULTANEOUS_GAMES = 18$", "SIMULTANEOUS_GAMES = 4", "4 games per step instead of 18"),
            Edit(r"^ *await backend\._experimental_pull_from_s3\(\n *model,\n *verbose=True,\n *\)\n", "",
                 "pulls the run from an S3 bucket (network by nature)", "network", None, 1),
            Edit(r"^ *# save the model to S3\n *await backend\._experimental_push_to_s3\(\n *model,\n *\)\n", "",
                 "pushes the run to an S3 bucket (network by nature)", "network", None, 1),
            Edit(_lit('"openai/o4-mini",'),
                 '"hosted_vllm/" + model.base_model,\n'
                 '                    extra_litellm_params={"api_base": model.inference_base_url, '
                 '"api_key": model.inference_api_key},',
                 "RULER's judge o4-mini is a hosted model: the judge is the base model served by artrl's local "
                 "server under its own name (litellm's hosted_vllm spelling, which ART reads the same way)",
                 "network", None, 1),
        ),
    ),
    Example(
        name="temporal_clue",
        main="examples/temporal_clue/temporal-clue.py",
        helpers=("examples/data/temporal-clue/puzzles.json",),
        steps=2,
        edits=(
            _base_model("Qwen/Qwen2.5-7B-Instruct"),
            *_TEMPORAL_CLUE_SIZES,
            _size(_lit("rollout(model, puzzle) for _ in range(50)"), "rollout(model, puzzle) for _ in range(4)",
                  "4 rollouts per puzzle instead of 50"),
            _size(r"^        stride = 4$", "        stride = 2", "2 puzzles per step instead of 4"),
            _size(_lit("range(await model.get_step(), 1_000)"), "range(await model.get_step(), 2)",
                  "2 training steps instead of 1000"),
            _size(r"messages=messages, model=model\.get_inference_name\(\)\n(\s*)\)",
                  r"messages=messages, model=model.get_inference_name(), max_tokens=64\n\1)",
                  f"at most 64 completion tokens (the script sets no limit; {_NO_EOS})"),
        ),
    ),
    *(
        Example(
            name=name,
            main=f"examples/temporal_clue/{name}.ipynb",
            helpers=("examples/data/temporal-clue/puzzles.json",),
            steps=steps,
            edits=(
                _base_model("Qwen/Qwen2.5-7B-Instruct"),
                *_TEMPORAL_CLUE_SIZES,
                _size(_lit("max_tokens=4096"), "max_tokens=64", f"at most 64 completion tokens instead of 4096 "
                      f"({_NO_EOS})"),
                _size(_lit("rollout(model, puzzle) for _ in range(16)"), "rollout(model, puzzle) for _ in range(4)",
                      "4 rollouts per puzzle instead of 16"),
                _size(r"^stride = 8$", "stride = 2", "2 puzzles per step instead of 8"),
                loop,
            ),
        )
        for name, steps, loop in (
            ("temporal-clue-7b", 2, _size(_lit("range(await model.get_step(), 1_000)"),
                                          "range(await model.get_step(), 2)", "2 training steps instead of 1000")),
            ("temporal-clue-7b-async", 3, _size(_lit("range(await model.get_step(), len(train_puzzles) // stride)"),
                                                "range(await model.get_step(), 3)",
                                                "3 batches (training steps) instead of every training puzzle")),
        )
    ),
    Example(
        name="prisoners-dilemma",
        main="examples/prisoners-dilemma.ipynb",
        steps=2,
        edits=(
            _base_model("Qwen/Qwen2.5-7B-Instruct"),
            _size(r"^PRISONERS_DILEMMA_ROUNDS = 10$", "PRISONERS_DILEMMA_ROUNDS = 2",
                  "2 rounds per game instead of 10"),
            _size(r"^TRAINING_STEPS = 1_000$", "TRAINING_STEPS = 2", "2 training steps instead of 1000"),
            _size(_lit("for _ in range(8)"), "for _ in range(2)", "2 games of each kind per step instead of 8",
                  count=2),
            _size(_lit("max_completion_tokens=512"), "max_completion_tokens=64",
                  f"at most 64 tokens per move instead of 512 ({_NO_EOS})", count=2),
        ),
    ),
    Example(
        name="rock-paper-tool-use",
        main="examples/rock-paper-tool-use.ipynb",
        steps=2,
        edits=(
            _base_model("Qwen/Qwen2.5-7B-Instruct"),
            _size(r"^TRAINING_STEPS = 1_000$", "TRAINING_STEPS = 2", "2 training steps instead of 1000"),
            _size(_lit("rollout() for _ in range(64)"), "rollout() for _ in range(4)",
                  "4 games per step instead of 64"),
            _size(r"^    for _ in range\(10\):$", "    for _ in range(3):", "at most 3 rounds per game instead of 10"),
        ),
    ),
)


# ---------------------------------------------------------------------------------------------- preparing the code


_ART_IMPORT = re.compile(r"^\s*(import art(\.[\w.]+)?(\s+as\s+\w+)?\s*$|from art(\.[\w.]+)? import )",
                         flags=re.MULTILINE)


def art_imports(text: str) -> int:
    """How many import statements of ART's package (`import art[.x] [as y]`, `from art[.x] import ...`) `text`
    holds; they are run as written, on artrl's modules of the same path (`artrl run`)."""
    return len(_ART_IMPORT.findall(text))


def apply_edits(text: str, edits: list[Edit], where: str) -> str:
    """`text` with every edit applied; an edit that matches no time (or not `count` times) raises EditError."""
    for edit in edits:
        try:
            text, n = re.subn(edit.pattern, edit.replacement, text, flags=re.MULTILINE)
        except re.error as e:
            raise EditError(f"{where}: edit pattern {edit.pattern!r} is not a valid regular expression: {e}") from e
        if n == 0 or (edit.count is not None and n != edit.count):
            expected = "at least once" if edit.count is None else f"{edit.count} time(s)"
            raise EditError(f"{where}: edit pattern {edit.pattern!r} ({edit.why}) matched {n} time(s), expected "
                            f"{expected}; ART's code changed, so review this example's edits")
    return text


_MAGIC = re.compile(r"^\s*[!%]")


def notebook_code(path: Path) -> str:
    """A notebook's code cells in order, as one Python source; cell magics (`%%html`) drop their cell, line magics
    and shell lines (`%autoreload`, `!pip ...`) drop their line, and a cell left empty is dropped. Each cell starts
    with a `# %% [cell N]` marker (N counts every cell of the notebook)."""
    try:
        notebook = json.loads(path.read_text())
        cells = notebook["cells"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EditError(f"{path} is not a readable notebook (JSON with a 'cells' list): {e}") from e
    parts = []
    for i, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        if source.lstrip().startswith("%%"):
            continue
        lines = [line for line in source.splitlines() if not _MAGIC.match(line)]
        if not any(line.strip() for line in lines):
            continue
        parts.append(f"# %% [cell {i}]\n" + "\n".join(lines).rstrip() + "\n")
    return "\n".join(parts)


LAUNCHER_SOURCE = '''"""Runs a notebook's exported code as Jupyter does: one event loop, top-level await allowed."""
import ast
import asyncio
import os
import sys

path = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.dirname(path))
code = compile(open(path).read(), path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


async def main():
    result = eval(code, {"__name__": "__main__", "__builtins__": __builtins__})
    if asyncio.iscoroutine(result):
        await result


asyncio.run(main())
'''


@dataclass
class Prepared:
    """An example written into its scratch directory: the command to run and where."""

    command: list[str]
    cwd: Path
    art_imports: int  # ART imports in the example's files, run as written
    edits: list[dict[str, Any]]


def prepare(example: Example, art_root: Path, scratch: Path, base_model: str = TINY) -> Prepared:
    """Copy the example and its helpers from `art_root` to `scratch` (same relative layout), with edits applied.

    `base_model` replaces "artrl/tiny" in the base-model edits (any model name or local path artrl can load).
    """
    art_root, scratch = Path(art_root).resolve(), Path(scratch).resolve()  # the run's cwd is not ours
    main = art_root / example.main
    if not main.is_file():
        raise EditError(f"{example.name}: {main} does not exist; is {art_root} the root of ART's source tree?")
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    model_text = base_model.replace("\\", "\\\\")  # a replacement string: a backslash in a path stays one
    edits = [replace(e, replacement=e.replacement.replace(TINY, model_text)) if e.kind == "model" else e
             for e in example.edits]
    by_file: dict[str, list[Edit]] = {}
    for edit in edits:
        by_file.setdefault(edit.file or example.main, []).append(edit)
    unknown = set(by_file) - {example.main, *example.helpers}
    if unknown:
        raise EditError(f"{example.name}: edits name files that are not the example's: {sorted(unknown)}")
    imports = 0
    for rel in (example.main, *example.helpers):
        src, dst = art_root / rel, scratch / rel
        if not src.exists():
            raise EditError(f"{example.name}: helper {src} does not exist in the ART tree")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
            continue
        if src.suffix not in (".py", ".ipynb"):
            shutil.copy2(src, dst)
            continue
        text = notebook_code(src) if src.suffix == ".ipynb" else src.read_text()
        imports += art_imports(text)
        text = apply_edits(text, by_file.get(rel, []), f"{example.name}: {rel}")
        if src.suffix == ".ipynb":
            dst = dst.with_suffix(".py")
        dst.write_text(text)
    if imports == 0:
        raise EditError(f"{example.name}: no `import art` / `from art... import` found; is this an ART program?")
    code = scratch / Path(example.main).with_suffix(".py")
    if example.main.endswith(".ipynb"):
        launcher = scratch / NOTEBOOK_LAUNCHER
        launcher.write_text(LAUNCHER_SOURCE)
        command = [*ARTRL_RUN, str(launcher), str(code)]
    else:
        command = [*ARTRL_RUN, str(code)]
    return Prepared(command, code.parent, imports, [asdict(e) for e in edits])


# ---------------------------------------------------------------------------------------------- running and checking


def offline_env() -> dict[str, str]:
    """This process's environment, offline: no hub downloads, W&B disabled, the internet unreachable (every proxy
    variable points at a closed local port; loopback, where artrl's server listens, is exempt), keys dropped."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               LITELLM_LOCAL_MODEL_COST_MAP="True",  # RULER's judge through litellm: its shipped price map
               PYTHONUNBUFFERED="1", NO_PROXY="localhost,127.0.0.1,::1", no_proxy="localhost,127.0.0.1,::1")
    env.update(dict.fromkeys(PROXY_VARS, CLOSED_PORT_PROXY))
    return env


@dataclass
class RunDir:
    """What one model's run directory shows about training."""

    path: str
    step: int  # the latest complete checkpoint
    train_rows: int  # history.jsonl rows of split "train"
    groups_trained: int  # groups handed to training with a reward spread (non-zero advantage)
    groups_logged: int  # groups in the train rows


def inspect_runs(cwd: Path) -> list[RunDir]:
    """Every model run directory under `<cwd>/.art/<project>/models/<name>/`, read from disk."""
    from artrl.run import storage

    runs = []
    for run in sorted((Path(cwd) / RUN_ROOT).glob(f"*/{storage.MODELS_DIR}/*")):
        if not run.is_dir():
            continue
        checkpoints = run / storage.CHECKPOINTS_DIR
        steps = [int(p.name) for p in checkpoints.glob("[0-9]*")
                 if p.name.isdigit() and (p / storage.COMPLETE_MARKER).exists()] if checkpoints.is_dir() else []
        rows = storage.read_jsonl(run / storage.HISTORY_FILE) if (run / storage.HISTORY_FILE).exists() else []
        train = [r for r in rows if r.get("split") == "train"]
        runs.append(RunDir(str(run), max(steps, default=0), len(train),
                           sum(int(r.get("data/step_num_groups_trainable", 0) or 0) for r in train),
                           sum(int(r.get("data/step_num_groups_submitted", 0) or 0) for r in train)))
    return runs


_ERROR_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Exit|Interrupt)\b.*")


def first_error(log_text: str) -> str:
    """The line a reader wants from a failed run: the last exception line of the last traceback, else the last
    non-empty line."""
    lines = [line.rstrip() for line in log_text.splitlines() if line.strip()]
    last_tb = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                  default=None)
    if last_tb is not None:
        for line in lines[last_tb:]:
            if _ERROR_LINE.match(line):
                return line[:300]
    return lines[-1][:300] if lines else ""


@dataclass
class Result:
    name: str
    result: str  # "pass", "fail", "timeout", "skip", "edit-error"
    steps: int = 0
    expected_steps: int = 0
    train_rows: int = 0
    groups_trained: int = 0
    groups_logged: int = 0
    seconds: float = 0.0
    error: str = ""
    note: str = ""
    log: str = ""
    edits: list[dict[str, Any]] = field(default_factory=list)


def run_example(example: Example, art_root: Path, workdir: Path, timeout: float, base_model: str = TINY) -> Result:
    """Prepare, run and check one example (in a fresh scratch directory, so its loop starts at step 0)."""
    if example.skip:
        return Result(example.name, "skip", expected_steps=example.steps, error=example.skip)
    scratch = Path(workdir) / example.name
    try:
        prepared = prepare(example, art_root, scratch, base_model)
    except EditError as e:
        return Result(example.name, "edit-error", expected_steps=example.steps, error=str(e))
    log_path = scratch / LOG_FILE
    started = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(prepared.command, cwd=prepared.cwd, env=offline_env(), stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    seconds = time.monotonic() - started
    runs = inspect_runs(prepared.cwd)
    trained = max(runs, key=lambda r: r.step, default=None)
    result = Result(example.name, "fail", expected_steps=example.steps, seconds=round(seconds, 1),
                    log=str(log_path), edits=prepared.edits)
    if trained is not None:
        result.steps, result.train_rows = trained.step, trained.train_rows
        result.groups_trained, result.groups_logged = trained.groups_trained, trained.groups_logged
    log_text = log_path.read_text(errors="replace")
    if timed_out:
        result.result, result.error = "timeout", f"still running after {timeout:.0f} s (killed)"
    elif rc != 0:
        result.error = f"exit {rc}: {first_error(log_text)}"
    elif trained is None:
        result.error = f"exit 0 but no run directory under {prepared.cwd / RUN_ROOT}"
    elif trained.step < example.steps or trained.train_rows == 0:
        result.error = (f"exit 0 but the run reached step {trained.step} of {example.steps} with "
                        f"{trained.train_rows} train rows in history.jsonl")
    else:
        result.result = "pass"
        if trained.groups_trained == 0:
            result.note = (f"no group with a reward spread reached training ({trained.groups_logged} logged): "
                           "every step advanced with the same weights, as ART's do")
    return result


# ---------------------------------------------------------------------------------------------- report


def art_version(art_root: Path) -> str:
    for name, pattern in (("PKG-INFO", r"^Version:\s*(\S+)"), ("pyproject.toml", r'^version\s*=\s*"([^"]+)"')):
        path = Path(art_root) / name
        if path.exists() and (m := re.search(pattern, path.read_text(), flags=re.MULTILINE)):
            return m.group(1)
    return "unknown"


def machine() -> str:
    desc = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"
    try:
        cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), flags=re.MULTILINE)
        desc += f" ({cpu.group(1).strip()})" if cpu else ""
    except OSError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            desc += f", {torch.cuda.get_device_name(0)}"
        desc += f", torch {torch.__version__}"
    except ImportError:
        pass
    return desc + f", Python {platform.python_version()}"


def table(results: list[Result]) -> str:
    head = "| example | result | train steps | groups with a reward spread / logged | seconds | first error or note |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in results:
        steps = f"{r.steps} / {r.expected_steps}" if r.result != "skip" else "-"
        groups = f"{r.groups_trained} / {r.groups_logged}" if r.result != "skip" else "-"
        error = (r.error or r.note).replace("|", "\\|")
        lines.append(f"| {r.name} | {r.result} | {steps} | {groups} | {r.seconds:.0f} | {error} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("art_root", type=Path, help="root of ART's source tree (the directory holding examples/)")
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these: {[e.name for e in EXAMPLES]}")
    p.add_argument("--timeout", type=float, default=600, help="seconds per example before it is killed")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temporary directory, kept)")
    p.add_argument("--base-model", default=TINY, help="the base model the examples train (a model name or local "
                   "path artrl can load without the network)")
    args = p.parse_args(argv)
    examples = list(EXAMPLES)
    if args.only:
        unknown = sorted(set(args.only) - {e.name for e in EXAMPLES})
        if unknown:
            p.error(f"unknown example(s) {unknown}; known: {[e.name for e in EXAMPLES]}")
        examples = [e for e in EXAMPLES if e.name in args.only]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="art-examples-"))
    print(f"ART {art_version(args.art_root)} at {args.art_root}, base model {args.base_model}; scratch and logs in "
          f"{workdir}", flush=True)
    started = time.monotonic()
    results = []
    for example in examples:
        print(f"-- {example.name} ...", flush=True)
        results.append(run_example(example, args.art_root, workdir, args.timeout, args.base_model))
        r = results[-1]
        print(f"   {r.result}: step {r.steps}/{r.expected_steps}, {r.groups_trained}/{r.groups_logged} groups with a "
              f"reward spread, {r.seconds:.0f} s {r.error}", flush=True)
    total = time.monotonic() - started
    print(table(results))
    passed = sum(r.result == "pass" for r in results)
    with_spread = sum(r.result == "pass" and r.groups_trained > 0 for r in results)
    print(f"{passed} of {len(results)} passed ({with_spread} with a reward spread to learn from) in {total:.0f} s "
          f"on {machine()}")
    if args.out:
        report = {"art_root": str(args.art_root), "art_version": art_version(args.art_root),
                  "base_model": args.base_model,
                  "date": datetime.date.today().isoformat(), "machine": machine(), "total_seconds": round(total, 1),
                  "command": " ".join([Path(sys.executable).name, *sys.argv]),
                  "examples": [asdict(r) for r in results]}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r.result in ("pass", "skip") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
