"""vLLM's engine arguments for an artrl model: artrl's settings, ART's `engine_args`, and what artrl fixes.

Written without importing vLLM, so the rules are tested where vLLM is not installed. Three
sources, in order of precedence:

1. **What artrl fixes**, because the token record depends on it: `logprobs_mode="raw_logprobs"`
   (logprobs are the log-softmax of the model's logits before temperature and top-p, as the
   trainer computes them), `enable_lora=True` (the live weights are a LoRA adapter),
   `model` / `tokenizer` (the base model's directory). Setting one of these in `engine_args` to
   another value is a `ConfigError`; `served_model_name` and any argument vLLM does not know are
   accepted with a notice (the server names the models; ART's arguments that vLLM dropped).
   `logits_processors` gets artrl's grammar processor (serve/engines/vllm_grammar.py: structured
   outputs) after any given in `engine_args`.
2. **ART's `engine_args`** (`InternalModelConfig.engine_args`): every other vLLM argument, as given;
   `max_num_seqs`, `max_model_len` and `trust_remote_code` come through the artrl fields they set
   (`inference_max_batch_size`, `inference_max_length`, `trust_remote_code`), so that where the two
   disagree the built-in engine and vLLM follow the same one.
3. **artrl's defaults**: `dtype` (float32 on CPU, bfloat16 on GPU, as the trainer), `max_model_len`,
   `seed`, `trust_remote_code`, `max_lora_rank` (the adapter's rank rounded up to a rank vLLM
   supports), `max_loras=4` (live weights, checkpoints and a KL reference in one batch),
   `generation_config="vllm"` (every sampling parameter comes from the request, none from the
   model's generation_config.json), `disable_log_stats=True`; on CPU
   `kv_cache_memory_bytes` = 1 GiB (or `VLLM_CPU_KVCACHE_SPACE` GiB when set), so vLLM does
   not reserve a share of the machine's memory; on a GPU ART's `enable_sleep_mode=True` with
   `gpu_memory_utilization` 0.79 (0.55 without sleep mode), as ART's `get_model_config`.

On CPU, vLLM refuses sleep mode: `enable_sleep_mode=True` there is dropped with a notice.

A mixture-of-experts model (models/moe.py): `enable_mixed_moe_lora_format` (adapters in peft's 3D layout on the
fused experts, each LoRA request marked so) and, where vLLM can (a GPU, `VLLM_USE_V2_MODEL_RUNNER=1`),
`enable_return_routed_experts` (each sampled token's experts, returned as the token record's `routed_experts`).

Quantised base weights (`load_in_4bit`, models/quantization.py): vLLM quantises the same checkpoint in flight
(`quantization="bitsandbytes"`, NF4) on a GPU; its CPU build and 8-bit weights are refused with one clear
ConfigError before vLLM starts (`quantization_arguments`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ...errors import ConfigError
from ...runtime.notices import notice_once

#: Arguments whose value the token record depends on (point 1 of the module docstring).
FIXED = {"logprobs_mode": "raw_logprobs", "enable_lora": True}
#: vLLM's name of artrl's grammar logits processor (serve/engines/vllm_grammar.py, which owns the
#: `SamplingParams.extra_args` key, GRAMMAR_ARG, that hands it a request's grammar: {"grammar": Lark text,
#: "end_ids": [ids]}).
GRAMMAR_PROCESSOR = "artrl.serve.engines.vllm_grammar:GrammarLogitsProcessor"
#: LoRA ranks vLLM 0.32 accepts as `max_lora_rank`.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORAS = 4
CPU_KV_CACHE_GIB = 1
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
GPU_MEMORY_SHARE = {True: 0.79, False: 0.55}  # ART's get_model_config, by enable_sleep_mode


def device_and_dtype(device: str | None, dtype: str, cuda_available: bool,
                     quantized: bool = False) -> tuple[str, str]:
    """(device type, dtype name) vLLM runs with for a model config's `device` and `dtype`: the trainer's rule
    (models/loading.py: cuda when available; "auto" = bfloat16 on a GPU or for quantised weights, float32 on CPU)."""
    device_type = device.split(":")[0] if device else ("cuda" if cuda_available else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device_type == "cuda" or quantized else "float32"
    return device_type, dtype


#: vLLM's switch for a mixture-of-experts model's LoRA adapters on its fused experts (peft's 3D layout, which
#: artrl trains: models/moe.py), and the one that returns the experts each sampled token was routed to (the token
#: record's routing). vLLM returns routing only from its V2 model runner, which needs Triton (a GPU) and
#: VLLM_USE_V2_MODEL_RUNNER=1 in the environment.
MOE_LORA = "enable_mixed_moe_lora_format"
MOE_ROUTING = "enable_return_routed_experts"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def moe_arguments(known: set[str], device_type: str) -> dict[str, Any]:
    """vLLM's arguments for a mixture-of-experts model; ConfigError when it cannot load adapters on fused experts.
    The routing record is asked for where vLLM can return it (a GPU with its V2 runner); elsewhere it is off, said
    once, and the trainer routes those tokens freely (docs/models.md)."""
    if device_type == "cpu":
        raise ConfigError("a mixture-of-experts model with inference_engine='vllm' on a CPU: vLLM's CPU build runs "
                          "a mixture-of-experts model's LoRA adapters through Triton kernels, which it does not have "
                          "(the engine dies at the first request). Use inference_engine='builtin', which serves it "
                          "and records its routing, or vLLM on a GPU.")
    if MOE_LORA not in known:
        raise ConfigError("this vLLM cannot load LoRA adapters on a mixture-of-experts model's fused experts "
                          f"(no {MOE_LORA}): use vLLM 0.32 or newer, inference_engine='builtin', or leave "
                          "'experts' out of target_modules.")
    args = {MOE_LORA: True}
    if MOE_ROUTING in known and os.environ.get(V2_RUNNER_ENV) == "1":
        args[MOE_ROUTING] = True
    else:
        notice_once("vllm.moe_routing", "vLLM returns no routing record for this mixture-of-experts model (it needs "
                    f"vLLM's V2 model runner: set {V2_RUNNER_ENV}=1); training routes its sampled tokens freely "
                    "(train/routing_record_tokens stays 0). The built-in engine records it.")
    return args


def quantization_arguments(quantization: str | None, device_type: str, given: Mapping[str, Any],
                           moe: bool = False) -> dict[str, Any]:
    """vLLM's arguments for the trainer's base weights: 4-bit NF4 -> vLLM's in-flight bitsandbytes quantisation
    (the same NF4 codes from the same checkpoint; vLLM's kernels compute, the train call reports the delta).
    Raises ConfigError where vLLM cannot serve them: its CPU build, 8-bit (vLLM quantises in flight to 4-bit
    only), or a mixture-of-experts model (`moe`), whose experts vLLM's bitsandbytes path quantises (its fused-MoE
    method, which no skip list reaches) while the trainer keeps them in its dtype (models/quantization.py): the
    sampler would hold another model than the trainer."""
    if quantization is None:
        return {}
    way_out = ("use inference_engine='builtin' (it decodes with the trainer's own quantised weights), or set "
               "load_in_4bit=False to serve and train full-precision weights")
    if quantization == "8bit":
        raise ConfigError(f"load_in_8bit=True with inference_engine='vllm': vLLM quantises a checkpoint in flight "
                          f"to 4-bit only, so it cannot serve the trainer's 8-bit weights; {way_out}.")
    if device_type == "cpu":
        raise ConfigError(f"4-bit base weights (load_in_4bit, the default for a Hugging Face model) with "
                          f"inference_engine='vllm' on a CPU: vLLM's CPU build has no bitsandbytes support; "
                          f"{way_out}.")
    if moe:
        raise ConfigError("4-bit base weights (load_in_4bit, the default for a Hugging Face model on a GPU) with "
                          "inference_engine='vllm' on a mixture-of-experts model: vLLM's bitsandbytes path quantises "
                          "the experts to 4-bit, and the trainer keeps them in its dtype (bitsandbytes quantises "
                          "nn.Linear layers only, and transformers fuses the experts into 3-D parameters), so the "
                          f"sampler and the trainer would hold different models; {way_out}.")
    if given.get("quantization") not in (None, "bitsandbytes"):
        raise ConfigError(f"engine_args.quantization={given['quantization']!r} with 4-bit base weights: vLLM must "
                          "serve the trainer's NF4 weights (quantization='bitsandbytes'). Remove it, or set "
                          "load_in_4bit=False.")
    return {"quantization": "bitsandbytes"}


def lora_rank_slot(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of rank `rank`."""
    for slot in LORA_RANKS:
        if slot >= rank:
            return slot
    raise ConfigError(f"lora_rank={rank} is above the largest LoRA rank vLLM serves ({LORA_RANKS[-1]}); "
                      f"lower lora_rank, or use inference_engine='builtin'.")


