"""The adapter's optimizer, under ART's names (`trainer_args.optim`: their table is artrl/config/optimizers.py), and
its state in one portable form.

    optim                        optimizer                                      state a weight
    "adamw_torch" (default)      torch.optim.AdamW (fused on CUDA)              8 bytes (two float32 moments)
    "adamw_torch_fused"          torch.optim.AdamW(fused=True)                  8 bytes
    "adamw_8bit", "adamw_bnb_8bit"  bitsandbytes AdamW8bit                      2 bytes (blockwise 8-bit moments)
    "paged_adamw_8bit"           bitsandbytes PagedAdamW8bit (ART's default)    2 bytes, paged to the host on CUDA
    "paged_adamw_32bit"          bitsandbytes PagedAdamW                        8 bytes, paged

bitsandbytes keeps a tensor's moments in 8 bits only from `MIN_8BIT_SIZE` elements on (its
default, the one Hugging Face's Trainer uses): smaller tensors keep float32 moments.

A checkpoint keeps the optimizer's own `state_dict()` (exact: a resumed run steps exactly as
the uninterrupted one) and the name of the optimizer that wrote it. `load_state` reads it into
an optimizer of another kind by way of the moments (`moments` / `set_moments`: float32
`exp_avg`, `exp_avg_sq` and the step count per parameter), so a run may change `optim` between
two sessions. That detour re-quantises 8-bit moments, which is exact but for blocks whose
largest moment is negative: the 8-bit map's most negative code is -0.993, so such a block's
scale comes back 0.7% smaller (distributed/shard_optimizer.py measures what that costs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..runtime.notices import notice_once
from ..config.optimizers import DEFAULT_OPTIM, OptimSpec, optim_spec

log = logging.getLogger(__name__)

MIN_8BIT_SIZE = 4096
BLOCKSIZE = 256  # bitsandbytes' block of 8-bit optimizer state


def build_optimizer(params: list[torch.nn.Parameter], spec: OptimSpec, *, fused: bool,
                    settings: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """(optimizer over `params`, param-group entries to set again each step). `fused`: torch's fused AdamW
    kernel (what fused_optimizer / the device chose; 'adamw_torch_fused' asks for it whatever the device).
    `settings`: betas, eps, weight_decay to start with (a trainer sets its call's before every step)."""
    settings = dict(settings or {})
    if not spec.bnb:
        use_fused = True if spec.fused else fused
        impl = {"fused": True, "foreach": False} if use_fused else {}
        return torch.optim.AdamW(params, lr=1e-5, **settings, **impl), impl
    on_cuda = any(p.device.type == "cuda" for p in params)
    if spec.paged and not on_cuda:
        notice_once(f"optim.{spec.name}.cpu", f"optim={spec.name!r} on a CPU: bitsandbytes pages optimizer states "
                    "between GPU and host only on CUDA; here they are ordinary host memory (the same updates).")
    return bnb_class(spec, paged=spec.paged and on_cuda)(params, lr=1e-5, min_8bit_size=MIN_8BIT_SIZE,
                                                         **settings), {}


def bnb_class(spec: OptimSpec, paged: bool | None = None) -> type:
    """bitsandbytes' optimizer class of a bitsandbytes `spec` (`paged`: None follows the spec)."""
    from ..models.quantization import import_bitsandbytes

    optim = import_bitsandbytes().optim
    paged = spec.paged if paged is None else paged
    return {(8, False): optim.AdamW8bit, (8, True): optim.PagedAdamW8bit, (32, False): optim.AdamW32bit,
            (32, True): optim.PagedAdamW32bit}[(spec.bits, paged)]


def is_bnb(optimizer: Any) -> bool:
    """A bitsandbytes optimizer (or a subclass of one: distributed/shard_optimizer.py)."""
    return any(c.__module__.startswith("bitsandbytes") for c in type(optimizer).__mro__)


# --------------------------------------------------------------------------------------------- portable moments

def _dequantized(state: dict[str, Any], key: str) -> torch.Tensor:
    """A bitsandbytes moment ("state1" / "state2") as float32."""
    value = state[key]
    if value.dtype != torch.uint8:
        return value.float()
    from ..models.quantization import import_bitsandbytes

    functional = import_bitsandbytes().functional
    n = key[-1]
    return functional.dequantize_blockwise(value, absmax=state[f"absmax{n}"], code=state[f"qmap{n}"],
                                           blocksize=BLOCKSIZE).float()


def moments(optimizer: Any) -> dict[int, dict[str, Any]]:
    """Per parameter index (the order of the optimizer's param groups): float32 `exp_avg`, `exp_avg_sq`, and
    `step` (an int); parameters without state are left out."""
    out: dict[int, dict[str, Any]] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p) or {}
            if state:
                if is_bnb(optimizer):
                    out[index] = {"exp_avg": _dequantized(state, "state1"), "exp_avg_sq": _dequantized(state, "state2"),
                                  "step": int(state["step"])}
                else:
                    out[index] = {"exp_avg": state["exp_avg"].float(), "exp_avg_sq": state["exp_avg_sq"].float(),
                                  "step": int(float(state["step"]))}
            index += 1
    return out


