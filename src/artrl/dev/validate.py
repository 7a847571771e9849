"""ART's checks of a dedicated-GPU configuration (`art.dev.is_dedicated_mode`, `validate_dedicated_config`).

ART's "dedicated mode" trains on `trainer_gpu_ids` and serves with vLLM on
`inference_gpu_ids`. artrl honours both keys (training workers on the trainer
GPUs, the server on the inference GPU: docs/distributed.md); ART scripts also
call these checks on their own configs, so they behave as ART's: pure functions
over the nested dict that raise ValueError on an inconsistent configuration.
One difference: ART 0.5.17 refuses more than one inference GPU ("Multi-GPU inference not
yet supported") and ART 0.5.23 reads several as one tensor-parallel engine (with
engine_args.tensor_parallel_size equal to their number); artrl starts one inference replica
per GPU, so several are accepted, and with tensor_parallel_size above 1 refused by name
(docs/art-compatibility.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

def tensor_parallel_over_replicas(inference_gpu_ids: Any, engine_args: Any) -> str | None:
    """Why several inference GPUs with `engine_args.tensor_parallel_size` above 1 are refused, or None: ART 0.5.23
    reads them as one engine over the GPUs, and artrl serves them as one replica each, which cannot honour it (the
    config's check and dev.validate_dedicated_config's, one rule)."""
    gpus = list(inference_gpu_ids or [])
    parallel = (engine_args or {}).get("tensor_parallel_size")
    if len(gpus) <= 1 or parallel in (None, 1):
        return None
    return (f"inference_gpu_ids={gpus} with engine_args.tensor_parallel_size={parallel}: artrl serves several "
            "inference GPUs as one replica each (docs/distributed.md), not as one tensor-parallel engine over them; "
            "drop tensor_parallel_size for replicas, or give one inference GPU per replica.")


def is_dedicated_mode(config: Mapping[str, Any]) -> bool:
    """True when the config names both trainer and inference GPUs."""
    return "trainer_gpu_ids" in config and "inference_gpu_ids" in config


def validate_dedicated_config(config: Mapping[str, Any]) -> None:
    """Raise ValueError if the GPU split of `config` is inconsistent; nothing when neither key is set."""
    trainer, inference = config.get("trainer_gpu_ids"), config.get("inference_gpu_ids")
    if ("trainer_gpu_ids" in config) != ("inference_gpu_ids" in config):
        raise ValueError("trainer_gpu_ids and inference_gpu_ids must both be set or both unset "
                         f"(got trainer_gpu_ids={trainer!r}, inference_gpu_ids={inference!r})")
    if "trainer_gpu_ids" not in config:
        return
    if not trainer:
        raise ValueError("trainer_gpu_ids must be non-empty")
    if not inference:
        raise ValueError("inference_gpu_ids must be non-empty")
    shared = sorted(set(trainer) & set(inference))
    if shared:
        raise ValueError(f"trainer_gpu_ids and inference_gpu_ids must not overlap (both hold {shared})")
    if trainer[0] != 0:
        raise ValueError(f"trainer_gpu_ids={list(trainer)} must start at GPU 0 (training runs in this process)")
    if list(trainer) != list(range(len(trainer))):
        raise ValueError(f"trainer_gpu_ids={list(trainer)} must be contiguous starting from 0, e.g. [0, 1]")
    tensor_parallel = tensor_parallel_over_replicas(inference, config.get("engine_args"))
    if tensor_parallel:
        raise ValueError(tensor_parallel)
    if (config.get("init_args") or {}).get("fast_inference"):
        raise ValueError("fast_inference is incompatible with dedicated mode (init_args.fast_inference=True; "
                         "inference runs in its own process there); remove it")
    if (config.get("engine_args") or {}).get("enable_sleep_mode"):
        raise ValueError("enable_sleep_mode is incompatible with dedicated mode (engine_args.enable_sleep_mode=True; "
                         "inference has its own GPU, nothing needs to sleep); remove it")
