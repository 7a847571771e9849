"""`artrl status`: what artrl can run on this machine, and whether a model fits it.

    artrl status                          devices, engines, extras, the memory plan of artrl/tiny
    artrl status --model Qwen/Qwen3-8B    ... and of that model (its config only: no weights are read)
    artrl status --json                   the same as one JSON object

ART's `art runtime status` says whether its managed vLLM and Megatron runtimes are prepared; artrl has no
runtimes to prepare (the built-in engine needs nothing, vLLM is a pip extra), so this says instead what a
user of artrl needs before a run: the devices (CPU cores and memory, each CUDA device and its free memory),
the inference engines (built-in, vLLM installed or not, and which one `inference_engine="auto"` picks for the
model), the optional libraries installed (the extras of pyproject.toml: 4-bit weights, fused kernels, trackers,
integrations), and the memory plan of `--model` on this machine's device (models/memory_plan.py, the plan
`LocalBackend.register` checks, `artrl bench memory` measures against), with the settings that would fit when
it does not. The model's name is checked the way `register` checks it: never the network for artrl's built-in
names (`artrl/...`, `random:...`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

GB = 1e9
DEFAULT_MODEL = "artrl/tiny"

# what the extras of pyproject.toml bring: (module to find, distribution for its version, extra, what it does)
EXTRAS: tuple[tuple[str, str, str, str], ...] = (
    ("vllm", "vllm", "vllm", "the vLLM inference engine"),
    ("vllm_router", "vllm-router", "replicas", "inference replicas behind a router"),
    ("bitsandbytes", "bitsandbytes", "", "4-bit base weights, 8-bit optimizers"),
    ("liger_kernel", "liger-kernel", "", "fused kernels in the trainer (CUDA)"),
    ("flash_attn", "flash-attn", "", "FlashAttention kernels"),
    ("wandb", "wandb", "wandb", "report_metrics=['wandb']"),
    ("tensorboard", "tensorboard", "tensorboard", "report_metrics=['tensorboard']"),
    ("litellm", "litellm", "litellm", "RULER's judge through litellm"),
    ("langgraph", "langgraph", "langgraph", "artrl.langgraph"),
    ("mcp", "mcp", "mcp", "artrl.mcp"),
)


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"the model whose memory plan to show (default {DEFAULT_MODEL}; a Hugging Face name, a path, "
                        "or one of artrl's built-in names)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, as a run picks)")
    p.add_argument("--load-in-4bit", action="store_true", help="plan with 4-bit base weights")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed(module: str, distribution: str) -> dict[str, Any]:
    """Whether `module` can be imported here (found, not imported) and its distribution's version."""
    found = importlib.util.find_spec(module) is not None
    return {"installed": found, "version": _version(distribution) if found else None}


