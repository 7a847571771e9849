"""Loading a causal LM with a LoRA adapter: transformers + peft, nothing hand-rolled.

`load_model("artrl/tiny")` builds (once) and loads the offline tiny model;
any other name is a Hugging Face model id or a local path, loaded with
`AutoModelForCausalLM` (weights must be present locally or reachable).

Defaults: float32 on CPU, bfloat16 on GPU; tree attention ("artrl_tree": one
SDPA call per packed node, train/tree_attention.py) on CPU, flex_attention
(block-sparse) on GPU; LoRA r=8, alpha=16 on
the attention and MLP projections of Llama/Qwen/Mistral-style models, peft's
"all-linear" elsewhere. `trust_remote_code` stays off unless asked for.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..types import InternalModelConfig
from .model_source import OWN_PREFIXES, RANDOM_CONFIGS, check_model_source  # RANDOM_CONFIGS: also read from here

log = logging.getLogger(__name__)

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: InternalModelConfig) -> torch.device:
    if cfg.device:
        dev = torch.device(cfg.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={cfg.device!r} but CUDA is not available; use device='cpu' or None.")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(cfg: InternalModelConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.dtype]


def resolve_attn(cfg: InternalModelConfig, device: torch.device) -> str:
    if cfg.attn_implementation:
        return cfg.attn_implementation
    if device.type == "cuda":
        return "flex_attention"
    from .tree_attention import TREE_ATTENTION, register

    register()
    return TREE_ATTENTION


def default_target_modules(model: torch.nn.Module) -> list[str] | str:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    found = [p for p in _PROJECTIONS if p in names]
    return found if len(found) >= 4 else "all-linear"


def resolve_name(base_model: str) -> str:
    from ..tiny import BUILTIN_MODELS, TINY_MODEL_NAME, resolve_model_path

    if base_model in RANDOM_CONFIGS:
        return resolve_model_path(TINY_MODEL_NAME)  # random models borrow the tiny tokenizer
    if base_model not in BUILTIN_MODELS and (base_model.startswith(OWN_PREFIXES) or (
            base_model.startswith(("/", "./", "../", "~")) and not Path(base_model).expanduser().exists())):
        check_model_source(base_model)  # raises: not built in, or no such path (never the network)
    return resolve_model_path(base_model)


def _random_model(base_model: str, device: torch.device, dtype: torch.dtype, attn: str, seed: int) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**RANDOM_CONFIGS[base_model], max_position_embeddings=40960,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)


def load_tokenizer(base_model: str, cfg: InternalModelConfig | None = None) -> Any:
    from transformers import AutoTokenizer

    cfg = cfg or InternalModelConfig()
    path = resolve_name(base_model)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise ConfigError(f"could not load the tokenizer of {base_model!r} ({path}): {e}") from None
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"the tokenizer of {base_model!r} has no chat template; artrl renders trajectories "
                          "with it. Use an instruct/chat model or set tokenizer.chat_template.")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_generation_config(base_model: str, cfg: InternalModelConfig | None = None) -> Any:
    """The model's saved `GenerationConfig` (its eos ids matter: `chat_format.end_of_turn_ids`), or None when it
    has none; for a caller that serves the model without loading its weights here (vLLM)."""
    from transformers import GenerationConfig

    if base_model in RANDOM_CONFIGS:
        return None
    cfg = cfg or InternalModelConfig()
    try:
        return GenerationConfig.from_pretrained(resolve_name(base_model), trust_remote_code=cfg.trust_remote_code)
    except OSError:
        return None


def load_base_model(base_model: str, cfg: InternalModelConfig | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) without an adapter, on the configured device and dtype."""
    from transformers import AutoModelForCausalLM

    cfg = cfg or InternalModelConfig()
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    path = resolve_name(base_model)
    tok = load_tokenizer(base_model, cfg)
    if base_model in RANDOM_CONFIGS:
        model = _random_model(base_model, device, dtype, resolve_attn(cfg, device), cfg.seed)
        log.info("built random-init %s (%s, %s, %.1fM parameters)", base_model, device, dtype,
                 sum(p.numel() for p in model.parameters()) / 1e6)
        return model, tok
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=resolve_attn(cfg, device),
            trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise ConfigError(f"could not load model {base_model!r} ({path}): {e}. artrl downloads nothing at "
                          "run time unless the Hugging Face cache or network provides it.") from None
    model.to(device)
    log.info("loaded %s (%s, %s, %s attention, %.1fM parameters)", base_model, device, dtype,
             model.config._attn_implementation, sum(p.numel() for p in model.parameters()) / 1e6)
    return model, tok


def add_lora(model: Any, cfg: InternalModelConfig | None = None) -> Any:
    """Wrap `model` in a peft LoRA adapter named 'default' (deterministic init from cfg.seed)."""
    from peft import LoraConfig, get_peft_model

    cfg = cfg or InternalModelConfig()
    targets = cfg.target_modules if cfg.target_modules is not None else default_target_modules(model)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM", bias="none", use_rslora=cfg.use_rslora)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(cfg.seed)
        peft_model = get_peft_model(model, lora)
    if cfg.gradient_checkpointing:
        peft_model.get_base_model().gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        peft_model.enable_input_require_grads()
    return peft_model


def load_model(base_model: str, cfg: InternalModelConfig | None = None) -> tuple[Any, Any]:
    """(peft model with a fresh LoRA adapter, tokenizer)."""
    model, tok = load_base_model(base_model, cfg)
    return add_lora(model, cfg), tok


def model_max_length(model: Any, cfg: InternalModelConfig | None = None) -> int:
    cfg = cfg or InternalModelConfig()
    config = model.config
    n = getattr(config, "max_position_embeddings", None) or 32768
    return min(n, cfg.max_length) if cfg.max_length else n
