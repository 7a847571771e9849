"""An ART program's imports run unedited: `art` and `art.X` are artrl's modules of the same path.

Each case runs in a fresh interpreter of this environment (the alias is installed at start-up by the wheel's
`artrl-art.pth`, src/_artrl_art.py): plainly with `python`, and through `artrl run` / `python -m artrl run`.
A package named `art` put on PYTHONPATH stands for an installed openpipe-art.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

# Written as ART 0.5.23's docs and skills write a program's imports, and checked to be artrl's modules themselves.
PROGRAM = textwrap.dedent("""
    import sys

    import art
    from art.local import LocalBackend
    from art.rewards import ruler_score_group
    from art.utils.iterate_dataset import iterate_dataset
    from art.utils.sft import train_sft_from_file
    from art.trajectories import tokenize
    import art.dev

    import artrl
    import artrl.local, artrl.rewards, artrl.utils.iterate_dataset, artrl.utils.sft, artrl.trajectories, artrl.dev

    assert art is artrl and art.local is artrl.local and art.dev is artrl.dev
    assert LocalBackend is artrl.local.LocalBackend and ruler_score_group is artrl.rewards.ruler_score_group
    assert iterate_dataset is artrl.utils.iterate_dataset.iterate_dataset
    assert train_sft_from_file is artrl.utils.sft.train_sft_from_file and tokenize is artrl.trajectories.tokenize
    assert sys.modules["art.utils.sft"] is artrl.utils.sft
    assert artrl.__spec__.name == "artrl" and artrl.utils.sft.__spec__.name == "artrl.utils.sft"
    print("ran on", art.__name__, sys.argv[1:], __name__)
""")


def run(args: list[str], cwd: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("ARTRL_ART", "PYTHONPATH")}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env={**environ, **env}, timeout=300)


def artrl_command() -> str:
    return str(pathlib.Path(sys.executable).with_name("artrl"))


@pytest.fixture
def program(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "program.py").write_text(PROGRAM)
    return tmp_path / "program.py"


@pytest.fixture
def fake_art(tmp_path: pathlib.Path) -> pathlib.Path:
    """A package `art` on PYTHONPATH: what an installed openpipe-art looks like to `import art`."""
    site = tmp_path / "site"
    (site / "art").mkdir(parents=True)
    (site / "art" / "__init__.py").write_text("WHO = 'the other art'\n")
    return site


@pytest.mark.parametrize("how", ["python", "artrl run", "python -m artrl run"])
def test_an_art_program_runs_unedited_and_its_modules_are_artrls(program, how):
    head = {"python": [sys.executable], "artrl run": [artrl_command(), "run"],
            "python -m artrl run": [sys.executable, "-m", "artrl", "run"]}[how]
    out = run([*head, str(program), "--steps", "2"], program.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ran on artrl ['--steps', '2'] __main__"
    assert "openpipe-art" not in out.stderr  # nothing to say when no other art is installed


def test_an_art_path_artrl_lacks_is_refused_naming_it_and_what_to_use(tmp_path):
    code = textwrap.dedent("""
        import art
        for path in ("art.megatron", "art.tinker.backend", "art.no_such_module"):
            try:
                __import__(path)
            except ModuleNotFoundError as e:  # an ImportError: code that tries an optional part goes on
                print(e.name, "|", e)
    """)
    out = run([sys.executable, "-c", code], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    megatron, tinker, missing = out.stdout.strip().splitlines()
    assert megatron.startswith("art.megatron | ") and "Megatron back end" in megatron and "art.LocalBackend" in megatron
    assert tinker.startswith("art.tinker | ") and "Tinker" in tinker  # the first missing part of the path
    assert missing.startswith("art.no_such_module | ") and "docs/art-compatibility.md" in missing


def test_an_installed_art_is_never_shadowed_and_artrl_run_says_it_takes_its_place(program, fake_art):
    plain = run([sys.executable, "-c", "import art; print(art.WHO)"], program.parent, PYTHONPATH=str(fake_art))
    assert plain.returncode == 0 and plain.stdout.strip() == "the other art", plain.stderr[-2000:]

    forced = run([artrl_command(), "run", str(program)], program.parent, PYTHONPATH=str(fake_art))
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert forced.stdout.strip() == "ran on artrl [] __main__"
    assert forced.stderr.count("`import art` is artrl in this process") == 1


def test_the_alias_can_be_switched_off(tmp_path):
    out = run([sys.executable, "-c", "import art"], tmp_path, ARTRL_ART="off")
    assert out.returncode != 0 and "No module named 'art'" in out.stderr


def test_a_folder_named_art_beside_the_program_does_not_switch_the_alias_off(program):
    (program.parent / "art").mkdir()  # a data folder: a namespace package to importlib, not ART
    out = run([sys.executable, str(program)], program.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ran on artrl")


def test_the_wheel_installs_the_start_up_hook(tmp_path):
    """The `.pth` that turns the alias on is in the built wheel, beside the package (setup.py)."""
    import zipfile

    root = pathlib.Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(".venv", ".git", "tests", "benchmarks", "docs", "*.egg-info",
                                                             "build", "__pycache__", ".art"))
    out = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
               str(tmp_path / "dist"), str(src)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("artrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "artrl-art.pth" in names and "_artrl_art.py" in names
    assert zipfile.ZipFile(wheel).read("artrl-art.pth").decode().startswith("import _artrl_art;")
