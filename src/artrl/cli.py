"""`artrl` command line: demo, serve, runs, and the benchmarks a user runs on their own setup (commands/).

    artrl run program.py [args]     an ART program unedited: `import art` is artrl for that process
    artrl demo                      SFT warm-up then RL on the tiny model (CPU, minutes)
    artrl serve --model NAME        the OpenAI-compatible server alone
    artrl runs show RUN_DIR         a run's rewards and losses per step: a table and a PNG
    artrl migrate PATH              ART's JSONL trajectory logs to Parquet (a model, project or trajectories dir)
    artrl status [--model M]        what artrl can run here: devices, engines, extras, M's memory plan
    artrl bench pack  --workload F  packing against the reference layout
    artrl bench train --workload F  train-step throughput against the reference trainer
    artrl bench train --workload F --workers N   N data-parallel workers against one
    artrl bench serve               inference throughput, concurrent vs sequential
    artrl bench memory --model M    the memory plan beside the measured peak of one LoRA RL call

The development benchmarks (learning per rollout, the pipeline against the synchronous loop, inference
replicas) are not part of the package: `python benchmarks/bench.py learn|pipeline|replicas` in a clone.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from .errors import ArtrlError


# (command, bench subcommand) -> the module (commands/) whose `add_arguments(parser)` fills that subcommand's
# parser and whose `main(args)` runs it. `main` adds only the arguments of the subcommand it runs, so `artrl --help`
# and `artrl runs show` never import the modules of the demo or the benchmarks (torch among them). A new
# subcommand: a module in commands/, a line here and one in `_parser`.
_ARGUMENTS = {
    ("run", None): "artrl.runtime.art_program",
    ("demo", None): "artrl.commands.demo",
    ("serve", None): "artrl.commands.serve",
    ("runs", None): "artrl.commands.runs",
    ("migrate", None): "artrl.commands.migrate",
    ("status", None): "artrl.commands.status",
    ("bench", "pack"): "artrl.commands.bench.pack",
    ("bench", "train"): "artrl.commands.bench.train",
    ("bench", "serve"): "artrl.commands.bench.serve",
    ("bench", "memory"): "artrl.commands.bench.memory",
}


def _parser(only: tuple[str, str | None] | None = None, *, first_pass: bool = False) -> argparse.ArgumentParser:
    """The command line. `only=(command, bench)`: that subcommand's arguments alone (None: every subcommand's).
    `first_pass`: the commands without their arguments or `--help`, to find which one `argv` names."""
    import importlib

    def command(parent: Any, name: str, help: str, key: tuple[str, str | None] | None = None) -> Any:
        parser = parent.add_parser(name, help=help, add_help=not first_pass)
        if key is not None and not first_pass and only in (None, key):
            importlib.import_module(_ARGUMENTS[key]).add_arguments(parser)
        return parser

    p = argparse.ArgumentParser(prog="artrl", description="Train LLM agents from experience.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    command(sub, "run", "run an ART program unedited (`import art` is artrl)", ("run", None))
    command(sub, "demo", "SFT warm-up then RL on the tiny model (CPU, minutes)", ("demo", None))
    command(sub, "serve", "the OpenAI-compatible inference server alone", ("serve", None))
    command(sub, "runs", "look at runs (history.jsonl)", ("runs", None))
    command(sub, "migrate", "ART's JSONL trajectory logs to Parquet", ("migrate", None))
    command(sub, "status", "what artrl can run here: devices, engines, extras, a model's memory plan",
            ("status", None))

    bench = command(sub, "bench", "measure your own setup (each prints one JSON line)")
    bsub = bench.add_subparsers(dest="bench", required=not first_pass)
    command(bsub, "pack", "packing: our layout vs the reference (ART) layout", ("bench", "pack"))
    command(bsub, "train", "train step: our batching vs the reference one-row-per-step trainer", ("bench", "train"))
    command(bsub, "serve", "inference: concurrent requests vs one at a time", ("bench", "serve"))
    command(bsub, "memory", "the memory plan of a model beside the measured peak of one LoRA RL call",
            ("bench", "memory"))
    return p


def _chosen(argv: list[str] | None) -> tuple[str, str | None]:
    """The (command, bench) that `argv` names, from a first pass that knows the commands but none of their
    arguments; `artrl --help` and a missing or unknown command end here, with argparse's own message."""
    known, _ = _parser(first_pass=True).parse_known_args(argv)
    return known.command, getattr(known, "bench", None)


def main(argv: list[str] | None = None) -> int:
    args = _parser(_chosen(argv)).parse_args(argv)
    if args.command == "run":  # the program's own logging setup (or none) stays its own
        from .runtime.art_program import main as run
        return run(args)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "uvicorn", "uvicorn.error", "uvicorn.access", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.command == "demo" and args.pipeline:
            from .commands.demo_pipeline import main as run
            return run(args)
        if args.command == "bench" and args.bench == "train" and args.workers > 1:
            from .commands.bench.workers import main as run  # N data-parallel workers against one
            return run(args)
        key = (args.command, getattr(args, "bench", None))
        if key in _ARGUMENTS:
            import importlib

            return importlib.import_module(_ARGUMENTS[key]).main(args)
    except ArtrlError as e:
        print(f"artrl: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
