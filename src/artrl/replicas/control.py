"""The control plane of a model's inference replicas: which versions each holds, which one is served.

`ReplicaSet` stands where the training session's engine stands in one process (it takes
`set_live_weights(path, step)` after each checkpoint, `training()`, `close()`), and keeps
these rules, whatever replica dies or refuses:

1. **Every version on every replica.** A checkpoint is loaded on every replica in service,
   straight to its address (replicas/client.py; never through the router), as `name@step`.
2. **Published only when all have it, and at once.** The new step becomes the served default
   (each artrl replica's live weights, and the name `model.get_inference_name()` answers:
   `name@step`) only after every replica in service acknowledged the load. Until then every
   replica serves the previous default, including those that already hold the new one. The
   switch itself has two phases: every replica first holds requests for the bare `name`
   (`hold_live`: they wait, at most `HOLD_WAIT_S` each), and only once all have acknowledged
   the hold is the step made live on each (`set_live`, which releases that replica's held
   requests). So once any replica has answered the bare `name` with the new step, every
   request for it that starts later, on any replica in service, gets the new step too.
3. **A failed load blocks the publish and is retried** (`PUBLISH_ATTEMPTS`, backing off); a
   replica that still refuses is taken out of the router (and, when started here, restarted)
   before the default moves, so no two replicas in service ever serve different defaults.
4. **Retained versions stay everywhere.** What a lease holds (`adapter_lease`, pipelined runs)
   and what `prune` keeps stays loaded on every replica; `prune` unloads the rest on every
   replica. Without prunes, at most `IDLE_VERSIONS_KEPT` versions that nothing uses stay loaded.
5. **A dead replica is taken out at once** (its process's end is an event: replicas/spawn.py)
   and restarted; an endpoint started elsewhere that stops answering is taken out and
   reported, and rejoins when it answers again. A replica (re)joins the router only after it
   has loaded every retained version and made the published one live. One restart owns a
   replica at a time: a process that dies while its replica is being restarted is that
   restart's failed attempt (it tries again), never a second restart.

Two locks: `_ops` orders what changes versions (publish, prune, a rejoin's loads); `_members`
guards who is in service, so a death takes its replica out at once even while a publish
retries on it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime import shutdown
from ..errors import ConfigError
from ..serve.http.served_models import STEP_SEPARATOR
from .client import ReplicaClient, ReplicaError
from .router import Router
from .spawn import ChildError, ChildProcess, child_env

log = logging.getLogger(__name__)

PUBLISH_ATTEMPTS = 4
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
RESTART_ATTEMPTS = 3
REPLICA_STARTUP_TIMEOUT_S = 600.0  # a replica loads its own copy of the base model (vLLM compiles, too)
ENDPOINT_CHECK_INTERVAL_S = 5.0
IDLE_VERSIONS_KEPT = 4
HOLD_WAIT_S = 60.0  # the longest a bare-name request waits while the default switches (then 503, and it retries)


@dataclass
class Replica:
    """One replica: started here (`process`) or an endpoint started elsewhere (`process` None)."""

    index: int
    url: str | None = None
    device: str | None = None
    process: ChildProcess | None = None
    kind: str = "artrl"  # or "vllm": a vLLM server (no live weights; its default is `name@step`)
    in_service: bool = False
    restarting: bool = False  # a restart owns it (one `_restart` thread at most; under `_members`)
    generation: int = 0
    restarts: int = 0
    loaded: set[int] = field(default_factory=set)

    @property
    def id(self) -> str:
        """What its responses say in `x-artrl-replica`: a restarted replica is another one (a new cache)."""
        return f"r{self.index}.{self.generation}"

    @property
    def external(self) -> bool:
        return self.process is None and self.device is None

    def __str__(self) -> str:
        return f"replica {self.index} ({self.url or 'starting'})"


class ReplicaSet:
    """See the module docstring. `start()` starts the router and the replicas started here; the first
    `set_live_weights` waits for them and publishes; `close()` ends them."""

    def __init__(self, *, name: str, base_model: str, cfg: Any, run: Path, api_key: str | None,
                 host: str = "127.0.0.1", leased: Callable[[], set[int]] = set,
                 engine: str | None = None, engine_options: list[str] | None = None) -> None:
        from ..serve.http.background import is_loopback

        if not is_loopback(host):
            raise ConfigError(f"inference replicas with LocalBackend(host={host!r}): the router's worker routes have "
                              "no authentication, so it listens on loopback only; keep host='127.0.0.1' (rollouts "
                              "in this program reach it), and give other machines' servers as inference_endpoints.")
        from ..models.loading import RANDOM_SHAPES

        if (engine or cfg.inference_engine) == "vllm" and base_model in RANDOM_SHAPES and not cfg.inference_endpoints:
            raise ConfigError(f"inference_engine='vllm' replicas of {base_model!r}: vLLM loads weights from a path, "
                              "and a random shape has none on disk; use inference_engine='builtin' (each replica "
                              "builds the same weights from the seed).")
        self.name, self.base_model, self.cfg, self.run = name, base_model, cfg, Path(run)
        self.api_key = api_key
        self.leased = leased
        self._engine = engine or cfg.inference_engine
        self._engine_options = list(engine_options or [])
        self.router = Router(host)
        devices = cfg.replica_devices()
        endpoints = cfg.inference_endpoints or []
        self.replicas = [Replica(i, device=d or "default") for i, d in enumerate(devices)] + \
                        [Replica(len(devices) + k, url=u.rstrip("/")) for k, u in enumerate(endpoints)]
        self.versions: dict[int, str] = {}  # retained step -> checkpoint directory
        self.published: int | None = None
        self.publish_seconds: list[float] = []
        self._ops = threading.RLock()
        self._members = threading.Lock()
        self._changed = threading.Condition()
        self._closing = threading.Event()
        self._started = False
        self._monitor: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        return self.router.base_url

    def start(self) -> "ReplicaSet":
        """Check that the local replicas fit their devices together, then start the router and every local replica's
        process (they load while the caller does its own work)."""
        self.check_memory()
        self.router.start()
        shutdown.track(self, shutdown.ENGINES)
        try:
            for replica in self.replicas:
                if not replica.external:
                    self._spawn(replica)
        except BaseException:
            self.close()
            raise
        return self

    def wait_ready(self) -> None:
        """Wait for every replica (local ones to load, endpoints to answer) and check it serves this base model."""
        for replica in self.replicas:
            if replica.process is not None:
                try:
                    info = replica.process.wait_ready(REPLICA_STARTUP_TIMEOUT_S)
                except ChildError as error:
                    raise ReplicaError(f"{replica} of {self.name!r} did not start: {error}") from error
                replica.url = f"http://{self.router.host}:{info['port']}"
            self._check_identity(replica)

    def close(self) -> None:
        """End the monitor, the local replicas and the router (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        with self._changed:
            self._changed.notify_all()
        stopping = [threading.Thread(target=r.process.stop, kwargs={"timeout": 30.0}, daemon=True)
                    for r in self.replicas if r.process is not None]
        for thread in stopping:  # all at once: each exits when its stdin closes
            thread.start()
        for thread in stopping:
            thread.join()
        self.router.stop()
        shutdown.untrack(self, shutdown.ENGINES)

    def check_memory(self) -> None:
        """The replicas this process starts, planned per device as one set (models/memory_plan.check_replicas_fit):
        they load at once, beside the trainer when it shares their device; a ConfigError before any starts."""
        if self._engine in ("scripted", "vllm"):
            return  # a benchmark's paced engine holds no model; vLLM sizes its own (gpu_memory_utilization)
        from ..models.loading import resolve_device
        from ..models.memory_plan import check_replicas_fit

        on: dict[str, int] = {}
        for replica in self.replicas:
            if not replica.external:
                on[replica.device or "default"] = on.get(replica.device or "default", 0) + 1
        if not on:
            return
        trainer = resolve_device(self.cfg)
        if self.cfg.trainer_gpu_ids is not None:
            trainer_on = {f"cuda:{g}" for g in self.cfg.trainer_gpu_ids}
        else:
            trainer_on = {"cpu" if trainer.type == "cpu" else f"cuda:{trainer.index or 0}"}
        for where, count in on.items():
            device = resolve_device(self.cfg.model_copy(update={"device": None if where == "default" else where}))
            key = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
            check_replicas_fit(self.base_model, self.cfg, device, count, with_trainer=key in trainer_on)

    def shutdown_at_exit(self) -> None:
        self.close()

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Held around a train call: the replicas keep serving rollouts meanwhile."""
        yield

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` holds (checked at every change of the set) or `timeout` passes."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate() or self._closing.is_set(), timeout) and predicate()

    def in_service(self) -> list[Replica]:
        return [r for r in self.replicas if r.in_service]

    # ------------------------------------------------------------------ versions
    def lora_name(self, step: int) -> str:
        return f"{self.name}{STEP_SEPARATOR}{step}"

    def set_live_weights(self, path: str, step: int) -> None:
        """Publish checkpoint `step` (module docstring, rules 1-3); the first call also brings every replica in."""
        import time

        started = time.perf_counter()
        if not self._started:
            self.wait_ready()
            with self._ops:
                self.versions[step] = str(path)
                self.published = step
            self._on_each(self.replicas, self._rejoin, "join")
            self._started = True
            if self._monitor is None and any(r.external for r in self.replicas):
                self._monitor = threading.Thread(target=self._watch_endpoints, name="artrl-endpoints", daemon=True)
                self._monitor.start()
        else:
            self.publish(str(path), step)
        if not self.in_service():
            raise ReplicaError(f"no inference replica of {self.name!r} serves step {step}: every one failed (see the "
                               "log above). Check the replicas' own log lines, then register again.")
        self.publish_seconds.append(time.perf_counter() - started)

    def publish(self, path: str, step: int) -> None:
        with self._ops:
            self.versions[step] = path
            self._on_each(self.in_service(), lambda r: self._load(r, step, path), f"load {self.lora_name(step)}")
            # the switch (rule 2): hold the bare name everywhere, then make the step live on each
            artrl = [r for r in self.in_service() if r.kind == "artrl"]
            self._on_each(artrl, lambda r: ReplicaClient(r.url, self.api_key).hold_live(self.name, step, HOLD_WAIT_S),
                          f"hold {self.name!r} for step {step}")
            artrl = [r for r in self.in_service() if r.kind == "artrl"]
            self._on_each(artrl, lambda r: ReplicaClient(r.url, self.api_key).set_live(self.name, step, path),
                          f"make step {step} live")
            self.published = step
            log.info("%s: step %d published on %d replicas", self.name, step, len(self.in_service()))
            idle = sorted(s for s in self.versions if s != step and s not in self.leased())
            if len(idle) > IDLE_VERSIONS_KEPT:
                self._unload(idle[:len(idle) - IDLE_VERSIONS_KEPT])
        self._notify()

    def ensure_loaded(self, step: int, path: str) -> None:
        """Make `name@step` loaded on every replica in service (a lease on a step pruned earlier)."""
        with self._ops:
            if step in self.versions:
                return
            self.versions[step] = path
            self._on_each(self.in_service(), lambda r: self._load(r, step, path), f"load {self.lora_name(step)}")
        self._notify()

    def prune(self, retain: set[int]) -> list[int]:
        """Unload on every replica the retained versions outside `retain`, leases and the published one; returns
        the steps no replica holds any more."""
        with self._ops:
            drop = sorted(s for s in self.versions if s not in retain and s != self.published
                          and s not in self.leased())
            unloaded = self._unload(drop)
        self._notify()
        return unloaded

    # ------------------------------------------------------------------ on each replica
    def _load(self, replica: Replica, step: int, path: str) -> None:
        assert replica.url is not None
        ReplicaClient(replica.url, self.api_key).load(self.lora_name(step), path)
        replica.loaded.add(step)

    def _unload(self, steps: list[int]) -> list[int]:
        done = []
        for step in steps:
            results = self._on_each(self.in_service(), lambda r, s=step: self._unload_one(r, s),
                                    f"unload {self.lora_name(step)}", attempts=1, eject=False)
            if all(results.values()):
                del self.versions[step]
                done.append(step)
        return done

    def _unload_one(self, replica: Replica, step: int) -> bool:
        assert replica.url is not None
        if ReplicaClient(replica.url, self.api_key).unload(self.lora_name(step)):
            replica.loaded.discard(step)
            return True
        return False  # a running request still uses it: the next prune asks again

    def _on_each(self, replicas: list[Replica], fn: Callable[[Replica], Any], what: str, *,
                 attempts: int = PUBLISH_ATTEMPTS, eject: bool = True) -> dict[int, Any]:
        """`fn(replica)` on every replica at once, each retried up to `attempts` times; a replica that still fails
        is taken out (`eject`). Returns each replica's result (index -> result, False for a failure)."""
        results: dict[int, Any] = {}
        pending = list(replicas)
        errors: dict[int, BaseException] = {}
        for attempt in range(attempts):
            if not pending or self._closing.is_set():
                break
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(pending)) as pool:
                futures = {pool.submit(fn, r): r for r in pending}
                failed = []
                for future, replica in futures.items():
                    try:
                        results[replica.index] = future.result()
                    except (ReplicaError, OSError, ConfigError) as error:
                        errors[replica.index] = error
                        failed.append(replica)
            pending = [r for r in failed if r.in_service or not self._started]
            if pending and attempt + 1 < attempts:
                wait = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                for replica in pending:
                    log.warning("%s: %s on %s failed (%s); retrying in %.1fs (attempt %d of %d): the publish waits",
                                self.name, what, replica, errors[replica.index], wait, attempt + 2, attempts)
                self._closing.wait(wait)
        for replica in pending:
            results[replica.index] = False
            if eject:
                self._eject(replica, f"{what} failed {attempts} times ({errors[replica.index]})")
        return results

    # ------------------------------------------------------------------ membership
    def _rejoin(self, replica: Replica) -> None:
        """Load every retained version, make the published one live, then take traffic."""
        with self._ops:
            if replica.url is None or self._closing.is_set():
                return
            client = ReplicaClient(replica.url, self.api_key)
            for step, path in sorted(self.versions.items()):
                client.load(self.lora_name(step), path)
                replica.loaded.add(step)
            if self.published is not None and replica.kind == "artrl":
                client.set_live(self.name, self.published, self.versions[self.published])
            with self._members:
                if self._closing.is_set():
                    return
                self.router.add(replica.url)
                replica.in_service = True
        log.info("%s: %s serves (id %s, steps %s, default %s)", self.name, replica, replica.id,
                 sorted(replica.loaded), self.published)
        self._notify()

    def _eject(self, replica: Replica, reason: str) -> None:
        """Take `replica` out of the router; restart it when it was started here, else report it."""
        with self._members:
            was = replica.in_service
            replica.in_service = False
            if was and replica.url is not None and not self._closing.is_set():
                try:
                    self.router.remove(replica.url)
                except (ChildError, OSError) as error:
                    log.error("%s: the router did not take %s out: %s", self.name, replica, error)
        if self._closing.is_set():
            return
        replica.loaded.clear()
        if replica.external:
            log.error("%s: %s taken out of the router: %s. Rollouts go to the other replicas; it rejoins (with every "
                      "retained version) once it answers again.", self.name, replica, reason)
        else:
            with self._members:
                owned, replica.restarting = replica.restarting, True
                process, replica.process = replica.process, None
            if process is not None:
                process.on_exit = None
                process.stop(timeout=10.0)
            if owned:  # its restart is under way: this was one of its attempts, which it retries
                log.error("%s: %s failed while restarting: %s", self.name, replica, reason)
            else:
                log.error("%s: %s taken out of the router: %s; restarting it", self.name, replica, reason)
                threading.Thread(target=self._restart, args=(replica,), name=f"artrl-restart-{replica.index}",
                                 daemon=True).start()
        self._notify()

    def _died(self, child: ChildProcess, code: int) -> None:
        replica = next((r for r in self.replicas if r.process is child), None)
        if replica is None or self._closing.is_set():
            return
        self._eject(replica, f"its process (pid {child.pid}) ended with status {code}")

    def _restart(self, replica: Replica) -> None:
        """The one restart of `replica` (its owner while `replica.restarting`): up to `RESTART_ATTEMPTS` new
        processes, each stopped (only that one) when it fails; a process that dies meanwhile fails its attempt."""
        try:
            for attempt in range(RESTART_ATTEMPTS):
                if self._closing.is_set():
                    return
                replica.restarts += 1
                replica.generation += 1
                process: ChildProcess | None = None
                try:
                    process = self._spawn(replica)
                    if self._closing.is_set():  # `close` may have listed the processes to stop before this one
                        raise ChildError("the replica set is closing")
                    info = process.wait_ready(REPLICA_STARTUP_TIMEOUT_S)
                    replica.url = f"http://{self.router.host}:{info['port']}"
                    self._check_identity(replica)
                    self._rejoin(replica)
                    with self._members:
                        if replica.in_service and replica.process is process:  # not taken out meanwhile
                            replica.restarting = False
                            return
                    raise ChildError(f"its process (pid {process.pid}) was taken out as it rejoined")
                except (ChildError, ReplicaError, ConfigError, OSError) as error:
                    log.error("%s: restarting %s failed (attempt %d of %d): %s", self.name, replica, attempt + 1,
                              RESTART_ATTEMPTS, error)
                    with self._members:
                        if replica.process is process:
                            replica.process = None
                    if process is not None:
                        process.on_exit = None
                        process.stop(timeout=10.0)
                    self._closing.wait(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)])
            log.error("%s: %s stays out after %d failed restarts; rollouts go to the other replicas", self.name,
                      replica, RESTART_ATTEMPTS)
        finally:
            with self._members:
                replica.restarting = False
            self._notify()

    def _watch_endpoints(self) -> None:
        """Endpoints started elsewhere: taken out when they stop answering, back in when they answer again."""
        while not self._closing.wait(ENDPOINT_CHECK_INTERVAL_S):
            for replica in [r for r in self.replicas if r.external]:
                assert replica.url is not None
                healthy = ReplicaClient(replica.url, self.api_key).healthy()
                if replica.in_service and not healthy:
                    self._eject(replica, "it does not answer /health")
                elif not replica.in_service and healthy:
                    try:
                        self._check_identity(replica)
                        self._rejoin(replica)
                    except (ReplicaError, ConfigError, OSError) as error:
                        log.error("%s: %s answers again but cannot rejoin: %s", self.name, replica, error)

    # ------------------------------------------------------------------ helpers
    def command(self, replica: Replica) -> tuple[list[str], dict[str, str]]:
        """(argv, environment) of `replica`'s process: replicas/process.py with the model's config, on its device
        (a GPU replica sees only its GPU, as its cuda:0)."""
        import json

        device = None if replica.device == "default" else replica.device
        env = child_env()
        if device is not None and device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
            device = "cuda"
        served = self.cfg.model_copy(update={"inference_replicas": None, "inference_endpoints": None,
                                             "inference_gpu_ids": None, "trainer_gpu_ids": None, "device": device})
        argv = [sys.executable, "-m", "artrl.replicas.process", "--base-model", self.base_model, "--name", self.name,
                "--replica", replica.id, "--config", json.dumps(served.model_dump(mode="json")),
                "--run-dir", str(self.run), "--engine", self._engine, "--host", self.router.host,
                "--memory-planned", *self._engine_options]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        return argv, env

    def _spawn(self, replica: Replica) -> ChildProcess:
        from .process import READY_PREFIX

        argv, env = self.command(replica)
        process = ChildProcess(f"replica{replica.index}", argv, ready_prefix=READY_PREFIX.strip(),
                               env=env, on_exit=self._died).start()
        replica.process = process
        self._notify()
        return process

    def _check_identity(self, replica: Replica) -> None:
        """The replica answers and serves this model's base model (and, when an artrl server, this model)."""
        assert replica.url is not None
        where = f"{replica} of {self.name!r}"
        client = ReplicaClient(replica.url, self.api_key)
        try:
            identity = client.identity()
        except OSError as error:
            raise ConfigError(f"{where} does not answer ({type(error).__name__}: {error}). Start the server there "
                              f"(`artrl serve --replica --model {self.base_model} --name {self.name}`, or vLLM's "
                              "server with runtime LoRA loading), or remove it from inference_endpoints.") from error
        except ReplicaError as error:
            if "401" in str(error):
                raise ConfigError(f"{where} refuses this backend's API key; give LocalBackend(api_key=...) the key the "
                                  "server was started with.") from error
            raise
        if identity is None:
            replica.kind = "vllm"
            bases = {str(m.get("root") or m.get("id")) for m in client.models() if not m.get("parent")}
            from ..models.loading import resolve_name

            wanted = {self.base_model, resolve_name(self.base_model)}
            if not bases & wanted:
                raise ConfigError(f"{where} is a vLLM server of {sorted(bases)}, not of this model's base model "
                                  f"{self.base_model!r}; every replica must serve the base model the trainer trains. "
                                  "Start it with that model, or remove it from inference_endpoints.")
            return
        replica.kind = "artrl"
        if identity.get("base_model") != self.base_model or self.name not in (identity.get("models") or {}):
            raise ConfigError(f"{where} serves {sorted(identity.get('models') or {})} on base model "
                              f"{identity.get('base_model')!r}; this model is {self.name!r} on {self.base_model!r}, and "
                              "every replica must serve the base model the trainer trains. Start it with `artrl serve "
                              f"--replica --model {self.base_model} --name {self.name}`, or remove it.")

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
