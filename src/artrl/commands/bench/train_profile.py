"""`bench train --profile`: one train call under torch.profiler, reduced to a small table.

The trainer marks its parts with `record_function` ranges (free when nothing
profiles): `artrl/attention_mask`, `artrl/forward` (the decoder), `artrl/logprobs`
(the LM head on trainable slots), `artrl/loss`, `artrl/backward` and
`artrl/optimizer` (clipping and the AdamW step). While profiling, forward hooks add
`artrl/lora` around each LoRA A/B matmul (forward only: the backward of a LoRA
matmul is not told apart from the rest of the backward).

The table: the top ops by self time on the device (CUDA kernels; on a CPU the
ops' self CPU time), each with its share; the time per range (device time of the
kernels launched inside it on CUDA, CPU time on a CPU); and on CUDA how long the
device sat idle between its first and last kernel (time the host kept it
waiting: launches, syncs, Python).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

RANGES = ("artrl/attention_mask", "artrl/forward", "artrl/logprobs", "artrl/loss", "artrl/backward",
          "artrl/optimizer")
LORA_RANGE = "artrl/lora"
TOP = 15


@contextlib.contextmanager
def lora_ranges(model: torch.nn.Module) -> Iterator[int]:
    """Mark every LoRA A/B module's forward with the `artrl/lora` range while the block runs."""
    handles = []

    def enter(module: torch.nn.Module, args: Any) -> None:
        rf = record_function(LORA_RANGE)
        rf.__enter__()
        module._artrl_range = rf  # type: ignore[attr-defined]

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        rf = getattr(module, "_artrl_range", None)
        if rf is not None:
            rf.__exit__(None, None, None)
            module._artrl_range = None  # type: ignore[attr-defined]

    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B"):
            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield len(handles) // 2
    finally:
        for h in handles:
            h.remove()


def _device_time(evt: Any, attr: str) -> float:
    """An event's device time in microseconds (torch names it device_* now, cuda_* before)."""
    value = getattr(evt, attr.replace("cuda", "device"), None)
    if value is None:
        value = getattr(evt, attr, 0.0)
    return float(value or 0.0)


def _idle(prof: Any) -> dict[str, float] | None:
    """Device busy time (union of kernel intervals) and idle time between the first and last kernel, in ms."""
    try:
        events = prof.profiler.kineto_results.events()
        spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events
                       if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0)
    except Exception:  # a torch without these accessors: leave the figure out rather than guess it
        return None
    if not spans:
        return None
    busy, end = 0, spans[0][0]  # the union of the kernel intervals
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    window = end - spans[0][0]  # first kernel's start to last kernel's end
    return {"device_window_ms": round(window / 1e6, 2), "device_busy_ms": round(busy / 1e6, 2),
            "device_idle_ms": round((window - busy) / 1e6, 2),
            "device_idle_share": round((window - busy) / window, 4) if window else 0.0}


def summarize(prof: Any, cuda: bool, wall_s: float) -> dict[str, Any]:
    """The compact table of one profiled call."""
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    averages = list(prof.key_averages())
    self_time = {a.key: (_device_time(a, key) if cuda else float(a.self_cpu_time_total)) for a in averages}
    ranges = set(RANGES) | {LORA_RANGE}
    ops = [(k, v) for k, v in self_time.items() if k not in ranges and v > 0]
    total = sum(v for _, v in ops)
    calls = {a.key: a.count for a in averages}
    top = [{"name": k[:120], "self_ms": round(v / 1e3, 3), "share": round(v / total, 4) if total else 0.0,
            "calls": calls[k]} for k, v in sorted(ops, key=lambda kv: -kv[1])[:TOP]]
    by_range: dict[str, float] = dict.fromkeys([*RANGES, LORA_RANGE], 0.0)
    for evt in prof.events():
        if evt.name in by_range and evt.device_type == torch.autograd.DeviceType.CPU:
            by_range[evt.name] += _device_time(evt, "cuda_time_total") if cuda else float(evt.cpu_time_total)
    top_level = sum(by_range[r] for r in RANGES)
    groups = {name.split("/", 1)[1]: {"ms": round(us / 1e3, 3), "share": round(us / total, 4) if total else 0.0}
              for name, us in by_range.items()}
    # on CUDA the backward runs on autograd's device thread, outside the ranges of the calling thread
    groups["unattributed"] = {"ms": round(max(total - top_level, 0.0) / 1e3, 3),
                              "share": round(max(total - top_level, 0.0) / total, 4) if total else 0.0}
    out: dict[str, Any] = {
        "time_basis": "device (CUDA kernels)" if cuda else "host CPU",
        "wall_s": round(wall_s, 3), "total_self_ms": round(total / 1e3, 3),
        "top_ops": top, "groups": groups,
        "groups_note": "lora is forward only and lies within forward; on CUDA backward kernels run on autograd's "
                       "thread and count as unattributed",
    }
    if cuda:
        idle = _idle(prof)
        if idle is not None:
            out["host_gaps"] = idle
    return out


def profile_call(run: Callable[[], Any], model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """Run `run()` (one train call) under torch.profiler and return its table."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with lora_ranges(model) as n_lora, profile(activities=activities, record_shapes=False) as prof:
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    table = summarize(prof, cuda, wall)
    table["lora_modules"] = n_lora
    return table
