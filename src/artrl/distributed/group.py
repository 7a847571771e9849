"""The driver's side of the training workers: start them, hand them calls, notice when they die.

The driver is the user's process: it serves the model and owns the run
directory. `WorkerGroup` hosts a c10d `TCPStore` at the rendezvous endpoint
(the rendezvous of every torchrun and the control channel, protocol.py),
starts this machine's workers with torchrun (launch.py), and turns a train
call, prepared by the driver, into: payload file (the prepared call: rows,
plan, learning rates, loss) -> `call/<n>` -> the workers train -> `trained/<n>`
-> the driver decides -> `commit/<n>` -> rank 0 writes the checkpoint ->
`done/<n>`.

While it waits, it polls the store and its launcher process. When a worker
dies (killed, out of memory, a Python error, a collective timing out after
`collective_timeout_s`), torchrun stops the other local workers and exits, and
the driver raises `WorkerError` naming the rank and how it ended (launch.py's
report). The group is then dead; `start()` begins a new generation from the
latest complete checkpoint, with a rendezvous id of its own (torchrun closes
a rendezvous when its group ends). A dead worker on another machine ends the
group the same way: the local ranks' next collective fails within the timeout.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import errors
from ..errors import ArtrlError, ConfigError, WorkerError
from ..config.model import InternalModelConfig
from . import protocol
from .launch import FAILURE_FILE_ENV

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # how long close() waits for the workers to leave before it terminates them
# a surviving rank's error when another rank died first: a consequence, not the cause
_CONSEQUENCE = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused|timed out|timeout|"
                          r"communicator was aborted|ProcessGroup\w* .*(abort|error)|SIGTERM", re.I)


def cpu_worker_threads(cfg: InternalModelConfig) -> int:
    """torch threads of each training worker on a CPU: OMP_NUM_THREADS when set; else this machine's cores shared
    among the workers, less those of the serving process's decode thread when a lone worker trains beside it
    (train_in_worker)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    cores = os.cpu_count() or 1
    if cfg.workers_here == 1:
        cores -= cfg.inference_cpu_threads or 0
    return max(1, cores // cfg.workers_here)


@dataclass
class Trained:
    """What rank 0 reports after a call ran (before anything is written)."""

    steps: list[dict[str, float]]  # metrics per optimizer step
    summary: dict[str, float]  # the call's summary metrics (train/call.py's run_call)
    optimizer_steps: int  # the workers' optimizer steps taken so far

    @property
    def empty(self) -> bool:
        return not self.steps


class WorkerGroup:
    """This run's training workers (all machines), driven from the serving process."""

    def __init__(self, run: Path, cfg: InternalModelConfig, *, name: str = "artrl") -> None:
        cfg.check()
        self.run = run
        self.cfg = cfg
        self.dir = run / protocol.WORKERS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        host, port = protocol.parse_endpoint(cfg.rendezvous_endpoint or "127.0.0.1:0")
        try:
            self._root: Any = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                            timeout=protocol.STORE_TIMEOUT)
        except (RuntimeError, OSError) as e:
            raise ConfigError(f"cannot host the workers' rendezvous store at {host}:{port} ({e}); choose a free "
                              "port of an address of this machine in rendezvous_endpoint.") from e
        self.endpoint = f"{host}:{self._root.port}"
        self.name = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:64]
        self.generation = 0
        self.world_size = 0
        self.workers: list[dict[str, Any]] = []  # ready/<rank> of every rank: pid, host, device
        self._store: Any = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._n = 0
        self._uncommitted: int | None = None  # a call the workers ran and await a commit for

    # ------------------------------------------------------------------ lifecycle
    @property
    def rdzv_id(self) -> str:
        """The rendezvous id of the current generation (torchrun closes a rendezvous when its group ends)."""
        return f"{self.name}-g{self.generation}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self.world_size > 0

    def command(self) -> list[str]:
        """The torchrun arguments of this machine's workers (the launcher wraps torchrun)."""
        return ["--nnodes", str(self.cfg.num_nodes), "--nproc-per-node", str(self.cfg.workers_here),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id,
                "--rdzv-conf", "is_host=false", "--max-restarts", "0", "--monitor-interval", "0.2",
                "-m", "artrl.distributed.worker", "--control", self.endpoint, "--run-dir", str(self.run)]

    def remote_command(self) -> str:
        """What to run on each other machine (printed when num_nodes > 1)."""
        return (f"torchrun --nnodes {self.cfg.num_nodes} --nproc-per-node <GPUS> --rdzv-backend c10d "
                f"--rdzv-endpoint {self.endpoint} --rdzv-id {self.rdzv_id} --rdzv-conf is_host=false "
                f"-m artrl.distributed.worker --control {self.endpoint} --run-dir {self.run}")

    def start(self) -> None:
        """Start a new generation of workers; returns when every rank is ready (or raises WorkerError)."""
        if self.running:
            return
        if self._root is None:
            raise WorkerError("this worker group was closed; register the model again to start new workers")
        self._reap()
        self.generation += 1
        self._n = 0
        self._uncommitted = None
        self.world_size = 0
        self.workers = []
        self._root.set(protocol.GENERATION, str(self.generation))
        self._store = protocol.generation_store(self._root, self.generation)
        env = dict(os.environ)
        env[FAILURE_FILE_ENV] = str(self._failure_file())
        if self.cfg.trainer_gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.cfg.trainer_gpu_ids)
        if not self._on_gpu() and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(cpu_worker_threads(self.cfg))  # torchrun would set 1
        cmd = [sys.executable, "-m", "artrl.distributed.launch", *self.command()]
        log.info("starting %d training worker(s) here (generation %d): %s", self.cfg.workers_here, self.generation,
                 " ".join(cmd))
        if self.cfg.num_nodes > 1:
            log.warning("waiting for %d more machine(s) to join the training group; on each, run:\n  %s",
                        self.cfg.num_nodes - 1, self.remote_command())
        self._proc = subprocess.Popen(cmd, env=env)
        try:
            first = protocol.get(self._store, protocol.wait_any(self._store, [protocol.READY.format(rank=0)],
                                                                 alive=self._alive))
            self.world_size = int(first["world_size"])
            self.workers = [first]
            for r in range(1, self.world_size):
                key = protocol.wait_any(self._store, [protocol.READY.format(rank=r)], alive=self._alive)
                self.workers.append(protocol.get(self._store, key))
        except WorkerError:
            self.world_size = 0
            raise
        log.info("training workers ready: %s", ", ".join(f"rank {w['rank']} on {w['host']} {w['device']}"
                                                         for w in self.workers))

    def close(self) -> None:
        """Stop the workers and release the store's port; the group cannot start again."""
        self.stop()
        self._store = None
        self._root = None

    def stop(self) -> None:
        """Ask the workers to leave, then stop the launcher (terminating it if it does not exit in time)."""
        if self._proc is not None and self._proc.poll() is None:
            if self._store is not None:
                try:
                    self._store.set(protocol.STOP, "1")
                except (RuntimeError, OSError):
                    pass
            try:
                self._proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("training workers did not stop within %.0f s; terminating them", STOP_GRACE_S)
                self._proc.terminate()
                try:
                    self._proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
        self._proc = None
        self.world_size = 0

    def _reap(self) -> None:
        if self._proc is not None:
            self.stop()
        self._failure_file().unlink(missing_ok=True)

    # ------------------------------------------------------------------ calls
    @property
    def device_type(self) -> str:
        """"cuda" or "cpu": where the workers train (what a call is prepared for)."""
        return "cuda" if self._on_gpu() else "cpu"

    def train(self, call: Any, *, desc: str, progress: bool) -> Trained:
        """Run one prepared train call (train/call.py's PreparedCall) on the workers; every rank gets it whole.
        Nothing is written until `commit`."""
        if not self.running:
            raise WorkerError("the training workers are not running; call start() first")
        if self._uncommitted is not None:  # the caller never decided about the last call: keep nothing of it
            self.commit(None)
        n = self._n
        self._n += 1
        payload = self.dir / protocol.PAYLOAD_FILE.format(generation=self.generation, n=n)
        tmp = payload.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            pickle.dump({"call": call, "desc": desc, "progress": progress}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, payload)
        try:
            protocol.put(self._store, protocol.CALL.format(n=n), {"payload": str(payload), "kind": call.kind})
            errors_ = [protocol.ERROR.format(n=n, rank=r) for r in range(self.world_size)]
            key = protocol.wait_any(self._store, [protocol.TRAINED.format(n=n), *errors_], alive=self._alive)
            if key != protocol.TRAINED.format(n=n):
                raise self._refusal(protocol.get(self._store, key), key)
            msg = protocol.get(self._store, key)
            self._uncommitted = n
            return Trained(steps=msg["steps"], summary=msg["summary"], optimizer_steps=msg["optimizer_steps"])
        finally:
            payload.unlink(missing_ok=True)

    def commit(self, step: int | None, record: dict[str, Any] | None = None) -> Path | None:
        """Have rank 0 write checkpoint `step` of the last call (None: write nothing); returns its path."""
        n = self._uncommitted
        if n is None:
            raise WorkerError("no train call of the workers awaits a commit")
        self._uncommitted = None
        protocol.put(self._store, protocol.COMMIT.format(n=n),
                     {"write": step is not None, "step": step, "record": record})
        if step is None:
            return None
        key = protocol.wait_any(self._store, [protocol.DONE.format(n=n)], alive=self._alive)
        return Path(protocol.get(self._store, key)["path"])

    # ------------------------------------------------------------------ failures
    def _alive(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        code = self._proc.returncode if self._proc is not None else None
        self._proc = None
        self.world_size = 0
        raise WorkerError(self._describe_failure(code))

    def _failure_file(self) -> Path:
        return self.dir / protocol.FAILURE_FILE.format(generation=self.generation)

    def _describe_failure(self, code: int | None) -> str:
        failures: list[dict[str, Any]] = []
        path = self._failure_file()
        deadline = time.monotonic() + 5.0  # the launcher writes its report just before it exits
        while not path.exists() and time.monotonic() < deadline and code == 1:
            time.sleep(0.05)
        if path.exists():
            try:
                failures = json.loads(path.read_text()).get("failures", [])
            except (OSError, ValueError):
                failures = []
        if not failures:
            return (f"the training workers' launcher exited with code {code} and no report of a failed rank "
                    f"(generation {self.generation}); see its output above. The next train call restarts the "
                    "workers from the latest complete checkpoint.")
        cause = min(failures, key=_cause_order)
        how = (f"was killed by {cause['signal']} (exit code {cause['exitcode']}; the kernel's out-of-memory killer "
               "sends SIGKILL)" if cause["signal"] else f"exited with code {cause['exitcode']}")
        detail = f": {cause['message'].strip()[:1500]}" if cause["message"] and not cause["signal"] else ""
        others = [f"rank {f['rank']}: {f['signal'] or 'exit ' + str(f['exitcode'])}" for f in failures
                  if f is not cause]
        host = next((w["host"] for w in self.workers if w["rank"] == cause["rank"]), "this machine")
        return (f"training worker rank {cause['rank']} (pid {cause['pid']} on {host}) {how}{detail}. "
                + (f"Then: {', '.join(others)}. " if others else "")
                + "No checkpoint of the interrupted step was written; the next train call restarts the workers "
                "from the latest complete checkpoint.")

    def _refusal(self, msg: dict[str, Any], key: str) -> ArtrlError:
        rank = key.rsplit("/", 1)[-1]
        cls = getattr(errors, str(msg.get("type")), None)
        text = f"{msg.get('message')} (refused by training worker rank {rank}; the workers wait for the next call)"
        if isinstance(cls, type) and issubclass(cls, ArtrlError):
            return cls(text)
        return ConfigError(f"{msg.get('type')}: {text}")

    def _on_gpu(self) -> bool:
        if self.cfg.trainer_gpu_ids is not None:
            return True
        if self.cfg.device is not None:
            return self.cfg.device.startswith("cuda")
        return torch.cuda.is_available()


def _cause_order(f: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """Which failure is the cause: not the launcher's own SIGTERM, a signal before an error, an error that is
    not a lost peer, then the earliest."""
    sigterm = f["signal"] == "SIGTERM"
    consequence = bool(_CONSEQUENCE.search(f["message"] or "")) and not f["signal"]
    return (int(sigterm), int(not f["signal"]), int(consequence), int(f["timestamp"]), int(f["rank"]))
