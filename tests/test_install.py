"""Every artrl module imports with the runtime dependencies alone (the README's plain install).

The test extra pulls in more (httpx, polars, pandas, duckdb, wandb, tensorboard, python-dotenv), which would
hide a module that needs one of them at import time; here they are made unimportable in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

OPTIONAL = ("httpx", "polars", "pandas", "duckdb", "wandb", "tensorboard", "dotenv", "litellm", "hypothesis",
            "pytest", "langgraph", "langchain_core", "langchain_openai", "mcp")
# The one package that needs its extra at import time, and says which (docs/integrations.md)
NEEDS_ITS_EXTRA = {"artrl.langgraph": "pip install 'artrl[langgraph]'"}


def test_every_module_imports_without_the_optional_packages():
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys

        for name in {OPTIONAL!r}:
            sys.modules[name] = None  # `import name` raises ImportError; find_spec(name) says "not installed"
        import artrl
        failed = []
        for m in pkgutil.walk_packages(artrl.__path__, "artrl."):
            try:
                importlib.import_module(m.name)
            except Exception as e:
                extra = {NEEDS_ITS_EXTRA!r}.get(m.name)
                if not (extra and isinstance(e, ImportError) and extra in str(e)):
                    failed.append(f"{{m.name}}: {{e!r}}")
        print("\\n".join(failed) or "ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout
