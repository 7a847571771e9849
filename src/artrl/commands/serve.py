"""`artrl serve`: the OpenAI-compatible server alone, for a base model and optional LoRA checkpoint.

    artrl serve --model artrl/tiny
    artrl serve --model Qwen/Qwen3-0.6B --checkpoint .art/demo/models/agent-001 --name agent-001

`--checkpoint` takes a checkpoint directory (with an adapter) or a run directory
(its latest complete checkpoint is used; older ones are served as `name@step`).
The server binds to 127.0.0.1; any other `--host` needs `--api-key`.

    artrl serve --replica --model Qwen/Qwen3-0.6B --name agent-001 --host 0.0.0.0 --api-key KEY

serves as an inference replica of a training run on another machine (its
`inference_endpoints`): the same server with the control routes of
serve/http/control_routes.py, through which that run loads every checkpoint here.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


def _adapter_and_run(checkpoint: str | None) -> tuple[Path | None, Path | None]:
    from ..run import storage

    if checkpoint is None:
        return None, None
    path = Path(checkpoint)
    if storage.is_complete(path):
        return path, path.parent.parent
    latest = storage.latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path} is neither a complete checkpoint nor a run directory with one")
    return storage.checkpoint_dir(path, latest), path


def build_app(args: Any) -> Any:
    from ..chat.format import end_of_turn_ids
    from ..serve.http.background import is_loopback
    from ..serve.engines.factory import open_engine, resolve_engine_kind
    from ..serve.http.served_models import ServedModels
    from ..serve.http.server import create_app
    from ..models.loading import load_base_model, load_generation_config, load_model, load_vision
    from ..models.resolved import resolve_base_model
    from ..models.tokenizer import load_tokenizer
    from ..models.vision import is_vision_model
    from ..config.model import InternalModelConfig
    from ..run import storage

    if not is_loopback(args.host) and not args.api_key:
        raise ConfigError(f"--host {args.host} is not a loopback address; set --api-key so that only clients "
                          "holding it can use the model")
    cfg = InternalModelConfig(device=args.device, trust_remote_code=args.trust_remote_code,
                              inference_max_batch_size=args.max_batch_size, inference_engine=args.engine)
    resolved = resolve_base_model(args.model, cfg)  # once: what the loader, the tokenizer and the engine read
    cfg = resolved.cfg
    on_disk = not resolved.random
    vision_model = on_disk and is_vision_model(resolved.config)
    kind = resolve_engine_kind(cfg.inference_engine, resolved.device.type, weights_on_disk=on_disk,
                               vision=vision_model)
    adapter, run = _adapter_and_run(args.checkpoint)
    if kind == "builtin":
        if args.replica and adapter is None:  # a peft model: the checkpoints it is sent load as its adapters
            model, tok = load_model(resolved)
        else:
            model, tok = load_base_model(resolved)
        if adapter is not None:
            from peft import PeftModel

            from ..models.lora_dtype import adapters_in_base_dtype

            model = PeftModel.from_pretrained(model, str(adapter))  # a peft model: set_live_weights adds versions
            adapters_in_base_dtype(model)
        ends = end_of_turn_ids(tok, model)
    else:
        model, tok = None, load_tokenizer(resolved.source, cfg, path=resolved.path)
        ends = end_of_turn_ids(tok, load_generation_config(resolved))
    vision = load_vision(resolved, tok, model.config, cfg) if vision_model else None
    engine = open_engine(kind, tokenizer=tok, end_ids=ends, cfg=cfg, model=model,
                         base_model_path=resolved.path if on_disk else None, vision=vision)
    if adapter is not None:
        engine.set_live_weights(str(adapter), int(adapter.name) if adapter.name.isdigit() else 0)
        log.info("serving adapter %s", adapter)
    name = args.name or (run.name if run is not None else args.model.replace("/", "-"))

    def checkpoint_path(_: str, step: int) -> str | None:
        if run is None:
            return None
        p = storage.checkpoint_dir(run, step)
        return str(p) if storage.is_complete(p) else None

    bounds = {k: v for k, v in (("body_timeout", args.body_timeout), ("body_deadline", args.body_deadline))
              if v is not None}  # else create_app's defaults
    served = ServedModels(name, engine, checkpoint_path=checkpoint_path)
    if args.replica:  # an inference replica of a training run elsewhere (replicas/, docs/distributed.md)
        served.add_base(args.model, engine)
        bounds.update(adapter_control=True, replica_id=args.replica_id or f"{socket.gethostname()}:{args.port}",
                      engine_kind=kind, base_model=args.model)
    app = create_app(served, api_key=args.api_key, unknown_fields=args.unknown_fields, **bounds)
    return app, name


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default="artrl/tiny", help="base model name or path (default: artrl/tiny)")
    p.add_argument("--checkpoint", default=None, help="checkpoint or run directory with a LoRA adapter")
    p.add_argument("--name", default=None, help="model name clients use (default: run or model name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    p.add_argument("--max-batch-size", type=int, default=32, help="sequences per generation batch")
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from the checkpoint")
    p.add_argument("--body-timeout", type=float, default=None,
                   help="seconds a request body may pause between two parts (408 after; default 30)")
    p.add_argument("--body-deadline", type=float, default=None,
                   help="seconds a whole request body has from the request head (408 after; default 60)")
    p.add_argument("--unknown-fields", choices=("refuse", "warn"), default="refuse",
                   help="a request field its route does not take: refuse (400 naming it, as OpenAI's and "
                        "Anthropic's APIs answer) or warn (served, with a bounded warning; default refuse)")
    p.add_argument("--engine", choices=("auto", "builtin", "vllm"), default="auto",
                   help="inference engine (default: auto = vLLM when installed and on a GPU, else built-in)")
    p.add_argument("--replica", action="store_true",
                   help="serve as an inference replica of a training run elsewhere (its inference_endpoints): adds "
                        "the routes that load checkpoints and set the live weights; --name must be the model's name")
    p.add_argument("--replica-id", default=None,
                   help="with --replica: the id in every response's x-artrl-replica header (default: host:port)")


def main(args: Any) -> int:
    import uvicorn

    app, name = build_app(args)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
