"""What the client costs: one server, three clients, the same lone `max_tokens=1` request.

    python benchmarks/serve_clients.py [--model artrl/tiny] [--requests 200] [--rounds 3]

Serves the model with the built-in engine in this process (`start_server`, as `LocalBackend` does)
and sends `--requests` sequential chat completions, in `--rounds` rounds, with each of:

* `openai`: `AsyncOpenAI(...).chat.completions.create` on the SDK's default transport (httpx);
* `openai_aiohttp`: the same on the SDK's aiohttp transport (what `model.openai_client()` gives a
  rollout for the local server, src/artrl/client/openai.py);
* `httpx`: `httpx.AsyncClient.post` of the same JSON body, the response parsed with `.json()`;
* `raw`: the same HTTP/1.1 request written on one kept-alive socket (TCP_NODELAY) and the response
  read by its content-length: no client library at all.

Prints one JSON line: each client's median milliseconds per request, one figure per round. The
differences between them are what the client libraries add; `raw` is the server and the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time

import torch

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artrl/tiny")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import httpx
    from openai import AsyncOpenAI, DefaultAioHttpClient

    from artrl.chat.format import end_of_turn_ids
    from artrl.serve import ServedModels, create_app, start_server
    from artrl.serve.engines.factory import open_engine
    from artrl.models.loading import load_base_model
    from artrl.config.model import InternalModelConfig

    torch.set_num_threads(1)
    cfg = InternalModelConfig(device="cpu", inference_cpu_threads=1)
    model, tok = load_base_model(args.model, cfg)
    engine = open_engine("builtin", tokenizer=tok, end_ids=end_of_turn_ids(tok, model), cfg=cfg, model=model,
                         base_model_path=None)
    body = json.dumps({"model": "m", "messages": QUESTION, "max_tokens": 1}).encode()
    try:
        with start_server(create_app(ServedModels("m", engine))) as handle:
            async def measure() -> dict[str, list[float]]:
                client = AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0)
                aio = AsyncOpenAI(base_url=handle.base_url, api_key="x", max_retries=0,
                                  http_client=DefaultAioHttpClient())
                plain = httpx.AsyncClient(base_url=handle.base_url)
                reader, writer = await asyncio.open_connection(handle.host, handle.port)
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {handle.host}\r\n"
                           f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body

                async def with_openai() -> None:
                    await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=1)

                async def with_aiohttp() -> None:
                    await aio.chat.completions.create(model="m", messages=QUESTION, max_tokens=1)

                async def with_httpx() -> None:
                    response = await plain.post("/chat/completions", content=body,
                                                headers={"content-type": "application/json"})
                    response.raise_for_status()
                    response.json()

                async def raw() -> None:
                    writer.write(request)
                    await writer.drain()
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200"), head
                    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length"))
                    await reader.readexactly(length)

                medians: dict[str, list[float]] = {}
                for _ in range(args.rounds):
                    for name, one in (("openai", with_openai), ("openai_aiohttp", with_aiohttp), ("httpx", with_httpx),
                                      ("raw", raw)):
                        for _ in range(10):  # warm-up
                            await one()
                        times = []
                        for _ in range(args.requests):
                            t0 = time.perf_counter()
                            await one()
                            times.append(time.perf_counter() - t0)
                        medians.setdefault(name, []).append(round(1000 * statistics.median(times), 3))
                writer.close()
                await plain.aclose()
                await client.close()
                await aio.close()
                return medians

            medians = asyncio.run(measure())
    finally:
        engine.close()
    print(json.dumps({"bench": "serve_clients", "model": args.model, "requests": args.requests,
                      "median_ms_per_round": medians}))


if __name__ == "__main__":
    main()
