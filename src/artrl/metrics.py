"""`MetricsBuilder`: step-level metrics with cumulative totals, under ART's metric taxonomy.

ART (0.5.x) names its history metrics by section: `loss/...`, `data/step_...`,
`time/step_...`, `throughput/...`, `costs/...`. Some of them are *builder
managed*: a step value (`data/step_trainer_tokens`) is buffered until the row
is written, and every flush adds its running total under the section's `cum`
namespace (`data/cum/trainer_tokens`). Costs roll up to their parents
(`costs/train/judge/ruler` -> `costs/train/judge` -> `costs/train` ->
`costs/all`). `Model.log` owns one builder per model; code that makes priced
calls (the RULER judge) finds it with `MetricsBuilder.get_active()`.

What we leave out of ART's builder: its built-in price tables and custom cost
extractors. A response's cost is taken from the response itself (`usage.cost`,
as OpenRouter reports it, or a litellm proxy's cost header) or from prices
registered with `register_model_pricing` (or passed to the call), applied to
the usage the response reports: OpenAI's (`prompt_tokens`, `completion_tokens`,
cached prompt tokens) or Anthropic's (`input_tokens`, `output_tokens`, cache
writes and reads), as ART prices them. Where neither gives a cost,
`add_response_cost` raises ValueError (ART raises for a model without prices
too, and returns None for a response without usage), which callers that may
meet unpriced models treat as "no cost recorded". RULER's judge through
litellm is priced by litellm then (rewards/litellm_judge.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any, Iterator

_active: ContextVar["MetricsBuilder"] = ContextVar("artrl_active_metrics_builder")

CUMULATIVE_SECTIONS = frozenset({"costs", "time", "data"})
"""Sections whose builder-managed step values also get a running total under `<section>/cum/...`."""
BUILDER_MANAGED_PREFIXES = ("costs/", "time/step_", "data/step_", "throughput/step_")
_IDLE_TOTALS = {"throughput/step_trainer_idle_s": "throughput/cum/trainer_idle_s",
                "throughput/step_actor_idle_s": "throughput/cum/actor_idle_s"}


def is_cumulative_metric_key(key: str) -> bool:
    parts = key.split("/", 2)
    return len(parts) >= 2 and parts[1] == "cum"


def is_builder_managed_metric(key: str) -> bool:
    return key.startswith(BUILDER_MANAGED_PREFIXES)


def to_cumulative_metric_key(key: str) -> str:
    """`data/step_trainer_tokens` -> `data/cum/trainer_tokens`; `costs/train/x` -> `costs/cum/train/x`."""
    if is_cumulative_metric_key(key):
        raise ValueError(f"metric key {key!r} is already cumulative")
    section, rest = key.split("/", 1)
    return f"{section}/cum/{rest.removeprefix('step_')}"


@dataclass(frozen=True)
class TokenPricing:
    """USD per million tokens."""

    prompt_per_million: float
    completion_per_million: float
    cached_prompt_per_million: float | None = None
    cache_creation_per_million: float | None = None
    cache_read_per_million: float | None = None


@dataclass
class _Shared:
    """What every view of one builder shares: pending buffers per scope, running totals, prices."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: dict[str, dict[str, float]] = field(default_factory=dict)
    pending_scenarios: dict[str, set[str]] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    scenarios: set[str] = field(default_factory=set)
    pricing: dict[str, TokenPricing] = field(default_factory=dict)


