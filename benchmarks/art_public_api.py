"""ART's public module paths and the names each defines, from ART's own source, for tests/test_art_public_api.py.

    python benchmarks/art_public_api.py --art-source /path/to/openpipe_art-0.5.23/src/art \\
        --art-source /path/to/openpipe_art-0.5.18/src/art > tests/data/art_public_api.json

A path is public when no part of it starts with `_`; the back ends artrl does not provide (Megatron, Tinker,
Unsloth, ART's transformers patches), ART's test helpers and tau-bench are left out, as docs/art-compatibility.md
says. A module's names are its `__all__` (read with a regex where ART's file uses syntax newer than this Python),
else its top-level classes, functions and assignments without a leading `_`. Nothing of ART is imported or copied:
the file holds names only.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re

LEFT_OUT = ("megatron", "test", "tinker", "tinker_native", "unsloth", "tau_bench", "transformers")
_ALL = re.compile(r"^__all__\s*=\s*\[(.*?)\]", re.S | re.M)


def public_names(source: str) -> list[str]:
    """The names a module exports: its `__all__`, else what it defines at the top level without a leading `_`."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # ART 0.5.23 uses Python 3.12 syntax in places: its __all__ by regex
        found = _ALL.search(source)
        return sorted(re.findall(r"[\"'](\w+)[\"']", found.group(1))) if found else []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            try:
                return sorted(ast.literal_eval(node.value))
            except ValueError:  # an __all__ built by an expression
                break
    names = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    names += [t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)]
    return sorted({n for n in names if not n.startswith("_")})


def walk(root: pathlib.Path) -> dict[str, list[str]]:
    """`art.x.y` -> its public names, for every public module under `root` (ART's src/art)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if any(p.startswith("_") for p in parts) or (parts and parts[0] in LEFT_OUT):
            continue
        out[".".join(["art", *parts])] = public_names(path.read_text())
    return out


def version_of(root: pathlib.Path) -> str:
    """ART's version from its sdist directory's name (openpipe_art-0.5.23/src/art)."""
    return root.resolve().parents[1].name.rsplit("-", 1)[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--art-source", action="append", required=True, type=pathlib.Path,
                   help="ART's src/art of one version (openpipe_art-X.Y.Z/src/art); repeat for several")
    args = p.parse_args()
    print(json.dumps({version_of(root): walk(root) for root in args.art_source}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
