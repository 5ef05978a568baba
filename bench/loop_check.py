"""loop_check: "no blocking call on the event loop", in two passes over a loaded refresh run.

1. As production runs (uvloop) with asyncio debug on and ``loop.slow_callback_duration =
   0.01``: every "Executing ... took ..." warning is counted, during the setup (config_sync,
   the slow path's first placements) and during the refresh run. Debug mode slows every
   callback, and on a busy 2-core machine the OS preempts the server mid-callback, so a
   warning is a lead, not a proof.
2. The same on the stdlib loop with every callback timed (``bench.server.audit_callbacks``):
   each callback over 10 ms is classified by its thread CPU time, the garbage collector's time
   and context switches — ``waited`` (it slept: a blocking syscall, or the GIL held by another
   thread of the process), ``cpu`` (it computed that long), ``gc`` (a collection ran in it),
   ``preempted`` (the OS gave the core to another process). Only ``preempted`` is not the
   process's own doing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.common import API, Context, LoadSpec, Server, client, configure, place_sessions

NAME = "loop_check"
GROUP, SESSIONS, SCOPES = "g-loop", 1000, 10
SLOW_CALLBACK = 0.01


async def run(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {"slow_callback_duration_s": SLOW_CALLBACK}
    out.update(await debug_pass(ctx))
    out["audit"] = await audit_pass(ctx)
    return out


def load(server: Server, ctx: Context, prefix: str) -> LoadSpec:
    return LoadSpec(
        url=server.url + f"{API}/route",
        mode="route_existing",
        group=GROUP,
        sessions=SESSIONS,
        scopes=SCOPES,
        prefix=prefix,
        seconds=ctx.loaded_seconds,
    )


async def setup(server: Server, prefix: str) -> None:
    async with client(server.url) as http:
        await configure(http, "loop", GROUP, scope_concurrency=100_000, pod_concurrency=100_000)
        await place_sessions(http, GROUP, SESSIONS, SCOPES, prefix=prefix)


async def debug_pass(ctx: Context) -> dict[str, Any]:
    server = await Server(ctx, "debug", asyncio_debug=SLOW_CALLBACK).start()
    try:
        await setup(server, "l-")
        after_setup = await server.stats()
        loaded = await ctx.loadgen.run(load(server, ctx, "l-"), servers=[server])
        after_run = await server.stats()
    finally:
        server.stop()
    during_run = after_run["slow_callbacks"] - after_setup["slow_callbacks"]
    return {
        "slow_callbacks_setup": after_setup["slow_callbacks"],
        "slow_callbacks_refresh_run": during_run,
        "setup_by_callback": by_callback(after_setup["slow_callback_log"]),
        "refresh_run_by_callback": by_callback(after_run["slow_callback_log"][-during_run:])
        if during_run
        else {},
        "longest": after_run["slow_callback_samples"][:5],
        "refresh_under_debug": {k: loaded[k] for k in ("rps", "p50_ms", "p99_ms", "requests")},
        "loadavg_during_run": loaded["loadavg"],
    }


async def audit_pass(ctx: Context) -> dict[str, Any]:
    server = await Server(ctx, "audit", callback_audit=SLOW_CALLBACK).start()
    try:
        await setup(server, "la-")
        stats0 = await server.stats()
        after_setup = len(stats0["callback_audit"])
        loaded = await ctx.loadgen.run(load(server, ctx, "la-"), servers=[server])
        stats1 = await server.stats()
        records = stats1["callback_audit"]
    finally:
        server.stop()
    setup_records, run_records = records[:after_setup], records[after_setup:]
    return {
        "loop": "asyncio (stdlib), every callback timed",
        "setup": classify(setup_records),
        "refresh_run": classify(run_records),
        "refresh_rps": loaded["rps"],
        "gc_setup": stats0["gc"],
        "gc_total_after_run": stats1["gc"],
        "loadavg_during_run": loaded["loadavg"],
    }


def classify(records: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = Counter(r["kind"] for r in records)
    worst = sorted(records, key=lambda r: -r["wall_ms"])[:5]
    return {
        "slow_callbacks": len(records),
        "by_kind": {k: kinds.get(k, 0) for k in ("waited", "cpu", "gc", "preempted")},
        "not_preempted": [r for r in records if r["kind"] != "preempted"][:10],
        "worst": worst,
    }


def by_callback(log: list[list[Any]]) -> dict[str, dict[str, float]]:
    """Per callback (coroutine or handle name): how many warnings, the longest."""
    out: dict[str, dict[str, float]] = {}
    for seconds, what in log:
        entry = out.setdefault(str(what), {"count": 0, "max_ms": 0.0})
        entry["count"] += 1
        entry["max_ms"] = max(entry["max_ms"], round(float(seconds) * 1000, 1))
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["count"]))