def devices() -> dict[str, Any]:
    """The CPU (cores this process may use, memory available) and each CUDA device (name, free and total memory)."""
    import torch

    from ..models.memory_plan import host_available_bytes

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out: dict[str, Any] = {"cpu": {"cores": cores, "available_gb": round(host_available_bytes() / GB, 1)},
                           "cuda": [], "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            props = torch.cuda.get_device_properties(i)
            out["cuda"].append({"index": i, "name": props.name, "free_gb": round(free / GB, 1),
                                "total_gb": round(total / GB, 1), "capability": f"{props.major}.{props.minor}"})
    return out


def memory_plan(model: str, device_type: str | None, load_in_4bit: bool) -> dict[str, Any]:
    """The memory plan of `model` with the default InternalModelConfig on this machine's device, and the engine
    `inference_engine="auto"` picks for it; `{"error": ...}` when its config cannot be read."""
    from ..config.model import InternalModelConfig
    from ..errors import ArtrlError
    from ..models.memory_plan import GB as PLAN_GB
    from ..models.memory_plan import alternatives, plan_for
    from ..models.resolved import resolve_device
    from ..models.shapes import is_random
    from ..models.source import check_model_source
    from ..serve.engines.factory import resolve_engine_kind

    fields: dict[str, Any] = {"device": device_type} if device_type else {}
    if load_in_4bit:
        fields["load_in_4bit"] = True
    try:
        cfg = InternalModelConfig(**fields)
        device = resolve_device(cfg)
        check_model_source(model)
        plan = plan_for(model, cfg, device)
        engine = resolve_engine_kind("auto", device.type, weights_on_disk=not is_random(model))
    except (ArtrlError, OSError, ValueError) as e:
        return {"model": model, "error": str(e)}
    out = {"model": model, "device": device.type, "engine": engine, "fits": plan.fits(), "line": plan.line(),
           **plan.as_json()}
    if not plan.fits():
        out["settings_that_fit"] = {what: round(p.peak / PLAN_GB, 1)
                                    for what, p in alternatives(plan.shape, plan.settings, plan.available or 0)}
    return out


def gather(model: str = DEFAULT_MODEL, device_type: str | None = None, load_in_4bit: bool = False) -> dict[str, Any]:
    """Everything `artrl status` says, as one dict."""
    from ..serve.engines.factory import VLLM_INSTALL_HINT

    extras = {dist: {**installed(module, dist), "extra": extra, "for": what} for module, dist, extra, what in EXTRAS}
    return {
        "artrl": _version("artrl"), "python": platform.python_version(),
        "torch": _version("torch"), "transformers": _version("transformers"),
        "devices": devices(),
        "engines": {"builtin": {"installed": True},
                    "vllm": {**{k: extras["vllm"][k] for k in ("installed", "version")},
                             **({} if extras["vllm"]["installed"] else {"install": VLLM_INSTALL_HINT})}},
        "extras": extras,
        "plan": memory_plan(model, device_type, load_in_4bit),
    }


def format_status(status: dict[str, Any]) -> str:
    """The text `artrl status` prints."""
    lines = [f"artrl {status['artrl']} (python {status['python']}, torch {status['torch']}, "
             f"transformers {status['transformers']})", "", "devices:"]
    dev = status["devices"]
    lines.append(f"  cpu: {dev['cpu']['cores']} cores, {dev['cpu']['available_gb']:.1f} GB memory available")
    for gpu in dev["cuda"]:
        lines.append(f"  cuda:{gpu['index']}: {gpu['name']} (compute capability {gpu['capability']}), "
                     f"{gpu['free_gb']:.1f} GB free of {gpu['total_gb']:.1f} GB")
    if not dev["cuda"]:
        lines.append("  cuda: none" + ("" if dev["torch_cuda"] else " (this torch is built without CUDA)"))
    vllm = status["engines"]["vllm"]
    lines += ["", "inference engines:", "  builtin (transformers): available, CPU or GPU",
              f"  vllm: {'installed ' + str(vllm['version']) if vllm['installed'] else 'not installed: ' + vllm['install']}"]
    lines += ["", "optional libraries:"]
    width = max(len(name) for name in status["extras"])
    for name, e in status["extras"].items():
        state = f"{e['version'] or 'installed'}" if e["installed"] else "-"
        extra = f", extra [{e['extra']}]" if e["extra"] else ""
        lines.append(f"  {name:<{width}}  {state:<12} {e['for']}{extra}")
    plan = status["plan"]
    lines += ["", f"model {plan['model']}:"]
    if "error" in plan:
        lines.append(f"  no memory plan: {plan['error']}")
    else:
        lines.append(f"  inference_engine='auto' serves it with: {plan['engine']}")
        lines.append(f"  {plan['line']}")
        lines.append("  fits: yes" if plan["fits"] else "  fits: NO; settings that fit (peak GB): "
                     + (", ".join(f"{what} ({gb})" for what, gb in plan["settings_that_fit"].items()) or "none"))
    return "\n".join(lines)


def main(args: Any) -> int:
    status = gather(args.model, args.device, args.load_in_4bit)
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        print(format_status(status))
    sys.stdout.flush()
    return 1 if "error" in status["plan"] else 0
