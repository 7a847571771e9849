"""`artrl bench serve`: inference throughput, N concurrent requests vs the same requests one at a time.

Starts the OpenAI-compatible server in-process on 127.0.0.1 (a free port) with
the engine `--engine` names (serve/engines/factory.py; default auto), then sends `--requests` chat completions with the real
`openai` client: first all at once (at most `--concurrency` in flight), then
sequentially. Each request has its own seed, so both runs sample the same
tokens. Prints one JSON line: completion tokens/s and latency percentiles (p50, p90,
p99, max) for each run, and their ratio; with the built-in engine, each run's
`oldest_waiter_s` (the longest a request waited in the engine's queue before its
first row joined a batch) and `admission_wait_p99_s` (null with vLLM, which does not report them): under a saturated queue the
engine admits in arrival order (serve/engines/decode_loop.py), so no request waits much
longer than the others.

`--latency` measures what a request costs besides the model's work instead (`run_latency_bench`): one short
question with `max_tokens=1`, sent `--requests` times one at a time (mean, p50, p99) with the client
`model.openai_client()` gives a rollout (`client`: its transport, client/openai.py) and again with the
SDK's default httpx client (`sequential_httpx_client`), the same question in each other wire protocol the server
speaks through its SDK's default client (`protocols`: Completions with the chat prompt's ids, Responses, Anthropic
Messages; sent in turn with the httpx-client chat requests, one of each a round, and `protocols_p50_over_chat`
their p50 over chat's), the same prompt ids
through the engine's `generate` without the server, the bare forward pass + argmax of the same ids with
transformers in this process (the model's work), their ratio, and the time per request when
`--concurrency` of them are in flight at once. A multi-turn agent waits for every turn, so this is what
each turn of a rollout pays on top of its tokens. With `--lora` the engine serves as a training session's does
(a serving copy of the model with a fresh LoRA adapter, saved and loaded as policy version 0, the version every
request runs) and the bare forward runs through the same adapter: a rollout's own path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import statistics
import tempfile
import time
from typing import Any

import torch

PROMPTS = ["Tell me about the weather.", "What is 2 + 3?", "Name three colours.", "Write a short greeting.",
           "Describe a cat.", "List some fruits.", "What day is it?", "Say something kind."]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def _one(client: Any, model: str, i: int, max_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=max_tokens,
        temperature=1.0, seed=1000 + i, logprobs=True)
    return r.usage.completion_tokens, time.perf_counter() - t0


async def _run(client: Any, model: str, n: int, concurrency: int, max_tokens: int, engine: Any = None
               ) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    admitted = getattr(engine, "requests_admitted", None)

    async def limited(i: int) -> tuple[int, float]:
        async with sem:
            return await _one(client, model, i, max_tokens)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(limited(i) for i in range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(t for t, _ in results)
    lat = [s for _, s in results]
    return {"requests": n, "concurrency": concurrency, "completion_tokens": tokens, "seconds": round(wall, 3),
            "completion_tokens_per_s": round(tokens / wall, 1), "latency_p50_s": round(_percentile(lat, 50), 3),
            "latency_p90_s": round(_percentile(lat, 90), 3), "latency_p99_s": round(_percentile(lat, 99), 3),
            "latency_max_s": round(max(lat), 3), "latency_mean_s": round(statistics.fmean(lat), 3),
            **_admission(engine, admitted)}


def _admission(engine: Any, admitted_before: int | None) -> dict[str, float | None]:
    """The built-in engine's queue waits of the requests admitted since `admitted_before` (null for vLLM, whose
    engine does not count them: the report keeps one shape for either engine)."""
    if admitted_before is None:
        return {"oldest_waiter_s": None, "admission_wait_p99_s": None}
    count = min(engine.requests_admitted - admitted_before, len(engine.admission_waits))
    waits = list(engine.admission_waits)[-count:] if count else [0.0]
    return {"oldest_waiter_s": round(max(waits), 3), "admission_wait_p99_s": round(_percentile(waits, 99), 3)}


LATENCY_QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
PROTOCOLS = ("completions", "responses", "messages")
"""The wire protocols besides chat whose lone request `--latency` times too (`protocols` in its JSON)."""


def _open_engine(model_name: str, cfg: Any, lora: bool = False, serve_copy: bool = False
                 ) -> tuple[str, Any, Any, Any]:
    """(engine kind, engine, tokenizer, the transformers model or None) for `cfg`, as LocalBackend opens them
    (`serve_copy`: the built-in engine decodes a copy of the model sharing its frozen tensors, as a training
    session's engine does)."""
    from ...chat.format import end_of_turn_ids
    from ...serve.engines.factory import open_engine, resolve_engine_kind
    from ...models.loading import (RANDOM_SHAPES, add_lora, load_base_model, load_generation_config, resolve_device,
                                  resolve_name)
    from ...models.tokenizer import load_tokenizer

    on_disk = model_name not in RANDOM_SHAPES
    kind = resolve_engine_kind(cfg.inference_engine, resolve_device(cfg).type, weights_on_disk=on_disk)
    if kind == "builtin":
        model, tok = load_base_model(model_name, cfg)
        ends = end_of_turn_ids(tok, model)
        if lora:  # as the trainer serves it: a fresh LoRA adapter on every projection
            model = add_lora(model, cfg)
    else:
        model, tok = None, load_tokenizer(model_name, cfg)
        ends = end_of_turn_ids(tok, load_generation_config(model_name, cfg))
    engine = open_engine(kind, tokenizer=tok, end_ids=ends, cfg=cfg, model=model,
                         base_model_path=resolve_name(model_name) if on_disk else None,
                         serve_copy=serve_copy and kind == "builtin")
    return kind, engine, tok, model


def _stats_ms(seconds: list[float]) -> dict[str, float]:
    return {"mean_ms": round(1000 * statistics.fmean(seconds), 3), "p50_ms": round(1000 * _percentile(seconds, 50), 3),
            "p99_ms": round(1000 * _percentile(seconds, 99), 3)}


def _bare_forward_s(model: Any, prompt_ids: list[int], runs: int, threads: int | None) -> list[float]:
    """Seconds of each of `runs` forward passes + argmax of `prompt_ids` (after 5 untimed), on `threads` threads."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)  # [1, prompt]
    before = torch.get_num_threads()
    if threads and device.type == "cpu":
        torch.set_num_threads(threads)  # the decode worker's count, set the same way (per thread)
    times = []
    try:
        with torch.inference_mode():
            for i in range(runs + 5):
                t0 = time.perf_counter()
                # as the engine's prefill: the last position's logits only
                token = model(input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1)  # [1]
                token.tolist()  # on a GPU: wait for it, as the engine does
                if i >= 5:
                    times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return times


def run_latency_bench(model_name: str = "artrl/tiny", requests: int = 200, concurrency: int = 256,
                      device: str | None = None, num_threads: int | None = None,
                      engine_kind: str = "auto", *, lora: bool = False) -> dict[str, Any]:
    """The `--latency` JSON (module docstring): sequential `max_tokens=1` requests against the bare forward.
    `lora`: serve as a training session does (module docstring), the bare forward through the same adapter."""
    if requests < 1 or concurrency < 1:
        raise ValueError(f"need requests >= 1 and concurrency >= 1, got {requests} and {concurrency}")
    from openai import AsyncOpenAI

    try:
        import anthropic
    except ImportError:  # the Messages row is null
        anthropic = None

    from ...chat.format import render_prompt
    from ...model import Model
    from ...client.openai import transport_of
    from ...serve import ServedModels, create_app, start_server
    from ...serve.engines.base import GenerationRequest
    from ...models.loading import load_base_model, resolve_device
    from ...config.model import InternalModelConfig

    threads = {"inference_cpu_threads": num_threads} if num_threads is not None else {}  # else LocalBackend's
    cfg = InternalModelConfig(device=device, inference_engine=engine_kind, **threads)
    dev = resolve_device(cfg)
    kind, engine, tok, model = _open_engine(model_name, cfg, lora=lora, serve_copy=lora)
    prompt_ids = render_prompt(tok, LATENCY_QUESTION, None, end_ids=engine.end_of_turn_ids)
    name = "bench"
    adapters = tempfile.TemporaryDirectory(prefix="artrl-bench-") if lora else contextlib.nullcontext()
    try:
        if lora:  # a new run's step 0, as a training session serves it: the adapter saved, loaded as a version
            model.save_pretrained(adapters.name)
            engine.set_live_weights(adapters.name, 0)
        with start_server(create_app(ServedModels(name, engine))) as handle:
            # the user's client: what `model.openai_client()` gives inside a rollout's event loop; and the SDK's
            # default (httpx) client, for comparison
            user = Model(name=name, project="bench", inference_base_url=handle.base_url, inference_api_key="bench")
            plain = AsyncOpenAI(base_url=handle.base_url, api_key="bench", max_retries=0, timeout=600)
            clients: dict[str, Any] = {}
            by_protocol: dict[str, list[float]] = {}

            async def one(which: str = "user") -> float:
                client = clients[which]
                t0 = time.perf_counter()
                r = await client.chat.completions.create(model=name, messages=LATENCY_QUESTION, max_tokens=1)
                assert r.usage.completion_tokens == 1, r.usage
                return time.perf_counter() - t0

            async def protocol(which: str) -> float:
                """One lone `max_tokens=1` request of the question in another wire protocol (its SDK's client)."""
                t0 = time.perf_counter()
                if which == "completions":
                    r = await plain.completions.create(model=name, prompt=prompt_ids, max_tokens=1)
                    assert r.usage.completion_tokens == 1, r.usage
                elif which == "responses":
                    r = await plain.responses.create(model=name, input=LATENCY_QUESTION[0]["content"],
                                                     max_output_tokens=1, store=False)
                    assert r.usage.output_tokens == 1, r.usage
                else:
                    r = await clients["messages"].messages.create(model=name, messages=LATENCY_QUESTION, max_tokens=1)
                    assert r.usage.output_tokens == 1, r.usage
                return time.perf_counter() - t0

            async def engine_alone() -> float:
                t0 = time.perf_counter()
                await engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=1))
                return time.perf_counter() - t0

            async def main() -> tuple[list[float], list[float], list[float], float]:
                clients.update(user=user.openai_client(), plain=plain)
                if anthropic is not None:
                    clients["messages"] = anthropic.AsyncAnthropic(base_url=handle.base_url.removesuffix("/v1"),
                                                                   api_key="bench", max_retries=0, timeout=600)
                for _ in range(10):  # warm-up: connection, caches, first batches
                    await one()
                    await one("plain")
                    await engine_alone()
                sequential = [await one() for _ in range(requests)]
                others = [which for which in PROTOCOLS if which != "messages" or anthropic is not None]
                for which in others:
                    for _ in range(5):
                        await protocol(which)
                # chat (the same SDK client) and each other protocol in turn, request by request: a load that
                # comes and goes on the machine falls on all of them alike
                with_httpx = []
                for _ in range(requests):
                    with_httpx.append(await one("plain"))
                    for which in others:
                        by_protocol.setdefault(which, []).append(await protocol(which))
                direct = [await engine_alone() for _ in range(requests)]
                await asyncio.gather(*(one() for _ in range(min(concurrency, 32))))  # warm-up of batching
                t0 = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(concurrency)))
                concurrent = time.perf_counter() - t0
                await plain.close()
                return sequential, with_httpx, direct, concurrent

            sequential, with_httpx, direct, concurrent_s = asyncio.run(main())
            transport = transport_of(clients["user"])
        if lora:  # the model's work: the forward of what was served, through the same adapter
            model = engine.model
            model.set_adapter(engine.live_adapter)
    finally:
        engine.close()
        if lora:
            adapters.cleanup()
    if model is None:  # vLLM runs its model in its own processes: the same weights with transformers, here
        model, _ = load_base_model(model_name, cfg)
    forward = _bare_forward_s(model, prompt_ids, requests, cfg.inference_cpu_threads if dev.type == "cpu" else None)
    seq, fwd, chat = _stats_ms(sequential), _stats_ms(forward), _stats_ms(with_httpx)
    others = {which: _stats_ms(times) for which, times in by_protocol.items()}  # the protocols timed
    return {"bench": "serve_latency", "model": model_name, "engine": kind, "device": str(dev),
            "threads": None if kind == "vllm" else
            (cfg.inference_cpu_threads if dev.type == "cpu" else None) or torch.get_num_threads(),
            "lora": lora, "prompt_tokens": len(prompt_ids), "max_tokens": 1, "requests": requests,
            "client": transport, "sequential": seq, "sequential_httpx_client": chat,
            # the same lone request in each other wire protocol, through its SDK's default client (null: anthropic
            # is not installed)
            "protocols": {which: others.get(which) for which in PROTOCOLS},
            # each protocol's p50 over chat's through the same client, timed in alternation with it
            "protocols_p50_over_chat": {which: round(stats["p50_ms"] / chat["p50_ms"], 3)
                                        for which, stats in others.items()},
            "engine_generate": _stats_ms(direct), "bare_forward": fwd,
            "ratio_mean": round(seq["mean_ms"] / fwd["mean_ms"], 2),
            "ratio_p50": round(seq["p50_ms"] / fwd["p50_ms"], 2),
            "concurrency": concurrency, "max_batch_size": cfg.inference_max_batch_size,
            "concurrent_ms_per_request": round(1000 * concurrent_s / concurrency, 3)}


