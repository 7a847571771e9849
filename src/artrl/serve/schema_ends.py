"""Whether a JSON schema's recursion can end: which recursive schemas a grammar may hold a reply to.

llguidance compiles a schema whose `$ref`s form a cycle into a recursive grammar, and a reply held
to it is valid for the schema wherever it stops. Such a reply can stop only if the recursion can
end: some way through it reaches a value that contains no further reference. A tree whose child
is optional ends at a node without a child:

    {"type": "object", "properties": {"v": {"type": "integer"}, "child": {"$ref": "#"}},
     "required": ["v"]}                                   -> {"v": 1, "child": {"v": 2}}

A recursion that cannot end leaves the grammar no way to finish, and llguidance then lets the
reply stop where it stands: `{"a": ` answered with `finish_reason: "stop"`. These schemas have
no finite value at all:

    {"$ref": "#"}                                          (itself and nothing else)
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
                                                           (a required self-reference)
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
                                                           (at least one item, each such an array)

`unending_part` finds the first part of a schema that cannot end, among every part a reply may
enter: an optional property whose schema cannot end is refused too, since a reply may start it and
then never finish. How:

1. **Which references can end** (a least fixed point): a reference ends once its target has a
   finite value given the references already known to end, where an object needs each *required*
   property to end, an array its first `minItems` items, an `anyOf` / `oneOf` one branch, an
   `allOf` every member, and strings, numbers, booleans, null, `enum` and `const` always end.
   Repeat until nothing changes; what is left out never ends.
2. **Every part a reply may enter** (every property, optional ones too, items, each branch of an
   `anyOf`, what a `$ref` names; from the root) must have a finite value, and so must each of its
   object or array forms.

Only local references (`#`, `#/$defs/...`, any JSON pointer into the schema) are followed; others,
and references to nothing, are left to the grammar library, which refuses what it cannot compile.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Path = tuple[str, ...]

_MISSING = object()
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _target(ref: Any) -> Path | None:
    """The JSON pointer of a local `$ref` as a path (`#` -> ()), or None for any other reference."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    return tuple(p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")) if ref != "#" else ()


def _at(root: Any, path: Path) -> Any:
    node = root
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _pointer(path: Path) -> str:
    return "#/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in path) if path else "#"


class _Ends:
    """Step 1 of the module docstring for one schema: `ending` holds the reference targets known to end."""

    def __init__(self, root: Any) -> None:
        self.root = root
        targets = {t for t in (_target(ref) for ref in _refs(root)) if t is not None}
        #: reference targets known to end; a $ref to nothing counts as ending (the library's to refuse)
        self.ending: set[Path] = {t for t in targets if _at(root, t) is _MISSING}
        grew = True
        while grew:
            new = {t for t in targets - self.ending if self.can_end(_at(root, t))}
            self.ending |= new
            grew = bool(new)

    def can_end(self, node: Any) -> bool:
        """Whether `node` has a finite value, references counting as finite when their target is in `ending`."""
        return self.why_not(node) is None

    def why_not(self, node: Any) -> str | None:
        """None when `node` can end; else what keeps it from ending, in words."""
        if node is False:
            return "it allows no value (false)"
        if not isinstance(node, dict) or "const" in node or node.get("enum"):
            return None
        target = _target(node.get("$ref"))
        if target is not None and target not in self.ending:
            return f"its $ref {node['$ref']!r} leads to a schema that cannot end"
        for i, member in enumerate(node.get("allOf") or []):
            if not self.can_end(member):
                return f"its allOf[{i}] cannot end"
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if branches and not any(self.can_end(b) for b in branches):
                return f"none of its {key} branches can end"
        types = node.get("type")
        if types is None:  # any JSON value: a string ends, whatever the object and array keywords say
            return None
        reasons = [self.why_type_not(t, node) for t in ([types] if isinstance(types, str) else types)]
        return None if any(r is None for r in reasons) else "; ".join(r for r in reasons if r)

    def why_type_not(self, kind: Any, node: dict[str, Any]) -> str | None:
        """None when `node`'s values of JSON type `kind` can be finite; else why not."""
        if kind == "object":
            properties = node.get("properties") or {}
            for name in node.get("required") or []:
                schema = properties.get(name, node.get("additionalProperties", True))
                if not self.can_end(schema):
                    return f"its required property {name!r} cannot end"
        elif kind == "array":
            least = node.get("minItems", 0)
            least = least if isinstance(least, int) else 0
            prefix = node.get("prefixItems") or (node["items"] if isinstance(node.get("items"), list) else [])
            rest = node.get("items", True) if not isinstance(node.get("items"), list) else True
            for i in range(least):
                if not self.can_end(prefix[i] if i < len(prefix) else rest):
                    return f"it needs at least {least} items and item {i} cannot end"
        return None


def _refs(node: Any) -> Iterator[Any]:
    """Every `$ref` value anywhere in `node`."""
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _children(node: dict[str, Any], path: Path) -> Iterator[tuple[Path, Any]]:
    """The subschemas a value of `node` may contain, or be (each with its path)."""
    for key in ("properties", "patternProperties"):
        for name, schema in (node.get(key) or {}).items():
            yield (*path, key, name), schema
    for key in ("additionalProperties", "items"):
        value = node.get(key)
        if isinstance(value, dict):
            yield (*path, key), value
        elif isinstance(value, list):  # the old tuple form of items
            for i, schema in enumerate(value):
                yield (*path, key, str(i)), schema
    for key in _SUBSCHEMA_LISTS:
        for i, schema in enumerate(node.get(key) or []):
            yield (*path, key, str(i)), schema


def unending_part(schema: Any) -> tuple[str, str] | None:
    """The first part of `schema` a reply may enter and never finish (module docstring): (its JSON pointer, why),
    or None when every part can end."""
    ends = _Ends(schema)
    seen: set[Path] = set()
    todo: list[tuple[Path, Any]] = [((), schema)]
    while todo:
        path, node = todo.pop()
        if path in seen or not isinstance(node, dict | bool):
            continue
        seen.add(path)
        why = ends.why_not(node)
        if why is None and isinstance(node, dict) and isinstance(node.get("type"), list):
            why = next((w for w in (ends.why_type_not(t, node) for t in node["type"]) if w), None)
        if why is None and isinstance(node, dict) and "type" not in node:
            forms = [k for k, keys in (("object", ("properties", "required")), ("array", ("items", "minItems")))
                     if any(key in node for key in keys)]
            why = next((w for w in (ends.why_type_not(k, node) for k in forms) if w), None)
        if why is not None:
            return _pointer(path), why
        if isinstance(node, dict):
            target = _target(node.get("$ref"))
            if target is not None and (found := _at(schema, target)) is not _MISSING:
                todo.append((target, found))
            todo.extend(reversed(list(_children(node, path))))
    return None
