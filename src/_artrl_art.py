"""`import art` on artrl: ART's module paths resolve to artrl's, one module under two names.

An ART program imports `art`, `art.local`, `art.rewards`, `art.utils.sft` ... artrl has the same paths under
`artrl`. This finder makes `art.X` the module `artrl.X` itself (`art.local is artrl.local`), so an ART program
runs on artrl with no line changed and both names see one set of classes and one module state.

When it applies (one rule, said in README.md and docs/art-compatibility.md):

- **openpipe-art not installed**: `import art` is artrl. The wheel's `artrl-art.pth` calls `install()` at every
  interpreter start of the environment; this module imports nothing of artrl until `art` is imported.
- **openpipe-art installed too**: `import art` is ART's own package; artrl never shadows it. `artrl run
  program.py` (or `ARTRL_ART=artrl` in the environment) makes `art` artrl for that one process and says so once
  on stderr. There is no half-mixed case: `art` is one package or the other, and every `art.X` follows it.
- `ARTRL_ART=off`: no alias at all (`import art` fails as it would without artrl).
- **`art.X` that artrl lacks** (ART's Megatron or Tinker back ends, its internals): ModuleNotFoundError naming
  `art.X` and what to use instead; code that catches ImportError for an optional part keeps working.
"""

from __future__ import annotations

import os
import sys
import threading

ENV = "ARTRL_ART"
"""`auto` (the default: artrl when openpipe-art is absent), `artrl` (always artrl), `off` (never)."""

ART = "art"
ARTRL = "artrl"

# ART module paths that artrl does not have: what each is, and what to use instead. The longest prefix wins.
_INSTEAD = {
    "art.megatron": ("ART's Megatron back end", "use `art.LocalBackend` (transformers + peft)"),
    "art.tinker": ("ART's Tinker back end", "use `art.LocalBackend`, which trains on this machine"),
    "art.tinker_native": ("ART's Tinker back end", "use `art.LocalBackend`, which trains on this machine"),
    "art.trainer_rank": ("ART's Megatron trainer internals", "use `art.LocalBackend`"),
    "art.serverless": ("ART's W&B-hosted training", "use `art.LocalBackend` (`art.ServerlessBackend` says the same)"),
    "art.local.service": ("ART's internal training service", "use `art.local.LocalBackend`"),
    "art.local.checkpoints": ("ART's internal checkpoint layout",
                              "use `model.delete_checkpoints()` and `art.utils.get_model_step`"),
    "art.preprocessing": ("ART's internal preprocessing", "use `art.trajectories.tokenize` / `tensorize`"),
    "art.tau_bench": ("ART's tau-bench harness", "it is not part of artrl"),
}
_DOCS = "docs/art-compatibility.md lists ART's paths and names and their status in artrl"

_guard = threading.local()
_said_forced = False


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    return mode if mode in ("auto", "artrl", "off") else "auto"


def _missing(name: str) -> str:
    """The message for an `art.X` that artrl lacks: the path, what it is in ART, and what to use instead."""
    best = max((p for p in _INSTEAD if name == p or name.startswith(p + ".")), key=len, default=None)
    if best is None:
        return (f"No module named {name!r}: `art` is artrl here, which has no {name}; import the name from `art` "
                f"itself if ART exports it there ({_DOCS})")
    what, instead = _INSTEAD[best]
    return f"No module named {name!r}: `art` is artrl here, which has no {name} ({what}); {instead}"


class _AliasLoader:
    """Hands back the already imported `artrl.X` as `art.X` (importlib sets `__spec__`; exec puts it back)."""

    def __init__(self, module: object) -> None:
        self.module = module
        self.spec = getattr(module, "__spec__", None)

    def create_module(self, spec: object) -> object:
        return self.module

    def exec_module(self, module: object) -> None:
        module.__spec__ = self.spec  # importlib wrote the alias spec over artrl's own; artrl.X keeps its identity


class ArtFinder:
    """A `sys.meta_path` finder for `art` and `art.*` (see the module's docstring for when it answers)."""

    def __init__(self, force: bool = False) -> None:
        self.force = force

    def find_spec(self, name: str, path: object = None, target: object = None):  # noqa: ANN201
        if name != ART and not name.startswith(ART + "."):
            return None
        if getattr(_guard, "active", False):
            return None
        if name == ART:
            if not self.force and (_mode() == "off" or (_mode() == "auto" and _art_installed(self))):
                return None
            return self._alias(ART, ARTRL)
        parent = sys.modules.get(ART)
        if parent is None or getattr(parent, "__name__", None) != ARTRL:
            return None  # `art` is ART's own package (or not imported): its submodules are its own
        return self._alias(name, ARTRL + name[len(ART):])

    def _alias(self, name: str, target: str):  # noqa: ANN202
        import importlib
        import importlib.util

        if name == ART:
            _say_forced(self)
        try:
            found = importlib.util.find_spec(target)
        except ModuleNotFoundError as e:  # a parent of the target is missing
            if e.name and (target == e.name or target.startswith(e.name + ".")):
                found = None
            else:
                raise
        if found is None:
            raise ModuleNotFoundError(_missing(name), name=name)
        module = importlib.import_module(target)
        return importlib.util.spec_from_loader(name, _AliasLoader(module), is_package=hasattr(module, "__path__"))


def _art_installed(finder: ArtFinder) -> bool:
    """Whether some other importer finds a package `art` (openpipe-art, or any other)."""
    _guard.active = True
    try:
        for other in list(sys.meta_path):
            if other is finder or isinstance(other, ArtFinder) or not hasattr(other, "find_spec"):
                continue
            try:
                spec = other.find_spec(ART, None)
            except (ImportError, ValueError):
                continue
            if spec is not None and spec.origin is not None:  # a namespace package (a folder `art/`) is not ART
                return True
        return False
    finally:
        _guard.active = False


def _say_forced(finder: ArtFinder) -> None:
    global _said_forced
    if _said_forced or not _art_installed(finder):
        return
    _said_forced = True
    try:
        from importlib.metadata import version
        art_version = " " + version("openpipe-art")
    except Exception:  # noqa: BLE001  (any other package named art)
        art_version = ""
    print(f"artrl: `import art` is artrl in this process; the installed openpipe-art{art_version} is not used "
          f"(run the program with plain `python` to use it)", file=sys.stderr)


def install(force: bool = False) -> ArtFinder:
    """Put the finder first on `sys.meta_path` (once; `force=True` upgrades it to always answer `art`)."""
    for finder in sys.meta_path:
        if isinstance(finder, ArtFinder):
            finder.force = finder.force or force
            return finder
    finder = ArtFinder(force=force)
    sys.meta_path.insert(0, finder)
    return finder


def force() -> None:
    """`art` is artrl in this process, whatever else is installed (`artrl run`). Refused once ART is imported."""
    loaded = sys.modules.get(ART)
    if loaded is not None and getattr(loaded, "__name__", None) != ARTRL:
        raise RuntimeError(f"`art` is already imported from {getattr(loaded, '__file__', '?')}; "
                           "artrl cannot take its place in this process")
    install(force=True)