def run_serve_bench(model_name: str = "artrl/tiny", requests: int = 32, concurrency: int = 16,
                    max_tokens: int = 64, device: str | None = None,
                    num_threads: int | None = None, engine_kind: str = "auto", *, lora: bool = False,
                    merge_lora: bool | None = None, attn_implementation: str | None = None,
                    static_cache: bool = False, cuda_graphs: bool | None = None,
                    sequential_requests: int | None = None, load_in_4bit: bool | None = None) -> dict[str, Any]:
    """The serve benchmark's JSON (module docstring); `sequential_requests` (default `requests`) is how many of
    the same requests the one-at-a-time run sends: fewer keep a slow engine's run short."""
    sequential_requests = requests if sequential_requests is None else sequential_requests
    if requests < 1 or not 1 <= sequential_requests <= requests:
        raise ValueError(f"need requests >= 1 and 1 <= sequential_requests <= requests, got {requests} and "
                         f"{sequential_requests}")
    from openai import AsyncOpenAI

    from ...models.loading import resolve_device
    from ...models.quantization import quantization_of
    from ...serve import ServedModels, create_app, start_server
    from ...config.model import InternalModelConfig

    threads = {"inference_cpu_threads": num_threads} if num_threads is not None else {}  # else LocalBackend's
    cfg = InternalModelConfig(device=device, inference_max_batch_size=max(concurrency, 1),
                              inference_engine=engine_kind, inference_merge_lora=merge_lora,
                              inference_attn_implementation=attn_implementation,
                              inference_static_cache=static_cache, inference_cuda_graphs=cuda_graphs,
                              load_in_4bit=load_in_4bit, **threads)
    dev = resolve_device(cfg)
    kind, engine, _, model = _open_engine(model_name, cfg, lora)
    name = "bench"
    try:
        with start_server(create_app(ServedModels(name, engine))) as handle:
            client = AsyncOpenAI(base_url=handle.base_url, api_key="bench", max_retries=0, timeout=600)

            async def main() -> tuple[dict[str, Any], dict[str, Any]]:
                await _one(client, name, 0, 4)  # warm-up
                batches_before = getattr(engine, "batches_served", None)
                concurrent = await _run(client, name, requests, concurrency, max_tokens, engine)
                if batches_before is not None:  # the built-in engine counts its decode batches
                    concurrent["engine_batches"] = engine.batches_served - batches_before
                sequential = await _run(client, name, sequential_requests, 1, max_tokens, engine)
                return concurrent, sequential

            concurrent, sequential = asyncio.run(main())
    finally:
        engine.close()
    return {"bench": "serve", "model": model_name, "engine": kind, "device": str(dev),
            # the built-in engine's decode threads; vLLM sets its own in its processes (null here)
            "threads": None if kind == "vllm" else
            (cfg.inference_cpu_threads if dev.type == "cpu" else None) or torch.get_num_threads(),
            "max_tokens": max_tokens, "lora": lora,
            # the built-in engine's weights as loaded ("4bit", "8bit" or null); the process's peak resident memory
            "quantization": quantization_of(model) if model is not None else None,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            # the built-in engine's GPU switches, as it resolved them (null: another engine)
            "merge_lora": getattr(engine, "merge_lora", None), "attn_implementation": getattr(
                engine, "attn_implementation", None) if kind == "builtin" else None,
            "static_cache": getattr(engine, "static_cache", None), "cuda_graphs": getattr(engine, "cuda_graphs", None),
            "ratio_tokens_per_s": round(concurrent["completion_tokens_per_s"] / sequential["completion_tokens_per_s"], 3),
            "concurrent": concurrent, "sequential": sequential}


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default="artrl/tiny", help="base model name or path")
    p.add_argument("--latency", action="store_true", help="per-request overhead instead of throughput: "
                   "sequential max_tokens=1 requests against the bare forward pass (module docstring); "
                   "--requests (default 200) and --concurrency (default 256) apply, the other options but "
                   "--model, --device, --threads, --engine and --lora do not")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 32; --latency: 200)")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight in the concurrent run "
                   "(default 16; --latency: 256)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads of the decode worker (default: LocalBackend's, 1 on CPU)")
    p.add_argument("--lora", action="store_true", help="serve the model with a fresh LoRA adapter on it, as a "
                   "trainer does (default: the bare base model); with --latency, as a training session serves "
                   "it (a serving copy, the adapter loaded as policy version 0)")
    p.add_argument("--merge-lora", choices=("auto", "on", "off"), default="auto", help="built-in engine: serve "
                   "the LoRA adapter from merged weights (auto: on CUDA)")
    p.add_argument("--attn", default=None, help="built-in engine: the attention implementation of decode "
                   "batches (default: sdpa on CUDA, the model's own on CPU)")
    p.add_argument("--static-cache", action="store_true", help="built-in engine: decode in the slots of a static "
                   "KV cache (off by default)")
    p.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto", help="built-in engine, with "
                   "--static-cache: replay the decode step from a CUDA graph (auto: on CUDA)")
    p.add_argument("--sequential-requests", type=int, default=None, help="requests of the one-at-a-time run "
                   "(default: --requests; the first N of the same requests)")
    p.add_argument("--load-in-4bit", action=argparse.BooleanOptionalAction, default=None, help="the base weights "
                   "in 4-bit NF4 (bitsandbytes) or not (default: the loader's rule, docs/models.md)")
    p.add_argument("--engine", choices=("auto", "builtin", "vllm"), default="auto",
                   help="inference engine (default: auto = vLLM when installed and on a GPU, else built-in)")


def main(args: Any) -> int:
    import os

    # the JSON line is this command's only standard output: vLLM (and its processes) log to stderr instead
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.latency:
        print(json.dumps(run_latency_bench(args.model, args.requests or 200, args.concurrency or 256, args.device,
                                           args.threads, args.engine, lora=args.lora)))
        return 0
    merge = {"auto": None, "on": True, "off": False}[args.merge_lora]
    print(json.dumps(run_serve_bench(args.model, args.requests or 32, args.concurrency or 16, args.max_tokens,
                                     args.device,
                                     args.threads, args.engine, lora=args.lora, merge_lora=merge,
                                     attn_implementation=args.attn, static_cache=args.static_cache,
                                     cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
                                     sequential_requests=args.sequential_requests,
                                     load_in_4bit=args.load_in_4bit)))
    return 0
