"""scale: the service at size. 100k live sessions on 10k pods in 1k scopes (quick: 10k / 1k /
100) are written directly through the service's own code — config_sync and resolve, the
resource manager's ``register`` and the session manager's ``register_pod`` and
``route_place`` scripts, in pipelines of EVALSHA (not HTTP). Then:

- the background jobs' ticks, in this process over the real Redis: ``SessionSweeper``
  ``sweep_once`` (nothing due, and with 1 % of the sessions just expired) and the resource
  manager's ``autoscale_once``, ``reclaim_once``, ``watch_once``, ``reconcile_once`` (the
  fake Kubernetes knows every pod): wall time and Redis round trips per tick;
- Redis memory per live session: ``used_memory`` delta over the sessions' writes (replay
  keys of the setup routes deleted first) and ``MEMORY USAGE`` of the keys a session lives
  in (exact per key, this db only);
- route refresh at that size: a short wrk run (50 connections and unloaded) against a bench
  server with the jobs off, then with the jobs on (its fake Kubernetes knows the pods).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import random
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from redis.asyncio import Redis

from agent_runtime.config import Mode, Settings
from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.session_manager import state as sm
from agent_runtime.session_manager.models import ConfigSyncRequest
from agent_runtime.session_manager.scope_cache import ScopeConfig
from agent_runtime.session_manager.state import SessionState
from agent_runtime.util import scope_id_of
from agent_runtime.wiring import (
    Backends,
    Services,
    build_redis,
    check_backends,
    load_pod_identity,
    wire,
)
from bench import server as bench_server
from bench.common import API, Context, LoadSpec, Server

NAME = "scale"
GROUP, EXPIRING_GROUP = "g-scale", "g-scale-exp"
PIPELINE = 1000
TICK_REPEATS = 3


def sizes(quick: bool) -> tuple[int, int, int]:
    return (10_000, 1_000, 100) if quick else (100_000, 10_000, 1_000)


async def run(ctx: Context) -> dict[str, Any]:
    n_sessions, n_pods, n_scopes = sizes(ctx.quick)
    ctx.stop_main_server()  # a clean db for the memory readings
    ctx.redis.wipe()
    bench_server.count_redis_commands()
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        mode=Mode.LOCAL,
        local_seed=False,
        jobs_enabled=False,
        redis_url=ctx.redis.url,
        database_url=ctx.database_url,
        instance_id="bench-scale",
    )
    redis = build_redis(settings)  # the service's client: blocking pool of 100 connections
    db = Database.from_url(ctx.database_url)
    k8s = FakeK8sPodClient()
    backends = Backends(redis=redis, db=db, k8s=k8s)
    out: dict[str, Any] = {"sessions": n_sessions, "pods": n_pods, "scopes": n_scopes}
    try:
        await check_backends(settings, backends)
        svc = wire(settings, backends, identity=await load_pod_identity(settings, backends.db))
        out["setup"], out["memory"] = await populate(ctx, svc, k8s, n_sessions, n_pods, n_scopes)
        # as `agent-runtime serve` does after startup (cli.tune_gc): the setup's objects out of
        # the collector, which would otherwise walk them in the ticks' loop stalls
        gc.collect()
        gc.freeze()
        out["ticks"] = await ticks(svc, profile=ctx.profile)
        out["expiry_tick"] = await expiry_tick(ctx, svc, k8s, max(100, n_sessions // 100))
    finally:
        gc.unfreeze()
        await redis.aclose()
        await db.close()
    out["refresh_jobs_off"] = await refresh_at_size(ctx, n_sessions, n_scopes, jobs=False)
    out["refresh_jobs_on"] = await refresh_at_size(ctx, n_sessions, n_scopes, jobs=True)
    ctx.redis.wipe()
    return out


async def sync(svc: Services, kind: str, item: dict[str, Any]) -> None:
    request = ConfigSyncRequest.model_validate({"kind": kind, "op": "sync", "item": item})
    await svc.config_store.config_sync(request)


async def limited(calls: Iterable[Awaitable[Any]], limit: int = 32) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(call: Awaitable[Any]) -> Any:
        async with gate:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


async def scopes_with_pods(
    svc: Services,
    k8s: FakeK8sPodClient,
    name: str,
    group: str,
    n_scopes: int,
    pods_per_scope: int,
    pod_concurrency: int,
    session_ttl: int,
) -> list[str]:
    """Template + rule, each scope resolved (resolve cache, registry) with its pool config,
    and its pods registered on both sides (fake Kubernetes knows them)."""
    template = {
        "template_id": f"bench-{name}",
        "image": "bench:1",
        "scope_concurrency": pods_per_scope * pod_concurrency,
        "pod_concurrency": pod_concurrency,
        "session_ttl": session_ttl,
        "min_idle_pods": 0,
    }
    await sync(svc, "template", template)
    await sync(
        svc, "routing_rule", {"group_id": group, "bot_id": "*", "template_id": f"bench-{name}"}
    )
    sids = [scope_id_of(group, f"b-{i}") for i in range(n_scopes)]
    configs: list[ScopeConfig] = await limited(
        svc.config_store.resolve(sid, group, f"b-{i}") for i, sid in enumerate(sids)
    )
    await limited(
        svc.resources.update_pool_config(c.scope_id, c.pool_config(), pod_spec=c.pod_spec)
        for c in configs
    )
    pods = [
        (c, k8s.add_pod(scope_id=c.scope_id, deploy_ver=c.deploy_ver, identity=svc.identity))
        for c in configs
        for _ in range(pods_per_scope)
    ]
    redis = svc.session_state.redis
    for start in range(0, len(pods), PIPELINE):
        async with redis.pipeline(transaction=False) as pipe:
            rm, sm_state = ResourceState(pipe), SessionState(pipe)
            for config, pod in pods[start : start + PIPELINE]:
                assert pod.pod_ip is not None
                url = f"http://{pod.pod_ip}:8080/sse"
                await rm.register(
                    scope_id=config.scope_id,
                    pod_id=pod.pod_id,
                    placeholder=None,
                    pod_sse_url=url,
                    pod_ip=pod.pod_ip,
                    namespace=pod.namespace,
                    deploy_ver=config.deploy_ver,
                    warm=False,
                )
                await sm_state.register_pod(config.scope_id, pod.pod_id, url, config.deploy_ver)
            await pipe.execute()
    return sids


async def place(
    svc: Services, sids: list[str], n_sessions: int, prefix: str, request_prefix: str
) -> Counter[str]:
    """route_place for sessions ``prefix + k`` in scope ``k % len(sids)``, pipelined."""
    outcomes: Counter[str] = Counter()
    for start in range(0, n_sessions, PIPELINE):
        batch = [
            (f"{request_prefix}{k}", f"{prefix}{k}", sids[k % len(sids)])
            for k in range(start, min(start + PIPELINE, n_sessions))
        ]
        for placement in await svc.session_state.place_many(batch, token="bench-setup"):
            outcomes[placement.action.value] += 1
    return outcomes


async def unlink(redis: Redis, keys: list[str]) -> None:
    for start in range(0, len(keys), PIPELINE):
        await redis.unlink(*keys[start : start + PIPELINE])


async def populate(
    ctx: Context,
    svc: Services,
    k8s: FakeK8sPodClient,
    n_sessions: int,
    n_pods: int,
    n_scopes: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    pods_per_scope = n_pods // n_scopes
    pod_concurrency = math.ceil(n_sessions / n_pods)
    redis = svc.session_state.redis
    t0 = time.perf_counter()
    sids = await scopes_with_pods(
        svc, k8s, "scale", GROUP, n_scopes, pods_per_scope, pod_concurrency, session_ttl=3600
    )
    t1 = time.perf_counter()
    mem_before = ctx.redis.used_memory()
    outcomes = await place(svc, sids, n_sessions, "s-", "setup-")
    t2 = time.perf_counter()
    mem_with_replay = ctx.redis.used_memory()
    await unlink(
        redis, [sm.route_key(sids[k % len(sids)], f"setup-{k}") for k in range(n_sessions)]
    )
    await asyncio.sleep(0.2)  # UNLINK frees in the background
    mem_after = ctx.redis.used_memory()
    setup = {
        "scopes_and_pods_seconds": round(t1 - t0, 2),
        "sessions_seconds": round(t2 - t1, 2),
        "sessions_per_second": round(n_sessions / (t2 - t1)),
        "pods_per_scope": pods_per_scope,
        "pod_concurrency": pod_concurrency,
        "route_place_outcomes": dict(outcomes),
    }
    memory = {
        "used_memory_delta_bytes_per_session": round((mem_after - mem_before) / n_sessions, 1),
        "with_replay_keys_bytes_per_session": round((mem_with_replay - mem_before) / n_sessions, 1),
        "note": "used_memory is server-wide (other dbs' activity is noise); MEMORY USAGE is exact",
        "memory_usage_bytes_per_session": await memory_usage(redis, sids, n_sessions),
    }
    return setup, memory


async def memory_usage(redis: Redis, sids: list[str], n_sessions: int) -> dict[str, float]:
    """Bytes per live session by the keys it lives in (sampled hashes, whole shared keys)."""
    sample = random.sample(range(n_sessions), min(200, n_sessions))
    hashes = [
        await redis.memory_usage(sm.session_key(sids[k % len(sids)], f"s-{k}")) or 0 for k in sample
    ]
    indexes = [await redis.memory_usage(sm.session_scope_key(f"s-{k}")) or 0 for k in sample]
    expiry = sum([await redis.memory_usage(sm.scope_expiry_key(s), samples=0) or 0 for s in sids])
    scope_sets = [await redis.memory_usage(sm.scope_sessions_key(s), samples=0) or 0 for s in sids]
    pod_sets = 0
    for sid in sids[: min(50, len(sids))]:
        for pod in await redis.zrange(sm.scope_pods_key(sid), 0, -1):
            pod_sets += await redis.memory_usage(sm.pod_sessions_key(sid, pod), samples=0) or 0
    pod_sets_total = pod_sets * len(sids) / min(50, len(sids))
    out = {
        "session_hash": statistics.fmean(hashes),
        "session_scope_index": statistics.fmean(indexes),
        "session_expiry_zset": expiry / n_sessions,
        "scope_sessions_sets": sum(scope_sets) / n_sessions,
        "pod_sessions_sets": pod_sets_total / n_sessions,
    }
    out["total"] = sum(out.values())
    return {k: round(v, 1) for k, v in out.items()}


class LoopStall:
    """The longest the event loop went without running a 1 ms ticker while a tick ran: what
    a request arriving at the worst moment would wait for the loop (jobs run in the serving
    process). Reported minus the 1 ms sleep. A watcher thread also samples the loop thread's
    stack whenever the ticker is over STALL_SAMPLE_MS late: where the long slices are."""

    STALL_SAMPLE_MS = 5.0

    def __init__(self) -> None:
        self.worst = 0.0
        self.where: Counter[str] = Counter()
        self._beat = time.perf_counter()
        self._task: asyncio.Task[None] | None = None
        self._stop = threading.Event()

    async def _watch(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last - 0.001)
            self._beat = last = now

    def _sample(self, loop_thread: int) -> None:
        while not self._stop.wait(0.001):
            if (time.perf_counter() - self._beat) * 1000 < self.STALL_SAMPLE_MS:
                continue
            frame = sys._current_frames().get(loop_thread)
            if frame is None:
                continue
            ours = [
                f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})"
                for f in traceback.extract_stack(frame)
                if "agent_runtime" in f.filename
            ]
            self.where[" <- ".join(reversed(ours[-4:])) or "(outside agent_runtime)"] += 1

    async def __aenter__(self) -> LoopStall:
        self._task = asyncio.create_task(self._watch())
        threading.Thread(target=self._sample, args=(threading.get_ident(),), daemon=True).start()
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def timed(fn: Callable[[], Awaitable[Any]], *, profile: bool = False) -> dict[str, Any]:
    runs, trips, stalls, result = [], [], [], None
    where: Counter[str] = Counter()
    for _ in range(TICK_REPEATS):
        r0 = bench_server.ROUND_TRIPS[0]
        async with LoopStall() as stall:
            t0 = time.perf_counter()
            try:
                result = await fn()
            except Exception as exc:  # a tick that fails at this size is a finding, not a crash
                result = {"error": f"{type(exc).__name__}: {exc}"}
            runs.append((time.perf_counter() - t0) * 1000)
        trips.append(bench_server.ROUND_TRIPS[0] - r0)
        stalls.append(stall.worst * 1000)
        where.update(stall.where)
    out = {
        "ms": [round(x, 1) for x in runs],
        "median_ms": round(statistics.median(runs), 1),
        "max_ms": round(max(runs), 1),
        "redis_round_trips": trips[-1],
        "loop_stall_max_ms": round(max(stalls), 1),
        "loop_stalled_in": dict(where.most_common(3)),  # stack samples over 5 ms late
        "result": result,
    }
    if profile:
        out["profile"] = await profiled(fn)
    return out


async def profiled(fn: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
    """One more run of the tick under pyinstrument (async mode): top frames by self time."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        return {"skipped": "pyinstrument is not installed"}
    profiler = Profiler(interval=0.0005, async_mode="enabled")
    profiler.start()
    try:
        await fn()
    finally:
        profiler.stop()
    summary = bench_server.profile_summary(profiler.last_session, top=12)
    return {k: summary[k] for k in ("total_seconds", "top_self", "self_by_package") if k in summary}


