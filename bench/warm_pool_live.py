"""warm_pool_live: one bounded real-time run of a warm pool trace through the running service,
beside the simulation's figures for the same trace (``bench/warm_pool_sim.py``).

The stack as production runs it: ``agent-runtime db upgrade`` (a PostgreSQL database created
for the run and dropped after it, on ``AGENT_RUNTIME_BENCH_PG_URL``), ``agent-runtime
kubesim`` (the Kubernetes simulator; a pod is Ready 2 + U(0, 8) s after its create) and
``agent-runtime serve --mode server`` with its jobs at their default 1 s ticks, on a Redis db of
its own (``AGENT_RUNTIME_BENCH_REDIS_URL``, default db 4, claimed as every bench claims it).
Two templates, ``static`` (``min_idle_pods`` 2) and ``predictive``, each with its own scope,
replay the SAME trace at the same moments: Poisson arrivals of new sessions at ``--rate``, each
session routed, held for a log-normal length (median 10 s) and ended by a touch ``eos``.
``pod_concurrency`` 1, ``pod_ttl`` 30 s (the trace is short). Per scope: cold waits (a route
answered after more than COLD seconds: it waited for a deploy), p50/p99 time to place, idle
pod-seconds (the scope's warm set sampled every 0.25 s) and deploys (pods seen registered);
the first WARMUP seconds are not counted (the predictive scope learns its rate meanwhile).

    python -m bench.warm_pool_live [--seconds 120] [--rate 1.0] [--seed 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis
from sqlalchemy import create_engine, make_url, text

from agent_runtime.resource_manager.warm_policy import DEFAULT_MARGIN
from agent_runtime.util import scope_id_of
from bench.common import DEFAULT_REDIS_URL, BenchRedis, free_port
from bench.warm_pool_sim import Result, Simulation, Template, Trace

COLD = 0.5  # seconds: a route slower than this waited for a deploy (a warm claim takes ms)
WARMUP = 30.0
POD_TTL = 30
SESSION_MEDIAN = 10.0
READY_DELAY, JITTER = 2.0, 8.0  # kubesim: Ready 2 + U(0, 8) s after the create
TOKEN = "warm-bench"
PG_ADMIN_URL = "postgresql+psycopg://root@127.0.0.1:5432/test"
START_WITHIN = 60.0
RM_SCOPE = "resource_manager:resource:scope:"  # the reference's key names (redis-keys.md)


@dataclass
class Scope:
    name: str
    group: str
    latencies: list[float] = field(default_factory=list)  # counted routes
    idle_seconds: float = 0.0
    seen: set[str] = field(default_factory=set)
    deploys: int = 0
    failed: Counter[str] = field(default_factory=Counter)

    @property
    def sid(self) -> str:
        return scope_id_of(self.group, "bot")

    def result(self) -> Result:
        r = Result(arrivals=len(self.latencies), idle_seconds=self.idle_seconds)
        r.cold = sum(1 for x in self.latencies if x > COLD)
        r.waits = list(self.latencies)
        r.deploys = self.deploys
        return r


def cli(*args: str) -> list[str]:
    """The ``agent-runtime`` command of this interpreter's environment."""
    return [str(Path(sys.executable).with_name("agent-runtime")), *args]


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def wait_for(check: Any, what: str, within: float = START_WITHIN) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{what}: not within {within:g} s")


def envelope(group: str, **metadata: Any) -> dict[str, Any]:
    meta = {"request_id": f"r-{uuid.uuid4().hex[:12]}", "bot_id": "bot", **metadata}
    meta["extra"] = {"group_id": group}
    return {"metadata": meta, "rawdata": {}}


async def session(http: httpx.AsyncClient, scope: Scope, length: float, counted: bool) -> None:
    session_id = f"s-{uuid.uuid4().hex[:12]}"
    began = time.perf_counter()
    resp = await http.post("/api/session/route", json=envelope(scope.group, session_id=session_id))
    took = time.perf_counter() - began
    if resp.status_code != 200:
        answer = resp.json()
        why = f"{answer.get('error_code', '')}: {answer.get('error_message', '')[:60]}"
        scope.failed[f"{resp.status_code} {why}"] += 1
        return
    if counted:
        scope.latencies.append(took)
    await asyncio.sleep(length)
    body = envelope(scope.group, session_id=session_id)
    body["rawdata"] = {"eos": True}
    await http.post("/api/session/touch", json=body)


