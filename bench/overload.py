"""overload: warm claims (a route that places a new session on a registered pod, then its eos
touch) first closed-loop to find one replica's capacity, then OPEN-loop (a fixed arrival rate,
whatever the answers) at 2 x that capacity, jobs running. Numbers: capacity (claims/s),
goodput at 2 x (claims served whole per second, and as a share of capacity), p50/p99 of the
served routes, the shed rate (503 OVERLOADED), other errors, the job ticks during the run.

Issue 13: without a bound, 300 claims/s against a replica good for ~250 collapsed it for the
whole run. With ``AGENT_RUNTIME_MAX_IN_FLIGHT`` the excess is shed at the edge and the rest is
served at capacity. On a machine with two CPUs or more the server is pinned to CPU 0 and this
process (the client) to CPU 1 for the whole bench, capacity included, so the client's own work
never takes the server's cycles (Redis floats: it takes what is left); capacity is then "one
replica on one core".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from typing import Any

from bench.common import (
    API,
    Context,
    RawConnection,
    Server,
    client,
    configure,
    pct,
    place_sessions,
)

NAME = "overload"
GROUP, SCOPES = "g-overload", 20
CAPACITY_WORKERS = 16  # closed loop: enough claims in flight to saturate one replica
OPEN_CONNECTIONS = 256  # open loop: a gateway's keep-alive pool; arrivals queue client-side
JOBS = ("sm_sweep", "rm_autoscale", "rm_reclaim", "rm_watch", "rm_reconcile")


class Claims:
    """Claims over a pool of raw keep-alive connections; counts and route latencies."""

    def __init__(self, url: str, run: str) -> None:
        self.url, self.run = url, run
        self.idle: list[RawConnection] = []
        self.opened = 0
        self.n = 0
        self.outcomes: Counter[str] = Counter()
        self.route_ms: list[float] = []  # served routes only
        self.shed_ms: list[float] = []  # answers of shed routes
        self.served = 0  # claims whose route and eos touch both succeeded

        self.intended_ms: list[float] = []  # served routes, from their arrival time

    async def _connection(self) -> RawConnection:
        while self.idle:
            conn = self.idle.pop()
            if conn.reader is not None and not conn.reader.at_eof():
                return conn
            await conn.close()  # closed by the server while idle (keep-alive timeout)
            self.opened -= 1
        self.opened += 1
        return await RawConnection(self.url).open()

    async def claim(self, arrived: float | None = None) -> None:
        self.n += 1
        k = self.n
        conn = await self._connection()
        session = f"o-{self.run}-{k}"
        bot = f"b-{k % SCOPES}"
        meta = {"request_id": f"{session}-r", "session_id": session, "bot_id": bot}
        body = {"metadata": {**meta, "extra": {"group_id": GROUP}}, "rawdata": {}}
        try:
            t0 = time.perf_counter()
            answer = await conn.post(f"{API}/route", body)
            took = (time.perf_counter() - t0) * 1000
            if not answer.get("ok"):
                code = str(answer.get("error_code"))
                self.outcomes[f"route_{code}"] += 1
                if code == "OVERLOADED":
                    self.shed_ms.append(took)
                self.idle.append(conn)
                return
            self.route_ms.append(took)
            if arrived is not None:
                self.intended_ms.append((time.perf_counter() - arrived) * 1000)
            eos = {"metadata": {"request_id": f"{session}-t", "session_id": session}}
            ended = await conn.post(f"{API}/touch", {**eos, "rawdata": {"eos": True}})
            if ended.get("ok"):
                self.served += 1
                self.outcomes["served"] += 1
            else:
                self.outcomes[f"touch_{ended.get('error_code')}"] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            self.outcomes[f"client_{type(exc).__name__}"] += 1
            with contextlib.suppress(Exception):
                await conn.close()
            self.opened -= 1
            return
        self.idle.append(conn)

    async def close(self) -> None:
        for conn in self.idle:
            await conn.close()


async def closed_loop(url: str, seconds: float) -> tuple[float, Claims]:
    claims = Claims(url, "cap")
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            await claims.claim()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CAPACITY_WORKERS)))
    elapsed = time.perf_counter() - started
    await claims.close()
    return claims.served / elapsed, claims


async def open_loop(url: str, rate: float, seconds: float) -> tuple[float, Claims]:
    """Arrivals at ``rate`` per second for ``seconds``, whatever the answers (open loop), over
    ``OPEN_CONNECTIONS`` keep-alive connections; an arrival that finds them all busy waits
    client-side and its latency counts from its arrival (no coordinated omission)."""
    claims = Claims(url, "open")
    arrivals: asyncio.Queue[float | None] = asyncio.Queue()
    for _ in range(OPEN_CONNECTIONS):
        claims.idle.append(await RawConnection(url).open())
    claims.opened = OPEN_CONNECTIONS

    async def worker() -> None:
        while (arrived := await arrivals.get()) is not None:
            await claims.claim(arrived)

    workers = [asyncio.create_task(worker()) for _ in range(OPEN_CONNECTIONS)]
    started = time.perf_counter()
    sent = 0
    while (now := time.perf_counter()) - started < seconds:
        due = int((now - started) * rate)
        while sent < due:
            sent += 1
            arrivals.put_nowait(started + sent / rate)
        await asyncio.sleep(0.002)
    claims.outcomes["left_unsent"] = arrivals.qsize()
    while not arrivals.empty():
        arrivals.get_nowait()
    for _ in workers:
        arrivals.put_nowait(None)
    await asyncio.wait(workers, timeout=30)
    elapsed = time.perf_counter() - started
    await claims.close()
    return claims.served / elapsed, claims


def _jobs(metrics: dict[str, float]) -> dict[str, float]:
    return {
        job: metrics.get(f'agent_runtime_job_runs_total{{job="{job}"}}', 0.0)
        - metrics.get(f'agent_runtime_job_failures_total{{job="{job}"}}', 0.0)
        for job in JOBS
    }


def _failures(metrics: dict[str, float]) -> float:
    return sum(metrics.get(f'agent_runtime_job_failures_total{{job="{job}"}}', 0.0) for job in JOBS)


def _pinning() -> tuple[set[int] | None, set[int] | None]:
    """(server CPUs, client CPUs): disjoint when the machine has two CPUs for us."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        return None, None
    return {mine[0]}, {mine[1]}


