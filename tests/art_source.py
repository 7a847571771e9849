"""Where ART's source is, for the tests that compare artrl with it.

Nothing of ART is copied into this repository. A test that reads ART's source takes it from an environment
variable (`ART_SOURCE` for 0.5.23, `ART_SOURCE_0518` for 0.5.18) and skips, saying so, when it is unset. The
variable may name any of the three folders a user has at hand after `pip download --no-binary :all:
openpipe-art==X` and unpacking: the sdist (`openpipe_art-X/`), its `src/`, or the package itself (`src/art/`).
"""

from __future__ import annotations

import os
from pathlib import Path


def art_package(variable: str = "ART_SOURCE") -> Path | None:
    """ART's `art` package folder named by `variable`, or None when the variable is unset. A set variable that
    names none of the three folders is an error, not a skip: it was meant to run the comparison."""
    root = os.environ.get(variable)
    if not root:
        return None
    for candidate in (Path(root) / "src" / "art", Path(root) / "art", Path(root)):
        if (candidate / "__init__.py").is_file() and (candidate / "types.py").is_file():
            return candidate
    raise FileNotFoundError(f"{variable}={root} holds no ART package: point it at ART's unpacked sdist, its src/ "
                            "folder or src/art/")
