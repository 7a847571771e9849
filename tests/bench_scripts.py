"""Benchmark scripts loaded as modules, for the tests that hold their rules and the docs' figures to them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
