"""refresh: sticky routes of live sessions (the hot path: one EVALSHA of route_place that
finds the binding and extends it). wrk picks one of ``SESSIONS`` pre-placed sessions per
request, with a unique request_id (the replay cache never answers instead).

With ``--profile``: the same load once more against a server run under pyinstrument,
sampled over the loaded window only; the top frames are printed."""

from __future__ import annotations

from typing import Any

from bench.common import (
    API,
    Context,
    LoadSpec,
    Server,
    client,
    configure,
    metric_delta,
    place_sessions,
)

NAME = "refresh"
GROUP, SESSIONS, SCOPES = "g-refresh", 1000, 10


async def setup(server: Server) -> dict[str, int]:
    async with client(server.url) as http:
        await configure(http, "refresh", GROUP, scope_concurrency=100_000, pod_concurrency=100_000)
        return dict(await place_sessions(http, GROUP, SESSIONS, SCOPES))


def spec() -> LoadSpec:
    return LoadSpec(url="", mode="route_existing", group=GROUP, sessions=SESSIONS, scopes=SCOPES)


async def run(ctx: Context) -> dict[str, Any]:
    server = await ctx.main_server()
    placed = await setup(server)
    before = await server.metrics()
    result = await ctx.throughput(spec(), [server], path=f"{API}/route")
    after = await server.metrics()
    result["setup"] = {"sessions": SESSIONS, "scopes": SCOPES, "placements": placed}
    result["answers"] = metric_delta(before, after, "agent_runtime_route_placements_total")
    if ctx.profile:
        result["profile"] = await profile(ctx)
    return result


async def profile(ctx: Context) -> dict[str, Any]:
    try:
        import pyinstrument  # noqa: F401
    except ImportError:
        return {
            "skipped": "pyinstrument is not installed: .venv/bin/pip install pyinstrument "
            "(not a project dependency)"
        }
    out = ctx.tmp / "profile-refresh"
    server = await Server(ctx, "profile", profile=out).start()
    try:
        warm = LoadSpec(**{**spec().__dict__, "url": server.url + f"{API}/route", "seconds": 1})
        await ctx.loadgen.run(warm, servers=[server])
        async with client(server.url) as http:
            await http.post("/_bench/profile/start")
            loaded = LoadSpec(**{**warm.__dict__, "seconds": ctx.loaded_seconds})
            run = await ctx.loadgen.run(loaded, servers=[server])
            summary = dict((await http.post("/_bench/profile/stop", timeout=120)).json())
    finally:
        server.stop()
    text = out.with_suffix(".txt")
    ctx.results.setdefault("_files", {})["profile_refresh_txt"] = str(text)
    summary["load_under_profiler"] = {k: run[k] for k in ("rps", "p50_ms", "p99_ms")}
    summary["call_tree"] = text.read_text()[:20000] if text.exists() else ""
    return summary
