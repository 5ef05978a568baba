"""failover: what a Sentinel failover mid-load costs, over N forced failovers
(``SENTINEL FAILOVER``), each under the same gateway load as tests/test_sentinel_failover.py
(the scenario is tests/failover_load.py: two in-process replicas on ``redis+sentinel://``, 30
gateway tasks over 3 scopes of scope_concurrency 4 / pod_concurrency 2, session_ttl 10 s).

Per failover: the unavailability window (the first ``BACKEND_UNAVAILABLE`` answer to the first
success after the last one; 0 when none failed), the longest stretch without any success, the
route refusals in the window, when a new session was placed again, and what asynchronous
replication lost (bindings the gateway holds that Redis forgot, ended sessions back, seats
beyond a cap once the forgotten sessions count, pods whose registration vanished), plus the
checks the test asserts (answers outside the contract, Redis inconsistent). Then p50 / max.

  .venv/bin/python -m bench.failover [--quick] [--failovers N] [--no-master-check]
      [--wait-replicas N] [--json F]

Needs the Sentinel set of scripts/redis_topologies.sh (``--sentinel-url``, default
``AGENT_RUNTIME_BENCH_REDIS_SENTINEL_URL`` or its sentinels 17211-17213, master
agent-runtime-test, db 4). The db must hold only this service's keys (as every bench's);
only those are deleted. ``--no-master-check`` turns the client's periodic question to the
sentinels off (redis_client.MASTER_CHECK: asked at the first connection only, then only when a
connection is opened): what the check buys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench.common import BenchRedis, BenchRefused, machine, pct  # noqa: E402

NAME = "failover"
DEFAULT_URL = (
    "redis+sentinel://127.0.0.1:17211,127.0.0.1:17212,127.0.0.1:17213/agent-runtime-test/4"
)


async def master_url(url: str) -> str:
    """The ``redis://`` URL of the master the sentinels name now (the claim and the wipe)."""
    from agent_runtime import redis_client
    from failover_load import SentinelSet

    sentinels = SentinelSet(url)
    try:
        host, port = await sentinels.ready(within=30)
    except TimeoutError as exc:
        raise BenchRefused(
            f"the Sentinel set of {url.split('@')[-1]} is not usable: {exc}"
        ) from None
    finally:
        await sentinels.aclose()
    return f"redis://{host}:{port}/{redis_client.parse(url).db}"


@asynccontextmanager
async def claimed(url: str) -> AsyncIterator[BenchRedis]:
    """The bench db on the master the sentinels name, claimed (own keys only), released after
    on whichever master they name then."""
    bench_redis = BenchRedis(await master_url(url))
    bench_redis.claim()
    try:
        yield bench_redis
    finally:
        BenchRedis(await master_url(url)).release()
        bench_redis.client.close()


async def run(
    url: str, failovers: int, master_check: bool, wait_replicas: int = 0
) -> dict[str, Any]:
    from agent_runtime import redis_client
    from failover_load import SentinelSet, Shape, one_failover, sqlite_service
    from helpers import topology_client

    if not master_check:
        redis_client.MASTER_CHECK = math.inf  # asked once, at the first connection
    shape = Shape(wait_replicas=wait_replicas)
    rows: list[dict[str, Any]] = []
    observer = topology_client(url)
    sentinels = SentinelSet(url)
    try:
        async with sqlite_service(url, shape) as svc:
            for i in range(failovers):
                out = await one_failover(svc, sentinels.failover, observer, shape)
                print(f"  [{i + 1}/{failovers}] {out.summary()}", file=sys.stderr)
                rows.append(row(out))
    finally:
        await sentinels.aclose()
        await observer.aclose()
    return {
        "failovers": failovers,
        "master_check": master_check,
        "shape": vars(shape),
        "rows": rows,
    }


