"""Pricing API calls: ART's `art.api_costs`, with its `track_api_cost` decorator.

    @track_api_cost(source="llm_judge/correctness", provider="openai", model_name="openai/gpt-4.1")
    async def judge(...) -> ChatCompletion: ...

Each call of `judge` made while a metrics builder is active (`model.activate_metrics_context("train")`, or the
rollouts and evals of a `PipelineTrainer`) adds its cost to `costs/<context>/llm_judge/correctness`, which the
model's next `log`/`train` row writes with its roll-ups (`costs/train`, `costs/all`) and running totals
(`costs/cum/...`). With no builder active the call is not priced at all.

A response's cost, in ART's order:
  1. what the response says it cost: `usage.cost` (OpenRouter; a number, or `{"total_cost": ...}`), the same in
     `usage.model_extra`, or a litellm proxy's cost header;
  2. a cost extractor registered for the provider (`MetricsBuilder.register_cost_extractor`);
  3. token counts x prices. The prices: those registered with `MetricsBuilder.register_model_pricing`, else
     `MODEL_TOKEN_PRICING`, else litellm's price map (when litellm is installed), else `artrl.costs.MODEL_PRICING`;
     prices passed to the call replace single fields of those. The counts: OpenAI's Chat Completions usage
     (`prompt_tokens` of which `prompt_tokens_details.cached_tokens` are cached, `completion_tokens`), its
     Responses usage (`input_tokens`, `input_tokens_details.cached_tokens`, `output_tokens`) or Anthropic's
     (`input_tokens`, cache writes and reads, `output_tokens`). A cache price that is not set is the prompt price.
A model with no prices at all is a ValueError ("No pricing configured ..."), raised from the decorated call.

Beyond ART: a model without any configured price is priced from prices passed to the call when both the prompt
and the completion price are given (ART refuses it), and the usage of either provider is read whatever
`provider` says (ART reads only the named provider's fields, and refuses other providers without an extractor).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, fields, replace
from functools import wraps
from inspect import iscoroutinefunction
from typing import Any, ParamSpec, TypeVar, cast

from .costs import get_model_pricing

OPENAI_PROVIDER = "openai"
ANTHROPIC_PROVIDER = "anthropic"
LITELLM_PROXY_COST_HEADER = "llm_provider-x-litellm-response-cost"

P = ParamSpec("P")
R = TypeVar("R")
CostExtractor = Callable[[Any], float | None]
ResponseGetter = Callable[[Any], Any]

ACTIVE_BUILDER: ContextVar[Any] = ContextVar("artrl_active_metrics_builder")
"""The metrics builder active in this context (`metrics.MetricsBuilder.activate` sets it); what
`track_api_cost` records into. It lives here, below metrics.py, so that this module never imports it."""


@dataclass(frozen=True)
class TokenPricing:
    """USD per million tokens."""

    prompt_per_million: float
    completion_per_million: float
    cached_prompt_per_million: float | None = None
    cache_creation_per_million: float | None = None
    cache_read_per_million: float | None = None


MODEL_TOKEN_PRICING: dict[str, TokenPricing] = {  # ART 0.5.23's two built-in judge prices
    "openai/gpt-4.1": TokenPricing(2.0, 8.0, cached_prompt_per_million=0.5),
    "anthropic/claude-sonnet-4-6": TokenPricing(3.0, 15.0, cache_creation_per_million=3.75,
                                                cache_read_per_million=0.30),
}

# litellm's model-info price per token -> TokenPricing's field (per million); its cache read is OpenAI's cached prompt
_LITELLM_FIELDS = (("input_cost_per_token", "prompt_per_million"),
                   ("output_cost_per_token", "completion_per_million"),
                   ("cache_read_input_token_cost", "cached_prompt_per_million"),
                   ("cache_creation_input_token_cost", "cache_creation_per_million"),
                   ("cache_read_input_token_cost", "cache_read_per_million"))


def normalize_provider(provider: str | None) -> str | None:
    """`" OpenAI "` -> `"openai"`; None for an empty name."""
    return (provider or "").strip().lower() or None


def normalize_model_name(model_name: str | None) -> str | None:
    """The name without surrounding blanks; None for an empty name."""
    return (model_name or "").strip() or None


# --------------------------------------------------------------------------- reading a response


def _field(obj: Any, name: str) -> Any:
    """`obj[name]` or `obj.name`, falling back to a pydantic model's extra fields."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None)
        if isinstance(extra, Mapping):
            value = extra.get(name)
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _cost_value(value: Any) -> float | None:
    """A cost as providers write it: a number, or an object with `total_cost`."""
    number = _number(value)
    return number if number is not None else _number(_field(value, "total_cost"))


