"""ART 0.5.23's in-package tests (`art/test/`) run against artrl, with only the package name changed.

Nothing of ART is copied into this repository. With `ART_SOURCE` pointing at ART's unpacked sdist
(`pip download --no-deps --no-binary :all: openpipe-art==0.5.23`, unpacked; the directory that holds
`src/art/test/`, or that `src/` itself), each test file is read at test time, its package name changed
(`benchmarks/art_unit_tests.py`'s `rename`: imports, and module paths written as strings), written into
a scratch directory and run there by pytest in a child process, offline, with this checkout's `src/`
first on the path. Without `ART_SOURCE` every test here skips, saying so.

Two substitutions, each written down here and applied to nothing else:

* `OFFLINE_MODELS`: a hub model name in a string literal becomes an offline built-in of the same family
  (`"Qwen/Qwen2.5-0.5B-Instruct"` -> `"artrl/tiny"`, a Qwen3-architecture model built in process), so no
  test downloads weights. What such a test checks (step counting, checkpoint directories) does not
  depend on the model's size.
* Async tests run under pytest-asyncio in `asyncio_mode=auto` (ART's own setting) when it is installed;
  otherwise a `conftest.py` written next to them runs each coroutine test with `asyncio.run`.

`test_step_skipping.py` as ART ships it asserts that a step with nothing to train *renames* checkpoint
0001 to 0002. ART 0.5.23's LocalBackend copies it instead (`_advance_skipped_step`: `shutil.copytree`,
0001 stays), and artrl does what 0.5.23 does, so that one test fails on both at that assertion (it needs a
GPU back end on ART, where nobody runs it on a CPU). It is run twice: as shipped, where it must fail at
exactly that assertion and nowhere before it; and with those two assertions stated as ART 0.5.23 behaves
(0001 kept), where it must pass. test_kl_advantage.py runs as shipped and every test must pass.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ART_SOURCE_ENV = "ART_SOURCE"
RUNNER_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "art_unit_tests.py"
PACKAGE_TESTS = "art/test"
OFFLINE_MODELS = {"Qwen/Qwen2.5-0.5B-Instruct": "artrl/tiny"}
"""Hub model names in ART's tests -> the offline built-in that stands in for them (string literals only)."""

STALE_RENAME = "should have been renamed"
"""The failure message of test_step_skipping's assertion that a skipped step renames the last checkpoint."""
AS_ART_0523 = (  # test_step_skipping's two stale assertions, stated as ART 0.5.23's copytree behaves
    ("assert not os.path.exists(checkpoint_1), (", "assert os.path.exists(checkpoint_1), ("),
    ('expected_checkpoints = ["0000", "0002", "0003"]', 'expected_checkpoints = ["0000", "0001", "0002", "0003"]'),
)

ASYNC_CONFTEST = '''\
import asyncio
import inspect

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(pyfuncitem.obj(**kwargs))
        return True
    return None
'''


def _load_runner():
    spec = importlib.util.spec_from_file_location("art_unit_tests", RUNNER_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("art_unit_tests", module)
    spec.loader.exec_module(module)
    return module


runner = _load_runner()


def art_test_dir() -> Path:
    root = os.environ.get(ART_SOURCE_ENV)
    if not root:
        pytest.skip(f"set {ART_SOURCE_ENV} to ART 0.5.23's unpacked sdist to run its in-package tests on artrl")
    for candidate in (Path(root) / "src" / PACKAGE_TESTS, Path(root) / PACKAGE_TESTS):
        if candidate.is_dir():
            return candidate
    pytest.skip(f"{ART_SOURCE_ENV}={root} holds no {PACKAGE_TESTS}/ (nor src/{PACKAGE_TESTS}/); point it at ART's "
                "unpacked sdist")


def offline(text: str) -> tuple[str, int]:
    """`text` with each hub model name in OFFLINE_MODELS replaced, in quoted strings; and how many were."""
    count = 0
    for hub, local in OFFLINE_MODELS.items():
        text, n = re.subn(r"""(["'])""" + re.escape(hub) + r"\1", lambda m: m.group(1) + local + m.group(1), text)
        count += n
    return text, count


def run_art_file(name: str, workdir: Path, edits: tuple[tuple[str, str], ...] = ()) -> dict[str, list]:
    """ART's `name`, renamed, offline and `edits` applied, run by pytest in `workdir`: test id -> failure
    messages ([] for a pass); skipped tests are left out."""
    source = art_test_dir() / name
    if not source.is_file():
        pytest.skip(f"{source} does not exist: {ART_SOURCE_ENV} is not ART 0.5.23's sdist")
    text, _ = offline(runner.rename(source.read_text()))
    for old, new in edits:
        assert text.count(old) == 1, f"{name} no longer holds {old!r}; this test's edits follow ART 0.5.23's file"
        text = text.replace(old, new)
    (workdir / name).write_text(text)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={workdir / 'report.xml'}",
           name]
    if importlib.util.find_spec("pytest_asyncio") is not None:
        cmd[4:4] = ["-o", "asyncio_mode=auto"]
    else:
        (workdir / "conftest.py").write_text(ASYNC_CONFTEST)
    env = runner.test_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    report = workdir / "report.xml"
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    outcomes: dict[str, list] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        if any(child.tag == "skipped" for child in case):
            continue
        outcomes[case.get("name", "")] = [c.get("message", "") for c in case if c.tag in ("failure", "error")]
    assert outcomes, f"{name}: nothing ran\n{done.stdout[-3000:]}"
    return outcomes


def test_offline_substitution_and_rename_touch_only_what_they_name():
    text = 'from art.local import LocalBackend\nbase_model="Qwen/Qwen2.5-0.5B-Instruct"\nx = "Qwen/Qwen2.5-0.5B"\n'
    renamed, n = offline(runner.rename(text))
    assert n == 1
    assert renamed == 'from artrl.local import LocalBackend\nbase_model="artrl/tiny"\nx = "Qwen/Qwen2.5-0.5B"\n'


def test_kl_advantage(tmp_path):
    outcomes = run_art_file("test_kl_advantage.py", tmp_path)
    failed = {k: v for k, v in outcomes.items() if v}
    assert not failed, failed
    source = (art_test_dir() / "test_kl_advantage.py").read_text()
    assert len(outcomes) == runner.count_tests(source)  # every test of the file ran (and passed)


def test_step_skipping_as_shipped_fails_only_at_its_stale_rename_assertion(tmp_path):
    outcomes = run_art_file("test_step_skipping.py", tmp_path)
    assert list(outcomes) == ["test_step_skipping"]
    (messages,) = outcomes.values()
    assert len(messages) == 1 and STALE_RENAME in messages[0], messages


def test_step_skipping_with_art_0523_skip_semantics(tmp_path):
    outcomes = run_art_file("test_step_skipping.py", tmp_path, AS_ART_0523)
    assert outcomes == {"test_step_skipping": []}, outcomes