#: engine_args keys that reach vLLM through the artrl field they set (dev/model.py's MAPPED).
THROUGH_FIELDS = ("max_num_seqs", "max_model_len", "trust_remote_code")


def engine_arguments(*, model_path: str, device_type: str, dtype: str, max_model_len: int | None, lora_rank: int,
                     seed: int, trust_remote_code: bool, max_num_seqs: int | None,
                     engine_args: Mapping[str, Any], known: Iterable[str],
                     quantization: str | None = None, moe: bool = False) -> dict[str, Any]:
    """Keyword arguments of `vllm.AsyncEngineArgs` (see the module docstring).

    `known`: the argument names vLLM's `AsyncEngineArgs` takes; `max_num_seqs`: sequences per batch when
    the model config sets one (None: vLLM's default); `max_model_len` None: the model's own maximum;
    `device_type`: "cpu" or "cuda"; `quantization`: the trainer's base weights ("4bit", "8bit" or None,
    `quantization_arguments`).
    """
    quantized = quantization_arguments(quantization, device_type, engine_args, moe)
    known = set(known)
    experts = moe_arguments(known, device_type) if moe else {}
    given = {key: value for key, value in engine_args.items() if key not in THROUGH_FIELDS}
    for key in ("model", "tokenizer"):
        value = given.pop(key, None)
        if value is not None and str(value) != model_path:
            notice_once(f"vllm.engine_args.{key}", f"engine_args.{key}={value!r:.80} has no effect: vLLM serves the "
                        f"model's base weights from {model_path} (base_model, with the run's adapters on top).")
    if "served_model_name" in given:
        notice_once("vllm.engine_args.served_model_name", f"engine_args.served_model_name="
                    f"{given.pop('served_model_name')!r:.80} has no effect: artrl's server names the models "
                    "(the model's name, name@step and the base model's name).")
    for key, required in FIXED.items():
        if key in given and given[key] != required:
            raise ConfigError(f"engine_args.{key}={given[key]!r} cannot be honoured: artrl needs {key}="
                              f"{required!r} (the token record holds the model's raw logprobs, and the trained "
                              f"weights are served as a LoRA adapter). Remove engine_args.{key}.")
        given.pop(key, None)
    processors = list(given.pop("logits_processors", None) or [])  # vLLM's own list: artrl's is added below
    for key in sorted(set(given) - known):
        notice_once(f"vllm.engine_args.{key}", f"engine_args.{key}={given.pop(key)!r:.80} has no effect: this "
                    "vLLM version has no such engine argument.")
    on_gpu = device_type != "cpu"
    if not on_gpu and given.get("enable_sleep_mode"):
        given.pop("enable_sleep_mode")
        notice_once("vllm.engine_args.enable_sleep_mode.cpu", "engine_args.enable_sleep_mode=True has no effect on "
                    "CPU: vLLM supports sleep mode on GPUs only; on CPU it keeps its own weights while training "
                    "runs.")
    rank = lora_rank_slot(lora_rank)
    if int(given.get("max_lora_rank", rank)) < lora_rank:
        raise ConfigError(f"engine_args.max_lora_rank={given['max_lora_rank']} is below lora_rank={lora_rank}: "
                          f"vLLM could not load the trained adapter. Raise it to at least {rank}, or drop it.")
    args: dict[str, Any] = {
        "dtype": dtype, "seed": seed, "trust_remote_code": trust_remote_code,
        "max_lora_rank": rank, "max_loras": DEFAULT_MAX_LORAS, "generation_config": "vllm",
        "disable_log_stats": True,
    }
    if max_model_len is not None:
        args["max_model_len"] = max_model_len
    if max_num_seqs is not None:
        args["max_num_seqs"] = max_num_seqs
    if on_gpu:
        sleep = bool(given.get("enable_sleep_mode", True))
        args["enable_sleep_mode"] = sleep
        args["gpu_memory_utilization"] = GPU_MEMORY_SHARE[sleep]
    elif "kv_cache_memory_bytes" not in given:
        gib = os.environ.get(CPU_KV_CACHE_ENV) or CPU_KV_CACHE_GIB
        args["kv_cache_memory_bytes"] = int(gib) * 1024**3
    args.update(given)
    args.update(quantized)
    args.update(experts)
    args.update(FIXED)
    args["logits_processors"] = [*(p for p in processors if p != GRAMMAR_PROCESSOR), GRAMMAR_PROCESSOR]
    args.update(model=model_path, tokenizer=model_path)
    return args
