"""A child process this program starts and watches: an inference replica, or the router.

What a supervisor needs from a child, and nothing more:

* **Ready as an event.** The child writes one line that says it is ready (for a replica, its
  port: `ARTRL_REPLICA_READY {"port": P}`); a reader thread sets an event when it comes, or
  when the child exits first. `wait_ready(timeout)` waits on that event, never polls.
* **Its output as log lines.** Every other line of its stdout and stderr goes to this
  process's logging (logger `artrl.replicas.<name>`), and the last ones are kept for the
  error that says why a child did not start.
* **Its end as an event.** A watcher thread waits for the exit and calls `on_exit(child, code)`
  (unless `stop()` ended it): the control plane takes the replica out and restarts it.
* **Never an orphan.** The child's stdin is a pipe this process holds: when this process
  ends, however (even SIGKILL), the pipe closes and the child exits (the child calls
  `on_parent_end`: replicas/process.py and replicas/router_main.py).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

log = logging.getLogger(__name__)

TAIL_LINES = 30


class ChildError(RuntimeError):
    """A child process did not start (or ended); the message has its exit status and last output lines."""


class ChildProcess:
    """See the module docstring. `ready_prefix`: the line that says the child is ready (what follows it is JSON
    kept in `ready_info`); `on_exit(child, returncode)`: called from the watcher thread when the child ends by
    itself."""

    def __init__(self, name: str, argv: list[str], *, ready_prefix: str, env: dict[str, str] | None = None,
                 on_exit: Callable[["ChildProcess", int], None] | None = None, ready_in_stderr: bool = False) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.ready_prefix = ready_prefix
        self.ready_in_stderr = ready_in_stderr
        self.on_exit = on_exit
        self.ready_info: dict[str, Any] | None = None
        self.returncode: int | None = None
        self._ready = threading.Event()  # set when ready, or when the child ended first
        self._ended = threading.Event()
        self._stopping = False
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._log = logging.getLogger(f"artrl.replicas.{name}")
        self._proc: subprocess.Popen[bytes] | None = None
        self._readers: list[threading.Thread] = []

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._ended.is_set()

    def start(self) -> "ChildProcess":
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=self.env, start_new_session=True)
        for stream, is_stderr in ((self._proc.stdout, False), (self._proc.stderr, True)):
            reader = threading.Thread(target=self._read, args=(stream, is_stderr), daemon=True,
                                      name=f"artrl-{self.name}-{'err' if is_stderr else 'out'}")
            reader.start()
            self._readers.append(reader)
        threading.Thread(target=self._watch, name=f"artrl-{self.name}-watch", daemon=True).start()
        return self

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """The ready line's JSON once the child said it is ready; ChildError if it ended or `timeout` passed."""
        if not self._ready.wait(timeout):
            raise ChildError(f"{self.name} (pid {self.pid}) did not become ready within {timeout:.0f}s; its last "
                             f"output:\n{self.tail()}")
        if self.ready_info is None:
            self._ended.wait(5.0)
            raise ChildError(f"{self.name} (pid {self.pid}) exited with status {self.returncode} before it was "
                             f"ready; its last output:\n{self.tail()}")
        return self.ready_info

    def wait_ended(self, timeout: float | None = None) -> bool:
        return self._ended.wait(timeout)

    def tail(self) -> str:
        return "\n".join(self._tail) or "(nothing)"

    def kill(self) -> None:
        """SIGKILL (what a test does to stand for a crash: the watcher reports the exit)."""
        if self._proc is not None and not self._ended.is_set():
            self._proc.kill()

    def stop(self, timeout: float = 30.0) -> None:
        """End the child: its stdin closes (it exits by itself), then SIGTERM, then SIGKILL; idempotent."""
        self._stopping = True
        proc = self._proc
        if proc is None:
            return
        try:
            self._close_stdin()
            if not self._ended.wait(timeout / 3):
                proc.terminate()
                if not self._ended.wait(timeout / 3):
                    proc.kill()
        except OSError:  # it ended meanwhile
            pass
        self._ended.wait(timeout / 3)
        for reader in self._readers:
            reader.join(5.0)

    # ------------------------------------------------------------------ threads
    def _close_stdin(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()

    def _read(self, stream: IO[bytes] | None, is_stderr: bool) -> None:
        assert stream is not None
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            if (is_stderr == self.ready_in_stderr) and self.ready_info is None and self.ready_prefix in line:
                tail = line.split(self.ready_prefix, 1)[1].strip()
                try:
                    self.ready_info = json.loads(tail) if tail.startswith("{") else {"line": line}
                except ValueError:
                    self.ready_info = {"line": line}
                self._ready.set()
                continue
            self._tail.append(line)
            self._log.info("%s", line)
        stream.close()

    def _watch(self) -> None:
        assert self._proc is not None
        code = self._proc.wait()
        self.returncode = code
        self._ended.set()
        self._ready.set()  # whoever waits for ready stops waiting
        if self._stopping:
            return
        log.warning("%s (pid %d) ended with status %d", self.name, self._proc.pid, code)
        if self.on_exit is not None:
            for reader in self._readers:  # its last lines are in the log before anyone acts on its end
                reader.join(5.0)
            self.on_exit(self, code)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment, plus `extra`."""
    env = dict(os.environ)
    env.update(extra)
    return env


def on_parent_end(callback: Callable[[], None], name: str) -> None:
    """In a child: call `callback` on a daemon thread once standard input, the pipe the parent holds, closes
    (the parent ended, however)."""
    def watch() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except OSError:
            pass
        callback()

    threading.Thread(target=watch, name=name, daemon=True).start()
