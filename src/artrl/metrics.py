"""`MetricsBuilder`: step-level metrics with cumulative totals, under ART's metric taxonomy.

ART (0.5.x) names its history metrics by section: `loss/...`, `data/step_...`,
`time/step_...`, `throughput/...`, `costs/...`. Some of them are *builder
managed*: a step value (`data/step_trainer_tokens`) is buffered until the row
is written, and every flush adds its running total under the section's `cum`
namespace (`data/cum/trainer_tokens`). Costs roll up to their parents
(`costs/train/judge/ruler` -> `costs/train/judge` -> `costs/train` ->
`costs/all`). `Model.log` owns one builder per model; code that makes priced
calls (the RULER judge) finds it with `MetricsBuilder.get_active()`.

A response's cost (`add_response_cost`, and ART's `track_api_cost` decorator, which calls it on the active
builder) is read as ART reads it, api_costs.py says in which order: what the response reports, a cost extractor
registered for its provider, or its token counts x prices (registered with `register_model_pricing`, built in,
litellm's, or artrl.costs'). Where none gives a cost, `add_response_cost` raises ValueError, as ART's does;
callers that may meet unpriced models (the RULER judge) treat that as "no cost recorded".
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import pydantic

from .api_costs import ACTIVE_BUILDER, CostExtractor, TokenPricing, extract_api_cost, normalize_provider
from .api_costs import track_api_cost as track_api_cost  # ART's `art.metrics.track_api_cost`

_active: ContextVar["MetricsBuilder"] = ACTIVE_BUILDER

CUMULATIVE_SECTIONS = frozenset({"costs", "time", "data"})
"""Sections whose builder-managed step values also get a running total under `<section>/cum/...`."""
BUILDER_MANAGED_PREFIXES = ("costs/", "time/step_", "data/step_", "throughput/step_")
_IDLE_TOTALS = {"throughput/step_trainer_idle_s": "throughput/cum/trainer_idle_s",
                "throughput/step_actor_idle_s": "throughput/cum/actor_idle_s"}
"""ART 0.5.18's idle keys and their totals (0.5.23 moved them to `time/step_{trainer,rollout}_idle_s`, whose totals
the `time` section keeps like any other)."""
# ART 0.5.23's names for what 0.5.18 called the actor's (the rollouts'), kept beside them: key -> 0.5.18 key
RENAMED_0518 = {"data/step_rollout_tokens": "data/step_actor_tokens", "time/step_rollout_s": "time/step_actor_s",
                "time/step_trainer_idle_s": "throughput/step_trainer_idle_s",
                "time/step_rollout_idle_s": "throughput/step_actor_idle_s"}


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


@dataclass
class _Shared:
    """What every view of one builder shares: pending buffers per scope, running totals, prices."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: dict[str, dict[str, float]] = field(default_factory=dict)
    pending_scenarios: dict[str, set[str]] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    scenarios: set[str] = field(default_factory=set)
    pricing: dict[str, TokenPricing] = field(default_factory=dict)
    extractors: dict[str, CostExtractor] = field(default_factory=dict)


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

    def add_data(self, step_num_scenarios: int | None = None, step_rollout_tokens: int | None = None,
                 scenario_ids: list[str] | None = None, *, step_actor_tokens: int | None = None) -> None:
        """ART 0.5.23's `step_rollout_tokens` (`data/step_rollout_tokens`); 0.5.18's `step_actor_tokens` is the
        same count and writes both keys (`_add_renamed`)."""
        if step_num_scenarios is not None:
            self.add_metric("data/step_num_scenarios", step_num_scenarios)
        self._add_renamed("data/step_rollout_tokens", step_rollout_tokens, step_actor_tokens)
        if scenario_ids is not None:
            self._shared.pending_scenarios.setdefault(self._scope, set()).update(str(s) for s in scenario_ids)

    def add_user_timing(self, step_wall_s: float | None = None, step_rollout_s: float | None = None,
                        step_eval_s: float | None = None, *, step_actor_s: float | None = None) -> None:
        """`time/step_wall_s`, `time/step_rollout_s` (0.5.18: `step_actor_s`), `time/step_eval_s`."""
        if step_wall_s is not None:
            self.add_metric("time/step_wall_s", step_wall_s)
        self._add_renamed("time/step_rollout_s", step_rollout_s, step_actor_s)
        if step_eval_s is not None:
            self.add_metric("time/step_eval_s", step_eval_s)

    def add_idle_times(self, step_trainer_idle_s: float | None = None, step_rollout_idle_s: float | None = None,
                       *, step_actor_idle_s: float | None = None) -> None:
        """ART 0.5.23's `time/step_{trainer,rollout}_idle_s` (0.5.18: `throughput/step_{trainer,actor}_idle_s`,
        written too)."""
        self._add_renamed("time/step_trainer_idle_s", step_trainer_idle_s, None)
        self._add_renamed("time/step_rollout_idle_s", step_rollout_idle_s, step_actor_idle_s)

    def _add_renamed(self, key: str, value: float | None, old_value: float | None) -> None:
        """Add `value` (given under ART 0.5.23's keyword, or `old_value` under 0.5.18's) under `key` and under its
        0.5.18 name (RENAMED_0518), so dashboards of either version read it; giving both is refused."""
        if value is not None and old_value is not None:
            raise ValueError(f"{key} given twice: under ART 0.5.23's keyword and 0.5.18's "
                             f"({RENAMED_0518[key]}); give one of them")
        value = value if value is not None else old_value
        if value is not None:
            self.add_metric(key, value)
            self.add_metric(RENAMED_0518[key], value)

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

    def register_cost_extractor(self, provider: str, extractor: CostExtractor) -> None:
        """`extractor(response)` gives the USD cost of `provider`'s responses (None: price them as usual)."""
        name = normalize_provider(provider)
        if name is None:
            raise ValueError("provider must be non-empty, e.g. 'openai'")
        self._shared.extractors[name] = extractor

    def add_response_cost(self, source: str, response: Any, *, provider: str | None = None, model_name: str,
                          prompt_price_per_million: float | None = None,
                          completion_price_per_million: float | None = None,
                          cached_prompt_price_per_million: float | None = None,
                          cache_creation_price_per_million: float | None = None,
                          cache_read_price_per_million: float | None = None) -> float | None:
        """Record `costs/<context>/<source>` for one API response; returns the cost in USD.

        The cost comes from the response (`usage.cost`), a cost extractor registered for `provider`, or its
        token counts x prices: those passed here on top of those registered for `model_name` (or its part
        after the provider), built in, or litellm's (api_costs.py). Raises ValueError when no cost can be
        computed.
        """
        source = source.strip("/")
        if not source:
            raise ValueError("source must be non-empty, e.g. 'judge/ruler'")
        cost = self.price_response(
            response, provider=provider, model_name=model_name, prompt_price_per_million=prompt_price_per_million,
            completion_price_per_million=completion_price_per_million,
            cached_prompt_price_per_million=cached_prompt_price_per_million,
            cache_creation_price_per_million=cache_creation_price_per_million,
            cache_read_price_per_million=cache_read_price_per_million)
        self.add_cost(f"{self.cost_context}/{source}", cost)
        return cost

    def price_response(self, response: Any, *, provider: str | None, model_name: str, **prices: float | None) -> float:
        """What `add_response_cost` would record for `response`, with this builder's registered prices and
        extractors, without recording it (`prices`: its `*_price_per_million` keywords)."""
        return extract_api_cost(response, provider=provider, model_name=model_name, **prices,
                                cost_extractors=self._shared.extractors, model_pricing=self._shared.pricing)

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
        # ART 0.5.23: trainable assistant tokens over the backend's train time; sampled tokens over rollout time.
        # Where a row has only 0.5.18's keys (trainer tokens and time, the actor's), 0.5.18's ratios.
        for name, tokens_key, seconds_key in (
                ("trainer", "trainable_assistant_tokens", "backend_train_s"), ("trainer", "trainer_tokens", "trainer_s"),
                ("rollout", "rollout_tokens", "rollout_s"), ("actor", "actor_tokens", "actor_s")):
            key = f"throughput/avg_{name}_tok_per_s"
            if key in out or (f"data/step_{tokens_key}" not in out and f"time/step_{seconds_key}" not in out):
                continue
            tokens, seconds = totals.get(f"data/cum/{tokens_key}"), totals.get(f"time/cum/{seconds_key}")
            if tokens is not None and seconds:
                out[key] = tokens / seconds

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


