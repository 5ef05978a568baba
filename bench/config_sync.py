"""config_sync at size: N scopes (default 10k) resolved under a ``(*, *)`` rule to one wide
template, plus one scope under an exact rule to a narrow template. Measures, in this process
over the real Redis (its own db: ``AGENT_RUNTIME_BENCH_REDIS_URL``; only the service's own
keys are ever deleted) and a SQLite file:

- a policy change of the narrow template (1 scope affected), and of the wide one (N scopes);
- while the wide one propagates: route refresh latency (``route_place``, the hot path's one
  EVALSHA, 8 callers in a loop) p50/p99/max, and a second config_sync of the narrow template
  (its answer and time: 409 ``CONFIG_SYNC_BUSY`` while the lock covered the walk);
- the scope registry's size before and after the scope expiry (``--expire``: idle TTL 1 s,
  the job ticked by hand), when the running code has it.

Run: ``AGENT_RUNTIME_BENCH_REDIS_URL=redis://127.0.0.1:6379/5 .venv/bin/python
bench/config_sync.py [--scopes 10000] [--expire]``. Bounded: setup ~20 s at 10k scopes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis as sync_redis

from agent_runtime.config import Mode, Settings
from agent_runtime.db.engine import Database
from agent_runtime.errors import ConfigSyncBusy
from agent_runtime.resource_manager import state as rms
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.scope_buckets import BUCKETS
from agent_runtime.session_manager import state as sm
from agent_runtime.session_manager.models import ConfigSyncRequest
from agent_runtime.util import scope_id_of
from agent_runtime.wiring import (
    Backends,
    Services,
    build_redis,
    check_backends,
    load_pod_identity,
    wire,
)

OWN = ("session_manager:", "resource_manager:", "agent_runtime:")
ROUTERS = 8


def wipe(url: str) -> None:
    client = sync_redis.Redis.from_url(url, decode_responses=True)
    batch = [k for k in client.scan_iter(count=2000) if k.startswith(OWN)]
    for i in range(0, len(batch), 2000):
        client.unlink(*batch[i : i + 2000])
    client.close()


async def sync(svc: Services, op: str, kind: str, **item: Any) -> dict[str, Any]:
    request = ConfigSyncRequest.model_validate({"kind": kind, "op": op, "item": item})
    return await svc.config_store.config_sync(request)


async def limited(calls: list[Any], limit: int = 32) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(call: Any) -> Any:
        async with gate:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(q * len(ordered)) - 1))] if ordered else 0.0


async def setup(svc: Services, n: int) -> tuple[str, list[str]]:
    await sync(svc, "sync", "template", template_id="wide", image="bench:1", pod_concurrency=1)
    await sync(svc, "sync", "template", template_id="narrow", image="bench:1", pod_concurrency=1)
    await sync(svc, "sync", "routing_rule", group_id="*", bot_id="*", template_id="wide")
    await sync(svc, "sync", "routing_rule", group_id="one", bot_id="b", template_id="narrow")
    pairs = [(f"g-{i}", "b") for i in range(n)] + [("one", "b")]
    configs = await limited([svc.config_store.resolve(scope_id_of(g, b), g, b) for g, b in pairs])
    await limited(
        [
            svc.resources.update_pool_config(c.scope_id, c.pool_config(), pod_spec=c.pod_spec)
            for c in configs
        ]
    )
    # a routed session to refresh during the walk: a scope with a registered pod
    sid = scope_id_of("route", "b")
    await svc.session_state.register_pod(sid, "bench-pod", "http://x/sse", "v")
    await svc.session_state.redis.hset(
        f"session_manager:scope:{{{sid}}}:config",
        mapping={
            "scope_concurrency": 100,
            "pod_concurrency": 100,
            "max_pods": 1,
            "session_ttl": 600,
        },
    )
    sessions = [f"bench-s{i}" for i in range(ROUTERS)]
    for s in sessions:
        reply = await svc.session_state.route_place(
            request_id=f"setup-{s}", session_id=s, scope_id=sid, token="t"
        )
        assert reply.action == "placed", reply
    return sid, sessions


async def timed_sync(svc: Services, *, retry_for: float = 0.0, **item: Any) -> dict[str, Any]:
    """One config_sync; with ``retry_for``, retried on 409 every 50 ms as a client would."""
    started, busy = time.perf_counter(), 0
    while True:
        try:
            out = await sync(svc, "update", "template", **item)
            answer = f"200 affected={out['affected_scopes']}"
            break
        except ConfigSyncBusy:
            busy += 1
            answer = "409 CONFIG_SYNC_BUSY"
            if time.perf_counter() - started >= retry_for:
                break
            await asyncio.sleep(0.05)
    return {"seconds": round(time.perf_counter() - started, 3), "answer": answer, "409s": busy}


async def during(svc: Services, sid: str, sessions: list[str], n: int) -> dict[str, Any]:
    stop = False
    latencies: list[float] = []

    async def router(session_id: str) -> None:
        k = 0
        while not stop:
            k += 1
            started = time.perf_counter()
            await svc.session_state.route_place(
                request_id=f"{session_id}-{k}", session_id=session_id, scope_id=sid, token="t"
            )
            latencies.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(0.002)

    routers = [asyncio.create_task(router(s)) for s in sessions]
    await asyncio.sleep(0.5)
    baseline = list(latencies)
    latencies.clear()
    generation = await svc.scope_state.config_generation()
    wide = asyncio.create_task(timed_sync(svc, template_id="wide", scope_concurrency=3))
    # the second sync starts once the wide one has written the DB (config_gen bumped): its
    # walk is running
    while await svc.scope_state.config_generation() == generation and not wide.done():  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    second = await timed_sync(svc, retry_for=60.0, template_id="narrow", scope_concurrency=4)
    wide_out = await wide
    stop = True
    await asyncio.gather(*routers)
    return {
        "wide_change": wide_out,
        "second_sync_during_walk": second,
        "route_ms_idle": {
            "p50": round(pct(baseline, 0.5), 3),
            "p99": round(pct(baseline, 0.99), 3),
        },
        "route_ms_during": {
            "n": len(latencies),
            "p50": round(pct(latencies, 0.5), 3),
            "p99": round(pct(latencies, 0.99), 3),
            "max": round(max(latencies, default=0.0), 3),
        },
    }


async def expire(svc: Services, redis_url: str) -> dict[str, Any] | None:
    sweeper = svc.session_sweeper
    if not hasattr(sweeper, "expire_scopes_once"):
        return None
    sweeper._scope_idle_ttl = 1.0
    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)

    def registered() -> int:
        return sum(int(client.hlen(sm.scope_registry_key(b))) for b in range(BUCKETS))

    before = registered()
    memory_before = client.info("memory")["used_memory"]
    started, ticks = time.perf_counter(), 0
    while registered() > 1 and ticks < 200:
        await sweeper.expire_scopes_once()
        ticks += 1
        await asyncio.sleep(0.2)
    out = {
        "registry_before": before,
        "registry_after": registered(),
        "rm_index_after": client.scard(rms.SCOPES_KEY),
        "used_memory_mb_before": round(memory_before / 2**20, 1),
        "used_memory_mb_after": round(client.info("memory")["used_memory"] / 2**20, 1),
        "ticks": ticks,
        "seconds": round(time.perf_counter() - started, 1),
    }
    client.close()
    return out


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scopes", type=int, default=10_000)
    parser.add_argument("--expire", action="store_true")
    args = parser.parse_args(argv)
    redis_url = os.environ.get("AGENT_RUNTIME_BENCH_REDIS_URL", "redis://127.0.0.1:6379/4")
    wipe(redis_url)
    tmp = Path(tempfile.mkdtemp(prefix="bench-config-sync-"))
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        mode=Mode.LOCAL,
        local_seed=False,
        jobs_enabled=False,
        redis_url=redis_url,
        sqlite_path=tmp / "config.db",
        instance_id="bench-config-sync",
    )
    redis = build_redis(settings)
    db = Database.from_url(f"sqlite:///{tmp / 'config.db'}")
    backends = Backends(redis=redis, db=db, k8s=FakeK8sPodClient())
    out: dict[str, Any] = {"scopes": args.scopes}
    try:
        await check_backends(settings, backends)
        svc = wire(settings, backends, identity=await load_pod_identity(settings, backends.db))
        started = time.perf_counter()
        sid, sessions = await setup(svc, args.scopes)
        out["setup_seconds"] = round(time.perf_counter() - started, 1)
        out["narrow_change"] = await timed_sync(svc, template_id="narrow", scope_concurrency=2)
        out.update(await during(svc, sid, sessions, args.scopes))
        if args.expire:
            out["expiry"] = await expire(svc, redis_url)
    finally:
        await redis.aclose()
        await db.close()
        wipe(redis_url)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
