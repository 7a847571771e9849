"""Loading a base model and its LoRA adapter: transformers + peft (+ bitsandbytes), nothing hand-rolled.

Every caller that needs a model (the training session, the training workers, `artrl serve`, the
benchmarks) loads it here. A `base_model` is one of (models/source.py checks which, in seconds):

* a built-in ("artrl/tiny", "artrl/bench-100m"): built offline once (tiny.py), loaded from its directory;
* a random-init shape ("random:qwen3-14b"...; models/shapes.py): built in memory one tensor at a
  time (models/random_init.py), with the tiny tokenizer;
* a local directory or a Hugging Face id: `AutoModelForCausalLM.from_pretrained`, which loads and,
  when quantised, quantises one checkpoint shard at a time; a vision-language model (Qwen2.5-VL,
  models/vision.py; "artrl/tiny-vl") through `AutoModelForImageTextToText`, its vision tower on SDPA
  attention, with its image processor (`load_vision`).

Defaults: float32 on CPU and bfloat16 on GPU, except quantised base weights, which compute in
bfloat16 everywhere (as Unsloth); 4-bit NF4 weights for a Hugging Face checkpoint on a GPU (ART's
default), on a CPU only where float32 would not fit (`settle_quantization`), and full precision for
artrl's own models (models/quantization.py); tree attention ("artrl_tree":
one SDPA call per packed node, models/tree_attention.py) on CPU, flex_attention (block-sparse) on
GPU; LoRA r=8, alpha=16 on the attention and MLP projections of Llama/Qwen/Mistral-style models,
peft's "all-linear" elsewhere. A vision-language model's adapter goes on its language model only (a list
of module names, ART's or the default, is matched there; the vision tower, whose MLP has the same names,
stays frozen); a regex string in `target_modules` is peft's to match anywhere. `trust_remote_code` stays
off unless asked for.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

import torch

from ..errors import ConfigError
from ..runtime.heap import release_free_memory
from ..runtime.progress import hf_bars_off_in_a_log
from ..config.model import InternalModelConfig
from .memory_plan import check_model_fits
from .moe import EXPERTS_IMPLEMENTATION, is_moe, lora_targets
from .quantization import bnb_config, check_quantized_layers, prepare_quantized, unquantized_modules, weight_numel
# resolve_device, resolve_dtype, settle_quantization: decided in resolved.py, also read from here
from .resolved import ResolvedBaseModel, resolve_base_model, resolve_device, resolve_dtype, settle_quantization
from .shapes import RANDOM_SHAPES
from .source import resolve_name
from .tokenizer import load_tokenizer
from .structure import MAX_LENGTH_KEYS, PROJECTIONS, config_max_length, text_config
from .vision import VisionInputs, is_vision_model

log = logging.getLogger(__name__)

def model_attn(cfg: InternalModelConfig, device: torch.device, config: Any) -> str | dict[str, str]:
    """The attention a model loads with: `resolve_attn`'s, and for a vision-language model SDPA in its vision
    tower (the packed-row implementations are for the language model's rows)."""
    attn = resolve_attn(cfg, device)
    if is_vision_model(config):
        return {"": attn, "text_config": attn, "vision_config": "sdpa"}
    return attn


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
    found = [p for p in PROJECTIONS if p in names]
    return found if len(found) >= 4 else "all-linear"


def language_model_targets(names: list[str]) -> str:
    """peft's regex for modules named `names` inside a vision-language model's language model only."""
    return rf".*\.language_model\..*\.({'|'.join(map(re.escape, names))})"



def load_generation_config(base_model: str | ResolvedBaseModel, cfg: InternalModelConfig | None = None) -> Any:
    """The model's saved `GenerationConfig` (its eos ids matter: `chat_format.end_of_turn_ids`), or None when it
    has none; for a caller that serves the model without loading its weights here (vLLM)."""
    from transformers import GenerationConfig

    if isinstance(base_model, ResolvedBaseModel):
        random, path, cfg = base_model.random, base_model.path, base_model.cfg
    else:
        random, path = base_model in RANDOM_SHAPES, None
    if random:
        return None
    cfg = cfg or InternalModelConfig()
    try:
        return GenerationConfig.from_pretrained(path or resolve_name(base_model),
                                                trust_remote_code=cfg.trust_remote_code)
    except OSError:
        return None


def _resolved(base_model: str | ResolvedBaseModel, cfg: InternalModelConfig | None,
              shape_overrides: dict[str, Any] | None = None) -> ResolvedBaseModel:
    """`base_model` as resolved by the caller, or resolved here from its name (models/resolved.py)."""
    if isinstance(base_model, ResolvedBaseModel):
        if shape_overrides:
            raise ConfigError("shape overrides are part of a model's resolution: pass them to resolve_base_model")
        return base_model
    return resolve_base_model(base_model, cfg, shape_overrides=shape_overrides)


def load_base_model(base_model: str | ResolvedBaseModel, cfg: InternalModelConfig | None = None, *,
                    shape_overrides: dict[str, Any] | None = None, memory_planned: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) without an adapter, on the resolved device, dtype and quantisation.

    `base_model`: a name (resolved here under `cfg`) or a `ResolvedBaseModel` (its own settled config is used).
    `shape_overrides`: config fields that replace a random shape's (models/resolved.py). `memory_planned`: the
    caller planned this load with others that share the device (an inference replica: `check_replicas_fit`), so
    it is not checked again on its own."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    resolved = _resolved(base_model, cfg, shape_overrides)
    base_model, cfg, config, device = resolved.source, resolved.cfg, resolved.config, resolved.device
    quantization, dtype, path = resolved.quantization, resolved.dtype, resolved.path
    tok = load_tokenizer(base_model, cfg, path=path)
    # memory is planned before anything loads: a model that cannot fit is refused now, with settings that fit
    if not memory_planned:
        check_model_fits(base_model, cfg, device, config=config)
    what = f"{quantization} weights computing in {dtype}" if quantization else str(dtype)
    if resolved.random:
        from .random_init import build_random_model

        if is_moe(config):
            config._experts_implementation = EXPERTS_IMPLEMENTATION
        model = build_random_model(config, device=device, dtype=dtype,
                                   attn_implementation=resolve_attn(cfg, device), seed=cfg.seed,
                                   quantization=quantization)
        if quantization is not None:
            check_quantized_layers(model, quantization)
        release_free_memory()  # the build's temporaries, left as holes in the C heap (artrl/runtime/heap.py)
        log.info("built random-init %s (%s, %s, %.1fM parameters)", base_model, device, what, parameter_count(model) / 1e6)
        return model, tok
    extra: dict[str, Any] = {}
    if is_moe(config):  # experts per routed token (models/moe.py)
        extra["experts_implementation"] = EXPERTS_IMPLEMENTATION
    if quantization is not None:
        # quantised shard by shard while loading, straight onto the device
        extra.update(quantization_config=bnb_config(quantization, dtype, unquantized_modules(config)),
                     device_map={"": device})
    auto = AutoModelForImageTextToText if is_vision_model(config) else AutoModelForCausalLM
    try:
        with warnings.catch_warnings(), hf_bars_off_in_a_log():
            warnings.filterwarnings("ignore", message=".*inputs will be cast from.*")
            model = auto.from_pretrained(
                path, dtype=dtype, attn_implementation=model_attn(cfg, device, config),
                trust_remote_code=cfg.trust_remote_code, **extra)
    except OSError as e:
        raise ConfigError(f"could not load model {base_model!r} ({path}): {e}. artrl downloads nothing at "
                          "run time unless the Hugging Face cache or network provides it.") from None
    if quantization is None:
        model.to(device)
    else:
        check_quantized_layers(model, quantization)
        prepare_quantized(model, quantization)
    release_free_memory()  # the load's and the quantiser's temporaries
    log.info("loaded %s (%s, %s, %s attention, %.1fM parameters)", base_model, device, what,
             model.config._attn_implementation, parameter_count(model) / 1e6)
    return model, tok


def parameter_count(model: Any) -> int:
    """Parameters of `model`, a 4-bit weight counted as the weights it stands for (bitsandbytes packs two in
    a byte)."""
    return sum(weight_numel(p) for p in model.parameters())


def add_lora(model: Any, cfg: InternalModelConfig | None = None) -> Any:
    """Wrap `model` in a peft LoRA adapter named 'default' (deterministic init from cfg.seed)."""
    from peft import LoraConfig, get_peft_model

    from .lora_dtype import adapters_in_base_dtype

    cfg = cfg or InternalModelConfig()
    targets: list[str] | str | None = cfg.target_modules
    parameters = None
    if is_moe(model.config):  # the experts are fused parameters: peft's target_parameters (models/moe.py)
        targets, parameters = lora_targets(model, targets)
        if parameters and cfg.lora_dropout:
            raise ConfigError(f"lora_dropout={cfg.lora_dropout} with LoRA on the experts of {type(model).__name__}: "
                              "peft cannot apply dropout to an adapter on a parameter. Set lora_dropout=0, or leave "
                              "'experts' out of target_modules.")
        if parameters and cfg.layers_to_transform is not None:
            raise ConfigError(f"layers_to_transform={cfg.layers_to_transform} with LoRA on the experts of "
                              f"{type(model).__name__}: the experts' adapters are on fused parameters, which peft "
                              "does not restrict to some layers. Leave 'experts' out of target_modules, or adapt "
                              "every layer (layers_to_transform=None).")
    if targets is None:
        targets = default_target_modules(model)
    if is_vision_model(model.config) and isinstance(targets, list):
        targets = language_model_targets(targets)
    try:
        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=targets, target_parameters=parameters, task_type="CAUSAL_LM", bias="none",
                          use_rslora=cfg.use_rslora, init_lora_weights=cfg.init_lora_weights,
                          layers_to_transform=cfg.layers_to_transform, layers_pattern=cfg.layers_pattern)
    except ValueError as e:  # peft's own checks, e.g. layers_to_transform with a regex of target modules
        raise ConfigError(f"peft refuses the LoRA settings (target_modules={targets!r}, layers_to_transform="
                          f"{cfg.layers_to_transform!r}, layers_pattern={cfg.layers_pattern!r}): {e}") from e
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(cfg.seed)
        peft_model = get_peft_model(model, lora)
    adapters_in_base_dtype(peft_model)  # no float32 copy of each adapted projection's input (models/lora_dtype.py)
    if cfg.gradient_checkpointing:
        peft_model.get_base_model().gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        peft_model.enable_input_require_grads()
    return peft_model


