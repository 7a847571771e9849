"""A lone request on a rollout's path against the model's own work: one JSON line, for A/B runs of two trees.

    python benchmarks/serve_lone.py [--requests 200]
    PYTHONPATH=/path/to/other/tree/src python benchmarks/serve_lone.py   # the same measure of another tree

A `TrainableModel` registered with a `LocalBackend` (its engine decodes a serving copy with policy version 0
as its adapter, as in training), `--requests` sequential chat completions (a system prompt and a question,
`max_tokens=1`) with `model.openai_client()`, then 256 at once; after the server is closed, the bare forward +
argmax of the same prompt ids through the same served model and adapter, on one thread. Prints the p50 of
each, their ratio, and the time per request of the 256. Uses only the public API and the backend's engine,
so one copy of this script measures any tree (`artrl bench serve --latency --lora` measures the same path
with the tree's own bench).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import torch

QUESTION = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What is 2 + 3?"}]


async def _serve(requests: int) -> tuple[list[float], float, object, str, list[int]]:
    import artrl as art
    from artrl.config.model import InternalModelConfig

    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="serve-lone-"), show_progress=False)
    model = art.TrainableModel(name="lone", project="p", base_model="artrl/tiny",
                               _internal_config=InternalModelConfig(device="cpu", inference_cpu_threads=1))
    try:
        await model.register(backend)
        engine = backend._runs[model.name].engine
        client, name = model.openai_client(), model.get_inference_name()
        for _ in range(10):  # warm-up: the connection, the first batches
            reply = await client.chat.completions.create(model=name, messages=QUESTION, max_tokens=1)
        walls = []
        for _ in range(requests):
            t0 = time.perf_counter()
            reply = await client.chat.completions.create(model=name, messages=QUESTION, max_tokens=1)
            walls.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await asyncio.gather(*(client.chat.completions.create(model=name, messages=QUESTION, max_tokens=1)
                               for _ in range(256)))
        concurrent = (time.perf_counter() - t0) / 256
        return walls, concurrent, engine.model, engine.live_adapter, reply.model_extra["prompt_token_ids"]
    finally:
        backend.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    args = p.parse_args()
    walls, concurrent, served, adapter, prompt_ids = asyncio.run(_serve(args.requests))
    served.set_adapter(adapter)  # what every request ran
    torch.set_num_threads(1)
    ids = torch.tensor([prompt_ids])  # [1, prompt]
    bare = []
    with torch.inference_mode():
        for i in range(args.requests + 10):
            t0 = time.perf_counter()
            served(input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()  # [1]
            if i >= 10:
                bare.append(time.perf_counter() - t0)
    p50, bare_p50 = statistics.median(walls), statistics.median(bare)
    print(json.dumps({"bench": "serve_lone", "requests": args.requests, "prompt_tokens": len(prompt_ids),
                      "p50_ms": round(1000 * p50, 3), "bare_p50_ms": round(1000 * bare_p50, 3),
                      "ratio_p50": round(p50 / bare_p50, 2), "concurrent_ms_per_request": round(1000 * concurrent, 3)}))


if __name__ == "__main__":
    main()
