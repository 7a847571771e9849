"""ART's `track_api_cost` (artrl.api_costs) and the cost rows it feeds: what a decorated call costs, where the cost
goes, and the order in which a response's cost is found (api_costs.py's docstring).

ART's own tests of it (its `tests/unit/test_track_api_cost.py`) run from an ART source tree through
tests/test_art_unit_tests.py (`ART_SOURCE=...`); these need no ART tree and no litellm.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest

import artrl as art
from artrl import api_costs
from artrl.api_costs import MODEL_TOKEN_PRICING, TokenPricing, track_api_cost
from artrl.costs import MODEL_PRICING, build_cost_calculator, compute_sample_costs, get_model_pricing
from artrl.metrics import MetricsBuilder


def chat(prompt: int, completion: int, cached: int = 0, **usage_extra) -> dict:
    return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "prompt_tokens_details": {"cached_tokens": cached}, **usage_extra}}


def responses_api(inp: int, out: int, cached: int = 0) -> dict:
    return {"usage": {"input_tokens": inp, "output_tokens": out, "input_tokens_details": {"cached_tokens": cached}}}


def anthropic(inp: int, out: int, written: int = 0, read: int = 0) -> dict:
    return {"usage": {"input_tokens": inp, "output_tokens": out, "cache_creation_input_tokens": written,
                      "cache_read_input_tokens": read}}


@pytest.fixture(autouse=True)
def no_litellm(monkeypatch):
    """litellm knows no model (a real import costs seconds and may fetch its price map); a test that needs its
    prices puts a fake litellm in sys.modules."""
    monkeypatch.setitem(sys.modules, "litellm", types.SimpleNamespace(get_model_info=_unmapped))


def _unmapped(name: str):
    raise Exception(f"This model isn't mapped yet. model={name}")


async def _priced(builder: MetricsBuilder, call) -> dict[str, float]:
    with builder.activate_context():
        result = call()
        if asyncio.iscoroutine(result):
            await result
    return await builder.flush()


def test_a_decorated_call_sync_or_async_is_priced_into_the_active_builders_context_and_returns_its_result():
    @track_api_cost(source="/llm_judge/correctness/", provider="OpenAI", model_name=" openai/gpt-4.1 ",
                    prompt_price_per_million=1.0, completion_price_per_million=2.0)
    async def judge_async():
        return chat(100, 50)

    @track_api_cost(source="judge/sync", provider="openai", model_name="openai/gpt-4.1",
                    response_getter=lambda result: result[1])
    def judge_sync():
        return "verdict", chat(1000, 100, cached=800)

    builder = MetricsBuilder(cost_context="train")
    with builder.activate_context():
        assert asyncio.run(judge_async()) == chat(100, 50)
        assert judge_sync() == ("verdict", chat(1000, 100, cached=800))
    rows = asyncio.run(builder.flush())
    assert rows["costs/train/llm_judge/correctness"] == pytest.approx((100 * 1 + 50 * 2) / 1e6)
    # no price passed: ART's built-in price of gpt-4.1 (2 / 0.5 cached / 8)
    assert rows["costs/train/judge/sync"] == pytest.approx((200 * 2.0 + 800 * 0.5 + 100 * 8.0) / 1e6)
    assert rows["costs/train"] == pytest.approx(rows["costs/train/llm_judge/correctness"]
                                                + rows["costs/train/judge/sync"])
    assert rows["costs/all"] == pytest.approx(rows["costs/train"])
    assert judge_sync.__name__ == "judge_sync"  # functools.wraps


def test_without_an_active_builder_a_call_is_not_priced_even_when_it_could_not_be():
    @track_api_cost(source="judge", provider="openai", model_name="openai/no-price-anywhere")
    def judge():
        return chat(10, 20)

    assert judge() == chat(10, 20)


@pytest.mark.parametrize("keyword", ["source", "provider", "model_name"])
def test_an_empty_source_provider_or_model_is_refused_at_decoration(keyword):
    given = {"source": "judge", "provider": "openai", "model_name": "openai/gpt-4.1", keyword: "//" if
             keyword == "source" else "  "}
    with pytest.raises(ValueError, match=f"{keyword} must be non-empty"):
        track_api_cost(**given)


def test_a_model_with_no_price_anywhere_fails_the_decorated_call_naming_it():
    @track_api_cost(source="judge", provider="openai", model_name="openai/missing-pricing-model")
    async def judge():
        return chat(10, 20)

    with pytest.raises(ValueError, match="No pricing configured for model 'openai/missing-pricing-model'"):
        asyncio.run(_priced(MetricsBuilder(cost_context="train"), judge))


def test_what_the_response_reports_comes_first_then_an_extractor_then_prices():
    builder = MetricsBuilder(cost_context="eval")
    builder.register_model_pricing("openai/judge", prompt_per_million=1.0, completion_per_million=1.0)
    seen = []
    builder.register_cost_extractor("OpenAI", lambda r: seen.append(r) or r.get("extracted"))
    add = lambda response: builder.add_response_cost("j", response, provider="openai", model_name="openai/judge")
    assert add(chat(100, 100, cost=0.5)) == 0.5 and seen == []  # usage.cost: no extractor asked
    assert add(chat(100, 100, cost={"total_cost": 0.25})) == 0.25
    assert add(chat(100, 100, model_extra={"cost": 0.125})) == 0.125
    assert add({**chat(100, 100), "extracted": 0.75}) == 0.75  # the extractor
    assert add(chat(100, 100)) == pytest.approx(200 / 1e6)  # the extractor said None: the prices
    assert len(seen) == 2


def test_prices_come_registered_then_built_in_then_litellms_then_arts_hosted_table(monkeypatch):
    builder = MetricsBuilder(cost_context="train")
    cost = lambda model, response, **kw: builder.add_response_cost("j", response, provider="openai",
                                                                   model_name=model, **kw)
    # ART's hosted price table (prefill/sample), when nothing else knows the model
    hosted = get_model_pricing("openai/gpt-oss-20b")
    expected = compute_sample_costs(prompt_tokens=1000, completion_tokens=2000, cost_context="train", pricing=hosted)
    assert cost("openai/gpt-oss-20b", chat(1000, 2000)) == pytest.approx(sum(expected.values()))
    # litellm's price map, when installed and it knows the model (its cache read is the cached-prompt price)
    info = {"openai/fallback-model": {"input_cost_per_token": 2.5e-06, "output_cost_per_token": 1.5e-05,
                                      "cache_read_input_token_cost": 2.5e-07}}
    monkeypatch.setitem(sys.modules, "litellm", types.SimpleNamespace(
        get_model_info=lambda name: info[name] if name in info else _unmapped(name)))
    assert cost("openai/fallback-model", chat(100, 50, cached=80)) == pytest.approx((20 * 2.5 + 80 * 0.25
                                                                                     + 50 * 15) / 1e6)
    # the built-in table before litellm; a registered price before both; a price passed replaces one field
    info["openai/gpt-4.1"] = {"input_cost_per_token": 1.0, "output_cost_per_token": 1.0}
    assert cost("openai/gpt-4.1", chat(1000, 100)) == pytest.approx((1000 * 2 + 100 * 8) / 1e6)
    builder.register_model_pricing("openai/gpt-4.1", prompt_per_million=3.0, completion_per_million=5.0)
    assert cost("openai/gpt-4.1", chat(1000, 100)) == pytest.approx((1000 * 3 + 100 * 5) / 1e6)
    assert cost("openai/gpt-4.1", chat(1000, 100), completion_price_per_million=7.0) == \
        pytest.approx((1000 * 3 + 100 * 7) / 1e6)
    assert MODEL_TOKEN_PRICING["openai/gpt-4.1"] == TokenPricing(2.0, 8.0, cached_prompt_per_million=0.5)


def test_openais_responses_usage_anthropics_cache_fields_and_a_usage_no_provider_writes():
    builder = MetricsBuilder(cost_context="train")
    builder.register_model_pricing("openai/j", prompt_per_million=2.0, completion_per_million=8.0,
                                   cached_prompt_per_million=0.5)
    assert builder.add_response_cost("r", responses_api(2000, 100, cached=1500), provider="openai",
                                     model_name="openai/j") == pytest.approx(0.00255)
    assert builder.add_response_cost("a", anthropic(100, 50, written=1000, read=500), provider="anthropic",
                                     model_name="anthropic/claude-sonnet-4-6") == pytest.approx(0.00495)
    with pytest.raises(ValueError, match="Response usage does not match provider 'openai'"):
        builder.add_response_cost("x", {"usage": {"total_tokens": 5}}, provider="openai", model_name="openai/j")


def test_arts_cost_helpers_give_its_tinker_leaves():
    pricing = MODEL_PRICING["openai/gpt-oss-20b"]
    rows = build_cost_calculator(pricing)(1000, 2000, "/eval/")
    assert rows == {"costs/eval/tinker_prefill": pytest.approx(0.00012),
                    "costs/eval/tinker_sample": pytest.approx(0.0006)}
    assert get_model_pricing("nobody/knows") is None
    with pytest.raises(ValueError, match="No pricing configured for model 'nobody/knows'"):
        get_model_pricing("nobody/knows", strict=True)


def test_costs_reach_the_next_history_row_of_their_context_with_running_totals(tmp_path):
    model = art.Model(name="judge-costs", project="p", base_path=str(tmp_path), report_metrics=[])

    @track_api_cost(source="llm_judge/correctness", provider="openai", model_name="openai/gpt-4.1",
                    prompt_price_per_million=1.0, completion_price_per_million=2.0)
    async def train_judge():
        return chat(100, 50)

    @track_api_cost(source="llm_judge/factuality", provider="anthropic", model_name="anthropic/claude-sonnet-4-6",
                    prompt_price_per_million=3.0, completion_price_per_million=4.0)
    async def eval_judge():
        return anthropic(40, 10)

    async def run():
        for context, judge in (("train", train_judge), ("eval", eval_judge)):
            token = model.activate_metrics_context(context)
            try:
                await judge()
            finally:
                token.var.reset(token)
        await model.log(trajectories=None, split="val", step=1, metrics={})  # the eval cost only
        await model.log(trajectories=None, split="train", step=1, metrics={})  # the train cost only

    asyncio.run(run())
    rows = [json.loads(line) for line in (tmp_path / "p" / "models" / "judge-costs" / "history.jsonl").open()]
    assert rows[0]["costs/eval/llm_judge/factuality"] == pytest.approx(0.00016)
    assert "costs/train/llm_judge/correctness" not in rows[0]
    assert rows[1]["costs/train/llm_judge/correctness"] == pytest.approx(0.0002)
    assert "costs/eval/llm_judge/factuality" not in rows[1]
    assert rows[1]["costs/cum/all"] == pytest.approx(0.00036)


def test_art_names_are_where_art_has_them():
    import artrl.metrics

    assert artrl.metrics.track_api_cost is api_costs.track_api_cost