def _price(value: float | None) -> float | None:
    return None if value is None else float(value)


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


# --------------------------------------------------------------------------- ART's catalogue of pipelined-RL metrics
# ART's catalogue of pipelined-RL metric keys: `MetricDefinition` and the `PIPELINE_RL_*` constants.
#
# ART 0.5.23 exports, at its top level, a description of each metric a pipelined RL run may log
# (`art.PIPELINE_RL_METRIC_DEFINITIONS`), the keys a dashboard shows by default
# (`PIPELINE_RL_DASHBOARD_DEFAULT_METRICS`) and the keys its objective score is built from
# (`PIPELINE_RL_SCORE_METRICS`). ART itself reads them nowhere: they are for the user's dashboards.
# They are the same keys, titles, kinds, units and flags here; the descriptions are written afresh.
#
# A catalogue entry says what a key means, not that a run logs it: several keys are those of ART's
# Megatron trainer (pipeline-parallel dummy micro-batches, context-parallel pruning) or of vLLM's
# metrics endpoint, which artrl's trainer and built-in engine do not have. `ARTRL_LOGS` lists the
# catalogue keys an artrl run writes (tests/test_art_0523_surface.py holds it to what the trainer emits).

MetricKind = Literal["counter", "duration", "gauge", "rate", "ratio", "score"]


