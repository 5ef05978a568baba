"""touch: keep-alive touches of live sessions (one EVALSHA of touch.lua)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from bench.common import API, Context, LoadSpec, client, configure, place_sessions, touch

NAME = "touch"
GROUP, SESSIONS, SCOPES = "g-touch", 1000, 10


async def run(ctx: Context) -> dict[str, Any]:
    server = await ctx.main_server()
    async with client(server.url) as http:
        await configure(http, "touch", GROUP, scope_concurrency=100_000, pod_concurrency=100_000)
        placed = dict(await place_sessions(http, GROUP, SESSIONS, SCOPES, prefix="t-"))
        spec = LoadSpec(
            url="", mode="touch", group=GROUP, sessions=SESSIONS, scopes=SCOPES, prefix="t-"
        )
        result = await ctx.throughput(spec, [server], path=f"{API}/touch")
        # the sessions are alive: a sample of touches must say so
        sample: Counter[str] = Counter()
        for k in random.sample(range(SESSIONS), 20):
            answer = await touch(http, f"t-{k}")
            sample[str(answer.get("data", {}).get("touched", answer.get("error_code")))] += 1
    result["setup"] = {"sessions": SESSIONS, "scopes": SCOPES, "placements": placed}
    result["answers"] = {"touched_sample": dict(sample)}
    return result
