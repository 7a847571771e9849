"""`python benchmarks/bench.py replicas`: rollout throughput on 1, 2, 4... inference replicas behind the router.

What it measures, on a workload whose requests wait on something other than this machine's CPU
(each replica is the paced scripted engine, serve/engines/scripted.py: `--slots` rows decode at once, each
holding its slot `--token-time-ms` per token for `--reply-tokens` tokens, asleep meanwhile; so a
2-core machine measures the replicas and the router, not its own cores):

1. **Rollout throughput** with each replica count: `--rollouts` rollouts of `--turns` turns, at
   most `--concurrency` at once, through the router with `model.openai_client()`'s session
   affinity (one `X-Session-ID` per rollout). One replica serves `slots / (token time x tokens)`
   requests a second; N replicas, with enough concurrency, N times that: the speedup and the
   scaling efficiency (speedup / N) say how close the router and the replicas come to it. The
   router places sessions by a hash, not by load: each count's requests per replica, and the
   busiest replica's share of them (1/N when even), say how much of a shortfall that explains.
2. **The router's added latency**: the same request, one at a time, to one replica directly and
   through the router, alternately (unpaced: the scripted engine answers at once), median and 90th
   percentile of each and the difference of the medians.
3. **Publish time**: `ReplicaSet.set_live_weights` of a new version across all replicas (load on
   every replica, then make it live on every one), median of `--publishes`. The scripted engine
   loads nothing, so this is the control plane's own time (its round trips), not a weight load.

Prints one JSON line (like the other benches) and a table to the log; the machine's load average
before and after is in the JSON, since a busy machine slows the client and the router.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def add_arguments(p: Any) -> None:
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4], help="replica counts to measure")
    p.add_argument("--rollouts", type=int, default=192, help="rollouts per replica count")
    p.add_argument("--turns", type=int, default=2, help="turns (requests) per rollout")
    p.add_argument("--concurrency", type=int, default=64, help="rollouts running at once")
    p.add_argument("--token-time-ms", type=float, default=20.0, help="scripted engine: time per token")
    p.add_argument("--reply-tokens", type=int, default=24, help="scripted engine: tokens per answer")
    p.add_argument("--slots", type=int, default=4, help="scripted engine: rows decoding at once per replica")
    p.add_argument("--latency-requests", type=int, default=200, help="requests for the router's added latency")
    p.add_argument("--publishes", type=int, default=5, help="versions published per replica count")


def _replica_set(n: int, args: Any, run: Path, token_time_ms: float) -> Any:
    from artrl.replicas.control import ReplicaSet
    from artrl.config.model import InternalModelConfig

    cfg = InternalModelConfig(inference_replicas=n, inference_max_batch_size=args.slots, device="cpu")
    return ReplicaSet(name="bench", base_model="artrl/tiny", cfg=cfg, run=run, api_key="bench-key",
                      engine="scripted", engine_options=["--token-time-ms", str(token_time_ms),
                                                         "--reply-tokens", str(args.reply_tokens)]).start()


def _client(base_url: str) -> Any:
    from openai import AsyncOpenAI, DefaultAioHttpClient

    from artrl.client.affinity import event_hooks

    return AsyncOpenAI(base_url=base_url, api_key="bench-key", max_retries=0,
                       http_client=DefaultAioHttpClient(event_hooks=event_hooks()))


async def _rollouts(base_url: str, args: Any) -> tuple[float, float, dict[str, int]]:
    """(seconds, this process's CPU seconds, requests per replica) for `args.rollouts` rollouts of `args.turns`
    turns, `args.concurrency` at once."""
    from artrl.client.affinity import REPLICA_HEADER

    client = _client(base_url)
    gate = asyncio.Semaphore(args.concurrency)
    served: dict[str, int] = {}

    async def rollout(k: int) -> None:
        async with gate:
            messages = [{"role": "user", "content": f"rollout {k}"}]
            for turn in range(args.turns):
                raw = await client.chat.completions.with_raw_response.create(model="bench", messages=messages,
                                                                             max_tokens=64)
                replica = raw.headers.get(REPLICA_HEADER, "?")
                served[replica] = served.get(replica, 0) + 1
                messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
                             {"role": "user", "content": f"turn {turn}"}]

    await asyncio.gather(*(rollout(k) for k in range(min(args.concurrency, args.rollouts))))  # warm connections
    served.clear()
    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(rollout(args.rollouts + k) for k in range(args.rollouts)))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    await client.close()
    return seconds, cpu, dict(sorted(served.items()))


async def _latencies(direct_url: str, routed_url: str, count: int) -> tuple[list[float], list[float]]:
    """Seconds of `count` requests one after the other, alternately to `direct_url` and `routed_url` (so that a
    change of the machine's load meanwhile weighs on both alike)."""
    clients = [_client(direct_url), _client(routed_url)]
    out: tuple[list[float], list[float]] = ([], [])
    for k in range(count + 10):
        for client, times in zip(clients, out):
            started = time.perf_counter()
            await client.chat.completions.create(model="bench", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=64)
            if k >= 10:  # the first ones open connections
                times.append(time.perf_counter() - started)
    for client in clients:
        await client.close()
    return out


def _ms(values: list[float], q: float) -> float:
    return round(1000 * statistics.quantiles(values, n=100)[int(q * 100) - 1], 2) if len(values) > 1 else 0.0


def main(args: Any) -> int:
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="artrl-bench-replicas-") as tmp:
        run = Path(tmp)
        for k in range(args.publishes + 1):
            (run / f"v{k}").mkdir()
        for n in args.replicas:
            replicas = _replica_set(n, args, run, args.token_time_ms)
            try:
                replicas.set_live_weights(str(run / "v0"), 0)
                seconds, cpu, served = asyncio.run(_rollouts(replicas.base_url, args))
                for k in range(1, args.publishes + 1):
                    replicas.set_live_weights(str(run / f"v{k}"), k)
                publish = replicas.publish_seconds[1:]
            finally:
                replicas.close()
            rows.append({"replicas": n, "seconds": round(seconds, 3), "rollouts_per_s": round(args.rollouts / seconds, 2),
                         "requests_per_s": round(args.rollouts * args.turns / seconds, 2),
                         "publish_ms_median": round(1000 * statistics.median(publish), 1),
                         "client_cpu_s": round(cpu, 2), "requests_per_replica": served,
                         "busiest_share": round(max(served.values()) / sum(served.values()), 3)})
            log.info("%d replica(s): %.2f rollouts/s, publish %.1f ms", n, rows[-1]["rollouts_per_s"],
                     rows[-1]["publish_ms_median"])
        base = next((r for r in rows if r["replicas"] == 1), rows[0])
        for row in rows:
            row["speedup"] = round(row["rollouts_per_s"] / base["rollouts_per_s"] * base["replicas"], 2)
            row["efficiency"] = round(row["speedup"] / row["replicas"], 2)
        replicas = _replica_set(1, args, run, 0.0)
        try:
            replicas.set_live_weights(str(run / "v0"), 0)
            direct, routed = asyncio.run(_latencies(f"{replicas.replicas[0].url}/v1", replicas.base_url,
                                                    args.latency_requests))
        finally:
            replicas.close()
    ideal = args.slots / (args.token_time_ms / 1000 * args.reply_tokens)
    report = {
        "bench": "replicas", "token_time_ms": args.token_time_ms, "reply_tokens": args.reply_tokens,
        "slots_per_replica": args.slots, "ideal_requests_per_s_per_replica": round(ideal, 2),
        "rollouts": args.rollouts, "turns": args.turns, "concurrency": args.concurrency, "results": rows,
        "latency_ms": {"direct_median": _ms(direct, 0.5), "router_median": _ms(routed, 0.5),
                       "added_median": round(_ms(routed, 0.5) - _ms(direct, 0.5), 2),
                       "direct_p90": _ms(direct, 0.9), "router_p90": _ms(routed, 0.9)},
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
    }
    log.info("%-9s %12s %12s %8s %10s %12s", "replicas", "rollouts/s", "requests/s", "speedup", "efficiency",
             "publish ms")
    for row in rows:
        log.info("%-9d %12.2f %12.2f %8.2f %10.2f %12.1f", row["replicas"], row["rollouts_per_s"],
                 row["requests_per_s"], row["speedup"], row["efficiency"], row["publish_ms_median"])
    log.info("router's added latency per request: %.2f ms (median; direct %.2f ms, through the router %.2f ms)",
             report["latency_ms"]["added_median"], report["latency_ms"]["direct_median"],
             report["latency_ms"]["router_median"])
    print(json.dumps(report), flush=True)
    return 0
