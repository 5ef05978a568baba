"""redis_cost: Redis commands and round trips per route (refresh, placed), per touch (naming
its scope; without: through the session-scope index), and for the no-op (control: none),
counted two ways over a fixed number of requests:

- client side, exact: the bench server counts every command it sends and every socket
  write (a round trip) in redis-py (``--count-redis``); those of the detached index writer
  (after the reply: ``detached_round_trips_per_request``) apart from the request's path;
- server side: ``INFO commandstats`` and ``total_commands_processed`` deltas. These are
  server-wide (every db and client of this Redis) and include the commands a script runs
  inside Redis (``redis.call``), so they show the script's own work; the idle rate of other
  clients is measured over an idle window and reported as noise.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from bench.common import (
    API,
    Context,
    Server,
    client,
    configure,
    place_sessions,
    rid,
    route_body,
)

NAME = "redis_cost"
GROUP, SESSIONS, SCOPES = "g-cost", 200, 4
CONCURRENCY = 8
IGNORED = {"info"}  # the bench's own INFO readings


async def run(ctx: Context) -> dict[str, Any]:
    n = 200 if ctx.quick else 2000
    server = await Server(ctx, "cost", count_redis=True, hot_path=True).start()
    try:
        async with client(server.url) as http:
            await configure(http, "cost", GROUP, scope_concurrency=100_000, pod_concurrency=100_000)
            await place_sessions(http, GROUP, SESSIONS, SCOPES, prefix="c-")
            noise = await idle_noise(ctx, seconds=1.0)
            phases: dict[str, Callable[[int], Awaitable[str]]] = {
                "noop": lambda i: post(http, "/_bench/noop", existing_route(i)),
                "refresh": lambda i: post(http, f"{API}/route", existing_route(i)),
                "placed": lambda i: post(http, f"{API}/route", new_route(i)),
                "touch": lambda i: post(http, f"{API}/touch", touch_body(i, named=True)),
                "touch_no_ids": lambda i: post(http, f"{API}/touch", touch_body(i)),
            }
            out: dict[str, Any] = {"requests_per_phase": n, "idle_noise": noise}
            for name, call in phases.items():
                out[name] = await measure(ctx, server, call, n)
    finally:
        server.stop()
    return out


def existing_route(i: int) -> dict[str, Any]:
    k = random.randrange(SESSIONS)
    return route_body(rid(), f"c-{k}", GROUP, f"b-{k % SCOPES}")


def new_route(i: int) -> dict[str, Any]:
    return route_body(rid(), f"cn-{rid()}", GROUP, f"b-{i % SCOPES}")


def touch_body(i: int, *, named: bool = False) -> dict[str, Any]:
    """A touch of a placed session; ``named``: with its scope (``bot_id`` +
    ``extra.group_id``, as a gateway should), else through the session-scope index."""
    k = random.randrange(SESSIONS)
    metadata: dict[str, Any] = {"request_id": rid(), "session_id": f"c-{k}"}
    if named:
        metadata.update(bot_id=f"b-{k % SCOPES}", extra={"group_id": GROUP})
    return {"metadata": metadata}


async def post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str:
    """The answer's placement, touch result or error code; a request the transport lost (a
    connection the loaded machine's server closed under it) is counted, not fatal: the phase's
    answers show it beside the round trips it measured."""
    try:
        answer = (await http.post(path, json=body)).json()
    except httpx.TransportError as exc:
        return f"transport:{type(exc).__name__}"
    data = answer.get("data") or {}
    if "placement" in data:
        return str(data["placement"])
    if "touched" in data:
        return f"touched={data['touched']}"
    return str(answer.get("error_code", "?"))


async def idle_noise(ctx: Context, seconds: float) -> dict[str, float]:
    """Commands other clients of this Redis run per second while the bench is idle."""
    t0, c0 = ctx.redis.total_commands(), time.perf_counter()
    await asyncio.sleep(seconds)
    delta = ctx.redis.total_commands() - t0 - 1  # the second reading's own INFO
    return {"commands_per_s": round(delta / (time.perf_counter() - c0), 1)}


async def measure(
    ctx: Context, server: Server, call: Callable[[int], Awaitable[str]], n: int
) -> dict[str, Any]:
    s0 = await server.stats()
    stats0, total0 = ctx.redis.commandstats(), ctx.redis.total_commands()
    answers: Counter[str] = Counter()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with gate:
            answers[await call(i)] += 1

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - started
    total1, stats1 = ctx.redis.total_commands(), ctx.redis.commandstats()
    s1 = await server.stats()

    sent = Counter(s1["redis_commands"])
    sent.subtract(s0["redis_commands"])
    detached = s1["redis_round_trips_detached"] - s0["redis_round_trips_detached"]
    by_client = {k: round(v / n, 3) for k, v in sorted(sent.items()) if v}
    by_server = {
        k: round((stats1.get(k, 0) - stats0.get(k, 0)) / n, 3)
        for k in sorted(stats1)
        if k not in IGNORED and stats1.get(k, 0) != stats0.get(k, 0)
    }
    info_calls = stats1.get("info", 0) - stats0.get("info", 0)
    return {
        "answers": dict(answers),
        "seconds": round(elapsed, 3),
        "client": {
            "commands_per_request": round(sum(sent.values()) / n, 3),
            # on the request's path: all but the detached index writer's (after the reply)
            "round_trips_per_request": round(
                (s1["redis_round_trips"] - s0["redis_round_trips"] - detached) / n, 3
            ),
            "detached_round_trips_per_request": round(detached / n, 3),
            "evalsha_per_request": round(sent.get("EVALSHA", 0) / n, 3),
            "by_command": by_client,
        },
        "server": {
            "commands_per_request": round((total1 - total0 - info_calls) / n, 3),
            "evalsha_per_request": by_server.get("evalsha", 0.0),
            "by_command": by_server,
            "note": "server-wide, incl. commands run inside scripts and other clients' noise",
        },
    }
