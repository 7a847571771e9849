"""The adapters the built-in engine's model holds: policy versions, named checkpoints, and who uses them.

With pipelined training (docs/pipeline.md) several versions of the policy are served at
once: a rollout that started on version v samples every turn from v while the trainer
writes v+1. The built-in engine keeps each version as a frozen peft adapter of its own
model, next to the checkpoints loaded by name (`name@step`, serve/http/served_models.py):

* **Versions.** `set_live_weights(path, step)` loads checkpoint `path` as a new adapter
  (`artrl_v<step>_<serial>`: a serial, so a name is never reused for other tensors, which
  a captured CUDA graph keyed by name relies on) and makes it the live version.
  `adapter=None` resolves to the live version *when a row is admitted* (`resolve`), and
  the row keeps that adapter until it ends: no sequence sees its weights change.
* **Named adapters.** `load_named(name, path)` loads a checkpoint under a request-visible
  name; a path already loaded as a version is aliased to it instead of loaded twice, so
  `name@<live step>` and `name` run the same adapter and report the same version. The other
  way round too: a version whose checkpoint is already loaded by name takes that adapter
  (an inference replica loads `name@step` on every replica first, then makes it live).
* **Leases.** Every admitted row holds its adapter (`hold` / `release`); `prune` and
  `unload_named` never remove an adapter a row holds, nor the live version.
* **Bounded without a pruner.** A version that is not live, that no row holds and no
  name aliases is reachable only by a later `name@step` request (which would load it
  from its checkpoint again). The `IDLE_VERSIONS_KEPT` newest such versions stay loaded
  for those; older ones are unloaded when a new version goes live, so a synchronous
  loop that never calls `prune` does not pile up one adapter per step.

Not thread-safe by itself: the engine calls every method on its decode worker, or while it
holds the model lock with the worker outside a batch (serve/engines/transformers_engine.py).
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...models.adapter_switch import BASE_WEIGHTS, load_frozen_adapter
from ...runtime.once_per_run import OncePerRun
from ..errors import InvalidRequestError

logger = logging.getLogger(__name__)

#: peft's name for "no adapter" in a mixed-adapter batch (`adapter_names=[...]`).
PEFT_BASE = "__base__"
#: Versions kept loaded that nothing uses (not live, held by no row, named by no alias): see the module docstring.
IDLE_VERSIONS_KEPT = 4


def _same_path(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


class AdapterVersions:
    """See the module docstring. `model`: the engine's own model (a peft `PeftModel`, or a plain one)."""

    def __init__(self, model: Any) -> None:
        from peft import PeftModel

        self.model = model
        self.is_peft = isinstance(model, PeftModel)
        self.named: dict[str, str] = {}  # request-visible adapter name -> checkpoint path
        self.alias: dict[str, str] = {}  # request-visible name -> the version adapter it runs
        self.versions: dict[int, str] = {}  # step -> peft adapter name
        self.step_of: dict[str, int] = {}  # peft adapter name -> step (versions only)
        self.paths: dict[str, str] = {}  # peft adapter name -> checkpoint path
        #: The step whose version `adapter=None` resolves to (None: no version yet: the model's active adapter).
        self.live_step: int | None = None
        self.in_use: collections.Counter[str] = collections.Counter()  # peft adapter name -> rows holding it
        #: What `adapter=None` runs before any version is loaded: the adapter active when the engine was built.
        self.live_adapter: str | None = model.active_adapter if self.is_peft else None
        self._retired: set[str] = set()  # replaced versions, deleted once no row holds them
        self._say = OncePerRun(logger)  # per-step housekeeping: INFO once, then DEBUG
        self._serial = itertools.count()
        #: Bumped whenever an adapter is loaded or unloaded: tensors of a name may have moved (a CUDA graph key).
        self.generation = 0

    # ------------------------------------------------------------------ versions
    def add_version(self, path: str, step: int) -> str:
        """Load checkpoint `path` as version `step` and make it the live one; returns its adapter name."""
        current = self.versions.get(step)
        if current is not None and _same_path(self.paths[current], path):
            self.live_step = step
            return current
        # a checkpoint already loaded by name (a replica's control plane loads `name@step` first, then makes it
        # live) becomes the version as it is: the name aliases its own tensors, so unloading the name keeps them
        name = next((n for n, p in self.named.items() if n not in self.alias and _same_path(p, path)), None)
        if name is not None:
            self.alias[name] = name
        else:
            name = f"artrl_v{step}_{next(self._serial)}"
            self.generation += 1
            load_frozen_adapter(self.model, name, path)
        if current is not None:  # the step was written again (a failed call redone): the old tensors retire
            self._retired.add(current)
            del self.step_of[current]
        self.versions[step], self.step_of[name], self.paths[name] = name, step, str(path)
        self.live_step = step
        self._delete_retired()
        aliased = set(self.alias.values())
        idle = [s for s, n in self.versions.items() if s != step and self.in_use[n] <= 0 and n not in aliased]
        if len(idle) > IDLE_VERSIONS_KEPT:
            self.prune(set(self.versions) - set(sorted(idle)[:len(idle) - IDLE_VERSIONS_KEPT]))
        return name

    def prune(self, retain: Iterable[int]) -> list[int]:
        """Unload every version not in `retain`, except the live one and those a row or a name still uses."""
        keep = set(retain)
        aliased = set(self.alias.values())
        pruned = []
        for step, name in sorted(self.versions.items()):
            if step in keep or step == self.live_step or self.in_use[name] > 0 or name in aliased:
                continue
            self._delete(name)
            del self.versions[step], self.step_of[name]
            pruned.append(step)
        self._delete_retired()
        if pruned:
            self._say("unloaded", "unloaded policy versions %s (live: %s)", pruned, self.live_step)
        return pruned

    # ------------------------------------------------------------------ named adapters
    def load_named(self, name: str, path: str) -> None:
        """Serve checkpoint `path` as `adapter=name` (an alias when it is a loaded version)."""
        if name in self.named:
            if _same_path(self.named[name], path):
                return
            raise InvalidRequestError(
                f"Adapter name {name!r} is already loaded from {self.named[name]}; cannot load it again from "
                f"{path}. Use another name.")
        version = next((v for v, p in self.paths.items() if v in self.step_of and _same_path(p, path)), None)
        if version is not None:
            self.alias[name] = version
        else:
            self.generation += 1
            load_frozen_adapter(self.model, name, path)
            self.paths[name] = str(path)
        self.named[name] = str(path)

    def unload_named(self, name: str) -> bool:
        """Forget the named adapter `name` (and unload its tensors unless it aliases a version). False when a
        row still uses what it names (nothing changes)."""
        if name not in self.named:
            return True
        target = self.alias.get(name, name)
        if self.in_use[target] > 0:
            return False
        if name in self.alias:
            del self.alias[name]
        else:
            self._delete(target)
        del self.named[name]
        return True

    # ------------------------------------------------------------------ rows
    def resolve(self, requested: str | None) -> tuple[str | None, int | None]:
        """(adapter to run, policy version) for a row asking for `requested` (None: the live weights).

        The adapter is a peft adapter name, `PEFT_BASE`, or None (a model without peft adapters)."""
        if requested is None:
            if self.live_step is not None:
                return self.versions[self.live_step], self.live_step
            return self.live_adapter, None
        if requested == BASE_WEIGHTS:
            return (PEFT_BASE if self.is_peft else None), None
        if requested not in self.named:
            raise InvalidRequestError(f"adapter {requested!r} is not loaded (it was unloaded after the request "
                                      "was accepted); request another model")
        adapter = self.alias.get(requested, requested)
        return adapter, self.step_of.get(adapter)

    def hold(self, adapter: str | None) -> None:
        if adapter is not None:
            self.in_use[adapter] += 1

    def release(self, adapter: str | None) -> None:
        if adapter is not None:
            self.in_use[adapter] -= 1
            if self.in_use[adapter] <= 0:
                del self.in_use[adapter]

    # ------------------------------------------------------------------ helpers
    def _delete(self, name: str) -> None:
        self.generation += 1
        self.model.delete_adapter(name)
        self.paths.pop(name, None)

    def _delete_retired(self) -> None:
        for name in [n for n in self._retired if self.in_use[n] <= 0]:
            self._delete(name)
            self._retired.discard(name)