async def run(ctx: Context) -> dict[str, Any]:
    server_cpus, client_cpus = _pinning()
    before_affinity = os.sched_getaffinity(0)
    server = await Server(ctx, "overload", jobs=True, cpus=server_cpus).start()
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    try:
        async with client(server.url) as http:
            await configure(
                http, "overload", GROUP, scope_concurrency=100_000, pod_concurrency=100_000
            )
            await place_sessions(http, GROUP, SCOPES, SCOPES, prefix="w-")  # one pod per scope
        cap_seconds = 4.0 if ctx.quick else 8.0
        over_seconds = 8.0 if ctx.quick else 20.0
        await closed_loop(server.url, ctx.warmup_seconds)
        capacity, cap_claims = await closed_loop(server.url, cap_seconds)
        before = await server.metrics()
        async with client(server.url) as http:
            await http.post("/_bench/loop_lag")  # starts (or resets) the loop's lag sampler
        rate = 2 * capacity
        goodput, over = await open_loop(server.url, rate, over_seconds)
        async with client(server.url) as http:
            loop_lag = (await http.post("/_bench/loop_lag")).json()
        after = await server.metrics()
        ticks_before, ticks_after = _jobs(before), _jobs(after)
        routes = sorted(over.route_ms)
        shed = over.outcomes.get("route_OVERLOADED", 0)
        return {
            "capacity_claims_per_s": round(capacity, 1),
            "capacity_route_p99_ms": round(pct(sorted(cap_claims.route_ms), 0.99), 2),
            "offered_claims_per_s": round(rate, 1),
            "goodput_claims_per_s": round(goodput, 1),
            "goodput_share_of_capacity": round(goodput / capacity, 3) if capacity else None,
            "served_route_p50_ms": round(pct(routes, 0.50), 2),
            "served_route_p99_ms": round(pct(routes, 0.99), 2),
            "served_route_p99_from_arrival_ms": round(pct(over.intended_ms, 0.99), 2),
            "shed_per_s": round(shed / over_seconds, 1),
            "shed_answer_p99_ms": round(pct(sorted(over.shed_ms), 0.99), 2),
            "outcomes": dict(over.outcomes),
            "client_connections": over.opened,
            "job_ticks_ok": {j: ticks_after[j] - ticks_before[j] for j in JOBS},
            "job_failures": _failures(after) - _failures(before),
            "server_loop_lag": loop_lag,
            "seconds": {"capacity": cap_seconds, "overload": over_seconds},
            "pinned": {"server": sorted(server_cpus or []), "client": sorted(client_cpus or [])},
        }
    finally:
        os.sched_setaffinity(0, before_affinity)
        server.stop()