async def sample(redis: Redis, scopes: list[Scope], began: float, until: float) -> None:
    """The scopes' warm sets and pods every 0.25 s: idle pod-seconds, pods registered."""
    last = time.monotonic()
    while time.monotonic() < until:
        await asyncio.sleep(0.25)
        now = time.monotonic()
        for scope in scopes:
            idle = await redis.scard(f"{RM_SCOPE}{{{scope.sid}}}:idle")
            pods = set(await redis.zrange(f"{RM_SCOPE}{{{scope.sid}}}:pods", 0, -1))
            if now - began >= WARMUP:
                scope.idle_seconds += idle * (now - last)
                scope.deploys += len(pods - scope.seen)
            scope.seen |= pods
        last = now


async def replay(base_url: str, redis: Redis, args: argparse.Namespace) -> list[Scope]:
    scopes = [Scope("static", "g-static"), Scope("predictive", "g-predictive")]
    headers = {"authorization": f"Bearer {TOKEN}"}
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=180, limits=limits
    ) as http:
        for scope in scopes:
            template = {
                "template_id": scope.name, "image": "agentserver:bench", "pod_concurrency": 1,
                "scope_concurrency": 400, "pod_ttl": POD_TTL, "ready_timeout": 120,
                "ready_poll_interval": 0.25, "session_ttl": 600,
                "min_idle_pods": 2 if scope.name == "static" else 0,
                "warm_pool": scope.name,
            }  # fmt: skip
            rule = {"group_id": scope.group, "bot_id": "*", "template_id": scope.name}
            for kind, item in (("template", template), ("routing_rule", rule)):
                body = envelope("-")
                body["rawdata"] = {"kind": kind, "op": "sync", "item": item}
                resp = await http.post("/api/session/config_sync", json=body)
                resp.raise_for_status()
        rng = random.Random(args.seed)
        arrivals, t = [], rng.expovariate(args.rate)
        while t < args.seconds:
            arrivals.append((t, min(rng.lognormvariate(math.log(SESSION_MEDIAN), 0.8), 600.0)))
            t += rng.expovariate(args.rate)
        began = time.monotonic()
        sampler = asyncio.create_task(sample(redis, scopes, began, began + args.seconds))
        tasks = []
        for at, length in arrivals:
            await asyncio.sleep(max(began + at - time.monotonic(), 0))
            for scope in scopes:
                coro = session(http, scope, length, counted=at >= WARMUP)
                tasks.append(asyncio.create_task(coro))
        await sampler
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return scopes


def simulated(args: argparse.Namespace, *, serial_cold: bool) -> dict[str, Result]:
    """The simulation of the same trace shape (its own draws of the same distributions);
    ``serial_cold``: a scope's cold routes share one deploy at a time, as the service does
    before issue 16 §1 (else one cold deploy per pod needed, in parallel)."""
    trace = Trace(
        "live", args.seconds - WARMUP, [Template(pod_ttl=float(POD_TTL))],
        lambda s, t: args.rate, lambda s: args.rate, (2,), warmup=WARMUP,
        deploy_time=lambda rng: READY_DELAY + rng.uniform(0.0, JITTER) + 0.25,
        session_median=SESSION_MEDIAN, serial_cold=serial_cold,
    )  # fmt: skip
    return {
        "static": Simulation(trace, "static", margin=0.0, min_idle=2, seed=args.seed).run(),
        "predictive": Simulation(
            trace, "predictive", margin=DEFAULT_MARGIN, min_idle=0, seed=args.seed
        ).run(),
    }


