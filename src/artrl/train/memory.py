"""Device memory: how many tokens a micro-batch may hold, when to checkpoint, what an OOM leaves behind.

On CUDA, when a call sets neither `per_device_train_batch_size` nor
`max_tokens_per_microbatch`, the token budget of a micro-batch follows the free
memory (`torch.cuda.mem_get_info`, plus what torch's allocator holds unused; within the process's cap when
`torch.cuda.set_per_process_memory_fraction` set one):

    budget = (free * MEMORY_FRACTION - head) / bytes_per_token

where `bytes_per_token` is an estimate from the model config of the
activations a token keeps for backward (every decoder layer's, or with
activation checkpointing one layer input per layer plus one layer recomputed at
a time) and `head` the LM-head chunk (chunk x vocab in float32, a few times).
The estimate errs high: on the Qwen3-0.6B shape it says 2.3 MB per token
without checkpointing, where a measured peak gave 1.8 MB.

With `gradient_checkpointing=None` (the default) checkpointing is on for a call
only when its largest micro-batch would not fit without it (on a CPU, against the
host's available memory; micro-batches there stay as configured); the budget is
never below the call's longest sequence, so what is trained never depends on
the memory (a too-long trajectory follows `on_too_long` against the model's
and the user's limits only).

A CUDA out-of-memory error in the middle of a call (`is_out_of_memory`) puts
the adapter weights, the optimizer state, the step count and the trainer's RNG
state back as they were at the start of the call (`CallState`), which is the
last checkpoint's state, and ends the call with `TrainOutOfMemoryError`.

The functions here take values (a plan, a budget, the config) and return a decision or an error; the trainer
(train/trainer.py: `Trainer.memory_budget`, `Trainer.call_memory`, `CallState`) applies them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import TrainOutOfMemoryError

if TYPE_CHECKING:
    from ..preprocess.plan import BatchPlan

log = logging.getLogger(__name__)

MEMORY_FRACTION = 0.85  # of the free memory a micro-batch may plan to use (fragmentation, workspaces)
BUDGET_MULTIPLE = 256  # token budgets are rounded down to this


@dataclass(frozen=True)
class MemoryBudget:
    """Token budgets of one micro-batch on a device: without and with activation checkpointing."""

    tokens: int  # without checkpointing
    tokens_checkpointed: int
    free_bytes: int  # what the budgets were computed from
    tokens_offloaded: int | None = None  # checkpointing with the layers' inputs in host memory (CUDA); None: no such

    def choose(self, longest: int, checkpointing: bool | None) -> tuple[int, bool]:
        """(token budget, checkpointing on) for a call whose longest sequence has `longest` tokens."""
        on = checkpointing if checkpointing is not None else longest > self.tokens
        budget = self.tokens_checkpointed if on else self.tokens
        return max(budget, longest), on


    @property
    def most_tokens(self) -> int:
        """The longest micro-batch any setting fits."""
        return max(self.tokens, self.tokens_checkpointed, self.tokens_offloaded or 0)


def bytes_per_token(config: Any, dtype: torch.dtype, checkpointing: bool, offload: bool = False,
                    fused: bool = False) -> int:
    """Activation bytes one token keeps on the device for backward (models/memory_plan.py's estimate, for a model
    config; `fused`: Liger's kernels are in the model)."""
    from ..models.memory_plan import ModelShape, bytes_per_token as per_token

    return per_token(ModelShape.of(config), torch.finfo(dtype).bits // 8, checkpointing, offload, fused)


def head_bytes(config: Any, chunk_size: int) -> int:
    """The LM head's working set for one chunk (models/memory_plan.py)."""
    from ..models.memory_plan import head_bytes as head

    from ..models.structure import text_config

    return head(int(text_config(config).vocab_size), chunk_size)


def free_bytes(device: torch.device) -> int:
    """Free device memory, counting what torch's caching allocator reserved but does not use; on a CPU the host's
    available memory."""
    from ..models.memory_plan import cuda_free_and_cap, host_available_bytes

    if device.type != "cuda":
        return host_available_bytes()
    free, cap = cuda_free_and_cap(device)
    allocated = torch.cuda.memory_allocated(device)
    unused = int(free + torch.cuda.memory_reserved(device) - allocated)
    return unused if cap is None else max(0, min(unused, cap - allocated))


def budget_for(config: Any, dtype: torch.dtype, chunk_size: int, free: int, *, offload: bool = False,
               fused: bool = False) -> MemoryBudget:
    """The token budgets that `free` bytes allow (at least one `BUDGET_MULTIPLE`); `offload`: also the budget with
    the checkpointed layer inputs in host memory (a CUDA device); `fused`: Liger's kernels are in the model."""
    usable = free * MEMORY_FRACTION - head_bytes(config, chunk_size)

    def tokens(checkpointing: bool, offloaded: bool = False) -> int:
        n = int(usable // bytes_per_token(config, dtype, checkpointing, offloaded, fused))
        return max(BUDGET_MULTIPLE, n // BUDGET_MULTIPLE * BUDGET_MULTIPLE)

    return MemoryBudget(tokens(False), tokens(True), int(free), tokens(True, True) if offload else None)


def checkpointing_on(model: Any) -> bool:
    """Whether transformers' activation checkpointing is on in `model` (named is_activation_checkpointing since
    transformers 5.x, is_gradient_checkpointing before)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def set_checkpointing(model: Any, on: bool) -> None:
    """Turn transformers' activation checkpointing of `model`'s layers on or off (non-reentrant), under its
    current name (activation_checkpointing_* since transformers 5.x) or its older one."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()


def _largest(plan: "BatchPlan") -> int:
    return max((mb.tokens for step in plan.steps for mb in step.micro_batches), default=0)


def refuse_too_long(plan: "BatchPlan", budget: MemoryBudget | None, cfg: Any, device_type: str) -> None:
    """A TrainTooLongError (before the call trains anything) when the plan's largest micro-batch fits the free memory
    under no setting the call may choose (checkpointing as configured; offload on CUDA), naming the length that
    would fit; a warning instead with `check_memory=False`. The per-token figures err high (models/memory_plan.py),
    so what is refused would not have fit."""
    from ..errors import TrainTooLongError

    if budget is None:
        return
    largest = _largest(plan)
    more = ""
    if cfg.gradient_checkpointing is False:
        fit, under = budget.tokens, "without activation checkpointing (gradient_checkpointing=False)"
        more = f", or leave gradient_checkpointing at None (with it, {budget.tokens_checkpointed} tokens fit)"
    elif cfg.offload_activations is not False and budget.tokens_offloaded is not None:
        fit, under = budget.tokens_offloaded, "with activation checkpointing and its inputs offloaded to host memory"
    else:
        fit, under = budget.tokens_checkpointed, "with activation checkpointing"
    if largest <= fit:
        return
    rows = plan.max_rows_per_micro_batch
    message = (f"this train call's largest micro-batch holds {largest} tokens ({rows} row{'s' if rows > 1 else ''}), "
               f"and {fit} fit the {budget.free_bytes / 1e9:.1f} GB free on this {device_type} device "
               f"{under} (the memory plan, models/memory_plan.py: activations linear in length). Nothing was "
               f"trained. To fit, train on sequences of at most {fit} tokens (InternalModelConfig(max_length={fit}), "
               f"with TrainConfig(on_too_long='truncate') or the default 'drop'), one row per micro-batch "
               f"(per_device_train_batch_size=1), or a lower logprob_chunk_size{more}; the plan errs high, and "
               f"check_memory=False in the model's InternalModelConfig runs the call anyway.")
    if not cfg.check_memory:
        log.warning("%s (check_memory=False: running it anyway)", message)
        return
    raise TrainTooLongError(message, tokens=largest, fit=fit)


def needs_offload(plan: "BatchPlan", budget: MemoryBudget | None, notes: Callable[..., None]) -> bool:
    """On CUDA, whether the plan's largest micro-batch would not fit with checkpointing alone but does with its
    inputs in host memory (`budget.tokens_offloaded` is None elsewhere). `notes(key, message, *args)` says so
    (the trainer's `memory_notes`)."""
    if budget is None or budget.tokens_offloaded is None:
        return False
    largest = _largest(plan)
    on = largest > budget.tokens_checkpointed
    if on:
        notes("offload", "activation offloading on: largest micro-batch %d tokens, %d fit with "
                             "checkpointing alone, %d with offloading (%.1f GB free)", largest,
              budget.tokens_checkpointed, budget.tokens_offloaded, budget.free_bytes / 1e9)
    return on


def needs_checkpointing(plan: "BatchPlan", budget: MemoryBudget | None, device_type: str,
                        notes: Callable[..., None]) -> bool:
    """Whether the plan's largest micro-batch would not fit the free memory (the host's, on a CPU) without activation
    checkpointing; `notes` says so where it matters (the trainer's `memory_notes`)."""
    if budget is None:
        return False
    largest = _largest(plan)
    on = largest > budget.tokens
    if not on and device_type == "cpu":
        return False  # the usual case on a CPU: said nothing before, says nothing now
    notes("checkpointing", "activation checkpointing %s: largest micro-batch %d tokens, %d fit without it "
          "(%.1f GB free)", "on" if on else "off", largest, budget.tokens, budget.free_bytes / 1e9)
    return on


# ---------------------------------------------------------------------------------------------- out of memory

def is_out_of_memory(e: BaseException) -> bool:
    """A CUDA (or other accelerator) out-of-memory error, as torch raises it."""
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if isinstance(e, oom):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def out_of_memory_error(plan: "BatchPlan", e: BaseException, model: Any, device: torch.device,
                        logprob_chunk_size: int) -> TrainOutOfMemoryError:
    """The error that ends a call which ran out of device memory (`model`, the trainer's, on `device`): what it ran,
    and what to lower."""
    largest = max((mb.tokens for step in plan.steps for mb in step.micro_batches), default=0)
    rows = plan.max_rows_per_micro_batch
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    checkpointing = checkpointing_on(model)
    where = str(device)
    if device.type == "cuda":
        where += f" ({torch.cuda.memory_allocated(device) / 1e9:.1f} GB allocated now)"
    advice = ("lower max_tokens_per_microbatch (or per_device_train_batch_size when no token budget is set), "
              "or row_length / max_row_length")
    if not checkpointing:
        advice += ", or set gradient_checkpointing=True in the model's InternalModelConfig"
    advice += f"; logprob_chunk_size={logprob_chunk_size} can go lower too"
    return TrainOutOfMemoryError(
        f"the train call ran out of memory on {where} with micro-batches of up to {rows} rows and {largest} "
        f"token slots (activation checkpointing {'on' if checkpointing else 'off'}): {str(e).splitlines()[0][:200]}. "
        f"The adapter and optimizer were put back as they were before the call: the last checkpoint, the "
        f"history and the served model are unchanged. To fit, {advice}.")
