"""redis_wait: what AGENT_RUNTIME_REDIS_WAIT_REPLICAS costs a route that binds a session.

Two in-process replicas over the Sentinel set (tests/failover_load.py's service: master + 1
replica, asynchronous replication), one gateway task after another: a route of a new session
(``placed``: route_place, then ``WAIT n timeout`` on the same connection when on) and its eos,
``--calls`` times (bounded: default 2000), with WAIT off and on. Prints route p50 / p99 / max
(ms) and the short WAITs counted. No failover here: bench/failover.py --wait-replicas N runs
the failovers with it on.

  .venv/bin/python -m bench.redis_wait [--calls N] [--wait-replicas 1] [--wait-timeout-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench.common import BenchRefused, machine, pct  # noqa: E402
from bench.failover import DEFAULT_URL, claimed  # noqa: E402

NAME = "redis_wait"


async def one_setting(url: str, calls: int, replicas: int, timeout_ms: int) -> dict[str, Any]:
    from failover_load import ROUTE, TOUCH, Shape, sqlite_service
    from helpers import envelope

    shape = Shape(scopes=1, wait_replicas=replicas, wait_timeout_ms=timeout_ms)
    async with sqlite_service(url, shape) as svc:
        app = svc.apps[0]
        group, bot = svc.scopes[0]

        async def route_and_end(i: int) -> float:
            session = f"s-{uuid.uuid4().hex}"
            body = envelope(
                request_id=f"r-{uuid.uuid4().hex}",
                session_id=session,
                bot_id=bot,
                extra={"group_id": group},
            )
            started = time.perf_counter()
            resp = await app.post(ROUTE, json=body)
            took = time.perf_counter() - started
            assert resp.status_code == 200, resp.text
            eos = envelope({"eos": True}, request_id=f"t-{i}-{session}", session_id=session)
            assert (await app.post(TOUCH, json=eos)).status_code == 200
            return took

        for i in range(20):  # the pod deployed, scripts loaded
            await route_and_end(-i - 1)
        times = [await route_and_end(i) for i in range(calls)]
        short = 0.0
        scrape = await app.get("/metrics")
        for line in scrape.text.splitlines():
            if line.startswith('agent_runtime_redis_wait_short_total{script="route_place"}'):
                short = float(line.split()[-1])
    ms = [t * 1000 for t in times]
    return {
        "wait_replicas": replicas,
        "wait_timeout_ms": timeout_ms,
        "calls": calls,
        "route_p50_ms": round(pct(ms, 0.5), 3),
        "route_p99_ms": round(pct(ms, 0.99), 3),
        "route_max_ms": round(max(ms), 3),
        "short_waits": int(short),
    }


def main(argv: list[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(prog="bench/redis_wait.py", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--wait-replicas", type=int, default=1)
    parser.add_argument("--wait-timeout-ms", type=int, default=50)
    parser.add_argument(
        "--sentinel-url",
        default=os.environ.get("AGENT_RUNTIME_BENCH_REDIS_SENTINEL_URL", DEFAULT_URL),
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    calls = max(1, min(args.calls, 20_000))

    async def go() -> list[dict[str, Any]]:
        async with claimed(args.sentinel_url) as bench_redis:
            rows = []
            for replicas in (0, args.wait_replicas):
                rows.append(
                    await one_setting(args.sentinel_url, calls, replicas, args.wait_timeout_ms)
                )
                bench_redis.wipe()
            return rows

    try:
        rows = asyncio.run(go())
    except BenchRefused as exc:
        print(f"{NAME}: refused: {exc}", file=sys.stderr)
        return 2
    print(f"\nredis_wait: {calls} routes (placed) + eos each, Sentinel master + 1 replica")
    print("| WAIT replicas | timeout ms | route p50 ms | p99 ms | max ms | short WAITs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['wait_replicas']} | {r['wait_timeout_ms']} | {r['route_p50_ms']} | "
            f"{r['route_p99_ms']} | {r['route_max_ms']} | {r['short_waits']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "machine": machine()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
