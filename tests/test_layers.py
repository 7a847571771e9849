"""The import graph of src/artrl, read with `ast`: arrows point one way.

Every import counts (module level and inside functions; only `if TYPE_CHECKING:`
blocks are left out, they never run). Two rules:

1. No cycle among artrl's modules, nor among its parts (a folder, or a root module).
2. Layers, lowest first: a module imports only from its own layer or lower ones,
   and the named layers never import each other sideways. The run directory
   (`run/`) is below the training workers (`distributed/`) and the inference
   replicas (`replicas/`, beside them), which are below the
   user's model handle (`model.py`), which is below the local backend and its
   sessions (`local/`), which are below what `artrl X` runs (`commands/`). The pure-data path
   (`preprocess/`) imports neither the trainer nor the server, and neither of
   those imports a backend. What a base model is (`models/`) is below both the
   trainer and the server; the config (`types.py`) imports neither, and the
   optimizer table they all read (`optim_spec.py`) imports none of them.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "artrl"

# name -> rank; an arrow must go to a strictly lower rank (the same name: inside one layer)
LAYERS = {"artrl.run": 0, "artrl.distributed": 1, "artrl.replicas": 1, "artrl.model": 2, "artrl.local": 3,
          "artrl.commands": 4}
# what a part of the data path must never import
FORBIDDEN = {
    "artrl.preprocess": ("artrl.train", "artrl.serve", "artrl.local", "artrl.distributed", "artrl.run"),
    # what a base model is: below the trainer and the engines, which both ask it
    "artrl.models": ("artrl.train", "artrl.serve", "artrl.local", "artrl.distributed", "artrl.run", "artrl.model",
                     "artrl.replicas", "artrl.pipeline_trainer"),
    "artrl.types": ("artrl.train", "artrl.serve", "artrl.local", "artrl.distributed", "artrl.run", "artrl.model",
                    "artrl.replicas"),
    "artrl.config.optimizers": ("artrl.models", "artrl.train", "artrl.types"),
    "artrl.train": ("artrl.serve", "artrl.local", "artrl.distributed", "artrl.run", "artrl.model"),
    "artrl.serve": ("artrl.train", "artrl.local", "artrl.distributed", "artrl.run", "artrl.model", "artrl.replicas"),
    "artrl.run": ("artrl.local", "artrl.distributed", "artrl.model", "artrl.commands", "artrl.serve", "artrl.train"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: pathlib.Path = SRC) -> dict[str, set[str]]:
    """module -> artrl modules it imports (a `from package import name` names the submodule when there is one)."""
    files = {_module_name(p): p for p in src.rglob("*.py")}
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names]
            graph[module] |= {t for t in targets if t in files and t != module}
    return graph


def _owner(module: str, names: collections.abc.Iterable[str]) -> str | None:
    return next((n for n in names if module == n or module.startswith(n + ".")), None)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_the_imports_it_must(graph: dict[str, set[str]]) -> None:
    # a module-level, a relative, a function-local import (the worker session loads the group lazily or not)
    assert "artrl.run.storage" in graph["artrl.model"]
    assert "artrl.run.checkpoint" in graph["artrl.local.session"]
    assert "artrl.distributed.group" in graph["artrl.local.worker_session"]
    assert "artrl.local.worker_session" in graph["artrl.local.backend"]  # imported inside a method


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    assert _cycles(graph) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same arrows between parts: a folder under src/artrl or a root module (`artrl.model`); the package's face
    (`artrl/__init__.py`, which imports everything ART exports) is left out."""
    def part(module: str) -> str | None:
        names = module.split(".")
        return ".".join(names[:2]) if len(names) > 1 else None

    parts: dict[str, set[str]] = collections.defaultdict(set)
    for module, targets in graph.items():
        here = part(module)
        for target in targets:
            there = part(target)
            if here and there and here != there:
                parts[here].add(there)
    return parts


def test_no_package_cycle(graph: dict[str, set[str]]) -> None:
    assert _cycles(package_graph(graph)) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_import_only_downwards(graph: dict[str, set[str]]) -> None:
    wrong = []
    for module, targets in graph.items():
        here = _owner(module, LAYERS)
        for target in targets:
            there = _owner(target, LAYERS)
            if here and there and here != there and LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_data_path_imports_nothing_above_it(graph: dict[str, set[str]]) -> None:
    wrong = []
    for module, targets in graph.items():
        part = _owner(module, FORBIDDEN)
        for target in targets:
            if part and _owner(target, FORBIDDEN[part]):
                wrong.append(f"{module} -> {target}")
    assert wrong == []
