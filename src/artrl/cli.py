"""`artrl` command line: demo, serve, and the benchmarks.

    artrl run program.py [args]     an ART program unedited: `import art` is artrl for that process
    artrl demo                      SFT warm-up then RL on the tiny model (CPU, minutes)
    artrl serve --model NAME        the OpenAI-compatible server alone
    artrl runs show RUN_DIR         a run's rewards and losses per step: a table and a PNG
    artrl bench pack  --workload F  packing against the reference layout
    artrl bench train --workload F  train-step throughput against the reference trainer
    artrl bench train --workload F --workers N   N data-parallel workers against one
    artrl bench serve               inference throughput, concurrent vs sequential
    artrl bench learn               learning per rollout: artrl's train step vs a plain GRPO step
    artrl bench pipeline            the synchronous RL loop vs ART's PipelineTrainer, tools that take time
    artrl bench memory --model M    the memory plan beside the measured peak of one LoRA RL call
    artrl bench replicas            rollouts on 1, 2, 4 inference replicas behind the router
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from .errors import ArtrlError

DEFAULT_WORKLOAD_HELP = ("workload JSON (format: benchmarks/workloads/README.md), e.g. "
                         "benchmarks/workloads/seed-like.json")


# (command, bench subcommand) -> the module whose `add_arguments(parser)` fills that subcommand's parser. `main`
# adds only the arguments of the subcommand it runs, so `artrl --help` and `artrl runs show` never import the
# modules of the demo or the benchmarks (torch among them). A new subcommand: a line here and one in `_parser`.
_ARGUMENTS = {
    ("run", None): "artrl.runtime.art_program",
    ("demo", None): "artrl.demo",
    ("serve", None): "artrl.local.standalone",
    ("runs", None): "artrl.runs",
    ("bench", "train"): "artrl.bench.train_bench",
    ("bench", "serve"): "artrl.bench.serve_bench",
    ("bench", "learn"): "artrl.bench.learn_bench",
    ("bench", "pipeline"): "artrl.bench.pipeline_bench",
    ("bench", "memory"): "artrl.bench.memory_bench",
    ("bench", "replicas"): "artrl.bench.replicas_bench",
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

    bench = command(sub, "bench", "benchmarks (pack/train/serve/pipeline print one JSON line; learn a table)")
    bsub = bench.add_subparsers(dest="bench", required=not first_pass)
    bp = command(bsub, "pack", "packing: our layout vs the reference (ART) layout")
    if not first_pass:
        bp.add_argument("--workload", required=True, help=DEFAULT_WORKLOAD_HELP)
        bp.add_argument("--row-length", type=int, default=None, help="fix the row length (default: automatic)")
        bp.add_argument("--max-length", type=int, default=32768, help="model maximum length bounding the rows")
        bp.add_argument("--scale", type=float, default=1.0, help="multiply every length by this factor")
    command(bsub, "train", "train step: our batching vs the reference one-row-per-step trainer", ("bench", "train"))
    command(bsub, "serve", "inference: concurrent requests vs one at a time", ("bench", "serve"))
    command(bsub, "learn", "learning per rollout: artrl vs a plain GRPO step, tasks x lrs x seeds", ("bench", "learn"))
    command(bsub, "pipeline", "the synchronous RL loop vs PipelineTrainer on an agent workload whose tools take time",
            ("bench", "pipeline"))
    command(bsub, "memory", "the memory plan of a model beside the measured peak of one LoRA RL call",
            ("bench", "memory"))
    command(bsub, "replicas", "rollout throughput on 1, 2, 4 inference replicas behind the router, its added "
            "latency, and the publish time of a version", ("bench", "replicas"))
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
            from .demo_pipeline import main as run
            return run(args)
        if args.command == "demo":
            from .demo import main as run
            return run(args)
        if args.command == "serve":
            from .local.standalone import main as run
            return run(args)
        if args.command == "runs":
            from .runs import main as run
            return run(args)
        if args.command == "bench" and args.bench == "pack":
            from .bench.pack_bench import main as run
            return run(args)
        if args.command == "bench" and args.bench == "serve":
            from .bench.serve_bench import main as run
            return run(args)
        if args.command == "bench" and args.bench == "train" and args.workers > 1:
            from .bench.workers_bench import main as run  # N data-parallel workers against one
            return run(args)
        if args.command == "bench" and args.bench == "train":
            from .bench.train_bench import main as run
            return run(args)
        if args.command == "bench" and args.bench == "learn":
            from .bench.learn_bench import main as run
            return run(args)
        if args.command == "bench" and args.bench == "pipeline":
            from .bench.pipeline_bench import main as run
            return run(args)
        if args.command == "bench" and args.bench == "replicas":
            from .bench.replicas_bench import main as run
            return run(args)
        if args.command == "bench" and args.bench == "memory":
            from .bench.memory_bench import main as run
            return run(args)
    except ArtrlError as e:
        print(f"artrl: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
