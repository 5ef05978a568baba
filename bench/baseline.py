"""baseline: the no-op route of the bench server (``POST /_bench/noop``): the same app stack,
token check and envelope parsing as route, a small envelope back, no Redis. Every throughput
ratio is against this, measured in the same run."""

from __future__ import annotations

from typing import Any

from bench.common import Context, LoadSpec

NAME = "baseline"
GROUP, SESSIONS, SCOPES = "g-base", 1000, 10


async def run(ctx: Context) -> dict[str, Any]:
    server = await ctx.main_server()
    spec = LoadSpec(url="", mode="noop", group=GROUP, sessions=SESSIONS, scopes=SCOPES)
    return await ctx.throughput(spec, [server], path="/_bench/noop")
