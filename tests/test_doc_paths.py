"""Every repository path that the README, docs/ and the command line's help name exists in a clone.

A path counts as the repository's when it starts with one of its top-level folders (`benchmarks/...`,
`src/...`), with `../` (which leaves the page's folder), or is a module path under src/artrl (`serve/engines/base.py`).
It must then name a file or folder inside the repository, relative to the repository's root, the page's
folder, or src/artrl. Paths with placeholders (`<name>`, `NNNN`, `*`) and the run directory's own layout
(`.art/...`, `checkpoints/...`) are not repository paths.

A listing of the source tree (a code block that opens with `src/artrl/`) names its files apart from their
folder, with spaces around them (`  train/   rl.py sft.py`, continued on the next lines): each file it lists
must exist in that folder of src/artrl too.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP = ("src", "tests", "docs", "benchmarks", "examples", ".ci")
PACKAGES = {p.name for p in (ROOT / "src" / "artrl").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
# Paths in ART's source tree, quoted where the docs say what runs from it (not this repository's).
ART_PATHS = {"tests/unit", "../data/temporal-clue/puzzles.json"}
_TOKEN = re.compile(r"(?<![\w./~<>-])((?:\.\./)*[\w.-]+(?:/[\w.-]+)+/?)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def repository_paths(text: str) -> list[str]:
    """The repository paths `text` names (see the module docstring)."""
    out = []
    for match in _TOKEN.finditer(text):
        path = match.group(1).rstrip(".")
        first = path.split("/")[0]
        if path.startswith("../") or first in TOP or (first in PACKAGES and path.endswith(".py")):
            out.append(path)
    return out


def missing(text: str, folder: pathlib.Path) -> list[str]:
    """The repository paths of `text` that name nothing inside the repository."""
    def found(path: str) -> bool:
        for base in (ROOT, folder, ROOT / "src" / "artrl"):
            where = (base / path).resolve()
            if where.is_relative_to(ROOT) and where.exists():
                return True
        return False

    return [p for p in repository_paths(text) if p not in ART_PATHS and not found(p)]


_BLOCK = re.compile(r"```[^\n]*\n(src/artrl/\n.*?)```", re.S)
_FILE = re.compile(r"^[\w-]+\.py$")


def listed_paths(text: str) -> list[str]:
    """The files that the source-tree listings of `text` name, as paths under src/artrl (module docstring)."""
    out = []
    for block in _BLOCK.findall(text):
        folder = ""
        for line in block.splitlines()[1:]:
            words = re.sub(r"\([^)]*\)?", " ", line).split()  # what is in parentheses is prose
            if not words:
                continue
            indent = len(line) - len(line.lstrip())
            if words[0].endswith("/"):
                folder = words[0]
            elif indent <= 2:
                folder = ""  # a line of top-level modules; deeper lines continue the folder above
            out += [folder + w for w in words if _FILE.match(w)]
    return out


def test_a_listing_names_files_apart_from_their_folder():
    text = ("```\nsrc/artrl/\n  types.py  cli.py   the command line\n  train/   rl.py (the loss.py of it) gone.py\n"
            "           sft.py\n  model.py\n```\n")
    assert listed_paths(text) == ["types.py", "cli.py", "train/rl.py", "train/gone.py", "train/sft.py", "model.py"]
    assert [p for p in listed_paths(text) if not (ROOT / "src" / "artrl" / p).exists()] == ["train/gone.py"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_file_a_source_listing_names_exists(page):
    assert [p for p in listed_paths(page.read_text()) if not (ROOT / "src" / "artrl" / p).exists()] == []


def test_the_rule_finds_repository_paths_and_leaves_the_rest():
    text = ("run `artrl bench pack --workload ../shared/workloads/seed-like.json` or benchmarks/workloads/x.json; "
            "see serve/engines/base.py, src/artrl/models/tiny.py and docs/batching.md; metrics train/loss and data/rows; "
            "the run's .art/p/models/m/history.jsonl; openai/gpt-4o")
    assert repository_paths(text) == ["../shared/workloads/seed-like.json", "benchmarks/workloads/x.json",
                                      "serve/engines/base.py", "src/artrl/models/tiny.py", "docs/batching.md"]
    assert missing(text, ROOT) == ["../shared/workloads/seed-like.json", "benchmarks/workloads/x.json"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(page):
    assert missing(page.read_text(), page.parent) == []


def _help_texts(parser: argparse.ArgumentParser) -> list[str]:
    out = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _help_texts(sub)
    return out


def test_every_path_the_command_lines_help_names_exists():
    """`artrl ... --help` for every subcommand, and each example's --help (its docstring)."""
    from artrl.cli import _parser

    texts = _help_texts(_parser())
    assert any("benchmarks/workloads/seed-like.json" in t for t in texts)  # the bench's --workload help
    texts += [ast.get_docstring(ast.parse(p.read_text())) or "" for p in sorted((ROOT / "examples").rglob("*.py"))]
    assert [m for t in texts for m in missing(t, ROOT)] == []