def direct_cost(response: Any) -> float | None:
    """The USD cost a response reports itself (`usage.cost`, in `usage.model_extra`, or a litellm proxy header)."""
    usage = _field(response, "usage")
    for value in (_field(usage, "cost"), _field(_field(usage, "model_extra"), "cost"),
                  _field(_field(_field(response, "_hidden_params"), "additional_headers"), LITELLM_PROXY_COST_HEADER)):
        cost = _cost_value(value)
        if cost is not None:
            return cost
    return None


def response_cost(response: Any, pricing: TokenPricing | None, *, provider: str | None = None) -> float | None:
    """USD cost of a response: what it reports itself, else its token counts x `pricing` (None: neither).

    `provider="anthropic"` reads Anthropic's usage fields first, any other OpenAI's first.
    """
    cost = direct_cost(response)
    if cost is not None or pricing is None:
        return cost
    return estimate_cost(_field(response, "usage"), pricing, provider=provider)


def estimate_cost(usage: Any, pricing: TokenPricing, *, provider: str | None = None) -> float | None:
    """Token counts of `usage` x `pricing`, in USD; None when `usage` has no counts either provider writes."""
    readers = (_openai_cost, _anthropic_cost)
    if normalize_provider(provider) == ANTHROPIC_PROVIDER:
        readers = readers[::-1]
    return next((c for c in (read(usage, pricing) for read in readers) if c is not None), None)


def _openai_cost(usage: Any, p: TokenPricing) -> float | None:
    prompt, completion = _number(_field(usage, "prompt_tokens")), _number(_field(usage, "completion_tokens"))
    cached = _number(_field(_field(usage, "prompt_tokens_details"), "cached_tokens"))
    responses_details = _field(usage, "input_tokens_details")
    if prompt is None and completion is None and responses_details is not None:  # the Responses API's usage
        prompt, completion = _number(_field(usage, "input_tokens")), _number(_field(usage, "output_tokens"))
        cached = _number(_field(responses_details, "cached_tokens"))
    if prompt is None and completion is None:
        return None
    prompt = prompt or 0.0
    cached = min(cached or 0.0, prompt)
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


# --------------------------------------------------------------------------- prices


def litellm_token_pricing(model_name: str) -> TokenPricing | None:
    """litellm's prices for `model_name`; None when litellm is not installed or does not price it.

    litellm fetches its price map from the network when first imported unless `LITELLM_LOCAL_MODEL_COST_MAP=True`
    is set (its own behaviour; it falls back to the map it ships)."""
    try:
        from litellm import get_model_info

        info = get_model_info(model_name)
    except Exception:  # not installed, or a model litellm has not mapped (it raises)
        return None
    if not isinstance(info, Mapping):
        return None
    per_million = {ours: _number(info.get(theirs)) for theirs, ours in _LITELLM_FIELDS}
    if per_million["prompt_per_million"] is None or per_million["completion_per_million"] is None:
        return None
    return TokenPricing(**{k: None if v is None else v * 1e6 for k, v in per_million.items()})


def _registered(model_name: str, table: Mapping[str, TokenPricing]) -> TokenPricing | None:
    """`table`'s prices for the name as given, lower-cased, or (lower-cased) without its provider prefix."""
    lowered = model_name.lower()
    for key in (model_name, lowered, lowered.split("/", 1)[-1]):
        if key in table:
            return table[key]
    return None


def configured_pricing(model_name: str, model_pricing: Mapping[str, TokenPricing] = {}) -> TokenPricing | None:
    """The prices of `model_name`: registered (`model_pricing`), built-in, litellm's, or `costs.MODEL_PRICING`."""
    found = _registered(model_name, model_pricing) or MODEL_TOKEN_PRICING.get(model_name) \
        or litellm_token_pricing(model_name)
    if found is None:
        hosted = get_model_pricing(model_name)
        found = None if hosted is None else TokenPricing(hosted.prefill, hosted.sample)
    return found


