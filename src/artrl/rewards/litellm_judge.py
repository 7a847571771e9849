"""RULER's judge through litellm (`litellm.acompletion`), as ART calls it, when litellm is installed.

ART's `judge_model` is a litellm model string (`"openai/o3"`,
`"anthropic/claude-sonnet-4-5"`, `"openrouter/..."`, `"hosted_vllm/<name>"`) and
`extra_litellm_params` go to `litellm.acompletion` as they are (`api_base`,
`api_key`, `temperature`, `num_retries`, `mock_response`, ...); the request asks
for ART's `Response` schema (`response_format=Response`) with litellm's cache off
(`caching=False`), as ART's does. One addition: with an `api_base` (or `base_url`)
and a name litellm cannot place (no provider prefix it knows, not a model it
knows, e.g. `judge_model=model.get_inference_name()`), the name is sent to that
endpoint as an OpenAI-compatible model (`custom_llm_provider="openai"`), which is
what artrl's own judge does with such a name; litellm would refuse it.

The judge's cost (ruler.py records it in `costs/<context>/judge/ruler`), in
this order: what the response carries (`usage.cost`, as OpenRouter reports it,
or a litellm proxy's cost header), else the prices the metrics builder knows
(registered, ART's tables, litellm's price map for `judge_model`: api_costs.py,
as ART reads them) applied to the response's usage; else, for a judge called
through litellm, litellm's own figure for the response
(`response._hidden_params["response_cost"]`), then litellm's price map again with
its usage read as litellm reports it. A model litellm prices at zero (a local
one, e.g. `ollama/...`) records no cost, as ART records none for it.

litellm fetches its price map from the network when it is imported unless
`LITELLM_LOCAL_MODEL_COST_MAP=True` is set (litellm's own behaviour; the map it
ships is used when the fetch fails). litellm is imported on the first judge call,
not with artrl.
"""

from __future__ import annotations

from typing import Any

PRICE_FIELDS = {  # litellm's model-info price per token -> MetricsBuilder.add_response_cost's price per million
    "input_cost_per_token": "prompt_price_per_million",
    "output_cost_per_token": "completion_price_per_million",
    "cache_read_input_token_cost": "cached_prompt_price_per_million",
    "cache_creation_input_token_cost": "cache_creation_price_per_million",
}


def load_litellm() -> dict[str, Any]:
    """litellm's `acompletion` and `ModelResponse`, or Nones when litellm is not installed."""
    try:
        from litellm import acompletion
        from litellm.types.utils import ModelResponse
    except ImportError:
        return {"acompletion": None, "ModelResponse": None}
    return {"acompletion": acompletion, "ModelResponse": ModelResponse}


def _provider_list() -> set[str]:
    import litellm

    return {str(getattr(p, "value", p)) for p in litellm.provider_list}


def _known_model(name: str) -> dict[str, Any] | None:
    import litellm

    return litellm.model_cost.get(name)


def litellm_request(judge_model: str, extra_litellm_params: dict[str, Any] | None) -> tuple[dict[str, Any], str | None]:
    """(keyword arguments for `acompletion` besides `messages` and `response_format`, the judge's provider)."""
    params = dict(extra_litellm_params or {})
    head, sep, _ = judge_model.partition("/")
    head = head.strip().lower()
    providers = _provider_list()
    provider: str | None = head if sep and head in providers else params.get("custom_llm_provider")
    if provider is None:
        known = _known_model(judge_model)
        provider = known.get("litellm_provider") if known else None
        if provider is None and (params.get("api_base") or params.get("base_url")):
            params["custom_llm_provider"] = provider = "openai"  # an OpenAI-compatible endpoint's own name
    return {"model": judge_model, "caching": False, **params}, provider


def litellm_response_cost(response: Any) -> float | None:
    """litellm's own cost of its response (None when it has none, or prices it at zero)."""
    hidden = getattr(response, "_hidden_params", None)
    cost = hidden.get("response_cost") if isinstance(hidden, dict) else None
    if isinstance(cost, (int, float)) and not isinstance(cost, bool) and cost > 0:
        return float(cost)
    return None


def litellm_prices(judge_model: str) -> dict[str, float] | None:
    """litellm's prices for `judge_model` as `add_response_cost` keywords; None when unknown or zero."""
    import litellm

    try:
        info = litellm.get_model_info(judge_model)
    except Exception:  # litellm raises for a model it has not mapped
        return None
    prices = {ours: float(info[theirs]) * 1e6 for theirs, ours in PRICE_FIELDS.items()
              if isinstance(info.get(theirs), (int, float))}
    if not prices.get("prompt_price_per_million") and not prices.get("completion_price_per_million"):
        return None
    if "cached_prompt_price_per_million" in prices:  # OpenAI's cached prompt and Anthropic's cache read
        prices["cache_read_price_per_million"] = prices["cached_prompt_price_per_million"]
    prices.setdefault("prompt_price_per_million", 0.0)
    prices.setdefault("completion_price_per_million", 0.0)
    return prices
