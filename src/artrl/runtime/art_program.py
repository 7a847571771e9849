"""`artrl run program.py [args]`: an ART program, exactly as its author wrote it, on artrl.

The program runs in this process as `python program.py [args]` would run it (`__main__`, its folder first on
`sys.path`, `sys.argv` its own), with every `art` and `art.*` import resolved to artrl's module of the same path
(`_artrl_art.force()`), even where openpipe-art is installed too (then said once on stderr). `-m module` runs a
module as `python -m` does. Logging is left as the program sets it up: artrl's notices reach stderr on their own
when it sets up none (runtime/voice.py).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", dest="module", default=None, help="run a module as `python -m` does")
    parser.add_argument("program", nargs="?", default=None, help="the ART program (a .py file)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the program's own arguments")


def main(args: Any) -> int:
    import _artrl_art

    if (args.module is None) == (args.program is None):
        print("artrl run: name a program (artrl run program.py [args]) or a module (artrl run -m module [args])",
              file=sys.stderr)
        return 2
    _artrl_art.force()
    if args.module is not None:
        rest = [args.program, *args.args] if args.program is not None else list(args.args)
        sys.argv = [args.module, *rest]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        return 0
    program = os.path.abspath(args.program)
    if not os.path.isfile(program):
        print(f"artrl run: no such program: {args.program}", file=sys.stderr)
        return 2
    sys.argv = [args.program, *args.args]
    sys.path.insert(0, os.path.dirname(program))
    runpy.run_path(program, run_name="__main__")
    return 0
