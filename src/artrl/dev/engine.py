"""`art.dev.EngineArgs`: ART's vLLM engine arguments, as a TypedDict (a plain dict at run time).

They reach vLLM when it serves the model (`inference_engine="vllm"`, serve/engines/vllm_args.py
says which ones artrl sets itself). With the built-in engine (serve/engines/transformers_engine.py)
most have nothing to configure: dev/model.py maps `max_num_seqs`, `max_model_len` and
`trust_remote_code` onto artrl's settings, and each other key is noticed once when that
engine opens. Any key is accepted at run time, as in ART.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import TypedDict


class EngineArgs(TypedDict, total=False):
    """vLLM engine arguments (the commonly set ones are typed; any other key is accepted too)."""

    model: str
    served_model_name: str | list[str] | None
    dtype: str
    seed: int
    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float
    tensor_parallel_size: int
    enforce_eager: bool | None
    enable_prefix_caching: bool | None
    enable_sleep_mode: bool
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    trust_remote_code: bool
    generation_config: str | None
    allowed_local_media_path: str
    override_generation_config: dict[str, Any] | None
    disable_log_stats: bool
    disable_log_requests: bool
    enable_log_requests: bool
