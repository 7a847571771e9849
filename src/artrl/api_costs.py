"""Pricing an API call: `TokenPricing` (ART's `art.api_costs.TokenPricing`, USD per million tokens) and
`response_cost`, the USD cost of one response.

A response's cost is taken from the response itself (`usage.cost`, as OpenRouter reports it, or a litellm proxy's
cost header) or from a `TokenPricing` applied to the usage the response reports: OpenAI's (`prompt_tokens`,
`completion_tokens`, cached prompt tokens) or Anthropic's (`input_tokens`, `output_tokens`, cache writes and
reads), as ART prices them. ART's built-in price tables and its `track_api_cost` decorator are not here;
`MetricsBuilder` (metrics.py) records what this computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenPricing:
    """USD per million tokens."""

    prompt_per_million: float
    completion_per_million: float
    cached_prompt_per_million: float | None = None
    cache_creation_per_million: float | None = None
    cache_read_per_million: float | None = None


LITELLM_PROXY_COST_HEADER = "llm_provider-x-litellm-response-cost"


def _field(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None)
        if isinstance(extra, dict):
            value = extra.get(name)
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def response_cost(response: Any, pricing: TokenPricing | None, *, provider: str | None = None) -> float | None:
    """USD cost of a chat completion: `usage.cost` when the provider reports it, else tokens x `pricing`.

    The provider's figure is `usage.cost` (OpenRouter) or a litellm proxy's cost header.
    Usage fields: OpenAI's (`prompt_tokens` of which `prompt_tokens_details.cached_tokens` are cached,
    `completion_tokens`) or Anthropic's (`input_tokens`, `cache_creation_input_tokens`,
    `cache_read_input_tokens`, `output_tokens`); `provider="anthropic"` tries Anthropic's first.
    A cache price that is not set is the prompt price.
    """
    usage = _field(response, "usage")
    direct = _number(_field(usage, "cost"))
    if direct is None:  # a litellm proxy reports the cost in a response header (litellm keeps it, as ART reads it)
        headers = _field(_field(response, "_hidden_params"), "additional_headers")
        direct = _number(_field(headers, LITELLM_PROXY_COST_HEADER))
    if direct is not None:
        return direct
    if pricing is None:
        return None
    readers = (_anthropic_cost, _openai_cost)
    if (provider or "").strip().lower() != "anthropic":
        readers = readers[::-1]
    return next((c for c in (read(usage, pricing) for read in readers) if c is not None), None)


def _openai_cost(usage: Any, p: TokenPricing) -> float | None:
    prompt, completion = _number(_field(usage, "prompt_tokens")), _number(_field(usage, "completion_tokens"))
    if prompt is None and completion is None:
        return None
    prompt = prompt or 0.0
    cached = min(_number(_field(_field(usage, "prompt_tokens_details"), "cached_tokens")) or 0.0, prompt)
    cached_price = p.prompt_per_million if p.cached_prompt_per_million is None else p.cached_prompt_per_million
    return ((prompt - cached) * p.prompt_per_million + cached * cached_price
            + (completion or 0.0) * p.completion_per_million) / 1e6


def _anthropic_cost(usage: Any, p: TokenPricing) -> float | None:
    counts = [_number(_field(usage, k)) for k in ("input_tokens", "output_tokens", "cache_creation_input_tokens",
                                                   "cache_read_input_tokens")]
    if not any(counts):  # nothing in Anthropic's fields (litellm's usage has zero cache counts): not its usage
        return None
    inp, out, written, read = (c or 0.0 for c in counts)
    write_price = p.prompt_per_million if p.cache_creation_per_million is None else p.cache_creation_per_million
    read_price = p.prompt_per_million if p.cache_read_per_million is None else p.cache_read_per_million
    return (inp * p.prompt_per_million + written * write_price + read * read_price
            + out * p.completion_per_million) / 1e6
