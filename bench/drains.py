"""drains: what a drain costs, in process over the bench Redis (the fake Kubernetes):

- the two scripts of a drain's start, one call each: ``drain_begin`` (RM: marked and out of
  the warm pool) and ``retire_pod`` (SM: out of its scope's candidates), µs per round trip;
- a node drain (the facade's ``drain_node``) of ``PODS`` pods on one node, each carrying
  ``SESSIONS`` sessions: ms for the whole call;
- one ``rm_drains`` tick (``drains_once``) when all those pods reach their deadline at once:
  every session evicted with its tombstone and every pod deleted — ms for the tick, ms a pod,
  and the longest stretch the tick held the event loop (a sampler task's worst wake-up delay).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from redis.asyncio import Redis

from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.drain_state import DrainState
from agent_runtime.resource_manager.drains import Drains
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.state import ResourceState, scope_draining_key
from agent_runtime.session_manager.facade import SessionManagerFacade
from agent_runtime.session_manager.state import SessionState
from bench.common import Context

NAME = "drains"
SCOPE = "d" * 32
SESSIONS = 4  # per pod


async def run(ctx: Context) -> dict[str, Any]:
    pods = 50 if ctx.quick else 200
    calls = 200 if ctx.quick else 2000
    redis = Redis.from_url(ctx.redis.url, decode_responses=True)
    try:
        costs = await script_costs(redis, calls)
        ctx.redis.wipe()  # the bench db's own keys only
        return {
            "script_us": costs,
            **await node_drain(redis, pods),
            "pods": pods,
            "sessions_per_pod": SESSIONS,
        }
    finally:
        ctx.redis.wipe()
        await redis.aclose()


async def setup_pods(
    redis: Redis, k8s: FakeK8sPodClient, count: int, *, node: str = "fake-node-0"
) -> list[str]:
    """``count`` pods registered in both modules, each with SESSIONS sessions."""
    rs, sm = ResourceState(redis, pod_budget=100_000), SessionState(redis)
    await rs.write_pool_config(
        SCOPE, {"min_idle_pods": 0, "max_pods": 100_000, "pod_ttl": 600, "pod_concurrency": 8}
    )
    await redis.hset(
        f"session_manager:scope:{{{SCOPE}}}:config",
        mapping={"scope_concurrency": "1000000", "pod_concurrency": str(SESSIONS),
                 "max_pods": "100000", "session_ttl": "600", "deploy_ver": "v1"},
    )  # fmt: skip
    pod_ids = []
    for i in range(count):
        pod = k8s.add_pod(scope_id=SCOPE, deploy_ver="v1", node=node)
        member = await DeployState(rs).add_placeholder(SCOPE, f"t{i}", 600)
        assert member is not None
        await rs.register(
            scope_id=SCOPE, pod_id=pod.pod_id, placeholder=member, pod_sse_url="http://x",
            pod_ip=pod.pod_ip or "", namespace="default", deploy_ver="v1", warm=False,
        )  # fmt: skip
        await sm.register_pod(SCOPE, pod.pod_id, "http://x", "v1")
        pod_ids.append(pod.pod_id)
    for n in range(count * SESSIONS):  # first fit: SESSIONS a pod, in arrival order
        await sm.route_place(request_id=f"r{n}", session_id=f"s{n}", scope_id=SCOPE, token="t")
    return pod_ids


async def script_costs(redis: Redis, calls: int) -> dict[str, float]:
    k8s = FakeK8sPodClient()
    (pod,) = await setup_pods(redis, k8s, 1)
    drains, sm = DrainState(ResourceState(redis)), SessionState(redis)
    out: dict[str, float] = {}
    for name, call in (
        ("drain_begin", lambda: drains.begin(pod, trigger="admin", pending=False, seconds=60)),
        ("retire_pod", lambda: sm.retire_pod(SCOPE, pod)),
    ):
        took = []
        for _ in range(calls):
            started = time.perf_counter()
            await call()
            took.append(time.perf_counter() - started)
        took.sort()
        out[f"{name}_p50"] = round(statistics.median(took) * 1e6, 1)
        out[f"{name}_p99"] = round(took[int(len(took) * 0.99) - 1] * 1e6, 1)
    return out


async def node_drain(redis: Redis, count: int) -> dict[str, Any]:
    k8s = FakeK8sPodClient()
    pods = await setup_pods(redis, k8s, count)
    rs = ResourceState(redis, pod_budget=100_000)
    drains = Drains(
        state=rs, k8s=k8s, sessions=SessionManagerFacade(state=SessionState(redis)),
        default_namespace="default",
    )  # fmt: skip
    started = time.perf_counter()
    drained = await drains.drain_node("fake-node-0", 3600)
    node_ms = (time.perf_counter() - started) * 1000
    assert len(drained) == count, (len(drained), count)
    # every deadline now: the next tick moves every session and deletes every pod
    await redis.zadd(scope_draining_key(SCOPE), dict.fromkeys(pods, 0))
    for pod in pods:
        await redis.hset(f"resource_manager:resource:pod:{{{SCOPE}}}:{pod}:drain", "deadline", "0")
    worst = 0.0
    running = True

    async def sampler() -> None:
        nonlocal worst
        loop = asyncio.get_running_loop()
        while running:
            before = loop.time()
            await asyncio.sleep(0.001)
            worst = max(worst, loop.time() - before - 0.001)

    watcher = asyncio.create_task(sampler())
    started = time.perf_counter()
    finished = await drains.drains_once()
    tick_ms = (time.perf_counter() - started) * 1000
    running = False
    await watcher
    return {
        "node_drain_ms": round(node_ms, 1),
        "tick_ms": round(tick_ms, 1),
        "tick_ms_per_pod": round(tick_ms / count, 2),
        "tick_longest_loop_hold_ms": round(worst * 1000, 2),
        "pods_deleted": finished,
        "sessions_moved": count * SESSIONS
        - len(await redis.zrange(f"session_manager:scope:{{{SCOPE}}}:session_expiry", 0, -1)),
    }
