"""cold_burst: ``BURST`` concurrent routes of new sessions to a scope that has no pod yet,
with a simulated deploy time D (``FakeK8sPodClient(ready_delay=D)``). One pod holds them all
(pod_concurrency = BURST) and max_pods (10) does not force a single deploy: the service must
deploy once and hand that pod to every waiting route. Measured per burst: deploys made (fake
Kubernetes calls), latency min/median/max from the moment the burst is sent, tail − D and
spread (max − min), and the service's own histograms (deploy time, follower wait, slow path,
route time inside the server) for where the time went."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from typing import Any

from bench.common import (
    API,
    Context,
    RawConnection,
    Server,
    client,
    configure,
    metric_delta,
    rid,
    route_body,
)

NAME = "cold_burst"
GROUP = "g-cold"
BURST = 50
DEPLOY_SECONDS = 1.0


async def run(ctx: Context) -> dict[str, Any]:
    reps = 2 if ctx.quick else 5
    server = await Server(ctx, "cold", ready_delay=DEPLOY_SECONDS, count_redis=True).start()
    bursts = []
    try:
        async with client(server.url) as http:
            await configure(
                http, "cold", GROUP, scope_concurrency=10 * BURST, pod_concurrency=BURST
            )
        # connections opened first and requests prepared as bytes: the burst leaves the
        # client within about a millisecond and measures the service, not the client
        conns = [await RawConnection(server.url).open() for _ in range(BURST)]
        try:
            for rep in range(reps):
                bursts.append(await burst(server, conns, f"b-cold-{rep}"))
        finally:
            for conn in conns:
                await conn.close()
    finally:
        server.stop()
    tails = [b["tail_minus_deploy_ms"] for b in bursts]
    return {
        "burst": BURST,
        "deploy_seconds": DEPLOY_SECONDS,
        "bursts": bursts,
        "deploys_per_burst": [b["deploys"] for b in bursts],
        "tail_minus_deploy_ms_median": round(statistics.median(tails), 1),
        "tail_minus_deploy_ms_worst": round(max(tails), 1),
        "spread_ms_worst": round(max(b["spread_ms"] for b in bursts), 1),
    }


def mean_ms(before: dict[str, float], after: dict[str, float], family: str) -> float | None:
    """Mean of a histogram's new observations (label-less families, or all labels summed)."""
    total = count = 0.0
    for name, value in after.items():
        if name.startswith(family + "_sum"):
            total += value - before.get(name, 0.0)
        elif name.startswith(family + "_count"):
            count += value - before.get(name, 0.0)
    return round(1000 * total / count, 1) if count else None


def count(before: dict[str, float], after: dict[str, float], prefix: str) -> int:
    return int(sum(metric_delta(before, after, prefix).values()))


async def burst(server: Server, conns: list[RawConnection], bot: str) -> dict[str, Any]:
    before = await server.stats()
    metrics_before = await server.metrics()
    latencies: list[float] = []
    answers: Counter[str] = Counter()
    requests = [
        conn.prepare(f"{API}/route", route_body(rid(), f"cold-{bot}-{i}", GROUP, bot))
        for i, conn in enumerate(conns)
    ]
    started = time.perf_counter()

    async def one(conn: RawConnection, request: bytes) -> None:
        answer = await conn.send(request)
        latencies.append((time.perf_counter() - started) * 1000)
        answers[(answer.get("data") or {}).get("placement") or answer.get("error_code", "?")] += 1

    await asyncio.gather(*(one(c, r) for c, r in zip(conns, requests, strict=True)))
    after = await server.stats()
    metrics_after = await server.metrics()
    latencies.sort()
    return {
        "deploys": after["k8s_deploy_calls"] - before["k8s_deploy_calls"],
        "answers": dict(answers),
        "min_ms": round(latencies[0], 1),
        "median_ms": round(statistics.median(latencies), 1),
        "max_ms": round(latencies[-1], 1),
        "tail_minus_deploy_ms": round(latencies[-1] - DEPLOY_SECONDS * 1000, 1),
        "spread_ms": round(latencies[-1] - latencies[0], 1),
        # where the time went, from the service's own histograms (means over this burst)
        "deploy_ms_mean": mean_ms(
            metrics_before, metrics_after, "agent_runtime_pool_deploy_seconds"
        ),
        "follower_wait_ms_mean": mean_ms(
            metrics_before, metrics_after, "agent_runtime_pool_follower_wait_seconds"
        ),
        "slow_path_ms_mean": mean_ms(
            metrics_before, metrics_after, "agent_runtime_queue_wait_seconds"
        ),
        "redis_round_trips": after["redis_round_trips"] - before["redis_round_trips"],
        "redis_commands": {
            k: v - before["redis_commands"].get(k, 0)
            for k, v in sorted(after["redis_commands"].items(), key=lambda kv: -kv[1])
            if v - before["redis_commands"].get(k, 0)
        },
        "db_calls": count(metrics_before, metrics_after, "agent_runtime_db_seconds_count"),
        "acquires": {
            k.split('"')[1]: v
            for k, v in metric_delta(
                metrics_before, metrics_after, "agent_runtime_pool_acquires_total"
            ).items()
        },
        "server_route_ms_mean": mean_ms(
            {k: v for k, v in metrics_before.items() if "/api/session/route" in k},
            {k: v for k, v in metrics_after.items() if "/api/session/route" in k},
            "agent_runtime_http_request_seconds",
        ),
    }
