"""Run OpenPipe ART's own unit tests against artrl, from an ART source tree, and count what passes.

    python benchmarks/art_unit_tests.py /path/to/ART [--only test_x.py ...] [--out results.json]
                                        [--workdir DIR] [--timeout S]

Every `tests/unit/test_*.py` and `art/test/test_*.py` of the ART tree is copied
into a scratch directory with only ART's package name changed (`RENAMES`: the
imports, and the module paths the tests hand to `unittest.mock.patch` or
`importlib.import_module`), then run one file at a time with this Python and
this checkout's `src/` first on the path: `pytest -p no:cacheprovider -o
asyncio_mode=auto` (ART's own pytest setting), offline (`HF_HUB_OFFLINE=1`,
`WANDB_MODE=disabled`, `LITELLM_LOCAL_MODEL_COST_MAP=True`).

ART's tests need pytest-asyncio, aiohttp and litellm, as ART's own test
environment has them: `pip install -e ".[art-tests]"` installs them (litellm at
the version ART 0.5.17 locks). Each file's outcome comes from pytest's JUnit XML.
A file that cannot be collected (it imports an ART module artrl does not have)
counts all its tests as failed, and one that skips itself while being collected
(a GPU back end's library missing) all as skipped; how many tests such a file
holds is counted from its source (`count_tests`: test functions and methods,
times the length of a literal `parametrize` list), which is what pytest collects
from these files.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_GLOBS = ("tests/unit/test_*.py", "art/test/test_*.py")
RENAMES = (  # ART's package name -> artrl, in imports and in module paths written as strings
    (r"^(\s*)import art$", r"\1import artrl as art"),
    (r"^(\s*)from art\.", r"\1from artrl."),
    (r"^(\s*)from art import", r"\1from artrl import"),
    (r"^(\s*)import art\.([A-Za-z_.]*)", r"\1import artrl.\2"),
    (r"""(["'])art\.""", r"\1artrl."),
)


def rename(text: str) -> str:
    """ART's test source with ART's package name changed to artrl (nothing else)."""
    for pattern, replacement in RENAMES:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    return text


def count_tests(source: str) -> int:
    """The tests pytest collects from a file: `test_*` functions, and methods of `Test*` classes, each times the
    length of its literal `@pytest.mark.parametrize` lists."""
    def cases(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
        n = 1
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize" and len(dec.args) >= 2 \
                    and isinstance(dec.args[1], (ast.List, ast.Tuple)):
                n *= len(dec.args[1].elts)
        return n

    total = 0
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            total += cases(node)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            total += sum(cases(f) for f in node.body
                         if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test"))
    return total


@dataclass
class FileResult:
    file: str
    tests: int
    passed: int
    failed: int
    skipped: int
    status: str  # "ran", "not collected" (all its tests count as failed), "skipped whole" (all skipped)
    failures: list[str]


COLLECTION = {"collection failure": "not collected", "collection skipped": "skipped whole"}
"""pytest's JUnit messages for a file that could not be collected, or skipped itself while being collected."""


def junit_outcomes(path: Path) -> tuple[list[str], list[str], list[str], str]:
    """(passed, failed or errored, skipped) test ids from a JUnit XML file, and how the file was collected:
    "ran", or one of COLLECTION's values."""
    passed, failed, skipped, status = [], [], [], "ran"
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        kinds = {child.tag for child in case}
        if not case.get("classname"):
            status = next((COLLECTION[c.get("message")] for c in case if c.get("message") in COLLECTION), status)
        if kinds & {"failure", "error"}:
            failed.append(name)
        elif "skipped" in kinds:
            skipped.append(name)
        else:
            passed.append(name)
    return passed, failed, skipped, status


def test_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled",
               LITELLM_LOCAL_MODEL_COST_MAP="True")
    env.pop("WANDB_API_KEY", None)
    return env


def run_file(source: Path, workdir: Path, timeout: float) -> FileResult:
    """Copy one of ART's test files, renamed, into `workdir` and run it; its counts."""
    text = source.read_text()
    target = workdir / source.name
    target.write_text(rename(text))
    report = workdir / f"{source.stem}.xml"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto",
           f"--junitxml={report}", target.name]
    try:
        subprocess.run(cmd, cwd=workdir, env=test_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    tests = count_tests(text)
    if not report.exists():
        return FileResult(source.name, tests, 0, tests, 0, "not collected", [f"{source.name}: no report (timed out)"])
    passed, failed, skipped, status = junit_outcomes(report)
    if status == "not collected":
        return FileResult(source.name, tests, 0, tests, 0, status, failed)
    if status == "skipped whole":
        return FileResult(source.name, tests, 0, 0, tests, status, [])
    return FileResult(source.name, len(passed) + len(failed) + len(skipped), len(passed), len(failed),
                      len(skipped), status, failed)


def find_tests(art_root: Path, only: list[str] | None) -> list[Path]:
    files = sorted(p for pattern in TEST_GLOBS for p in Path(art_root).glob(pattern))
    if not files:
        raise SystemExit(f"no ART tests under {art_root} (looked for {', '.join(TEST_GLOBS)})")
    if only:
        missing = sorted(set(only) - {p.name for p in files})
        if missing:
            raise SystemExit(f"not among ART's tests: {missing}")
        files = [p for p in files if p.name in only]
    return files


def table(results: list[FileResult]) -> str:
    lines = ["| ART test file | tests | pass | skipped |", "|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| `{r.file}` | {r.tests} | {r.passed} | {r.skipped} |"
                     + ("" if r.status == "ran" else f" ({r.status})"))
    tests, passed = sum(r.tests for r in results), sum(r.passed for r in results)
    lines.append(f"| all | {tests} | {passed} | {sum(r.skipped for r in results)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("art_root", type=Path, help="root of ART's source tree (holding tests/unit/ and art/test/)")
    p.add_argument("--only", nargs="+", metavar="FILE", help="run only these test files (e.g. test_sft.py)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temporary directory)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per test file before it is stopped")
    args = p.parse_args(argv)
    files = find_tests(args.art_root, args.only)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="art-unit-tests-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for source in files:
        result = run_file(source, workdir, args.timeout)
        results.append(result)
        print(f"{result.file}: {result.passed} of {result.tests} pass" + (f", {result.skipped} skipped"
              if result.skipped else "") + ("" if result.status == "ran" else f" ({result.status})"), flush=True)
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
