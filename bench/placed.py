"""placed: routes of new sessions onto pods with free slots (one EVALSHA of route_place that
places first-fit and commits the session's four places). Pods are pre-registered (one per
scope, through the service's own slow path) with pod_concurrency and scope_concurrency so
large that every request places; every request carries a new session id."""

from __future__ import annotations

from typing import Any

from bench.common import API, Context, LoadSpec, client, configure, metric_delta, place_sessions

NAME = "placed"
GROUP, SCOPES = "g-placed", 20


async def run(ctx: Context) -> dict[str, Any]:
    server = await ctx.main_server()
    async with client(server.url) as http:
        await configure(http, "placed", GROUP, scope_concurrency=100_000, pod_concurrency=100_000)
        warmed = dict(await place_sessions(http, GROUP, SCOPES, SCOPES, prefix="w-"))
    before = await server.metrics()
    spec = LoadSpec(url="", mode="route_new", group=GROUP, scopes=SCOPES)
    result = await ctx.throughput(spec, [server], path=f"{API}/route")
    after = await server.metrics()
    result["setup"] = {"scopes": SCOPES, "pods": SCOPES, "warm_placements": warmed}
    result["answers"] = metric_delta(before, after, "agent_runtime_route_placements_total")
    return result
