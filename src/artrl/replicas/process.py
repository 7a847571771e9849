"""One inference replica: a process that serves one model with artrl's server and its control routes.

    python -m artrl.replicas.process --base-model artrl/tiny --name agent --replica r0 \\
        --config '{"device": "cpu"}' [--run-dir RUN] [--host 127.0.0.1] [--port 0] [--engine builtin]

The control plane (replicas/control.py) starts one per replica with `spawn.ReplicaProcess`
(on other machines `artrl serve --replica` is the same server): it loads the base model
with the model's `InternalModelConfig` (the trainer's LoRA shape, dtype, context length,
batch size; the built-in engine holds a fresh adapter until the first checkpoint is made
live), serves `name`, `name@step` and the base model like the training process's own
server, plus the control routes (serve/http/control_routes.py), binds its port (0: a free one)
and then writes one line `ARTRL_REPLICA_READY {"port": P}` to stdout: the parent waits on
that line, not on polling. It exits when its standard input closes (the parent ended,
however it ended) or on SIGTERM.

`--engine scripted` serves the paced scripted engine (serve/engines/scripted.py: `--token-time-ms`
per token, `--reply-tokens` tokens per answer), for `python benchmarks/bench.py replicas`.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any

from .spawn import on_parent_end

log = logging.getLogger("artrl.replicas.process")

READY_PREFIX = "ARTRL_REPLICA_READY "


def open_engine_for(args: argparse.Namespace, cfg: Any) -> tuple[Any, str]:
    """(engine, engine kind) that serves `args.base_model` in this process."""
    from ..chat.format import end_of_turn_ids
    from ..models.loading import load_generation_config, load_model
    from ..models.resolved import resolve_base_model
    from ..models.tokenizer import load_tokenizer
    from ..serve.engines.factory import open_engine, resolve_engine_kind

    if args.engine == "scripted":
        from ..serve.engines.scripted import ScriptedEngine

        tok = load_tokenizer(args.base_model, cfg)
        ids = list(range(10, 10 + args.reply_tokens - 1)) + [tok.eos_token_id]  # `reply_tokens` in all
        engine = ScriptedEngine(tok, token_time_s=args.token_time_ms / 1000, max_batch_size=cfg.inference_max_batch_size)
        engine.next = (ids, [-1.0] * len(ids))
        return engine, "scripted"
    resolved = resolve_base_model(args.base_model, cfg)  # once for this replica: what it loads and serves
    on_disk = not resolved.random
    kind = resolve_engine_kind(args.engine, resolved.device.type, weights_on_disk=on_disk)
    if kind == "builtin":
        # a peft model: each checkpoint becomes a version of it; a set started by the control plane was planned
        # together (models/memory_plan.check_replicas_fit), not one replica at a time
        model, tok = load_model(resolved, memory_planned=getattr(args, "memory_planned", False))
        ends = end_of_turn_ids(tok, model)
    else:
        model, tok = None, load_tokenizer(resolved.source, resolved.cfg, path=resolved.path)
        ends = end_of_turn_ids(tok, load_generation_config(resolved))
    engine = open_engine(kind, tokenizer=tok, end_ids=ends, cfg=cfg, model=model,
                         base_model_path=resolved.path if on_disk else None)
    return engine, kind


def build_app(args: argparse.Namespace) -> tuple[Any, Any]:
    """(app, engine) of this replica."""
    from pathlib import Path

    from ..run import storage
    from ..serve.http.served_models import ServedModels
    from ..serve.http.server import create_app
    from ..config.model import InternalModelConfig

    cfg = InternalModelConfig(**json.loads(args.config))
    engine, kind = open_engine_for(args, cfg)
    run = Path(args.run_dir) if args.run_dir else None

    def checkpoint_path(_: str, step: int) -> str | None:  # `name@step` not loaded yet: read from the run
        if run is None:
            return None
        path = storage.checkpoint_dir(run, step)
        return str(path) if storage.is_complete(path) else None

    served = ServedModels(args.name, engine, checkpoint_path=checkpoint_path)
    served.add_base(args.base_model, engine)
    app = create_app(served, api_key=args.api_key, adapter_control=True, replica_id=args.replica,
                     engine_kind=kind, base_model=args.base_model)
    return app, engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model", required=True, help="base model name or path (the trainer's)")
    p.add_argument("--name", required=True, help="the served model's name (the trainable model's)")
    p.add_argument("--replica", required=True, help="this replica's id (the x-artrl-replica header)")
    p.add_argument("--config", default="{}", help="the model's InternalModelConfig as JSON")
    p.add_argument("--run-dir", default=None, help="run directory: `name@step` loads its checkpoint on demand")
    p.add_argument("--engine", default="auto", choices=("auto", "builtin", "vllm", "scripted"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (reported on the ready line)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route")
    p.add_argument("--memory-planned", action="store_true",
                   help="the memory plan of this replica's device was checked for all its replicas at once (the "
                        "control plane does): no check of this one alone")
    p.add_argument("--token-time-ms", type=float, default=10.0, help="scripted engine: time per token")
    p.add_argument("--reply-tokens", type=int, default=16, help="scripted engine: tokens per answer")


def serve(args: argparse.Namespace, *, ready_line: bool = True) -> int:
    """Serve until standard input closes or SIGTERM; returns the exit status."""
    from ..serve.http.background import start_server

    app, engine = build_app(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = start_server(app, host=args.host, port=args.port)
    if ready_line:
        on_parent_end(stop.set, "artrl-replica-stdin")
        print(READY_PREFIX + json.dumps({"port": server.port}), flush=True)
    log.info("replica %s serving %r on %s", args.replica, args.name, server.base_url)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
        server.stop(timeout=10.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m artrl.replicas.process", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[replica {args.replica}] %(levelname)s %(name)s: %(message)s")
    cfg = json.loads(args.config)
    if cfg.get("device") in (None, "cpu"):
        import torch

        torch.set_num_threads(cfg.get("inference_cpu_threads") or 1)  # one process per replica: cores are shared
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
