"""What a mixed-version decode batch costs against a single-version one (built-in engine).

Eight rows of 64 greedy tokens each on the tiny model with a LoRA adapter: either every row
on the live policy version (`--mix single`: peft's plain forward), or the rows spread over
two versions and the base weights (`--mix mixed`: peft's `adapter_names` forward). The
whole process is what a timer measures (see docs/engines.md, *Mixed-version batches*), the two
modes run in turn, five of each:

    for i in 1 2 3 4 5; do
        /usr/bin/time -f %e python benchmarks/mixed_versions.py --mix mixed
        /usr/bin/time -f %e python benchmarks/mixed_versions.py --mix single
    done

Prints one JSON line: rows, decode steps, and the decode wall seconds inside the process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from artrl.serve import GenerationRequest, TransformersEngine
from artrl.serve.engines.base import BASE_WEIGHTS
from artrl.models.tiny import load_tiny

LORA = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
                                                      "gate_proj"], lora_dropout=0.0, init_lora_weights=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", choices=("single", "mixed"), required=True)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base, tokenizer = load_tiny(Path(tmp) / "cache")
        model = get_peft_model(base, LORA).eval()
        for step in (1, 2):
            model.save_pretrained(Path(tmp) / str(step))
        engine = TransformersEngine(model, tokenizer, max_batch_size=args.rows, end_ids=frozenset(), serve_copy=True)
        try:
            engine.set_live_weights(str(Path(tmp) / "1"), 1)
            engine.load_adapter("m@1", str(Path(tmp) / "1"))
            engine.set_live_weights(str(Path(tmp) / "2"), 2)
            adapters = [None] if args.mix == "single" else [None, "m@1", BASE_WEIGHTS]
            prompt = tokenizer("tell me a story about the sea", add_special_tokens=False).input_ids
            requests = [GenerationRequest(prompt_ids=prompt, max_tokens=args.tokens, temperature=0.0,
                                          adapter=adapters[i % len(adapters)]) for i in range(args.rows)]

            async def together() -> None:
                await asyncio.gather(*(engine.generate(r) for r in requests))

            steps = engine.decode_steps
            start = time.perf_counter()
            asyncio.run(together())
            seconds = time.perf_counter() - start
        finally:
            engine.close()
    print(json.dumps({"mix": args.mix, "rows": args.rows, "decode_steps": engine.decode_steps - steps,
                      "decode_s": round(seconds, 3)}))


if __name__ == "__main__":
    main()