@torch.no_grad()
def set_moments(optimizer: Any, saved: dict[int, dict[str, Any]]) -> None:
    """Give `optimizer` the moments `moments()` returned (of the same parameters, any optimizer kind)."""
    optimizer.state.clear()
    index = 0
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, p in enumerate(group["params"]):
            entry = saved.get(index)
            index += 1
            if entry is None:
                continue
            m, v = entry["exp_avg"].to(p.device), entry["exp_avg_sq"].to(p.device)
            if tuple(m.shape) != tuple(p.shape):
                raise ValueError(f"saved moments of shape {tuple(m.shape)} for a parameter of shape {tuple(p.shape)}")
            if not is_bnb(optimizer):
                step = torch.tensor(float(entry["step"]), dtype=torch.float32,
                                    device=p.device if group.get("fused") else "cpu")
                optimizer.state[p] = {"step": step, "exp_avg": m.to(p.dtype).clone(),
                                      "exp_avg_sq": v.to(p.dtype).clone()}
                continue
            optimizer.init_state(group, p, gindex, pindex)
            state = optimizer.state[p]
            state["step"] = int(entry["step"])
            for n, value in (("1", m), ("2", v)):
                if state[f"state{n}"].dtype == torch.uint8:
                    from ..models.quantization import import_bitsandbytes

                    q, qs = import_bitsandbytes().functional.quantize_blockwise(
                        value.contiguous(), code=state[f"qmap{n}"], blocksize=BLOCKSIZE)
                    state[f"state{n}"].copy_(q.view_as(state[f"state{n}"]))
                    state[f"absmax{n}"].copy_(qs.absmax)
                else:
                    state[f"state{n}"].copy_(value)


def load_state(optimizer: Any, saved: dict[str, Any], saved_optim: str | None, spec: OptimSpec) -> None:
    """Load a checkpoint's optimizer state (`saved`, written by an optimizer named `saved_optim`; None: torch's
    AdamW, which wrote every checkpoint before the name was recorded) into `optimizer` (built from `spec`)."""
    written_by = optim_spec(saved_optim or DEFAULT_OPTIM)
    if written_by.bnb == spec.bnb and written_by.bits == spec.bits:
        optimizer.load_state_dict(saved)
        return
    # another kind: read the state into an optimizer of the kind that wrote it, then hand over the moments
    params = [p for group in optimizer.param_groups for p in group["params"]]
    other, _ = build_optimizer([torch.nn.Parameter(p.detach().clone(), requires_grad=True) for p in params],
                               written_by, fused=False)
    other.load_state_dict(saved)
    set_moments(optimizer, moments(other))
    log.info("the checkpoint's optimizer state was written by optim=%r; converted for optim=%r", saved_optim,
             spec.name)
