"""Which weights a request's `model` field names.

ART's naming, kept here: `name` is the live weights of a served model (whatever the
trainer last wrote, adapter None), `name@step` is the checkpoint saved at that
training step, loaded as a named LoRA adapter the first time it is asked for,
and the base model's own name (e.g. "Qwen/Qwen2.5-7B-Instruct", added with
`add_base`) is the untrained base weights: the same engine with every adapter
switched off (`BASE_WEIGHTS`), as ART's vLLM server serves the base model under
its Hugging Face name. A served model's own name wins over a base name.
Where a checkpoint lives is the caller's business: `ServedModels` asks the
`checkpoint_path(name, step)` callback, which returns a directory holding a saved
peft adapter, or None when there is no such checkpoint (-> 404).

Loaded checkpoint adapters stay loaded (a LoRA adapter is small) until `prune`,
which a pipelined trainer calls (ART's `prune_model_adapters`): it unloads the
checkpoints loaded by name and the engine's policy versions (serve/engines/adapter_versions.py)
whose steps are not retained, except the live version and anything a running row uses.
`with_versions` fills in the policy version of results sampled from `name@step` where
the engine could not tell it.

An inference replica (replicas/) switches its live weights in two steps so that the bare
`name` moves from one step to the next at once on every replica: `hold_live(name, step)`
makes requests for `name` wait (each at most `wait_s`, then a 503 the client retries) until
`release_live(name, step)`, which the control route calls once `set_live` made that step live.
The control plane holds every replica before it makes the step live on any, so no request
for `name` that starts after one replica serves the new step is served the old one by another.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import threading
import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

from ...errors import ArtrlError, CheckpointError
from ...runtime.once_per_run import OncePerRun
from ..engines.base import BASE_WEIGHTS, GenerationResult, InferenceEngine
from ..errors import InvalidRequestError

logger = logging.getLogger(__name__)

CheckpointPathFn = Callable[[str, int], "str | None"]

STEP_SEPARATOR = "@"


class ModelNotFoundError(ArtrlError, LookupError):
    """The requested model name is neither served nor a known checkpoint."""


class LiveSwitchingError(ArtrlError, RuntimeError):
    """A request for a served model's bare name waited past its hold while the live weights switch (503)."""