def row(label: str, r: Result) -> str:
    return (
        f"{label:<24}{r.arrivals:>7}{r.cold_fraction:>11.1%} {r.pct(0.5):>9.3f}s"
        f" {r.pct(0.99):>8.2f}s{r.idle_seconds:>11.0f}{r.deploys:>8}"
    )


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A database of the run's own on the PostgreSQL server (created, then dropped)."""
    admin_url = make_url(os.environ.get("AGENT_RUNTIME_BENCH_PG_URL", PG_ADMIN_URL))
    name = f"ar_warm_live_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield admin_url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="the trace's length")
    parser.add_argument("--rate", type=float, default=1.0, help="new sessions per second")
    parser.add_argument("--seed", type=int, default=16)
    args = parser.parse_args()
    bench_redis = BenchRedis(os.environ.get("AGENT_RUNTIME_BENCH_REDIS_URL", DEFAULT_REDIS_URL))
    bench_redis.claim()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="warm-live-") as tmp, postgres_database() as db_url:
        work = Path(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_RUNTIME_", "HTTP"))}
        env["AGENT_RUNTIME_DATABASE_URL"] = db_url
        try:
            subprocess.run(cli("db", "upgrade"), env=env, check=True, capture_output=True)
            kubeconfig = work / "kubeconfig"
            sim_args = cli(
                "kubesim", "--kubeconfig-out", str(kubeconfig), "--ready-delay", str(READY_DELAY),
                "--jitter", str(JITTER), "--seed", str(args.seed), "--log-level", "WARNING",
            )  # fmt: skip
            procs.append(start(sim_args, env, work / "kubesim.log"))
            port = free_port()
            serve_env = {
                **env,
                "AGENT_RUNTIME_REDIS_URL": bench_redis.url,
                "AGENT_RUNTIME_KUBECONFIG": str(kubeconfig),
                "AGENT_RUNTIME_GATEWAY_TOKENS": TOKEN,
                "AGENT_RUNTIME_ADMIN_TOKENS": TOKEN,
                "AGENT_RUNTIME_POD_IDENTITY_SECRET": "warm-live-bench-identity-secret",
                "AGENT_RUNTIME_LOG_LEVEL": "WARNING",
            }
            asyncio.run(wait_for(lambda: _exists(kubeconfig), "kubesim's kubeconfig", START_WITHIN))
            serve = cli("serve", "--mode", "server", "--port", str(port))
            procs.append(start(serve, serve_env, work / "server.log"))
            base_url = f"http://127.0.0.1:{port}"
            scopes = asyncio.run(_run(base_url, bench_redis.url, args))
        except BaseException:
            for log in sorted(work.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
        finally:
            for proc in reversed(procs):
                stop(proc)
            bench_redis.release()
            warnings = (work / "server.log").read_text(errors="replace").splitlines()
            for line in warnings[-8:]:  # the service's last warnings (why a route failed)
                print(f"server: {line[:300]}", file=sys.stderr)
    parallel, serial = simulated(args, serial_cold=False), simulated(args, serial_cold=True)
    print(
        f"warm_pool_live: {args.seconds:.0f} s of Poisson {args.rate}/s (first {WARMUP:.0f} s not"
        f" counted), sessions median {SESSION_MEDIAN:.0f} s, kubesim Ready"
        f" {READY_DELAY:.0f}+U(0,{JITTER:.0f}) s, pod_ttl {POD_TTL} s, pod_concurrency 1"
    )
    print(f"{'run':<24}{'routes':>7}{'cold waits':>11}{'p50 place':>11}{'p99 place':>10}"
          f"{'idle pod-s':>11}{'deploys':>8}")  # fmt: skip
    for scope in scopes:
        failed = f"  (failed: {dict(scope.failed)})" if scope.failed else ""
        print(row(f"service {scope.name}", scope.result()) + failed)
        print(row(f"simulation {scope.name}", parallel[scope.name]))
        print(row("  cold one at a time", serial[scope.name]))


async def _exists(path: Path) -> bool:
    return await asyncio.to_thread(lambda: path.exists() and path.stat().st_size > 0)


async def _run(base_url: str, redis_url: str, args: argparse.Namespace) -> list[Scope]:
    async def healthy() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient(timeout=2) as http:
                return (await http.get(base_url + "/healthz")).status_code == 200
        return False

    await wait_for(healthy, "the service's /healthz")
    redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        return await replay(base_url, redis, args)
    finally:
        await redis.aclose()


if __name__ == "__main__":
    main()
