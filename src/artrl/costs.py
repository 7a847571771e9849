"""ART's `art.costs`: per-model token prices (USD per million tokens) and the cost rows they give.

`MODEL_PRICING` is ART 0.5.23's table of its hosted models' prices (prefill, sample, train); `api_costs.py`
falls back to it when a priced API call names one of these models and nothing more specific is known.
`compute_sample_costs` turns one inference call's token counts into ART's two cost leaves,
`costs/<context>/tinker_prefill` and `costs/<context>/tinker_sample` (ART's names, whatever served the call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True)
class ModelPricing:
    """USD per million tokens: of the prompt (`prefill`), of sampled tokens (`sample`), of trained tokens."""

    prefill: float
    sample: float
    train: float


TokenCount: TypeAlias = int | None
CostCalculator: TypeAlias = Callable[[TokenCount, TokenCount, str], dict[str, float]]


def _table(rows: dict[str, tuple[float, float, float]]) -> dict[str, ModelPricing]:
    return {name: ModelPricing(*prices) for name, prices in rows.items()}


# model -> (prefill, sample, train), USD per million tokens: ART 0.5.23's figures
MODEL_PRICING: dict[str, ModelPricing] = _table({
    "Qwen/Qwen3.6-35B-A3B": (0.36, 0.89, 1.07),
    "Qwen/Qwen3.6-27B": (1.24, 3.73, 3.73),
    "Qwen/Qwen3.5-4B": (0.22, 0.67, 0.67),
    "Qwen/Qwen3.5-27B": (1.24, 3.73, 3.73),
    "Qwen/Qwen3.5-35B-A3B": (0.36, 0.89, 1.07),
    "Qwen/Qwen3.5-397B-A17B": (2.00, 5.00, 6.00),
    "Qwen/Qwen3.5-397B-A17B:peft:262144": (4.00, 10.00, 12.00),
    "Qwen/Qwen3-4B-Instruct-2507": (0.07, 0.22, 0.22),
    "Qwen/Qwen3-8B": (0.13, 0.40, 0.40),
    "Qwen/Qwen3-8B-Base": (0.13, 0.40, 0.40),
    "Qwen/Qwen3-30B-A3B": (0.12, 0.30, 0.36),
    "Qwen/Qwen3-30B-A3B-Base": (0.12, 0.30, 0.36),
    "Qwen/Qwen3-30B-A3B-Instruct-2507": (0.12, 0.30, 0.36),
    "Qwen/Qwen3-32B": (0.49, 1.47, 1.47),
    "Qwen/Qwen3-235B-A22B-Instruct-2507": (0.68, 1.70, 2.04),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": (0.18, 0.44, 0.53),
    "Qwen/Qwen3-VL-235B-A22B-Instruct": (1.02, 2.56, 3.07),
    "meta-llama/Llama-3.2-1B": (0.03, 0.09, 0.09),
    "meta-llama/Llama-3.2-3B": (0.06, 0.18, 0.18),
    "meta-llama/Llama-3.1-8B": (0.13, 0.40, 0.40),
    "meta-llama/Llama-3.1-8B-Instruct": (0.13, 0.40, 0.40),
    "meta-llama/Llama-3.1-70B": (1.05, 3.16, 3.16),
    "meta-llama/Llama-3.3-70B-Instruct": (1.05, 3.16, 3.16),
    "deepseek-ai/DeepSeek-V3.1": (1.13, 2.81, 3.38),
    "deepseek-ai/DeepSeek-V3.1-Base": (1.13, 2.81, 3.38),
    "openai/gpt-oss-120b": (0.18, 0.44, 0.52),
    "openai/gpt-oss-120b:peft:131072": (0.63, 1.54, 1.82),
    "openai/gpt-oss-20b": (0.12, 0.30, 0.36),
    "moonshotai/Kimi-K2-Thinking": (0.98, 2.44, 2.93),
    "moonshotai/Kimi-K2.5": (1.47, 3.66, 4.40),
    "moonshotai/Kimi-K2.5:peft:131072": (5.15, 12.81, 15.40),
    "moonshotai/Kimi-K2.6": (1.47, 3.66, 4.40),
    "moonshotai/Kimi-K2.6:peft:131072": (5.15, 12.81, 15.40),
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": (0.13, 0.33, 0.40),
    "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16": (0.38, 0.96, 1.16),
    "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16:peft:262144": (0.76, 1.92, 2.32),
})


def get_model_pricing(model_name: str | None, *, strict: bool = False) -> ModelPricing | None:
    """The prices of `model_name` in `MODEL_PRICING`; None when it has none (`strict=True`: ValueError)."""
    pricing = MODEL_PRICING.get(model_name) if model_name is not None else None
    if pricing is None and strict:
        raise ValueError(f"No pricing configured for model {model_name!r}: add it to artrl.costs.MODEL_PRICING "
                         f"(models priced now: {sorted(MODEL_PRICING)})")
    return pricing


def tokens_to_cost(num_tokens: float, price_per_million: float) -> float:
    """USD of `num_tokens` at `price_per_million`."""
    return float(num_tokens) * price_per_million / 1e6


def compute_sample_costs(*, prompt_tokens: int | None, completion_tokens: int | None, cost_context: str,
                         pricing: ModelPricing) -> dict[str, float]:
    """One inference call's cost leaves: `costs/<context>/tinker_prefill` and `.../tinker_sample` (USD)."""
    context = cost_context.strip("/")
    if not context:
        raise ValueError("cost_context must be non-empty, e.g. 'train' or 'eval'")
    return {f"costs/{context}/tinker_prefill": tokens_to_cost(prompt_tokens or 0, pricing.prefill),
            f"costs/{context}/tinker_sample": tokens_to_cost(completion_tokens or 0, pricing.sample)}


def build_cost_calculator(pricing: ModelPricing) -> CostCalculator:
    """`compute_sample_costs` at fixed prices, called as `(prompt_tokens, completion_tokens, cost_context)`."""
    def calculate(prompt_tokens: TokenCount, completion_tokens: TokenCount, cost_context: str) -> dict[str, float]:
        return compute_sample_costs(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                    cost_context=cost_context, pricing=pricing)

    return calculate


def compute_train_cost(train_tokens: float, pricing: ModelPricing) -> float:
    """USD of training on `train_tokens` tokens."""
    return tokens_to_cost(train_tokens, pricing.train)
