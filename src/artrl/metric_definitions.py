"""ART's catalogue of pipelined-RL metric keys: `MetricDefinition` and the `PIPELINE_RL_*` constants.

ART 0.5.23 exports, at its top level, a description of each metric a pipelined RL run may log
(`art.PIPELINE_RL_METRIC_DEFINITIONS`), the keys a dashboard shows by default
(`PIPELINE_RL_DASHBOARD_DEFAULT_METRICS`) and the keys its objective score is built from
(`PIPELINE_RL_SCORE_METRICS`). ART itself reads them nowhere: they are for the user's dashboards.
They are the same keys, titles, kinds, units and flags here; the descriptions are written afresh.

A catalogue entry says what a key means, not that a run logs it: several keys are those of ART's
Megatron trainer (pipeline-parallel dummy micro-batches, context-parallel pruning) or of vLLM's
metrics endpoint, which artrl's trainer and built-in engine do not have. `ARTRL_LOGS` lists the
catalogue keys an artrl run writes (tests/test_art_0523_surface.py holds it to what the trainer emits).
"""

from __future__ import annotations

from typing import Literal

import pydantic

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
