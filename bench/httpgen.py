"""Fallback load generator when ``wrk`` is not installed: the same requests as
``wrk/bench.lua`` (same ``BENCH_*`` environment), from an asyncio + httpx process, with the
same one-line ``BENCH_JSON`` output. Far weaker than wrk (a Python client on the same two
cores): its req/s are a floor, not the server's capacity.

    python bench/httpgen.py URL CONNECTIONS SECONDS
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time

import httpx


def percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def make_body(n: int, worker: int) -> bytes:
    mode = os.environ.get("BENCH_MODE", "route_existing")
    sessions = int(os.environ.get("BENCH_SESSIONS", "1"))
    scopes = int(os.environ.get("BENCH_SCOPES", "1"))
    group = os.environ.get("BENCH_GROUP", "g-bench")
    prefix = os.environ.get("BENCH_PREFIX", "s-")
    rid = f"{os.environ.get('BENCH_RUN', 'run')}-{worker}-{n}"
    if mode == "route_new":
        session, bot = f"n-{rid}", f"b-{n % scopes}"
    else:
        k = random.randrange(sessions)
        session, bot = f"{prefix}{k}", f"b-{k % scopes}"
    if mode == "touch":
        return json.dumps({"metadata": {"request_id": rid, "session_id": session}}).encode()
    meta = {"request_id": rid, "session_id": session, "bot_id": bot, "extra": {"group_id": group}}
    if mode == "touch_ids":
        return json.dumps({"metadata": meta}).encode()
    return json.dumps({"metadata": meta, "rawdata": {}}).encode()


async def main(url: str, connections: int, seconds: float) -> None:
    latencies: list[float] = []
    errors = {"connect": 0, "read": 0, "write": 0, "status": 0, "timeout": 0}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(limits=limits, timeout=5.0, trust_env=False) as client:
        started = time.perf_counter()
        deadline = started + seconds

        async def worker(w: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                n += 1
                body = make_body(n, w)
                t0 = time.perf_counter()
                try:
                    response = await client.post(url, content=body, headers=headers)
                except httpx.TimeoutException:
                    errors["timeout"] += 1
                    continue
                except httpx.ConnectError:
                    errors["connect"] += 1
                    continue
                except httpx.HTTPError:
                    errors["read"] += 1
                    continue
                latencies.append((time.perf_counter() - t0) * 1e6)
                if response.status_code >= 400:
                    errors["status"] += 1

        await asyncio.gather(*(worker(w) for w in range(connections)))
        elapsed = time.perf_counter() - started
    ordered = sorted(latencies)
    result = {
        "requests": len(ordered),
        "duration_s": round(elapsed, 6),
        "p50_us": round(percentile(ordered, 0.5)),
        "p90_us": round(percentile(ordered, 0.9)),
        "p99_us": round(percentile(ordered, 0.99)),
        "p999_us": round(percentile(ordered, 0.999)),
        "max_us": round(ordered[-1]) if ordered else 0,
        "mean_us": round(sum(ordered) / len(ordered), 1) if ordered else 0.0,
        "errors": errors,
    }
    print("BENCH_JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        from uvloop import new_event_loop as loop_factory
    except ImportError:
        loop_factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