async def ticks(svc: Services, *, profile: bool = False) -> dict[str, Any]:
    jobs: dict[str, Callable[[], Awaitable[Any]]] = {
        "sm_sweep": svc.session_sweeper.sweep_once,
        "rm_autoscale": svc.pool_jobs.autoscale_once,
        "rm_reclaim": svc.pool_jobs.reclaim_and_prune_once,
        "rm_watch": svc.pool_jobs.watch_once,
        "rm_reconcile": svc.pool_jobs.reconcile_once,
    }
    out = {name: await timed(fn, profile=profile) for name, fn in jobs.items()}
    await svc.session_sweeper.wait_for_notices()
    return out


async def expiry_tick(
    ctx: Context, svc: Services, k8s: FakeK8sPodClient, n_expiring: int
) -> dict[str, Any]:
    """``n_expiring`` sessions (10 scopes, ttl 1 s) next to the others; one sweep once they
    are due."""
    sids = await scopes_with_pods(
        svc, k8s, "scale-exp", EXPIRING_GROUP, 10, 1, math.ceil(n_expiring / 10), session_ttl=1
    )
    outcomes = await place(svc, sids, n_expiring, "e-", "setup-e-")
    await asyncio.sleep(1.2)
    r0 = bench_server.ROUND_TRIPS[0]
    async with LoopStall() as stall:
        t0 = time.perf_counter()
        result = await svc.session_sweeper.sweep_once()
        elapsed = (time.perf_counter() - t0) * 1000
    await svc.session_sweeper.wait_for_notices()
    return {
        "expiring": n_expiring,
        "placed": dict(outcomes),
        "ms": round(elapsed, 1),
        "loop_stall_max_ms": round(stall.worst * 1000, 1),
        "redis_round_trips": bench_server.ROUND_TRIPS[0] - r0,
        "result": result,
    }


async def refresh_at_size(
    ctx: Context, n_sessions: int, n_scopes: int, *, jobs: bool
) -> dict[str, Any]:
    name = "scale-jobs" if jobs else "scale"
    server = await Server(ctx, name, jobs=jobs, seed_k8s=jobs).start(within=120)
    try:
        spec = LoadSpec(
            url=server.url + f"{API}/route",
            mode="route_existing",
            group=GROUP,
            sessions=n_sessions,
            scopes=n_scopes,
            seconds=1,
        )
        await ctx.loadgen.run(spec, servers=[server])  # warm-up
        seconds = 3 if ctx.quick else 5
        loaded = await ctx.loadgen.run(
            LoadSpec(**{**spec.__dict__, "seconds": seconds}), servers=[server]
        )
        unloaded = await ctx.loadgen.run(
            LoadSpec(**{**spec.__dict__, "seconds": seconds, "connections": 1, "threads": 1}),
            servers=[server],
        )
        metrics = await server.metrics()
    finally:
        server.stop()
    placements = {
        k.split('"')[1]: v
        for k, v in metrics.items()
        if k.startswith("agent_runtime_route_placements_total{")
    }
    return {"jobs": jobs, "loaded": loaded, "unloaded": unloaded, "placements": placements}
