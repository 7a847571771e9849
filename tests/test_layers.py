"""The import graph of src/artrl, read with `ast`: arrows point one way.

Every import counts: at module level, inside functions, and under `if TYPE_CHECKING:` (an annotation that names
a module is a dependency on it, and a circle closed by one is still a circle), and the strings that name a module
for the interpreter: `importlib.import_module("artrl.x")`, a `"-m", "artrl.x"` launch, a `"artrl.x:Name"` entry
point (every string that is exactly an artrl module's dotted path, or one followed by `:Name`, except the
argument of `logging.getLogger`). Rules:

1. No cycle among artrl's modules, nor among its parts (a folder, or a root module).
2. Tiers, lowest first (TIERS): a part imports only from itself or from a lower tier, never sideways. The
   run directory (`run/`) is below the training workers (`distributed/`) and the inference replicas
   (`replicas/`), which are below the user's model handle (`model.py`), below the local backend and its
   sessions (`local/`), below what `artrl X` runs (`commands/`). The pure-data path (`preprocess/`) is
   below the trainer and the server; what a base model is (`models/`) below all three.
3. Inside trajectories/ and serve/, their modules' own order (INNER), lowest first.
4. What some parts must never import, beyond the tiers (FORBIDDEN).
5. No registration hook: no module hands `sys.modules[__name__]` to anything, and a module-level `__getattr__`
   exists only where GETATTR says why.
6. Every string that looks like an artrl module path names one that exists (a move cannot leave one stale);
   NOT_MODULES lists the module-like strings that are something else, each with its reason.
7. A private name (`_x`) is imported by no other module: what another module reads is public.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "artrl"
MODULE_PATH = re.compile(r"^artrl(?:\.\w+)+$")

# lowest first; one set per tier; a name is a root module or a folder under src/artrl ("artrl": the package's face)
TIERS: tuple[frozenset[str], ...] = tuple(
    frozenset("artrl" if n == "(face)" else f"artrl.{n}" for n in tier.split()) for tier in (
        "errors runtime costs",
        "types metrics_taxonomy api_costs mcp",
        "dev metrics",
        "config chat",
        "models",
        "tokenizer trajectories",
        "preprocess gather yield_trajectory auto_trajectory rewards",
        "train serve run batches",
        "loss distributed replicas client",
        "model",
        "backend",
        "local serverless",
        "pipeline_tuner utils langgraph",
        "pipeline_trainer tasks",
        "(face)",
        "commands",
        "cli",
        "__main__",  # `python -m artrl`: the command line
    ))
RANK = {name: i for i, tier in enumerate(TIERS) for name in tier}
# the order of the modules (first name after the package) inside a package, lowest first; its __init__ is its face
INNER = {
    "artrl.trajectories": ("exchanges", "capture", "gather_context", "token_record", "lineage", "sequences", "tensors",
                           "tokens", "history", "protocol_histories", "branches", "data", "tokenization", "scopes"),
    "artrl.serve": ("errors", "schema_ends", "tool_calls", "structured", "engines", "http"),
}
# what a part must never import, beyond what the tiers forbid
FORBIDDEN = {
    "artrl.preprocess": ("artrl.train", "artrl.serve", "artrl.local", "artrl.distributed", "artrl.run"),
    # what a base model is: below the trainer and the engines, which both ask it
    "artrl.models": ("artrl.train", "artrl.serve", "artrl.local", "artrl.distributed", "artrl.run", "artrl.model",
                     "artrl.replicas", "artrl.pipeline_trainer"),
    "artrl.types": ("artrl.train", "artrl.serve", "artrl.local", "artrl.distributed", "artrl.run", "artrl.model",
                    "artrl.replicas"),
    # the optimizer table the model config, the memory plan and the trainer all read
    "artrl.config.optimizers": ("artrl.models", "artrl.train", "artrl.types"),
    "artrl.train": ("artrl.serve", "artrl.local", "artrl.distributed", "artrl.run", "artrl.model"),
    "artrl.serve": ("artrl.train", "artrl.local", "artrl.distributed", "artrl.run", "artrl.model", "artrl.replicas"),
    "artrl.run": ("artrl.local", "artrl.distributed", "artrl.model", "artrl.commands", "artrl.serve", "artrl.train"),
}
GETATTR = {
    "artrl": "refuses ART's Megatron names",
    "artrl.types": "refuses ART's Megatron config names",
    "artrl.rewards.ruler": "loads litellm (third party) on first use",
}
NOT_MODULES = {  # module-like strings that are not modules, on purpose
    "artrl.notices": "a logger name, kept when notices.py moved to runtime/ (docs/art-compatibility.md names it)",
    "artrl.data": "package data (tiny_corpus.txt), read with importlib.resources",
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files(src: pathlib.Path = SRC) -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in src.rglob("*.py")}


def import_graph(src: pathlib.Path = SRC) -> dict[str, set[str]]:
    """module -> artrl modules it imports (a `from package import name` names the submodule when there is one)."""
    files = _files(src)
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        logger_names = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call)
                        and ast.unparse(n.func).endswith("getLogger") for a in n.args}
        for node in ast.walk(tree):
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
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in logger_names:
                name = node.value.split(":", 1)[0]  # "artrl.x", "-m" "artrl.x", "artrl.x:Name"; not a logger
                targets = [name] if MODULE_PATH.match(name) else []
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


def _package(module: str) -> str:
    """The part a module belongs to: its folder under src/artrl, or the root module itself ("artrl": the face)."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same arrows between parts (a folder under src/artrl, a root module, the package's face)."""
    parts: dict[str, set[str]] = collections.defaultdict(set)
    for module, targets in graph.items():
        parts[_package(module)] |= {_package(t) for t in targets if _package(t) != _package(module)}
    return parts


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if _package(m) != _package(t) and RANK.get(_package(t), -1) >= RANK.get(_package(m), -1))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_the_imports_it_must(graph: dict[str, set[str]]) -> None:
    assert "artrl.run.storage" in graph["artrl.model"]  # module level
    assert "artrl.run.checkpoint" in graph["artrl.local.session"]  # relative
    assert "artrl.local.worker_session" in graph["artrl.local.backend"]  # inside a method
    assert "artrl.model" in graph["artrl.backend"]  # under TYPE_CHECKING
    assert "artrl.commands.demo" in graph["artrl.cli"]  # importlib.import_module("artrl.commands.demo")
    assert "artrl.distributed.worker" in graph["artrl.distributed.group"]  # "-m", "artrl.distributed.worker"
    assert "artrl.serve.engines.vllm_grammar" in graph["artrl.serve.engines.vllm_args"]  # "module:Name"


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    assert _cycles(graph) == []


