"""Where a judge model lives: ART's `provider/model` strings and litellm parameters -> an OpenAI client.

ART calls its judge through litellm. We call any OpenAI-compatible endpoint
with the `openai` client, and read ART's spellings:

* `"openai/o4-mini"`, `"anthropic/claude-sonnet-4-5"`, `"openrouter/openai/gpt-4.1"`,
  ...: the provider's OpenAI-compatible API (`PROVIDERS` below), its key from
  the provider's usual environment variable (`OPENAI_API_KEY`, ...).
* `extra_litellm_params={"api_base": url, "api_key": key}` (or `base_url`):
  that endpoint, e.g. artrl's own server (`judge_model=model.get_inference_name()`
  or `"hosted_vllm/<served name>"`, `api_base=model.inference_base_url`).
  With an `api_base`, a provider prefix (`openai/`, `hosted_vllm/`, ...) is
  dropped from the served name, as litellm does; any other name is sent as written.
* A bare name with no `api_base` is inferred like litellm (`gpt-*`, `o1/o3/o4*`
  -> openai; `claude-*` -> anthropic; `gemini-*` -> gemini), else refused.

Other `extra_litellm_params` are OpenAI request fields (temperature,
max_tokens, ...) and pass through; `num_retries` sets the client's retries;
litellm-only options that mean nothing here are accepted with one notice.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)

PROVIDERS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    # provider: (OpenAI-compatible base URL, environment variables holding the key)
    "openai": ("https://api.openai.com/v1", ("OPENAI_API_KEY",)),
    "anthropic": ("https://api.anthropic.com/v1/", ("ANTHROPIC_API_KEY",)),
    "gemini": ("https://generativelanguage.googleapis.com/v1beta/openai/", ("GEMINI_API_KEY", "GOOGLE_API_KEY")),
    "openrouter": ("https://openrouter.ai/api/v1", ("OPENROUTER_API_KEY",)),
    "groq": ("https://api.groq.com/openai/v1", ("GROQ_API_KEY",)),
    "together_ai": ("https://api.together.xyz/v1", ("TOGETHERAI_API_KEY", "TOGETHER_API_KEY")),
    "deepseek": ("https://api.deepseek.com/v1", ("DEEPSEEK_API_KEY",)),
    "mistral": ("https://api.mistral.ai/v1", ("MISTRAL_API_KEY",)),
    "fireworks_ai": ("https://api.fireworks.ai/inference/v1", ("FIREWORKS_AI_API_KEY", "FIREWORKS_API_KEY")),
    "xai": ("https://api.x.ai/v1", ("XAI_API_KEY",)),
    "cerebras": ("https://api.cerebras.ai/v1", ("CEREBRAS_API_KEY",)),
    "ollama": ("http://localhost:11434/v1", ()),
    "ollama_chat": ("http://localhost:11434/v1", ()),
    "hosted_vllm": (None, ("HOSTED_VLLM_API_KEY",)),  # needs api_base
}
_INFERRED = (("gpt-", "openai"), ("chatgpt-", "openai"), ("o1", "openai"), ("o3", "openai"), ("o4", "openai"),
             ("claude-", "anthropic"), ("gemini-", "gemini"))
REQUEST_FIELDS = frozenset({
    "temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "stop", "reasoning_effort",
    "frequency_penalty", "presence_penalty", "logit_bias", "user", "metadata", "service_tier", "extra_body",
    "extra_headers", "extra_query", "response_format", "top_logprobs", "logprobs", "store", "verbosity"})
"""extra_litellm_params that are OpenAI chat-completion request fields (passed through)."""
IGNORED_LITELLM = frozenset({"caching", "drop_params", "mock_response", "fallbacks", "api_version",
                             "input_cost_per_token", "output_cost_per_token", "litellm_logging_obj"})
_noticed: set[str] = set()


@dataclass
class JudgeEndpoint:
    """Where and how to call the judge."""

    model: str
    base_url: str
    api_key: str
    provider: str | None
    request: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None
    max_retries: int | None = None

    def client(self) -> Any:
        from openai import AsyncOpenAI

        kwargs: dict[str, Any] = {}
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        if self.max_retries is not None:
            kwargs["max_retries"] = self.max_retries
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


def _split(judge_model: str) -> tuple[str | None, str]:
    head, sep, rest = judge_model.partition("/")
    if sep and head.strip().lower() in (*PROVIDERS, "openai_compatible"):
        return head.strip().lower(), rest
    return None, judge_model


def resolve(judge_model: str, extra_litellm_params: dict[str, Any] | None = None) -> JudgeEndpoint:
    """The endpoint for ART's (`judge_model`, `extra_litellm_params`); ConfigError says what is missing."""
    if not judge_model or not isinstance(judge_model, str):
        raise ConfigError(f"judge_model={judge_model!r}; name the judge, e.g. 'openai/o4-mini'")
    params = dict(extra_litellm_params or {})
    api_base = params.pop("api_base", None) or params.pop("base_url", None)
    api_key = params.pop("api_key", None)
    timeout = params.pop("timeout", None)
    retries = params.pop("num_retries", None)
    forced = params.pop("custom_llm_provider", None)
    request: dict[str, Any] = {}
    for key in list(params):
        value = params.pop(key)
        if key in REQUEST_FIELDS:
            request[key] = value
        elif key in IGNORED_LITELLM:
            if key not in _noticed:
                _noticed.add(key)
                log.warning("RULER: extra_litellm_params[%r] is a litellm option with no effect here", key)
        else:
            raise ConfigError(f"extra_litellm_params[{key!r}] is not an OpenAI request field nor a litellm option "
                              f"this judge understands; accepted: api_base/base_url, api_key, timeout, num_retries, "
                              f"custom_llm_provider, {sorted(REQUEST_FIELDS)}")
    provider, model = _split(judge_model)
    if forced:
        provider, model = str(forced).lower(), judge_model if provider is None else model
    if api_base:  # the provider prefix (openai/, hosted_vllm/, ...) only said how to talk to it
        return JudgeEndpoint(model=model, base_url=str(api_base),
                             api_key=api_key or _env_key(provider) or "none", provider=provider, request=request,
                             timeout=timeout, max_retries=retries)
    if provider is None:
        provider = next((p for prefix, p in _INFERRED if judge_model.startswith(prefix)), None)
        if provider is None:
            raise ConfigError(f"judge_model {judge_model!r} names no provider; write 'provider/model' (e.g. "
                              f"'openai/o4-mini'; providers: {sorted(PROVIDERS)}) or pass "
                              "extra_litellm_params={'api_base': <OpenAI-compatible URL>}")
    if provider not in PROVIDERS:
        raise ConfigError(f"judge provider {provider!r} is not known; known: {sorted(PROVIDERS)}, or pass "
                          "extra_litellm_params={'api_base': ...}")
    base_url, env = PROVIDERS[provider]
    if provider == "openai":
        base_url = os.environ.get("OPENAI_BASE_URL") or base_url
    if base_url is None:
        raise ConfigError(f"judge_model {judge_model!r}: provider {provider!r} needs "
                          "extra_litellm_params={'api_base': <its URL>}")
    key = api_key or _env_key(provider)
    if key is None and env:
        raise ConfigError(f"judge_model {judge_model!r} calls {base_url} but none of {list(env)} is set; set it, "
                          "or pass extra_litellm_params={'api_key': ...}")
    return JudgeEndpoint(model=model, base_url=base_url, api_key=key or "none", provider=provider, request=request,
                         timeout=timeout, max_retries=retries)


def _env_key(provider: str | None) -> str | None:
    for name in PROVIDERS.get(provider or "", (None, ()))[1]:
        if os.environ.get(name):
            return os.environ[name]
    return None
