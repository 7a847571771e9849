"""Where one chat request's time goes: a stage-by-stage breakdown of a lone `max_tokens=1` request.

    python benchmarks/serve_profile.py [--model artrl/tiny] [--requests 200]

The path a rollout takes: a `TrainableModel` registered with a `LocalBackend` (its engine decodes a
serving copy of the peft model with the live policy version as its adapter), and `--requests` sequential chat
completions (a system prompt and a short question, `max_tokens=1`) sent with `model.openai_client()`,
the client a rollout gets (the `openai` SDK on aiohttp). Two views of the same requests:

* **Wall time by stage**, each timed by wrapping the function that does it, in this process only
  (the library is not changed): client + HTTP (the client's wall time minus the server's ASGI time),
  server ASGI from the first byte the app sees to the last it sends (request parsing, rendering +
  tokenizing, `engine.generate`, the choice, the JSON response), and inside `generate` the hand-off to
  the decode worker (until the request's rows join a batch), the batch (prefill forward, sampling, the
  record) and the hand-off back.
* **CPU time per request of each thread** (the client's event loop, the server's, the decode worker,
  any other), read from each thread's CPU clock before and after the requests. On a machine shared
  with other work a request's wall time includes waiting for a core and for the interpreter lock; CPU
  time counts only the work, so it says which stage costs what on a loaded machine too.

Both next to the bare forward pass + argmax of the same prompt ids through the same served model (its
adapter included): the model's work. Prints a Markdown table of each (median and mean, milliseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

import torch

QUESTION = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What is 2 + 3?"}]


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


def _thread_cpu() -> dict[str, float]:
    """CPU seconds each live thread of this process has used, by thread name."""
    out: dict[str, float] = defaultdict(float)
    for thread in threading.enumerate():
        try:
            clock = time.pthread_getcpuclockid(thread.ident)  # type: ignore[arg-type]
            out[_role(thread.name)] += time.clock_gettime(clock)
        except (OSError, TypeError):  # ended meanwhile
            pass
    return out


def _role(name: str) -> str:
    if name == "MainThread":
        return "client (the rollout's event loop)"
    if name.startswith("artrl-server"):
        return "server event loop"
    if name.startswith("artrl-transformers-engine"):
        return "decode worker"
    return "other threads"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artrl/tiny")
    p.add_argument("--requests", type=int, default=200)
    args = p.parse_args()

    import artrl as art
    from artrl.serve.http import core, server
    from artrl.serve.http.prompts import PromptBuilder
    from artrl.serve.engines.decode_batch import DecodeBatch
    from artrl.serve.engines.decode_loop import DecodeLoop
    from artrl.config.model import InternalModelConfig

    torch.set_num_threads(1)
    times: dict[str, list[float]] = defaultdict(list)
    marks: dict[str, float] = {}
    server.parse_body = _timed(times, "request parsing + validation", server.parse_body)
    core.request_messages = _timed(times, "message checks", core.request_messages)
    core._choice_json = _timed(times, "choice: detokenize, stops, token record", core._choice_json)
    server.JSONResponse.render = _timed(times, "JSON response", server.JSONResponse.render)
    PromptBuilder.prompt_ids = _timed(times, "render + tokenize", PromptBuilder.prompt_ids)
    admit, finish = DecodeBatch.admit, DecodeLoop._finish

    def timed_admit(self: Any, *args: Any, **kwargs: Any) -> None:
        marks["run"] = time.perf_counter()  # the request's rows join a batch: its prefill starts
        if "generate" in marks:
            times["  hand-off to the worker"].append(marks["run"] - marks["generate"])
        admit(self, *args, **kwargs)

    def timed_finish(self: Any, row: Any) -> None:
        marks["answered"] = time.perf_counter()  # just before the request's future gets its result
        times["  batch: prefill, sample, record"].append(marks["answered"] - marks["run"])
        finish(self, row)

    DecodeBatch.admit, DecodeLoop._finish = timed_admit, timed_finish  # type: ignore[method-assign]

    async def requests() -> tuple[list[float], dict[str, float], Any, list[int]]:
        backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="serve-profile-"), show_progress=False)
        cfg = InternalModelConfig(device="cpu", inference_cpu_threads=1)
        model = art.TrainableModel(name="profile", project="p", base_model=args.model, _internal_config=cfg)
        try:
            await model.register(backend)
            engine = backend._runs[model.name].engine
            generate = engine.generate

            async def timed_generate(request: Any, on_token: Any = None) -> Any:
                marks["generate"] = time.perf_counter()
                out = await generate(request, on_token)
                now = time.perf_counter()
                times["engine.generate"].append(now - marks["generate"])
                times["  hand-off back to the event loop"].append(now - marks["answered"])
                return out

            engine.generate = timed_generate  # type: ignore[method-assign]
            name = model.get_inference_name()
            app = backend._server._server.config.app  # the ASGI app: time it from the outside
            inner = app.middleware_stack or app.build_middleware_stack()

            async def asgi_timer(scope: dict, receive: Any, send: Any) -> None:
                t0 = time.perf_counter()
                await inner(scope, receive, send)
                if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
                    times["server ASGI"].append(time.perf_counter() - t0)

            app.middleware_stack = asgi_timer
            client = model.openai_client()

            async def one() -> tuple[float, Any]:
                t0 = time.perf_counter()
                reply = await client.chat.completions.create(model=name, messages=QUESTION, max_tokens=1)
                return time.perf_counter() - t0, reply

            for _ in range(10):
                await one()
            times.clear()
            cpu_before = _thread_cpu()
            walls, reply = [], None
            for _ in range(args.requests):
                wall, reply = await one()
                walls.append(wall)
            cpu_after = _thread_cpu()
            cpu = {k: (cpu_after[k] - cpu_before.get(k, 0.0)) / args.requests for k in cpu_after}
            return walls, cpu, engine.model, reply.model_extra["prompt_token_ids"]
        finally:
            backend.close()

    walls, cpu, served, prompt_ids = asyncio.run(requests())
    ids = torch.tensor([prompt_ids])  # [1, prompt]
    bare, bare_cpu = [], []
    with torch.inference_mode():
        for i in range(args.requests + 10):
            t0, c0 = time.perf_counter(), time.thread_time()
            served(input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()  # [1]
            if i >= 10:
                bare.append(time.perf_counter() - t0)
                bare_cpu.append(time.thread_time() - c0)

    times["client + HTTP (wall - server ASGI)"] = [w - s for w, s in zip(walls, times["server ASGI"])]
    times["client wall time"] = walls
    times["bare forward + argmax (same prompt, served model)"] = bare
    order = ["client wall time", "client + HTTP (wall - server ASGI)", "server ASGI",
             "request parsing + validation", "message checks", "render + tokenize", "engine.generate",
             "  hand-off to the worker", "  batch: prefill, sample, record", "  hand-off back to the event loop",
             "choice: detokenize, stops, token record", "JSON response",
             "bare forward + argmax (same prompt, served model)"]
    print(f"{args.requests} sequential requests with model.openai_client(), max_tokens=1, prompt of "
          f"{len(prompt_ids)} tokens, one decode thread, served: the LocalBackend's serving copy with its adapter\n")
    print("| stage (wall time) | median ms | mean ms |\n|---|---|---|")
    for stage in order:
        values = times[stage]
        if values:
            print(f"| {stage} | {1000 * statistics.median(values):.2f} | {1000 * statistics.fmean(values):.2f} |")
    print("\n| thread | CPU ms per request |\n|---|---|")
    for role in sorted(cpu):
        print(f"| {role} | {1000 * cpu[role]:.2f} |")
    print(f"| all threads | {1000 * sum(cpu.values()):.2f} |")
    print(f"| bare forward + argmax (CPU, median) | {1000 * statistics.median(bare_cpu):.2f} |")


if __name__ == "__main__":
    main()
