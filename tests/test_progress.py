"""Progress bars: live on a terminal (a pty), a few lines in a file or pipe; every bar of the package is ours."""

from __future__ import annotations

import io
import os
import pathlib
import re
import sys

import pytest

import artrl
from artrl.runtime.progress import LOG_INTERVAL_S, is_live, progress_bar


def updates(stream, n: int = 2000, **kwargs) -> str:
    with progress_bar(total=n, desc="work", file=stream, **kwargs) as bar:
        for _ in range(n):
            bar.update(1)
    return stream.getvalue() if isinstance(stream, io.StringIO) else ""


def test_a_file_or_pipe_gets_a_bar_that_redraws_every_few_seconds_and_ends_with_its_last_state():
    log = io.StringIO()  # not a terminal
    assert not is_live(log)
    out = updates(log)
    assert "2000/2000" in out
    assert out.count("\r") <= 3  # first state, final state: not one redraw per update
    with progress_bar(total=1, file=io.StringIO()) as bar:
        assert bar.mininterval == LOG_INTERVAL_S


def test_a_pipe_and_a_pty_are_told_apart():
    read_end, write_end = os.pipe()
    master, slave = os.openpty()
    with os.fdopen(write_end, "w") as pipe, os.fdopen(slave, "w") as terminal:
        assert not is_live(pipe) and is_live(terminal)
        with progress_bar(total=1, file=pipe) as piped, progress_bar(total=1, file=terminal) as live:
            assert piped.mininterval == LOG_INTERVAL_S
            assert live.mininterval == pytest.approx(0.1)  # tqdm's own default: a live bar
    os.close(read_end)
    os.close(master)


def test_stderr_decides_by_default_and_the_callers_settings_win(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress_bar(total=1) as bar:
        assert bar.mininterval == LOG_INTERVAL_S and bar.fp is not None
    with progress_bar(total=1, mininterval=0.5) as bar:
        assert bar.mininterval == 0.5
    assert updates(io.StringIO(), disable=True) == ""


def test_tqdms_environment_override_is_left_to_tqdm(monkeypatch):
    """With TQDM_MININTERVAL set, the bar is tqdm's own (tqdm applies the variable, read when it is imported)."""
    from artrl.runtime.progress import ProgressBar

    monkeypatch.setenv("TQDM_MININTERVAL", "2")
    log = io.StringIO()
    with progress_bar(total=1, file=log) as ours, ProgressBar(total=1, file=log) as plain:
        assert ours.mininterval == plain.mininterval != LOG_INTERVAL_S


def test_every_bar_in_the_package_is_made_by_progress_bar():
    src = pathlib.Path(artrl.__file__).parent
    users = [str(p.relative_to(src)) for p in src.rglob("*.py")
             if p.name != "progress.py" and re.search(r"^\s*(from|import) tqdm", p.read_text(), re.M)]
    assert users == []


def test_a_gathers_bar_in_a_log_is_a_few_lines_with_the_final_means(monkeypatch):
    """The running means used to force a redraw on every rollout (ART's set_postfix): a log line per rollout."""
    import asyncio

    monkeypatch.setattr(sys, "stderr", io.StringIO())

    async def rollout(i: int) -> artrl.Trajectory:
        return artrl.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=i % 2)

    groups = asyncio.run(artrl.gather_trajectory_groups(
        (artrl.TrajectoryGroup(rollout(i) for i in range(10)) for _ in range(20)), pbar_desc="rollouts"))
    out = sys.stderr.getvalue()
    assert len(groups) == 20 and "200/200" in out and "reward=0.5" in out
    assert out.count("\r") <= 3, out


def test_a_bar_that_clears_itself_on_a_terminal_still_leaves_its_last_state_in_a_log():
    """The trainer's per-call bar is made with leave=False; in a log it used to end as a blank line."""
    out = updates(io.StringIO(), n=8, leave=False)
    assert "8/8" in out and out.rstrip("\n").endswith("]")
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as terminal:
        with progress_bar(total=1, file=terminal, leave=False) as live:
            assert live.leave is False  # a terminal keeps the caller's choice
    os.close(master)


def test_bars_into_a_pipe_are_plain_lines_with_no_cursor_codes():
    """Two stacked bars and a log line written between their states, stderr a pipe: each state is a line of its
    own, with no carriage return and no cursor code (a second bar moves the cursor up with ESC[A on a terminal)."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import sys
        from artrl.runtime.progress import progress_bar
        with progress_bar(total=2, desc="outer") as outer:
            for i in range(2):
                with progress_bar(total=3, desc=f"inner {i}", position=1, mininterval=0, leave=False) as inner:
                    for _ in range(3):
                        inner.update(1)
                print(f"a log line after inner {i}", file=sys.stderr)
                outer.update(1)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert b"\r" not in out.stderr and b"\x1b" not in out.stderr, out.stderr
    lines = out.stderr.decode().splitlines()
    assert all(line == line.rstrip() and line for line in lines)
    assert "a log line after inner 0" in lines and "a log line after inner 1" in lines  # not run into a bar's line
    assert [x.split("|")[0].strip() for x in lines if x.startswith("inner 0")][-1] == "inner 0: 100%"
    assert lines[-1].startswith("outer: 100%") and "2/2" in lines[-1]
    assert len(lines) <= 16  # a few lines per bar, not one per character redraw