def _with_given(base: TokenPricing | None, given: tuple[float | None, ...], model_name: str) -> TokenPricing:
    """`base` with the prices passed to a call in place of its own (in TokenPricing's field order)."""
    if base is None:
        if given[0] is None or given[1] is None:
            raise ValueError(
                f"No pricing configured for model {model_name!r}: register it with "
                "MetricsBuilder.register_model_pricing(...), pass prompt_price_per_million and "
                "completion_price_per_million, or add it to artrl.api_costs.MODEL_TOKEN_PRICING")
        base = TokenPricing(float(given[0]), float(given[1]))
    return replace(base, **{f.name: float(g) for f, g in zip(fields(TokenPricing), given) if g is not None})


def extract_api_cost(response: Any, *, provider: str | None, model_name: str,
                     prompt_price_per_million: float | None = None, completion_price_per_million: float | None = None,
                     cached_prompt_price_per_million: float | None = None,
                     cache_creation_price_per_million: float | None = None,
                     cache_read_price_per_million: float | None = None,
                     cost_extractors: Mapping[str, CostExtractor] = {},
                     model_pricing: Mapping[str, TokenPricing] = {}) -> float:
    """USD cost of one API response, in the order this module's docstring gives; ValueError when it has none."""
    cost = direct_cost(response)
    if cost is not None:
        return cost
    name = normalize_provider(provider)
    extractor = cost_extractors.get(name) if name else None
    if extractor is not None and (custom := extractor(response)) is not None:
        return float(custom)
    model = normalize_model_name(model_name)
    if model is None:
        raise ValueError("model_name must be non-empty, e.g. 'openai/gpt-4.1'")
    given = (prompt_price_per_million, completion_price_per_million, cached_prompt_price_per_million,
             cache_creation_price_per_million, cache_read_price_per_million)
    pricing = _with_given(configured_pricing(model, model_pricing), given, model)
    cost = estimate_cost(_field(response, "usage"), pricing, provider=name)
    if cost is None:
        raise ValueError(f"Response usage does not match provider {provider!r}: the response of {model!r} has no "
                         "OpenAI or Anthropic token counts and reports no cost; register a cost extractor for "
                         "it with MetricsBuilder.register_cost_extractor(provider, fn)")
    return cost


# --------------------------------------------------------------------------- the decorator


def track_api_cost(*, source: str, provider: str, model_name: str, response_getter: ResponseGetter | None = None,
                   prompt_price_per_million: float | None = None, completion_price_per_million: float | None = None,
                   cached_prompt_price_per_million: float | None = None,
                   cache_creation_price_per_million: float | None = None,
                   cache_read_price_per_million: float | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Price each call of the decorated function (sync or async) into the active metrics builder.

    The function's result is the response (or `response_getter(result)` is); its cost goes to
    `costs/<builder's context>/<source>`. Without an active builder the call is not priced."""
    source = source.strip("/")
    if not source:
        raise ValueError("source must be non-empty, e.g. 'llm_judge/correctness'")
    if normalize_provider(provider) is None:
        raise ValueError("provider must be non-empty, e.g. 'openai' or 'anthropic'")
    model = normalize_model_name(model_name)
    if model is None:
        raise ValueError("model_name must be non-empty, e.g. 'openai/gpt-4.1'")
    prices = {"prompt_price_per_million": prompt_price_per_million,
              "completion_price_per_million": completion_price_per_million,
              "cached_prompt_price_per_million": cached_prompt_price_per_million,
              "cache_creation_price_per_million": cache_creation_price_per_million,
              "cache_read_price_per_million": cache_read_price_per_million}

    def record(result: Any) -> None:
        builder = ACTIVE_BUILDER.get(None)
        if builder is None:
            return
        response = response_getter(result) if response_getter is not None else result
        builder.add_response_cost(source, response, provider=normalize_provider(provider), model_name=model,
                                  **prices)

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        if iscoroutinefunction(func):
            coroutine = cast(Callable[P, Awaitable[Any]], func)

            @wraps(func)
            async def priced_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                result = await coroutine(*args, **kwargs)
                record(result)
                return result

            return cast(Callable[P, R], priced_async)

        @wraps(func)
        def priced(*args: P.args, **kwargs: P.kwargs) -> R:
            result = func(*args, **kwargs)
            record(result)
            return result

        return priced

    return decorate
