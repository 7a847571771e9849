"""`art.dev.EngineArgs`: ART's vLLM engine arguments, as a TypedDict (a plain dict at run time).

artrl's default inference engine is its own transformers decode loop
(serve/transformers_engine.py), so most vLLM arguments have nothing to
configure: they are accepted with one notice each (dev/model.py says which
keys map onto artrl's settings: `max_num_seqs`, `max_model_len`,
`trust_remote_code`). Any key is accepted at run time, as in ART.
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
