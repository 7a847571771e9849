"""vLLM alone (no artrl server) on the tiny model: what LoRA support and artrl's grammar
logits processor cost vLLM's CPU build. One JSON line per run.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        .venv-vllm/bin/python benchmarks/vllm_direct.py plain|lora|lora+grammar

`plain`: vLLM with raw logprobs; `lora`: as artrl starts it (enable_lora, 4 adapter slots,
rank 16), serving the base model; `lora+grammar`: plus artrl's structured-output logits
processor (serve/engines/vllm_grammar.py), idle for requests without a grammar. Eight 64-token
requests one at a time, then 16 at once (ignore_eos, so every request yields 64 tokens).
"""

import json
import sys
import time

from vllm import LLM, SamplingParams

from artrl.models.tiny import tiny_model_path

variant = sys.argv[1] if len(sys.argv) > 1 else "plain"
if variant not in ("plain", "lora", "lora+grammar"):
    sys.exit(f"usage: {sys.argv[0]} plain|lora|lora+grammar")
kw = dict(model=str(tiny_model_path()), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=1024**3,
          logprobs_mode="raw_logprobs", disable_log_stats=True)
if "lora" in variant:
    kw.update(enable_lora=True, max_loras=4, max_lora_rank=16)
if "grammar" in variant:
    kw.update(logits_processors=["artrl.serve.engines.vllm_grammar:GrammarLogitsProcessor"])
llm = LLM(**kw)


def params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=64, temperature=1.0, seed=1000 + i, logprobs=1, ignore_eos=True)


llm.generate(["hi"], params(0), use_tqdm=False)  # warm-up
t = time.perf_counter()
for i in range(8):
    llm.generate([f"Tell me about {i}"], params(i), use_tqdm=False)
sequential = 8 * 64 / (time.perf_counter() - t)
t = time.perf_counter()
llm.generate([f"Tell me about {i}" for i in range(16)], [params(i) for i in range(16)], use_tqdm=False)
batched = 16 * 64 / (time.perf_counter() - t)
print(json.dumps({"bench": "vllm_direct", "variant": variant, "sequential_tokens_per_s": round(sequential, 1),
                  "batched16_tokens_per_s": round(batched, 1)}))