@dataclasses.dataclass
class _Hold:
    """Requests for a bare name wait on `released` until `step` is live (made on the server's event loop)."""

    step: int
    wait_s: float
    released: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class ServedModels:
    """Resolve request model names to `(engine, adapter)`; see the module docstring."""

    def __init__(
        self,
        name: str | None = None,
        engine: InferenceEngine | None = None,
        *,
        checkpoint_path: CheckpointPathFn | None = None,
    ) -> None:
        self._engines: dict[str, InferenceEngine] = {}
        self._bases: dict[str, InferenceEngine] = {}  # base model name -> an engine holding those base weights
        self._checkpoint_path = checkpoint_path
        self._adapters: dict[tuple[str, int], str] = {}  # (name, step) -> engine adapter name
        self._paths: dict[tuple[str, int], str] = {}  # (name, step) -> the checkpoint it was loaded from
        self._serial = itertools.count()  # adapter names are never reused (an unloaded one may come back)
        self._load_lock = threading.Lock()
        self._say = OncePerRun(logger)  # checkpoints loaded and unloaded as steps go by: INFO once, then DEBUG
        self._holds: dict[str, _Hold] = {}  # served name -> the switch its bare-name requests wait for
        if name is not None:
            if engine is None:
                raise ValueError(f"ServedModels({name!r}) needs the engine that serves it")
            self.add(name, engine)

    def add(self, name: str, engine: InferenceEngine) -> None:
        """Serve `engine`'s live weights as `name` (and its checkpoints as `name@step`)."""
        if STEP_SEPARATOR in name:
            raise ValueError(f"Model name {name!r} must not contain {STEP_SEPARATOR!r} (it separates the step)")
        self._engines[name] = engine

    def add_base(self, base_model: str, engine: InferenceEngine) -> None:
        """Serve `engine`'s base weights (every adapter off) as `base_model`; the first engine added keeps it."""
        if base_model in self._engines:
            logger.warning("a served model is named %r like a base model; that name serves the model's live "
                           "weights, not the base model", base_model)
        self._bases.setdefault(base_model, engine)

    def served(self) -> list[str]:
        """Names of the served models (their live weights), without base models and checkpoints."""
        return list(self._engines)

    def names(self) -> list[str]:
        """Served names: every live model, every base model, then every checkpoint loaded so far."""
        loaded = [f"{name}{STEP_SEPARATOR}{step}" for name, step in sorted(self._adapters)]
        bases = [base for base in self._bases if base not in self._engines]
        return list(self._engines) + bases + loaded

    async def resolve(self, model: str) -> tuple[InferenceEngine, str | None]:
        """`(engine, adapter)` for a request's model name; raises ModelNotFoundError."""
        if model in self._engines:
            hold = self._holds.get(model)
            if hold is not None:
                await self._wait_for_switch(model, hold)
            return self._engines[model], None
        if model in self._bases:
            return self._bases[model], BASE_WEIGHTS
        name, sep, step_text = model.rpartition(STEP_SEPARATOR)
        if not sep or name not in self._engines or not step_text.isdigit():
            raise ModelNotFoundError(
                f"The model {model!r} does not exist. Served models: {self.names()} "
                f"(a checkpoint is named '<model>{STEP_SEPARATOR}<step>')."
            )
        engine, step = self._engines[name], int(step_text)
        adapter = self._adapters.get((name, step))
        if adapter is None:
            adapter = await asyncio.to_thread(self._load_checkpoint, name, step, engine)
        return engine, adapter

    def _load_checkpoint(self, name: str, step: int, engine: InferenceEngine) -> str:
        with self._load_lock:
            if (name, step) in self._adapters:  # loaded by a concurrent request meanwhile
                return self._adapters[(name, step)]
            path = self._checkpoint_path(name, step) if self._checkpoint_path is not None else None
            if path is None:
                raise ModelNotFoundError(
                    f"The model {name}{STEP_SEPARATOR}{step} does not exist: no checkpoint of {name!r} "
                    f"at step {step}."
                )
            return self._load_locked(name, step, str(path), engine)

    def load(self, name: str, step: int, path: str) -> None:
        """Serve the checkpoint in `path` as `name@step` from now on (the control route `/v1/load_lora_adapter`).

        Loading the same path again is a no-op; another path under a loaded `name@step` is refused."""
        engine = self._engine(name)
        with self._load_lock:
            if (name, step) in self._adapters:
                loaded = self._paths.get((name, step))
                if loaded is not None and Path(loaded).resolve() != Path(path).resolve():
                    raise InvalidRequestError(
                        f"{name}{STEP_SEPARATOR}{step} is already loaded from {loaded}; cannot load it from {path}. "
                        f"Unload it first (/v1/unload_lora_adapter).")
                return
            self._load_locked(name, step, str(path), engine)

    def unload(self, name: str, step: int) -> bool | None:
        """Stop serving `name@step` and free its adapter (the control route `/v1/unload_lora_adapter`).

        None: it was not loaded; False: a running request still uses it (nothing changed, ask again later);
        True: unloaded. The engine's policy version of that step goes too, unless it is the live one."""
        engine = self._engine(name)
        unload = getattr(engine, "unload_adapter", None)
        with self._load_lock:
            adapter = self._adapters.get((name, step))
            if adapter is None:
                return None
            if unload is None or not unload(adapter):
                return False
            del self._adapters[(name, step)]
            self._paths.pop((name, step), None)
        loaded = getattr(engine, "loaded_versions", None)
        prune_versions = getattr(engine, "prune_versions", None)
        if loaded is not None and prune_versions is not None and step in loaded:
            prune_versions(set(loaded) - {step})
        self._say("unloaded", "unloaded %s%s%d", name, STEP_SEPARATOR, step)
        return True

    def set_live(self, name: str, path: str, step: int) -> None:
        """Serve the checkpoint in `path` (step `step`) as `name`, the live weights, from now on."""
        self._engine(name).set_live_weights(str(path), int(step))

    def hold_live(self, name: str, step: int, wait_s: float) -> bool:
        """From now on, requests for the bare `name` wait (each at most `wait_s` s, then LiveSwitchingError) until
        `release_live(name, step)`. False, holding nothing, when `name` already serves `step` or a later one. Call
        on the server's event loop; a second hold for the same step keeps the first (a retried call)."""
        live = self.live_step(name)
        if live is not None and live >= step:
            return False
        held = self._holds.get(name)
        if held is None or held.step != step:
            if held is not None:
                held.released.set()  # an older switch never completed: this one supersedes it
            self._holds[name] = _Hold(step, wait_s)
        else:
            held.wait_s = wait_s
        return True

    def release_live(self, name: str, step: int) -> None:
        """`name` serves `step` now: requests held for it (or an earlier step) go on. Call on the event loop."""
        held = self._holds.get(name)
        if held is not None and held.step <= step:
            del self._holds[name]
            held.released.set()

    def held_steps(self) -> dict[str, int]:
        """Served name -> the step its bare-name requests wait for (empty when no switch is under way)."""
        return {name: hold.step for name, hold in self._holds.items()}

    async def _wait_for_switch(self, name: str, hold: _Hold) -> None:
        try:
            async with asyncio.timeout(hold.wait_s):
                await hold.released.wait()
        except TimeoutError as error:
            raise LiveSwitchingError(
                f"The model {name!r} is switching its live weights to step {hold.step} on every replica, and this "
                f"replica has not switched after {hold.wait_s:g} s; retry, or name a step ('{name}"
                f"{STEP_SEPARATOR}<step>').") from error

    def live_step(self, name: str) -> int | None:
        """The step `name` serves now (None: not known, e.g. the base weights of `artrl serve`)."""
        engine = self._engine(name)
        step = getattr(engine, "live_step", None)
        if step is None and getattr(engine, "live_weights", None) is not None:
            step = engine.live_weights[1]  # type: ignore[attr-defined]
        return step

    def loaded_steps(self, name: str) -> list[int]:
        """Steps of `name` loaded as `name@step`."""
        return sorted(step for served, step in self._adapters if served == name)

    def _engine(self, name: str) -> InferenceEngine:
        engine = self._engines.get(name)
        if engine is None:
            raise ModelNotFoundError(f"The model {name!r} is not served. Served models: {self.names()}")
        return engine

    def _load_locked(self, name: str, step: int, path: str, engine: InferenceEngine) -> str:
        """Load `path` as `name@step` (the caller holds the load lock); returns the engine's adapter name."""
        adapter = f"ckpt_{re.sub(r'[^0-9A-Za-z_]', '_', name)}_{step}_{next(self._serial)}"
        self._say("loading", "Loading checkpoint %s%s%d from %s", name, STEP_SEPARATOR, step, path)
        try:
            engine.load_adapter(adapter, str(path))
        except InvalidRequestError:
            raise  # the engine cannot hold adapters at all: not the checkpoint's fault
        except Exception as error:  # a truncated, garbage or mismatched adapter on disk
            raise CheckpointError(
                f"The checkpoint of {name}{STEP_SEPARATOR}{step} at {path} cannot be loaded "
                f"({type(error).__name__}: {error}). Delete that directory or request another step."
            ) from error
        self._adapters[(name, step)] = adapter
        self._paths[(name, step)] = str(path)
        return adapter

    def prune(self, name: str, retain_steps: Iterable[int]) -> list[int]:
        """Unload `name`'s checkpoints and policy versions whose step is not in `retain_steps`; returns the steps
        unloaded. The live version and anything a running row uses stay (those steps are not returned); an
        engine that cannot unload keeps everything. A running batch may wait one decode step meanwhile (the
        built-in engine unloads at a step boundary): call it off the event loop when that matters."""
        engine = self._engines.get(name)
        if engine is None:
            raise ModelNotFoundError(f"The model {name!r} is not served. Served models: {self.names()}")
        retain = set(retain_steps)
        unloaded: set[int] = set()
        unload = getattr(engine, "unload_adapter", None)
        with self._load_lock:
            for (served, step), adapter in sorted(self._adapters.items()):
                if served == name and step not in retain and unload is not None and unload(adapter):
                    del self._adapters[(served, step)]
                    self._paths.pop((served, step), None)
                    unloaded.add(step)
        prune_versions = getattr(engine, "prune_versions", None)
        if prune_versions is not None:
            unloaded.update(prune_versions(retain))
        if unloaded:
            self._say("unloaded", "unloaded steps %s of %s (retained %s)", sorted(unloaded), name, sorted(retain))
        return sorted(unloaded)

    def with_versions(self, model: str, results: list[GenerationResult]) -> list[GenerationResult]:
        """`results` of a request for `model`, each with its policy version: the step of `name@step` where the
        engine reported none."""
        name, sep, step_text = model.rpartition(STEP_SEPARATOR)
        if not sep or name not in self._engines or not step_text.isdigit():
            return results
        step = int(step_text)
        return [r if r.policy_version is not None else dataclasses.replace(r, policy_version=step) for r in results]
