"""What a base model is, decided once: `resolve_base_model(name, cfg)` -> `ResolvedBaseModel`.

A `base_model` name says little by itself: is it built in, a random shape, a directory, a hub id? Does the hub
answer, or does a cached snapshot load instead? Which device, which dtype, are its weights quantised, and (on a
CPU, where the memory plan decides) would full precision fit? Each of those questions is asked here, once per
process, and the answers travel together: the loader, the tokenizer, the image processor and the engine read
them instead of asking again from the name.

    name -> check_model_source   (the name loads at all; the cached snapshot when the hub does not answer)
         -> resolve_name         (the directory or hub id its files load from)
         -> the transformers config, read once (a random shape's built in memory)
         -> device, settle_quantization (the memory plan on a CPU), resolve_quantization, dtype

`LocalBackend` resolves a model once at `register` and hands the description to the training session; a
loader given only a name (`load_model(name, cfg)`, a benchmark, a test) resolves it itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config.model import InternalModelConfig
from ..errors import ConfigError
from .memory_plan import GB, plan_for
from .quantization import Quantization, is_own_model, resolve_quantization
from .shapes import RANDOM_SHAPES, random_config
from .source import check_model_source, read_config, resolve_name

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: InternalModelConfig) -> torch.device:
    if cfg.device:
        dev = torch.device(cfg.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={cfg.device!r} but CUDA is not available; use device='cpu' or None.")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(cfg: InternalModelConfig, device: torch.device, quantization: Quantization | None = None) -> torch.dtype:
    """The dtype of the weights that are not quantised, and the compute dtype of those that are."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or quantization is not None else torch.float32
    return _DTYPES[cfg.dtype]


def settle_quantization(base_model: str, cfg: InternalModelConfig, device: torch.device, *,
                        config: Any = None) -> InternalModelConfig:
    """`cfg` with its default base weights made explicit where the memory plan decides them: a Hugging Face
    checkpoint on a CPU loads in full precision when the plan says that fits, else in 4-bit (said at INFO, with
    the figures); everything else is `cfg` itself (models/quantization.py, the table). A session settles once,
    before its trainer, its engine and any worker or replica load, so all of them hold the same weights."""
    if cfg.load_in_4bit is not None or cfg.load_in_8bit or device.type != "cpu" or is_own_model(base_model):
        return cfg
    full = plan_for(base_model, cfg.model_copy(update={"load_in_4bit": False}), device, config=config)
    if full.fits():
        log.debug("%s on a CPU: full precision fits (%s)", base_model, full.line())
        return cfg.model_copy(update={"load_in_4bit": False})
    log.info("%s on a CPU: full precision would need %.1f GB at its peak and %.1f GB is available, so it loads in "
             "4-bit (slower on a CPU; set load_in_4bit=False to refuse, or True to say so)", base_model,
             full.peak / GB, (full.available or 0) / GB)
    return cfg.model_copy(update={"load_in_4bit": True})


@dataclass(frozen=True)
class ResolvedBaseModel:
    """A `base_model` name resolved once (module docstring): where its files are, what it is, how it loads here."""

    name: str  # as the user wrote it: the run's base_model, the key its checkpoints are saved under
    source: str  # what loads: the name, or its cached snapshot directory when the hub did not answer
    path: str  # the directory or hub id its files load from (a random shape: the tiny model's, for the tokenizer)
    random: bool  # a random-init shape, built in memory (models/random_init.py): no weights on disk
    device: torch.device
    cfg: InternalModelConfig  # the model config with the base weights' precision settled
    quantization: Quantization | None  # "4bit", "8bit" or None (full precision)
    dtype: torch.dtype  # of the weights not quantised, and the compute dtype of those that are
    config: Any = field(compare=False, repr=False)  # the transformers config, read once


def resolve_base_model(base_model: str, cfg: InternalModelConfig | None = None, *,
                       shape_overrides: dict[str, Any] | None = None) -> ResolvedBaseModel:
    """`base_model` under `cfg`, resolved once (module docstring); a ConfigError with the remedy when it cannot
    load. `shape_overrides`: config fields that replace a random shape's (e.g. `num_hidden_layers` for a benchmark
    cut to a few layers, every other dimension kept); refused for any other model."""
    cfg = cfg or InternalModelConfig()
    random = base_model in RANDOM_SHAPES
    if shape_overrides and not random:
        raise ConfigError(f"shape overrides {sorted(shape_overrides)} apply to random shapes ({sorted(RANDOM_SHAPES)}), "
                          f"not to {base_model!r}, whose weights fix its shape.")
    # in seconds, with the way out (never the network for artrl's names); a cached model whose hub does not answer
    # loads from its cached directory, so nothing after this waits on the network
    source = check_model_source(base_model) or base_model
    path = resolve_name(source)
    config = random_config(base_model, **(shape_overrides or {})) if random else read_config(path, base_model, cfg)
    device = resolve_device(cfg)
    cfg = settle_quantization(source, cfg, device, config=config)
    quantization = resolve_quantization(cfg, source, device.type)
    return ResolvedBaseModel(name=base_model, source=source, path=path, random=random, device=device, cfg=cfg,
                             quantization=quantization, dtype=resolve_dtype(cfg, device, quantization),
                             config=config)
