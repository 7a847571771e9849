"""`artrl` command line: demo, serve, and the benchmarks.

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

from .errors import ArtrlError

DEFAULT_WORKLOAD_HELP = "workload JSON (see shared/workloads/README.md), e.g. ../shared/workloads/seed-like.json"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="artrl", description="Train LLM agents from experience.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="SFT warm-up then RL on the tiny model (CPU, minutes)")
    from .demo import add_arguments as add_demo_args

    add_demo_args(demo)

    sv = sub.add_parser("serve", help="the OpenAI-compatible inference server alone")
    from .local.standalone import add_arguments as add_serve_args

    add_serve_args(sv)

    runs = sub.add_parser("runs", help="look at runs (history.jsonl)")
    from .runs import add_arguments as add_runs_args

    add_runs_args(runs)

    bench = sub.add_parser("bench", help="benchmarks (pack/train/serve/pipeline print one JSON line; learn a table)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bp = bsub.add_parser("pack", help="packing: our layout vs the reference (ART) layout")
    bp.add_argument("--workload", required=True, help=DEFAULT_WORKLOAD_HELP)
    bp.add_argument("--row-length", type=int, default=None, help="fix the row length (default: automatic)")
    bp.add_argument("--max-length", type=int, default=32768, help="model maximum length bounding the rows")
    bp.add_argument("--scale", type=float, default=1.0, help="multiply every length by this factor")
    bt = bsub.add_parser("train", help="train step: our batching vs the reference one-row-per-step trainer")
    from .bench.train_bench import add_arguments as add_train_args

    add_train_args(bt)
    bs = bsub.add_parser("serve", help="inference: concurrent requests vs one at a time")
    from .bench.serve_bench import add_arguments as add_serve_bench_args

    add_serve_bench_args(bs)
    bl = bsub.add_parser("learn", help="learning per rollout: artrl vs a plain GRPO step, tasks x lrs x seeds")
    from .bench.learn_bench import add_arguments as add_learn_args

    add_learn_args(bl)
    bpl = bsub.add_parser("pipeline", help="the synchronous RL loop vs PipelineTrainer on an agent workload whose "
                          "tools take time")
    from .bench.pipeline_bench import add_arguments as add_pipeline_args

    add_pipeline_args(bpl)
    brp = bsub.add_parser("replicas", help="rollout throughput on 1, 2, 4 inference replicas behind the router, its "
                          "added latency, and the publish time of a version")
    from .bench.replicas_bench import add_arguments as add_replicas_args

    add_replicas_args(brp)
    bm = bsub.add_parser("memory", help="the memory plan of a model beside the measured peak of one LoRA RL call")
    from .bench.memory_bench import add_arguments as add_memory_args

    add_memory_args(bm)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "uvicorn", "uvicorn.error", "uvicorn.access"):
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
