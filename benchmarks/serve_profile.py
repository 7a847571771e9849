"""Where one chat request's time goes: a stage-by-stage breakdown of a lone `max_tokens=1` request.

    python benchmarks/serve_profile.py [--model artrl/tiny] [--requests 200] [--threads 1]

Serves the model with the built-in engine in this process (`start_server`, as `LocalBackend` does) and
sends `--requests` sequential chat completions with the `openai` client (one short question,
`max_tokens=1`, as `artrl bench serve --latency` does). Each stage is timed by wrapping the function
that does it, in this process only (the library is not changed):

* client + HTTP: the client's wall time minus the server's ASGI time (the `openai` client, httpx,
  the socket in both directions, uvicorn's parsing);
* server ASGI: the app from the first byte it sees to the last it sends, split into
  request parsing and validation (pydantic, the remainder), message checks (`request_messages`),
  rendering + tokenization (`PromptBuilder.prompt_ids`), the engine's `generate`, the choice
  (detokenization, stop strings, tool calls, the token record: `_choice_json`) and the JSON
  response;
* inside `generate`: the hand-off to the worker thread (from `generate` until the worker starts
  the batch), the batch itself (prefill forward, sampling, record), and the hand-off back (from
  the batch's end until `generate` returns on the event loop);
* the bare forward pass + argmax of the same prompt ids in this process, for scale.

Prints a Markdown table of the median and mean of each stage, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def _timed(times: dict[str, list[float]], stage: str, fn: Any) -> Any:
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper_async(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                times[stage].append(time.perf_counter() - t0)
        return wrapper_async

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[stage].append(time.perf_counter() - t0)
    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artrl/tiny")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the decode worker and the bare forward")
    args = p.parse_args()

    from openai import AsyncOpenAI

    from artrl.chat_format import end_of_turn_ids, render_prompt
    from artrl.serve import ServedModels, create_app, server, start_server
    from artrl.serve.chat import PromptBuilder
    from artrl.serve.decode_loop import DecodeLoop
    from artrl.serve.factory import open_engine
    from artrl.models.loading import load_base_model
    from artrl.types import InternalModelConfig

    torch.set_num_threads(args.threads)
    cfg = InternalModelConfig(device="cpu", inference_cpu_threads=args.threads)
    model, tok = load_base_model(args.model, cfg)
    ends = end_of_turn_ids(tok, model)
    engine = open_engine("builtin", tokenizer=tok, end_ids=ends, cfg=cfg, model=model, base_model_path=None)

    times: dict[str, list[float]] = defaultdict(list)
    marks: dict[str, float] = {}
    server.request_messages = _timed(times, "message checks", server.request_messages)
    server._choice_json = _timed(times, "choice: detokenize, stops, token record", server._choice_json)
    server.JSONResponse.render = _timed(times, "JSON response", server.JSONResponse.render)
    PromptBuilder.prompt_ids = _timed(times, "render + tokenize", PromptBuilder.prompt_ids)
    generate = engine.generate

    async def timed_generate(request: Any) -> Any:
        marks["generate"] = time.perf_counter()
        out = await generate(request)
        now = time.perf_counter()
        times["engine.generate"].append(now - marks["generate"])
        times["  hand-off back to the event loop"].append(now - marks["answered"])
        return out

    engine.generate = timed_generate  # type: ignore[method-assign]
    run, finish = DecodeLoop._run, DecodeLoop._finish

    def timed_run(self: Any, waiting: Any) -> None:
        marks["run"] = time.perf_counter()
        times["  hand-off to the worker"].append(marks["run"] - marks["generate"])
        run(self, waiting)

    def timed_finish(self: Any, row: Any) -> None:
        marks["answered"] = time.perf_counter()  # just before the request's future gets its result
        times["  batch: prefill, sample, record"].append(marks["answered"] - marks["run"])
        finish(self, row)

    DecodeLoop._run, DecodeLoop._finish = timed_run, timed_finish  # type: ignore[method-assign]

    app = create_app(ServedModels("m", engine))

    class AsgiTimer:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            t0 = time.perf_counter()
            await self.inner(scope, receive, send)
            if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
                times["server ASGI"].append(time.perf_counter() - t0)

    app.add_middleware(AsgiTimer)
    try:
        with start_server(app) as handle:
            client = AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0)

            async def one() -> float:
                t0 = time.perf_counter()
                await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=1)
                return time.perf_counter() - t0

            async def requests() -> list[float]:
                for _ in range(10):
                    await one()
                times.clear()
                return [await one() for _ in range(args.requests)]

            walls = asyncio.run(requests())
    finally:
        engine.close()
    ids = torch.tensor([render_prompt(tok, QUESTION, None, end_ids=ends)])  # [1, prompt]
    bare = []
    with torch.inference_mode():
        for i in range(args.requests + 10):
            t0 = time.perf_counter()
            model(ids).logits[:, -1].argmax(-1)  # [1]
            if i >= 10:
                bare.append(time.perf_counter() - t0)

    times["client + HTTP (wall - server ASGI)"] = [w - s for w, s in zip(walls, times["server ASGI"])]
    named = {"message checks", "render + tokenize", "engine.generate", "choice: detokenize, stops, token record",
             "JSON response"}
    times["request parsing + validation, rest"] = [
        s - sum(times[k][i] for k in named) for i, s in enumerate(times["server ASGI"])]
    order = ["client wall time", "client + HTTP (wall - server ASGI)", "server ASGI",
             "request parsing + validation, rest", "message checks", "render + tokenize", "engine.generate",
             "  hand-off to the worker", "  batch: prefill, sample, record", "  hand-off back to the event loop",
             "choice: detokenize, stops, token record", "JSON response", "bare forward + argmax (same prompt)"]
    times["client wall time"] = walls
    times["bare forward + argmax (same prompt)"] = bare
    print(f"{args.requests} sequential requests, max_tokens=1, prompt of {ids.shape[1]} tokens, "
          f"{args.threads} thread(s)\n")
    print("| stage | median ms | mean ms |\n|---|---|---|")
    for stage in order:
        values = times[stage]
        print(f"| {stage} | {1000 * statistics.median(values):.2f} | {1000 * statistics.fmean(values):.2f} |")


if __name__ == "__main__":
    main()