class MetricsBuilder:
    """Accumulates builder-managed metrics between rows; `flush()` returns them with running totals.

    `cost_context` names where costs go (`costs/<context>/<source>`); views made with
    `for_cost_context` share the totals but buffer separately (train rows and eval rows).
    """

    def __init__(self, cost_context: str, *, _shared: _Shared | None = None, _scope: str | None = None) -> None:
        if not cost_context or not cost_context.strip():
            raise ValueError("cost_context must be a non-empty string, e.g. 'train' or 'eval'")
        self.cost_context = cost_context.strip()
        self._scope = _scope or self.cost_context
        self._shared = _shared or _Shared()

    # ------------------------------------------------------------------ adding
    def add_metric(self, key: str, value: float) -> None:
        if "/" not in key:
            raise ValueError(f"metric key {key!r} needs a section prefix, e.g. 'data/{key}'")
        if is_cumulative_metric_key(key):
            raise ValueError(f"metric key {key!r} is in the reserved cumulative namespace '<section>/cum/'")
        buf = self._buffer()
        for other in buf:
            if other != key and (other.startswith(f"{key}/") or key.startswith(f"{other}/")):
                raise ValueError(f"cannot log {key!r} next to {other!r}: one would be the other's parent")
        buf[key] = buf.get(key, 0.0) + float(value)

    def add_cost(self, path: str, usd: float) -> None:
        if not path:
            raise ValueError("cost path must be non-empty, e.g. 'train/judge/ruler'")
        self.add_metric(f"costs/{path}", usd)

    def add_data(self, step_num_scenarios: int | None = None, step_actor_tokens: int | None = None,
                 scenario_ids: list[str] | None = None, *, step_rollout_tokens: int | None = None) -> None:
        """`step_actor_tokens` is ART 0.5.18's keyword (`data/step_actor_tokens`), `step_rollout_tokens` ART
        0.5.23's (`data/step_rollout_tokens`)."""
        if step_num_scenarios is not None:
            self.add_metric("data/step_num_scenarios", step_num_scenarios)
        if step_actor_tokens is not None:
            self.add_metric("data/step_actor_tokens", step_actor_tokens)
        if step_rollout_tokens is not None:
            self.add_metric("data/step_rollout_tokens", step_rollout_tokens)
        if scenario_ids is not None:
            self._shared.pending_scenarios.setdefault(self._scope, set()).update(str(s) for s in scenario_ids)

    def add_user_timing(self, step_wall_s: float | None = None, step_actor_s: float | None = None,
                        step_eval_s: float | None = None, *, step_rollout_s: float | None = None) -> None:
        """`step_actor_s` is ART 0.5.18's keyword (`time/step_actor_s`), `step_rollout_s` ART 0.5.23's
        (`time/step_rollout_s`)."""
        for key, value in (("time/step_wall_s", step_wall_s), ("time/step_actor_s", step_actor_s),
                           ("time/step_eval_s", step_eval_s), ("time/step_rollout_s", step_rollout_s)):
            if value is not None:
                self.add_metric(key, value)

    def add_idle_times(self, step_trainer_idle_s: float | None = None,
                       step_actor_idle_s: float | None = None, *, step_rollout_idle_s: float | None = None) -> None:
        """ART 0.5.18 writes the trainer's idle time as `throughput/step_trainer_idle_s`, ART 0.5.23 as
        `time/step_trainer_idle_s`: both are written. `step_actor_idle_s` is 0.5.18's keyword
        (`throughput/step_actor_idle_s`), `step_rollout_idle_s` 0.5.23's (`time/step_rollout_idle_s`)."""
        if step_trainer_idle_s is not None:
            self.add_metric("throughput/step_trainer_idle_s", step_trainer_idle_s)
            self.add_metric("time/step_trainer_idle_s", step_trainer_idle_s)
        if step_actor_idle_s is not None:
            self.add_metric("throughput/step_actor_idle_s", step_actor_idle_s)
        if step_rollout_idle_s is not None:
            self.add_metric("time/step_rollout_idle_s", step_rollout_idle_s)

    @contextmanager
    def measure(self, key: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.add_metric(key, time.monotonic() - started)

    def register_model_pricing(self, model_name: str, *, prompt_per_million: float, completion_per_million: float,
                               cached_prompt_per_million: float | None = None,
                               cache_creation_per_million: float | None = None,
                               cache_read_per_million: float | None = None) -> None:
        """USD per million tokens for `model_name`; unset cache prices are the prompt price (as ART)."""
        if not model_name:
            raise ValueError("model_name must be non-empty")
        self._shared.pricing[model_name.strip().lower()] = TokenPricing(
            float(prompt_per_million), float(completion_per_million), _price(cached_prompt_per_million),
            _price(cache_creation_per_million), _price(cache_read_per_million))

    def add_response_cost(self, source: str, response: Any, *, provider: str | None = None, model_name: str,
                          prompt_price_per_million: float | None = None,
                          completion_price_per_million: float | None = None,
                          cached_prompt_price_per_million: float | None = None,
                          cache_creation_price_per_million: float | None = None,
                          cache_read_price_per_million: float | None = None) -> float | None:
        """Record `costs/<context>/<source>` for one API response; returns the cost in USD.

        The cost comes from the response (`usage.cost`) or from prices: those passed here on top of
        those registered for `model_name` (or its part after the provider). `provider` "anthropic"
        reads Anthropic's usage fields, anything else OpenAI's (either is read when the other is
        absent). Raises ValueError when no cost can be computed.
        """
        source = source.strip("/")
        if not source:
            raise ValueError("source must be non-empty, e.g. 'judge/ruler'")
        given = (prompt_price_per_million, completion_price_per_million, cached_prompt_price_per_million,
                 cache_creation_price_per_million, cache_read_price_per_million)
        cost = response_cost(response, self._pricing_for(model_name, given), provider=provider)
        if cost is None:
            raise ValueError(f"no cost for a response of {model_name!r}: the response carries no usage.cost and "
                             "no prices are known; call register_model_pricing(...) to record its cost")
        self.add_cost(f"{self.cost_context}/{source}", cost)
        return cost

    def _pricing_for(self, model_name: str, given: tuple[float | None, ...]) -> TokenPricing | None:
        name = model_name.strip().lower()
        base = self._shared.pricing.get(name) or self._shared.pricing.get(name.split("/", 1)[-1])
        if base is None:
            if given[0] is None or given[1] is None:
                return None
            base = TokenPricing(float(given[0]), float(given[1]))
        mine = dataclasses.astuple(base)
        return TokenPricing(*(_price(g) if g is not None else b for g, b in zip(given, mine)))

    # ------------------------------------------------------------------ flushing
    async def flush(self) -> dict[str, float]:
        """This scope's buffered step values, cost roll-ups and running totals; empties the buffer."""
        async with self._shared.lock:
            out = dict(self._buffer())
            out.update(_cost_rollups({k: v for k, v in out.items() if k.startswith("costs/")}))
            for key, value in list(out.items()):
                if key.split("/", 1)[0] in CUMULATIVE_SECTIONS:
                    cum = to_cumulative_metric_key(key)
                    self._shared.totals[cum] = self._shared.totals.get(cum, 0.0) + value
                    out[cum] = self._shared.totals[cum]
            scenarios = self._shared.pending_scenarios.pop(self._scope, set())
            if scenarios:
                self._shared.scenarios |= scenarios
                out["data/cum/num_unique_scenarios"] = float(len(self._shared.scenarios))
            self._throughput(out)
            self._buffer().clear()
            return out

    def _throughput(self, out: dict[str, float]) -> None:
        totals = self._shared.totals
        for step_key, cum_key in _IDLE_TOTALS.items():
            if step_key in out:
                totals[cum_key] = totals.get(cum_key, 0.0) + out[step_key]
                out[cum_key] = totals[cum_key]
        for who in ("trainer", "actor"):
            if f"data/step_{who}_tokens" in out or f"time/step_{who}_s" in out:
                tokens, seconds = totals.get(f"data/cum/{who}_tokens"), totals.get(f"time/cum/{who}_s")
                if tokens is not None and seconds:
                    out[f"throughput/avg_{who}_tok_per_s"] = tokens / seconds

    # ------------------------------------------------------------------ context and state
    def activate(self) -> Token["MetricsBuilder"]:
        return _active.set(self)

    @contextmanager
    def activate_context(self) -> Iterator["MetricsBuilder"]:
        token = self.activate()
        try:
            yield self
        finally:
            _active.reset(token)

    @staticmethod
    def get_active() -> "MetricsBuilder":
        """The builder activated in this context; LookupError when none is."""
        return _active.get()

    def for_cost_context(self, cost_context: str, *, buffer_scope: str | None = None) -> "MetricsBuilder":
        scope = (buffer_scope or cost_context).strip()
        if cost_context.strip() == self.cost_context and scope == self._scope:
            return self
        return MetricsBuilder(cost_context, _shared=self._shared, _scope=scope)

    def state_dict(self) -> dict[str, Any]:
        return {"cum_state": dict(self._shared.totals), "unique_scenario_ids": sorted(self._shared.scenarios)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._shared.totals = {str(k): float(v) for k, v in (state.get("cum_state") or {}).items()}
        self._shared.scenarios = {str(s) for s in state.get("unique_scenario_ids") or []}
        self._shared.pending.clear()
        self._shared.pending_scenarios.clear()

    def _buffer(self) -> dict[str, float]:
        return self._shared.pending.setdefault(self._scope, {})


def _cost_rollups(costs: dict[str, float]) -> dict[str, float]:
    """Parents of every cost leaf (sums of their leaves) and `costs/all`."""
    if not costs:
        return {}
    out: dict[str, float] = {}
    for key, value in costs.items():
        parts = key.split("/")
        for depth in range(2, len(parts)):
            parent = "/".join(parts[:depth])
            out[parent] = out.get(parent, 0.0) + value
    out["costs/all"] = sum(costs.values())
    return out


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


def _price(value: float | None) -> float | None:
    return None if value is None else float(value)


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
