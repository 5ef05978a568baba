"""dead_pod: from a pod killed in the simulator, at a random moment, to the next route that
answers ``rebound`` — the time a conversation hangs on a dead pod.

The service (``bench.server`` with ``--kubeconfig``: the real Kubernetes client) runs over
an in-process kubesim (ready delay 0.2 s), its jobs at their defaults (the watch pass every
10 s). A scope keeps two warm pods (``min_idle_pods`` 2), so a rebound never waits for a
deploy: what is measured is how long the death goes unnoticed. Each trial places a new
session, waits a random part of the pass interval, kills the session's pod, and then:

- ``stream``: the watch stream on; the gateway routes every ``POLL`` s without reporting;
- ``report``: the stream off; the gateway holds the pod's SSE stream, and when it breaks
  routes with ``rawdata.failed_pod_id`` (again every ``POLL`` s until ``rebound``);
- ``pass``: the stream off, no report: the old behaviour, the pass alone.

Deaths: ``kill`` (kubesim ``fail``: phase Failed, the AgentServer gone) and ``health``
(``/health`` answers 500, the pod Running: half-dead; with ``report`` the gateway reports
from the fault on, as if its stream had failed with it). Prints a table of p50 / p99 / max
per mode and death; bounded (``--trials``, each trial at most ``TRIAL_DEADLINE`` s).

  .venv/bin/python -m bench.dead_pod [--quick] [--trials N] [--rows MODE:DEATH ...] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    API,
    BenchRefused,
    Context,
    Server,
    bench_context,
    client,
    free_port,
    pct,
    rid,
)

NAME = "dead_pod"
GROUP = "g-dead"
WATCH_INTERVAL = 10.0  # the default pass
POLL = 0.05  # the gateway's routes while it waits for a rebound
TRIAL_DEADLINE = 40.0
MODES = ("stream", "report", "pass")
DEATHS = ("kill", "health")
# the measurement before the stream and the report (the pass alone)
BEFORE = {"kill": (5.3, 9.5), "health": (15.4, 19.4)}


ALL_ROWS = [(mode, death) for mode in MODES for death in DEATHS]


async def run(
    ctx: Context, trials: int | None = None, rows: list[tuple[str, str]] | None = None
) -> dict[str, Any]:
    """``rows``: the (mode, death) pairs to measure (default: all six)."""
    from kubesim import KubeSim

    n = trials or (3 if ctx.quick else 8)
    wanted = rows or ALL_ROWS
    results: dict[str, Any] = {"trials": n, "watch_interval": WATCH_INTERVAL, "rows": []}
    async with KubeSim(
        ready_delay=0.2, jitter=0.05, grace_period=0.3, probe_period=0.05, sse_interval=0.1
    ) as sim:
        assert sim.kubeconfig_path is not None
        for mode in [m for m in MODES if any(m == w for w, _ in wanted)]:
            extra = ["--kubeconfig", str(sim.kubeconfig_path)]
            extra += ["--watch-interval", str(WATCH_INTERVAL)]
            if mode != "stream":
                extra.append("--no-pod-watch-stream")
            server = await Server(ctx, f"dead-{mode}", jobs=True, extra_args=extra).start()
            try:
                for death in [d for d in DEATHS if (mode, d) in wanted]:
                    times = await trials_of(server, sim, mode, death, n)
                    results["rows"].append(row(mode, death, times))
            finally:
                server.stop()
                sim.faults.clear()
    print_table(results)
    return results


async def trials_of(server: Server, sim: Any, mode: str, death: str, n: int) -> list[float]:
    port = free_port()  # the AgentServers' (loopback addresses are shared with other runs)
    bot = f"b-{mode}-{death}-{uuid.uuid4().hex[:6]}"
    async with client(server.url) as http:
        template = {
            "template_id": f"bench-{bot}",
            "image": "bench:1",
            "scope_concurrency": 100,
            "pod_concurrency": 1,
            "session_ttl": 3600,
            "min_idle_pods": 2,  # a rebound takes a warm pod: only the noticing is measured
            "container_port": port,
            "sse_port": port,
            "ready_timeout": 10,
            "ready_poll_interval": 0.05,
        }
        rule = {"group_id": GROUP, "bot_id": bot, "template_id": template["template_id"]}
        for kind, item in (("template", template), ("routing_rule", rule)):
            body = {
                "metadata": {"request_id": rid()},
                "rawdata": {"kind": kind, "op": "sync", "item": item},
            }
            resp = await http.post(f"{API}/config_sync", json=body)
            if resp.status_code != 200:
                raise BenchRefused(f"config_sync {kind} refused: {resp.text[:300]}")
        times = []
        for trial in range(n):
            times.append(await one_trial(http, sim, mode, death, bot, trial))
    return times


async def one_trial(
    http: httpx.AsyncClient, sim: Any, mode: str, death: str, bot: str, trial: int
) -> float:
    session = f"s-{bot}-{trial}"
    first = await route(http, session, bot)
    pod, url = first["pod_id"], first["pod_sse_url"]
    await asyncio.sleep(random.uniform(0, WATCH_INTERVAL))  # a random moment of the pass
    watching = asyncio.create_task(sse_until_broken(url)) if mode == "report" else None
    await asyncio.sleep(0.2 if watching else 0)  # the gateway's stream is open
    fault = None
    if death == "kill":
        killed = time.monotonic()
        await sim.kill("default", pod, "fail")
    else:
        killed = time.monotonic()
        fault = sim.faults.add("health", mode="500", name=pod)
    try:
        if watching is not None and death == "kill":
            await asyncio.wait_for(watching, TRIAL_DEADLINE)  # the stream breaks
        report = {"failed_pod_id": pod} if mode == "report" else {}
        while time.monotonic() - killed < TRIAL_DEADLINE:
            answer = await route(http, session, bot, report)
            if answer["placement"] == "rebound":
                assert answer["previous_pod_id"] == pod, answer
                return time.monotonic() - killed
            await asyncio.sleep(POLL)
        raise BenchRefused(f"{mode}/{death}: no rebound within {TRIAL_DEADLINE:g} s")
    finally:
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(BaseException):
                await watching
        if fault is not None:
            sim.faults.remove(fault.id)


async def sse_until_broken(url: str) -> None:
    """The gateway's SSE stream to the pod, read until it breaks (an error or its end)."""
    with contextlib.suppress(Exception):
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=30.0), trust_env=False) as sse,
            sse.stream("GET", url) as resp,
        ):
            async for _ in resp.aiter_lines():
                pass