def load_model(base_model: str | ResolvedBaseModel, cfg: InternalModelConfig | None = None, *,
               shape_overrides: dict[str, Any] | None = None, memory_planned: bool = False) -> tuple[Any, Any]:
    """(peft model with a fresh LoRA adapter, tokenizer); the arguments: see `load_base_model`."""
    resolved = _resolved(base_model, cfg, shape_overrides)
    if resolved.device.type == "cpu":
        from ..runtime.host_allocator import fix_mmap_threshold

        fix_mmap_threshold()  # before the weights load: a heap fragmented by loading would stay (host_allocator.py)
    model, tok = load_base_model(resolved, memory_planned=memory_planned)
    return add_lora(model, resolved.cfg), tok


def load_vision(base_model: str | ResolvedBaseModel, tokenizer: Any, config: Any,
                cfg: InternalModelConfig | None = None) -> VisionInputs | None:
    """A vision-language model's image processing under `cfg`'s media policy (None for a text-only model)."""
    from ..chat.images import MediaPolicy

    if not is_vision_model(config):
        return None
    cfg = cfg or InternalModelConfig()
    path = base_model.path if isinstance(base_model, ResolvedBaseModel) else resolve_name(base_model)
    return VisionInputs.of_model(path, tokenizer, config, MediaPolicy.of(cfg),
                                 trust_remote_code=cfg.trust_remote_code)


def model_max_length(model: Any, cfg: InternalModelConfig | None = None) -> int:
    """`max_length` when set, capped by what the model's config says; else the config's (ART 0.5.23 reads the same
    keys); a ConfigError asking for max_length when the config says nothing."""
    cfg = cfg or InternalModelConfig()
    n = config_max_length(model.config)
    if n is None:
        if cfg.max_length:
            return cfg.max_length
        raise ConfigError(f"the config of this {type(model).__name__} gives no maximum sequence length (none of "
                          f"{list(MAX_LENGTH_KEYS)}); set InternalModelConfig(max_length=...) "
                          "(ART: init_args.max_seq_length).")
    return min(n, cfg.max_length) if cfg.max_length else n
