"""Where a base model comes from, checked before anything loads it.

A `base_model` is one of four things, tried in this order:

* a built-in model ("artrl/tiny", "artrl/bench-100m"): built offline, never fetched;
* a random-init shape ("random:qwen3-0.6b" ... "random:qwen3-32b", models/shapes.py): built in memory, never
  fetched;
* a local directory;
* a Hugging Face model id, loaded from the local Hugging Face cache or the hub.

`check_model_source` answers in seconds, with the way out, where transformers would
answer after about 50 s of retries against the hub with a message of its own:

* a name in artrl's namespace ("artrl/..." or "random:...") that is not built in
  is refused at once and never reaches the network (a typo, usually);
* otherwise one request to the hub (no retries) says whether the model exists and
  can be reached; a missing, gated or unreachable model is refused with the
  built-in names, `HF_HUB_OFFLINE=1` and the local-path route in the message. A hub
  that answers with another error (rate limit, server error) is logged and the load
  goes on, so a passing hub hiccup never blocks a model that would load;
* a hub id in the local Hugging Face cache loads as transformers loads it (asking
  the hub for updates) when the hub answers, and from the cached snapshot directory
  when it does not: measured without this, a cached model on a machine without
  network took 165 s of retries (transformers' and peft's) to load. With
  `HF_HUB_OFFLINE=1` nothing asks the hub at all.

`check_model_source` returns the local directory to load instead of the name in that
last case (None otherwise); the name stays the run's `base_model`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)

#: Names in artrl's own namespace: never a Hugging Face id, never looked up on the network.
OWN_PREFIXES = ("artrl/", "random:")
_PROBE_TIMEOUT_S = 10.0

def known_models() -> list[str]:
    """The built-in models and random-init shapes, sorted."""
    from .tiny import BUILTIN_MODELS
    from .shapes import RANDOM_SHAPES

    return sorted([*BUILTIN_MODELS, *RANDOM_SHAPES])


def _ways_out(base_model: str) -> str:
    return (f"Ways out: a built-in model (no download) {known_models()}; a local model directory (a path "
            "holding config.json, the weights and the tokenizer, e.g. one saved with save_pretrained or "
            "`hf download`); or, for a Hugging Face id, its files in the local cache (download "
            f"them once with network, e.g. `hf download {base_model}`, then set HF_HUB_OFFLINE=1 "
            "to load them without asking the hub). See docs/getting-started.md.")


def check_model_source(base_model: str) -> str | None:
    """Raise ConfigError, fast and with the remedy, if `base_model` cannot be loaded; else the cached snapshot
    directory to load instead of the name when the hub cannot be reached (None: load the name itself).
    See the module docstring."""
    from .tiny import BUILTIN_MODELS
    from .shapes import RANDOM_SHAPES

    if base_model in BUILTIN_MODELS or base_model in RANDOM_SHAPES:
        return None
    if base_model.startswith(OWN_PREFIXES):
        raise ConfigError(f"base model {base_model!r} is not a built-in model; artrl's built-in models are "
                          f"{known_models()} (nothing under 'artrl/' or 'random:' is looked up on the network).")
    path = Path(base_model).expanduser()
    if path.exists():
        return None
    if base_model.startswith(("/", "./", "../", "~")):
        raise ConfigError(f"base model {base_model!r} looks like a local path, but nothing is there. Use an "
                          f"existing model directory, a Hugging Face model id, or one of {known_models()}.")
    return _check_hub_model(base_model)


def _check_hub_model(repo_id: str) -> str | None:
    import huggingface_hub
    from huggingface_hub import constants

    cached = isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str)
    if cached and constants.HF_HUB_OFFLINE:
        return None  # transformers loads it from the cache without asking the hub
    try:
        huggingface_hub.model_info(repo_id, timeout=_PROBE_TIMEOUT_S)
        return None
    except Exception as e:  # noqa: BLE001 -- every failure is sorted below
        if cached:
            snapshot = huggingface_hub.snapshot_download(repo_id, local_files_only=True)
            log.info("the Hugging Face hub did not answer for %s (%s); loading it from the local cache, %s (set "
                     "HF_HUB_OFFLINE=1 to skip asking)", repo_id, type(e).__name__, snapshot)
            return snapshot
        refusal = _refusal(repo_id, e)
        if refusal is not None:
            raise refusal from e
        log.warning("the Hugging Face hub answered %s about %r; loading it anyway", str(e)[:200], repo_id)
        return None


def _refusal(repo_id: str, e: Exception) -> ConfigError | None:
    """The error for a hub id that is not cached and that the hub could not give; None when the hub answered
    with something that says nothing about the model (rate limit, server error): the load then tries."""
    from huggingface_hub import errors as hub_errors

    if isinstance(e, hub_errors.OfflineModeIsEnabled):
        return ConfigError(f"base model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                           f"set, so it cannot be downloaded. {_ways_out(repo_id)}")
    if isinstance(e, hub_errors.GatedRepoError):
        return ConfigError(f"base model {repo_id!r} is gated on the Hugging Face hub: accept its licence on its "
                           "page and log in (`hf auth login` or HF_TOKEN), or use another model. "
                           f"{_ways_out(repo_id)}")
    if isinstance(e, hub_errors.RepositoryNotFoundError):
        return ConfigError(f"base model {repo_id!r} is neither a local directory nor a model on the Hugging Face "
                           "hub (or it is private: log in with `hf auth login` or HF_TOKEN). Check the "
                           f"spelling. {_ways_out(repo_id)}")
    if isinstance(e, hub_errors.HfHubHTTPError):
        return None
    return ConfigError(f"base model {repo_id!r} is not in the local Hugging Face cache and the hub cannot be "
                       f"reached ({type(e).__name__}: {str(e)[:200]}). {_ways_out(repo_id)}")


def resolve_name(base_model: str) -> str:
    from .tiny import BUILTIN_MODELS, TINY_MODEL_NAME, resolve_model_path
    from .shapes import RANDOM_SHAPES

    if base_model in RANDOM_SHAPES:
        return resolve_model_path(TINY_MODEL_NAME)  # random models borrow the tiny tokenizer
    if base_model not in BUILTIN_MODELS and (base_model.startswith(OWN_PREFIXES) or (
            base_model.startswith(("/", "./", "../", "~")) and not Path(base_model).expanduser().exists())):
        check_model_source(base_model)  # raises: not built in, or no such path (never the network)
    return resolve_model_path(base_model)


def load_config(base_model: str, cfg: Any = None) -> Any:
    """The model's transformers config, without its weights (what the memory plan reads); `cfg`: the model's
    InternalModelConfig (its trust_remote_code)."""
    from .shapes import RANDOM_SHAPES, random_config

    if base_model in RANDOM_SHAPES:
        return random_config(base_model)
    return read_config(resolve_name(base_model), base_model, cfg)


def read_config(path: str, base_model: str, cfg: Any = None) -> Any:
    """The transformers config at `path`, already resolved from `base_model` (named in the error)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=bool(getattr(cfg, "trust_remote_code", False)))
    except OSError as e:
        raise ConfigError(f"could not read the config of model {base_model!r} ({path}): {e}") from e
