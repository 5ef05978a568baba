"""scale_out: refresh (and the no-op, for the HTTP stack alone) on one replica with 50
connections, against two replicas (two server processes on two ports, one Redis, one DB)
with 25 connections each, at once. Reports the sum of req/s and the ratio two / one. On a
2-core machine both replicas, Redis and the load generator share the same two cores."""

from __future__ import annotations

from typing import Any

from bench.common import (
    API,
    CONNECTIONS,
    Context,
    LoadSpec,
    Server,
    client,
    configure,
    place_sessions,
)

NAME = "scale_out"
GROUP, SESSIONS, SCOPES = "g-sout", 1000, 10


async def run(ctx: Context) -> dict[str, Any]:
    ctx.stop_main_server()  # two fresh replicas, nothing else serving
    a = await Server(ctx, "replica-a").start()
    b = await Server(ctx, "replica-b").start()
    try:
        async with client(a.url) as http:
            await configure(http, "sout", GROUP, scope_concurrency=100_000, pod_concurrency=100_000)
            await place_sessions(http, GROUP, SESSIONS, SCOPES, prefix="o-")
        out: dict[str, Any] = {}
        for name, path, mode in (
            ("refresh", f"{API}/route", "route_existing"),
            ("noop", "/_bench/noop", "noop"),
        ):
            base = LoadSpec(
                url="", mode=mode, group=GROUP, sessions=SESSIONS, scopes=SCOPES, prefix="o-"
            )
            out[name] = await compare(ctx, a, b, base, path)
    finally:
        a.stop()
        b.stop()
    return out


async def compare(ctx: Context, a: Server, b: Server, base: LoadSpec, path: str) -> dict[str, Any]:
    half = CONNECTIONS // 2

    def spec(server: Server, connections: int, threads: int, seconds: float) -> LoadSpec:
        fields = {"url": server.url + path, "connections": connections, "threads": threads}
        return LoadSpec(**{**base.__dict__, **fields, "seconds": seconds})

    await ctx.loadgen.run_many(
        [spec(a, half, 1, ctx.warmup_seconds), spec(b, half, 1, ctx.warmup_seconds)],
        servers=[a, b],
    )
    one = await ctx.loadgen.run(spec(a, CONNECTIONS, 2, ctx.loaded_seconds), servers=[a, b])
    two = await ctx.loadgen.run_many(
        [spec(a, half, 1, ctx.loaded_seconds), spec(b, half, 1, ctx.loaded_seconds)],
        servers=[a, b],
    )
    two_rps = sum(r["rps"] for r in two)
    return {
        "one_replica": one,
        "two_replicas": {
            "rps": round(two_rps, 1),
            "per_replica": two,
            "p99_ms_worst": max(r["p99_ms"] for r in two),
            "errors": sum(r["error_total"] for r in two),
        },
        "ratio": round(two_rps / one["rps"], 3) if one["rps"] else None,
    }