def row(out: Any) -> dict[str, Any]:
    fo = out.failover
    return {
        "promoted_s": round(fo.promoted - fo.commanded, 3),
        "named_s": round(fo.named - fo.commanded, 3),
        "demoted_s": round(fo.demoted - fo.commanded, 3),
        "lost_bytes": fo.lost_bytes,
        "window_s": round(out.window_s, 3),
        "gap_s": round(out.gap_s, 3),
        "slowest_s": round(out.slowest_s, 3),
        "placed_again_s": None if out.placed_again_s is None else round(out.placed_again_s, 3),
        "calls": out.calls,
        "backend_503": out.codes.get("BACKEND_UNAVAILABLE", 0),
        "route_refusals_in_window": sum(out.refused_in_window.values()),
        "bindings_lost": out.bindings_lost,
        "binding_lost_answers": out.anomalies.get("binding_lost", 0),
        "wrong_pod_answers": out.anomalies.get("wrong_pod", 0),
        "eos_undone": out.eos_undone,
        "seats_over_cap": out.seats_over_cap,
        "pods_unregistered": out.pods_unregistered,
        "bad_answers": len(out.bad),
        "unexposed_anomalies": len(out.unexposed_anomalies),
        "redis_consistent": bool(out.state and out.state.consistent and not out.over_cap_seen),
        "leftovers_after": len(out.after.leftovers) if out.after else None,
    }


COLUMNS = [
    ("promoted_s", "promoted"),
    ("named_s", "named"),
    ("demoted_s", "demoted"),
    ("lost_bytes", "old master wrote after promotion (B)"),
    ("window_s", "window"),
    ("gap_s", "gap"),
    ("backend_503", "503s"),
    ("route_refusals_in_window", "route 503 in win"),
    ("placed_again_s", "placed again"),
    ("binding_lost_answers", "binding lost (answers)"),
    ("bindings_lost", "bindings lost (end)"),
    ("eos_undone", "eos undone"),
    ("seats_over_cap", "seats over cap"),
    ("pods_unregistered", "pods unregistered"),
    ("bad_answers", "bad answers"),
    ("redis_consistent", "redis consistent"),
]


def print_table(results: dict[str, Any]) -> None:
    rows = results["rows"]
    check = "on" if results["master_check"] else "off"
    wait = results["shape"]["wait_replicas"]
    print(
        f"\nfailover: {results['failovers']} x SENTINEL FAILOVER mid-load (master check {check}, "
        f"WAIT replicas {wait})"
    )
    print("| # | " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|" + "---|" * (len(COLUMNS) + 1))
    for i, r in enumerate(rows, 1):
        cells = ["-" if r[k] is None else str(r[k]) for k, _ in COLUMNS]
        print(f"| {i} | " + " | ".join(cells) + " |")
    for label, q in (("p50", 0.5), ("max", 1.0)):
        cells = []
        for key, _ in COLUMNS:
            values = [
                float(r[key])
                for r in rows
                if isinstance(r[key], int | float) and not isinstance(r[key], bool)
            ]
            cells.append(f"{pct(values, q):.2f}" if values else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(prog="bench/failover.py", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 failovers")
    parser.add_argument("--failovers", type=int, help="how many (default 5; --quick 2)")
    parser.add_argument(
        "--sentinel-url",
        default=os.environ.get("AGENT_RUNTIME_BENCH_REDIS_SENTINEL_URL", DEFAULT_URL),
    )
    parser.add_argument("--no-master-check", action="store_true")
    parser.add_argument(
        "--wait-replicas",
        type=int,
        default=0,
        help="AGENT_RUNTIME_REDIS_WAIT_REPLICAS of the replicas (default 0: off)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    failovers = args.failovers or (2 if args.quick else 5)

    async def go() -> dict[str, Any]:
        async with claimed(args.sentinel_url):
            return await run(
                args.sentinel_url, failovers, not args.no_master_check, args.wait_replicas
            )

    try:
        results = asyncio.run(go())
    except BenchRefused as exc:
        print(f"{NAME}: refused: {exc}", file=sys.stderr)
        return 2
    results["machine"] = machine()
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
