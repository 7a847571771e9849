"""`art.dev.OpenAIServerConfig` / `ServerArgs`: ART's settings of the OpenAI-compatible server.

ART starts a vLLM server per model and configures it with these dicts
(`model.register(backend, _openai_client_config=...)`). artrl's LocalBackend runs
one server for all its models; `LocalBackend._prepare_backend_for_training`
reads `server_args.host`, `port` and `api_key` before that server starts and
notices every other key once (notices.py). `get_openai_server_config` builds the
dict ART builds (names served: the base model under its own name, checkpoints
as `name@step`), as data; artrl's server does not read `engine_args` from it.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from typing_extensions import TypedDict

from .engine import EngineArgs


class ServerArgs(TypedDict, total=False):
    """Arguments of ART's vLLM OpenAI server; `host`, `port`, `api_key` apply here, any key is accepted."""

    host: str | None
    port: int
    api_key: str | None
    uvicorn_log_level: Literal["debug", "info", "warning", "error", "critical", "trace"]
    lora_modules: list[str] | None
    return_tokens_as_token_ids: bool
    enable_auto_tool_choice: bool
    tool_call_parser: str | None
    chat_template: str | None


class OpenAIServerConfig(TypedDict, total=False):
    log_file: str
    server_args: ServerArgs
    engine_args: EngineArgs


def get_openai_server_config(model_name: str, base_model: str, log_file: str, lora_path: str | None = None,
                             config: OpenAIServerConfig | None = None) -> OpenAIServerConfig:
    """ART's server config for a model: defaults, then `config`'s server and engine args on top."""
    config = config or OpenAIServerConfig()
    lora_modules = None
    if lora_path:
        step = int(os.path.basename(os.path.normpath(lora_path)))
        lora_modules = [f'{{"name": "{model_name}@{step}", "path": "{lora_path}"}}']
    server_args: dict[str, Any] = {"api_key": "default", "lora_modules": lora_modules,
                                   "return_tokens_as_token_ids": True, "enable_auto_tool_choice": True,
                                   "tool_call_parser": "hermes", **config.get("server_args", {})}
    engine_args: dict[str, Any] = {"model": base_model, "served_model_name": base_model if lora_path else model_name,
                                   "generation_config": "vllm", **config.get("engine_args", {})}
    result: dict[str, Any] = {"log_file": config.get("log_file", log_file), "server_args": server_args,
                              "engine_args": engine_args}
    return OpenAIServerConfig(**result)  # type: ignore[typeddict-item]