async def route(
    http: httpx.AsyncClient, session: str, bot: str, rawdata: dict[str, str] | None = None
) -> dict[str, Any]:
    body = {
        "metadata": {
            "request_id": rid(),
            "session_id": session,
            "bot_id": bot,
            "extra": {"group_id": GROUP},
        },
        "rawdata": rawdata or {},
    }
    resp = await http.post(f"{API}/route", json=body)
    if resp.status_code != 200:
        raise BenchRefused(f"route answered {resp.status_code}: {resp.text[:200]}")
    data: dict[str, Any] = resp.json()["data"]
    return data


def row(mode: str, death: str, times: list[float]) -> dict[str, Any]:
    return {
        "mode": mode,
        "death": death,
        "n": len(times),
        "p50_s": round(pct(times, 0.5), 2),
        "p99_s": round(pct(times, 0.99), 2),
        "max_s": round(max(times), 2),
        "min_s": round(min(times), 2),
    }


def print_table(results: dict[str, Any]) -> None:
    print(f"\ndead_pod: kill → next route `rebound` (s), {results['trials']} trials each")
    print(f"{'mode':<8} {'death':<7} {'p50':>6} {'p99':>6} {'max':>6} {'min':>6}")
    for r in results["rows"]:
        print(
            f"{r['mode']:<8} {r['death']:<7} {r['p50_s']:>6.2f} {r['p99_s']:>6.2f} "
            f"{r['max_s']:>6.2f} {r['min_s']:>6.2f}"
        )
    for death, (p50, worst) in BEFORE.items():
        print(f"{'before':<8} {death:<7} {p50:>6.2f} {'':>6} {worst:>6.2f}  (the issue's)")


def main(argv: list[str] | None = None) -> int:
    from bench.common import DEFAULT_REDIS_URL

    parser = argparse.ArgumentParser(prog="bench/dead_pod.py", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 trials per row")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=[f"{m}:{d}" for m, d in ALL_ROWS],
        metavar="MODE:DEATH",
        help="only these rows (default all): " + " ".join(f"{m}:{d}" for m, d in ALL_ROWS),
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    rows = [(r.split(":")[0], r.split(":")[1]) for r in args.rows] if args.rows else None

    async def go() -> None:
        async with bench_context(quick=args.quick, redis_url=args.redis_url) as ctx:
            results = await run(ctx, args.trials, rows)
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=2))

    try:
        asyncio.run(go())
    except BenchRefused as exc:
        print(f"dead_pod: refused: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
