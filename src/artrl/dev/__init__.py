"""ART's `art.dev` names: advanced per-call options and the model-level configuration.

* `TrainConfig`, `TrainSFTConfig` (dev/train.py): extra per-call options as a dict.
* `InternalModelConfig`, `InitArgs`, `TrainerArgs`, `TinkerArgs`, ... (dev/model.py) and
  `EngineArgs` (dev/engine.py): ART's nested model config, mapped onto artrl's flat
  `artrl.InternalModelConfig` (the table is in dev/model.py).
* `LoRAConfig` (dev/model.py; what each key does: lora_config.py); `PeftArgs`, removed in ART 0.5.23, raises
  its migration message `PEFT_ARGS_MIGRATION_MESSAGE`.
* `OpenAIServerConfig`, `ServerArgs`, `get_openai_server_config` (dev/openai_server.py).
* `is_dedicated_mode`, `validate_dedicated_config` (dev/validate.py).
"""

from .engine import EngineArgs
from .model import (PEFT_ARGS_MIGRATION_MESSAGE, InitArgs, InternalModelConfig, LoRAConfig, PeftArgs, TinkerArgs,
                    TinkerNativeArgs, TinkerTrainingClientArgs, TrainerArgs, flatten_internal_config)
from .openai_server import OpenAIServerConfig, ServerArgs, get_openai_server_config
from .train import TrainConfig, TrainSFTConfig
from .validate import is_dedicated_mode, validate_dedicated_config

__all__ = [
    "EngineArgs", "InitArgs", "InternalModelConfig", "LoRAConfig", "OpenAIServerConfig", "PEFT_ARGS_MIGRATION_MESSAGE",
    "PeftArgs", "ServerArgs", "TinkerArgs", "TinkerNativeArgs", "TinkerTrainingClientArgs", "TrainConfig",
    "TrainSFTConfig", "TrainerArgs",
    "flatten_internal_config", "get_openai_server_config", "is_dedicated_mode", "validate_dedicated_config",
]
