"""A child started by replicas/spawn.py never outlives its parent: it acts when its stdin pipe closes."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import threading
from artrl.replicas.spawn import on_parent_end
ended = threading.Event()
on_parent_end(ended.set, "test-stdin")
print("watching", flush=True)
print("parent ended" if ended.wait(60) else "still waiting", flush=True)
"""


def test_a_child_learns_that_its_parent_ended_when_its_stdin_closes():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "watching"
        child.stdin.write("bytes the child reads and ignores\n")
        child.stdin.flush()
        child.stdin.close()  # what the parent's end does to the pipe, however it ends
        assert child.wait(timeout=60) == 0
        assert child.stdout.read().strip() == "parent ended"
    finally:
        child.kill()
        child.wait()