class MetricDefinition(pydantic.BaseModel):
    """One metric key: what it measures, its kind and unit, and which way is better (ART's fields)."""

    key: str
    title: str
    description: str
    kind: MetricKind
    unit: str | None = None
    higher_is_better: bool | None = None
    dashboard_default: bool = False
    score_component: bool = False


# key, title, kind, unit, higher_is_better, flags (D: dashboard default, S: score component), description
_ROWS: tuple[tuple[str, str, MetricKind, str | None, bool | None, str, str], ...] = (
    ("objective/score", "Score", "score", None, True, "DS",
     "accepted trainable assistant tokens per second x freshness discount x critical-batch factor"),
    ("sample_efficiency/freshness_discount", "Freshness discount", "ratio", None, True, "S",
     "1 over the token-weighted mean of exp(age of the sampling policy in train steps / 8)"),
    ("sample_efficiency/batch_factor", "Batch factor", "ratio", None, True, "S",
     "critical-batch factor: accepted groups and rollouts per group against their configured references"),
    ("offpolicy/token_weighted_policy_age_steps", "Token-weighted policy age", "gauge", "steps", False, "S",
     "mean age, in train steps, of the policy that sampled the accepted data, weighted by completion tokens"),
    ("throughput/accepted_train_tok_per_s", "Accepted train tokens per second", "rate", "tok/s", True, "DS",
     "accepted trainable assistant tokens over the train step's wall time"),
    ("data/step_trainable_assistant_tokens", "Accepted assistant tokens", "counter", "tokens", None, "S",
     "trainable assistant tokens of the groups accepted for this train step"),
    ("data/step_nonpadding_logical_tokens", "Non-padding logical train tokens", "counter", "tokens", None, "",
     "tokens of the step's micro-batches that are not padding"),
    ("data/step_loss_bearing_tokens", "Loss-bearing train tokens", "counter", "tokens", None, "",
     "token positions that contribute to the loss"),
    ("data/step_executed_token_equivalents", "Executed token-equivalents", "counter", "tokens", None, "",
     "token slots computed on every rank, padding and dummy micro-batches included"),
    ("data/step_nominal_schedule_capacity_tokens", "Nominal schedule capacity", "counter", "tokens", None, "",
     "token slots of the packed rows as configured, before context-parallel pruning"),
    ("data/step_dummy_executed_token_equivalents", "Executed dummy token-equivalents", "counter", "tokens", False,
     "", "token slots computed by pipeline-parallel dummy micro-batches"),
    ("data/step_dummy_schedule_capacity_tokens", "Dummy schedule capacity", "counter", "tokens", False, "",
     "token slots assigned to pipeline-parallel dummy micro-batches"),
    ("data/step_unused_packed_capacity_tokens", "Unused packed capacity", "counter", "tokens", False, "",
     "token slots of real micro-batches that hold no token"),
    ("data/step_unused_and_dummy_ratio", "Unused and dummy capacity ratio", "ratio", None, False, "D",
     "(unused packed slots + dummy slots) / nominal schedule capacity"),
    ("throughput/train_nonpadding_logical_tok_per_s", "Logical train tokens per second", "rate", "tok/s", True, "D",
     "non-padding tokens over training time"),
    ("throughput/train_loss_bearing_tok_per_s", "Loss-bearing train tokens per second", "rate", "tok/s", True, "",
     "loss-bearing tokens over training time"),
    ("throughput/train_executed_tok_equiv_per_s", "Executed token-equivalents per second", "rate", "tok/s", True,
     "D", "computed token slots over training time"),
    ("throughput/train_nominal_capacity_tok_per_s", "Nominal schedule capacity per second", "rate", "tok/s", True,
     "", "configured packed-row slots over training time"),
    ("loss/importance_ratio_mean", "Importance ratio mean", "ratio", None, None, "",
     "mean importance ratio (at the configured level) of the trainable tokens"),
    ("loss/importance_ratio_p95", "Importance ratio p95", "ratio", None, False, "",
     "95th percentile of the importance ratio, read from a histogram"),
    ("loss/importance_ratio_p99", "Importance ratio p99", "ratio", None, False, "",
     "99th percentile of the importance ratio, read from a histogram"),
    ("loss/clipped_token_fraction", "Clipped token fraction", "ratio", None, False, "",
     "share of trainable tokens whose importance ratio falls outside the active clip interval"),
    ("vllm/prompt_tok_per_s", "vLLM prompt tokens per second", "rate", "tok/s", True, "D",
     "vLLM prefill throughput"),
    ("vllm/completion_tok_per_s", "vLLM completion tokens per second", "rate", "tok/s", True, "D",
     "vLLM decode throughput"),
    ("vllm/num_requests_running", "vLLM running requests", "gauge", "requests", None, "D",
     "requests vLLM is running now"),
    ("vllm/num_requests_waiting", "vLLM waiting requests", "gauge", "requests", None, "D",
     "requests queued for admission by vLLM"),
    ("vllm/num_requests_waiting_capacity", "vLLM capacity-waiting requests", "gauge", "requests", False, "D",
     "queued requests that wait because vLLM has no capacity left"),
    ("vllm/max_num_seqs", "vLLM max running sequences", "gauge", "requests", None, "",
     "the most sequences vLLM schedules in one iteration (configured)"),
    ("vllm/world_size", "vLLM GPU world size", "gauge", "ranks", None, "",
     "GPU ranks that serve the model"),
    ("vllm/max_num_batched_tokens", "vLLM max batched tokens", "gauge", "tokens", None, "",
     "token budget of one vLLM iteration (configured)"),
    ("vllm/max_num_scheduled_tokens", "vLLM max scheduled tokens", "gauge", "tokens", None, "",
     "the most tokens scheduled in one vLLM iteration (configured)"),
    ("vllm/max_model_len", "vLLM max model length", "gauge", "tokens", None, "",
     "longest sequence vLLM serves (configured)"),
    ("vllm/prefix_cache_hit_rate", "vLLM prefix cache hit rate", "ratio", None, True, "D",
     "prefix-cache hits over prefix-cache queries since the last sample"),
    ("vllm/kv_cache_usage_perc", "vLLM KV cache usage", "ratio", None, None, "",
     "share of vLLM's KV-cache blocks in use"),
    ("vllm/num_preemptions_total", "vLLM preemptions", "counter", None, False, "",
     "requests vLLM has preempted so far"),
    ("queue/freshness_pressure", "Queue freshness pressure", "ratio", None, False, "",
     "predicted policy age of the queue over the off-policy limit in force"),
    ("queue/predicted_stale_fraction", "Predicted stale queue fraction", "ratio", None, False, "",
     "share of queued groups expected to be stale at the next train step"),
    ("queue/actual_stale_fraction", "Actual stale dequeue fraction", "ratio", None, False, "",
     "stale groups over all groups taken from the queue for this train step"),
    ("queue/put_wait_frac", "Completed queue wait fraction", "ratio", None, False, "",
     "time rollout workers waited to enqueue a finished group, over that wait plus rollout time"),
    ("queue/put_wait_s", "Completed queue wait", "duration", "seconds", False, "",
     "worker-seconds spent waiting to enqueue finished rollout groups"),
)

PIPELINE_RL_METRIC_DEFINITIONS: tuple[MetricDefinition, ...] = tuple(
    MetricDefinition(key=key, title=title, kind=kind, unit=unit, higher_is_better=higher,
                     dashboard_default="D" in flags, score_component="S" in flags, description=description)
    for key, title, kind, unit, higher, flags, description in _ROWS
)
PIPELINE_RL_DASHBOARD_DEFAULT_METRICS: tuple[str, ...] = tuple(
    d.key for d in PIPELINE_RL_METRIC_DEFINITIONS if d.dashboard_default)
PIPELINE_RL_SCORE_METRICS: tuple[str, ...] = tuple(d.key for d in PIPELINE_RL_METRIC_DEFINITIONS if d.score_component)

ARTRL_LOGS: frozenset[str] = frozenset({
    "loss/importance_ratio_mean", "loss/importance_ratio_p95", "loss/importance_ratio_p99",
    "loss/clipped_token_fraction",
})
"""Catalogue keys that every RL train call of artrl reports (its loss figures); the others are not written."""