def test_no_package_cycle(graph: dict[str, set[str]]) -> None:
    assert _cycles(package_graph(graph)) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_part_has_a_tier() -> None:
    parts = {_package(m) for m in _files()}
    assert sorted(parts - set(RANK)) == []  # a new folder or root module takes a place in TIERS
    assert sorted(set(RANK) - parts) == []  # a tier names nothing that is gone


def test_tiers_import_only_downwards(graph: dict[str, set[str]]) -> None:
    assert _upward(graph) == []


def test_the_tier_check_catches_an_upward_and_a_sideways_import() -> None:
    fake = {"artrl.preprocess.pack": {"artrl.train.trainer"},  # the data path reaching the trainer
            "artrl.train.trainer": {"artrl.serve.engines.base"}}  # the trainer reaching the server beside it
    assert _upward(fake) == ["artrl.preprocess.pack -> artrl.train.trainer",
                             "artrl.train.trainer -> artrl.serve.engines.base"]


@pytest.mark.parametrize("package", sorted(INNER))
def test_inside_a_package_its_order_holds(graph: dict[str, set[str]], package: str) -> None:
    order = {name: i for i, name in enumerate(INNER[package])}

    def part(module: str) -> str | None:
        return module[len(package) + 1:].split(".")[0] if module.startswith(package + ".") else None

    inside = {part(m) for m in _files() if part(m)}
    assert sorted(inside - set(order)) == []  # a new module there takes a place in INNER
    assert sorted(set(order) - inside) == []
    wrong = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
             if part(m) and part(t) and part(m) != part(t) and order[part(t)] >= order[part(m)]]
    assert wrong == []


def test_parts_never_import_what_they_must_not(graph: dict[str, set[str]]) -> None:
    wrong = []
    for module, targets in graph.items():
        part = _owner(module, FORBIDDEN)
        for target in targets:
            if part and _owner(target, FORBIDDEN[part]):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_no_registration_hooks() -> None:
    hooks, getattrs = [], []
    for module, path in _files().items():
        tree = ast.parse(path.read_text())
        hooks += [f"{module}:{n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Subscript) and ast.unparse(n) == "sys.modules[__name__]"]
        getattrs += [module for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
    assert hooks == []
    assert sorted(getattrs) == sorted(GETATTR)


def test_module_path_strings_name_modules() -> None:
    files = _files()
    stale = []
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value.split(":", 1)[0]
                if MODULE_PATH.match(name) and name not in files and name not in NOT_MODULES:
                    stale.append(f"{module}: {node.value!r}")
    assert stale == []


def test_private_names_stay_in_their_module() -> None:
    files = _files()
    crossing = []
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("artrl")):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                crossing += [f"{module} <- {source}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossing == []
