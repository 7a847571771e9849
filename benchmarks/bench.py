"""The development benchmarks, run from a clone: `python benchmarks/bench.py learn|pipeline|replicas ...`.

    learn      learning per rollout: artrl's train step against a plain GRPO step, tasks x lrs x seeds
               (a table, and a JSON file; `--baseline benchmarks/results/learning-baseline.json` guards it)
    pipeline   the synchronous RL loop against ART's PipelineTrainer on an agent workload whose tools take time
    replicas   rollouts on 1, 2, 4 inference replicas behind the router, its added latency, a version's publish time

Each is a module of benchmarks/harness/ with `add_arguments(parser)` and `main(args)`, as the product's own
benchmarks (`artrl bench pack|train|serve|memory`, src/artrl/commands/bench/) are. These read the repository's
workloads and results and compare artrl with yardsticks, so they are not part of the installed package.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.harness

from artrl.errors import ArtrlError  # noqa: E402

BENCHES = {
    "learn": ("benchmarks.harness.learn_bench", "learning per rollout: artrl vs a plain GRPO step, tasks x lrs x seeds"),
    "pipeline": ("benchmarks.harness.pipeline_bench",
                 "the synchronous RL loop vs PipelineTrainer on an agent workload whose tools take time"),
    "replicas": ("benchmarks.harness.replicas_bench", "rollout throughput on 1, 2, 4 inference replicas behind the "
                 "router, its added latency, and the publish time of a version"),
}


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line; `only`: that bench's arguments alone (its module is imported only then)."""
    p = argparse.ArgumentParser(prog="benchmarks/bench.py", description=__doc__.split("\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="bench", required=True)
    for name, (module, help) in BENCHES.items():
        parser = sub.add_parser(name, help=help)
        if only in (None, name):
            importlib.import_module(module).add_arguments(parser)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in BENCHES), None)
    args = _parser(chosen).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "uvicorn", "uvicorn.error", "uvicorn.access", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return importlib.import_module(BENCHES[args.bench][0]).main(args)
    except ArtrlError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
