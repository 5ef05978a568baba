"""The resource manager's background jobs (autoscale, reclaim, watch, reconcile) and the
JobRunner's leader lock, on fakeredis and the real Redis with the fake Kubernetes.

Assertions go through the contract's key names (§4), spelled out here on purpose rather than
imported from ``state.py``: these tests hold the code to the contract, not to itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Redis

from agent_runtime import jobs as jobs_module
from agent_runtime import spec_fields
from agent_runtime.jobs import Job, JobRunner
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager import pool_jobs as pool_jobs_module
from agent_runtime.resource_manager import pool_jobs_state
from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.facade import (
    AcquiredPod,
    DeployInProgress,
    K8sApiError,
    MaxPodsReached,
    ResourceManagerFacade,
)
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.models import PodStatus
from agent_runtime.resource_manager.orchestrator import ResourceOrchestrator
from agent_runtime.resource_manager.pod_manifest import pod_labels
from agent_runtime.resource_manager.pool_jobs import PoolJobs
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.session_manager.facade import SessionManagerFacade
from agent_runtime.session_manager.state import SessionState
from contract_keys import (
    rm_pod,
    rm_pod_known,
    rm_scope,
    sm_expiry,
    sm_pod,
    sm_pods_registered,
    sm_scope,
    sm_session,
)
from helpers import IDENTITY, GatedK8s, other_client

SCOPE = "scope-jobs"
OTHER_SCOPE = "scope-other"

# --- contract key names (§4) -------------------------------------------------------------------


def job_lock(name: str) -> str:
    return f"agent_runtime:job:{name}"


# --- building an instance ----------------------------------------------------------------------


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "image": "agentserver:1",
        "pod_name": "agent",
        "namespace": None,
        "container_port": 8080,
        "sse_port": 8080,
        "sse_path": "/sse",
        "ready_timeout": 5.0,
        "ready_poll_interval": 0.02,
        "env": {},
    }
    base.update(overrides)
    return base


V1 = spec()
V2 = spec(image="agentserver:2")
VER1 = spec_fields.deploy_ver(V1)
VER2 = spec_fields.deploy_ver(V2)


def pool(
    *, min_idle: int = 0, max_pods: int = 6, pod_ttl: int = 60, pod_concurrency: int = 2
) -> dict[str, int]:
    return {
        "min_idle_pods": min_idle,
        "max_pods": max_pods,
        "pod_ttl": pod_ttl,
        "pod_concurrency": pod_concurrency,
    }


class SpySessions(SessionManagerFacade):
    """The real session facade, recording every notify_pod_dead and what it evicted."""

    def __init__(self, *, state: SessionState) -> None:
        super().__init__(state=state)
        self.dead: list[str] = []
        self.evicted: dict[str, int] = {}

    async def notify_pod_dead(self, scope_id: str, pod_id: str) -> int:
        self.dead.append(pod_id)
        evicted = await super().notify_pod_dead(scope_id, pod_id)
        self.evicted[pod_id] = self.evicted.get(pod_id, 0) + evicted
        return evicted


@dataclass
class Env:
    redis: Redis
    k8s: FakeK8sPodClient
    state: ResourceState
    orchestrator: ResourceOrchestrator
    facade: ResourceManagerFacade
    sessions: SpySessions
    pool_jobs: PoolJobs
    notifier: Notifier


@pytest.fixture
def k8s() -> FakeK8sPodClient:
    return FakeK8sPodClient()


@pytest.fixture
async def env(redis: Redis, k8s: FakeK8sPodClient) -> AsyncIterator[Env]:
    state = ResourceState(redis)
    notifier = Notifier(redis)
    await notifier.start()
    orchestrator = ResourceOrchestrator(
        state=state, k8s=k8s, notifier=notifier, default_namespace="default", identity=IDENTITY
    )
    sessions = SpySessions(state=SessionState(redis))
    pool_jobs = PoolJobs(
        state=state,
        k8s=k8s,
        orchestrator=orchestrator,
        sessions=sessions,
        default_namespace="default",
        identity=IDENTITY,
    )
    instance = Env(
        redis,
        k8s,
        state,
        orchestrator,
        ResourceManagerFacade(orchestrator=orchestrator),
        sessions,
        pool_jobs,
        notifier,
    )
    try:
        yield instance
    finally:
        await pool_jobs.wait_for_warm_deploys()
        await orchestrator.close()
        await notifier.stop()


async def configure(
    env: Env, pod_spec: dict[str, Any] | None = V1, scope: str = SCOPE, **pool_kw: int
) -> None:
    await env.facade.update_pool_config(scope, pool(**pool_kw), pod_spec)


async def add_warm(env: Env, pod_spec: dict[str, Any] = V1, scope: str = SCOPE) -> str:
    """One warm pod deployed and registered directly (not through autoscale)."""
    member = await DeployState(env.state).add_placeholder(
        scope, f"warm:test-{time.monotonic_ns()}", 60
    )
    assert member is not None, "test setup: scope at max_pods"
    result = await env.orchestrator.deploy_and_register(scope, pod_spec, member, warm=True)
    return result.pod_id


async def take_in_use(env: Env, request_id: str, pod_spec: dict[str, Any] = V1) -> str:
    """A pod handed out by acquire (phase in_use); the pool config must exist already."""
    config = await env.state.pool_config(SCOPE)
    assert config is not None
    pool_config = {
        "min_idle_pods": config.min_idle_pods,
        "max_pods": config.max_pods,
        "pod_ttl": config.pod_ttl,
        "pod_concurrency": config.pod_concurrency,
    }
    return (await env.facade.acquire(SCOPE, pod_spec, pool_config, request_id)).pod_id


async def redis_now(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return seconds + micros / 1_000_000


async def set_idle_age(redis: Redis, pod_id: str, age: float) -> None:
    """Pretend the pod went idle ``age`` seconds ago (Redis clock)."""
    assert await redis.exists(rm_pod(SCOPE, pod_id, "idle_since")), "only a warm pod has idle_since"
    await redis.set(rm_pod(SCOPE, pod_id, "idle_since"), f"{await redis_now(redis) - age:.6f}")


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while True:
        if await check():
            return
        assert time.monotonic() < deadline, f"condition not met within {within}s"
        await asyncio.sleep(0.01)


# --- the session side, through its contract keys -------------------------------------------------


async def add_sessions(
    redis: Redis, pod_id: str, session_ids: list[str], *, scope: str = SCOPE, candidate: bool
) -> None:
    """Live sessions on a registered pod, in their four places; ``candidate`` keeps the pod in
    first-fit (False: a sunset pod, or one the idle notice took out)."""
    expiry = int((await redis.time())[0]) + 600
    await redis.sadd(sm_pods_registered(scope), pod_id)
    await redis.hset(sm_pod(scope, pod_id, "info"), mapping={"sse_url": "x", "deploy_ver": "v"})
    if candidate:
        await redis.zadd(sm_scope(scope, "pods"), {pod_id: 1})
    for session_id in session_ids:
        await redis.hset(
            sm_session(scope, session_id),
            mapping={"scope_id": scope, "pod_id": pod_id, "expiry": expiry, "session_ttl": 600},
        )
        await redis.zadd(sm_expiry(scope), {session_id: expiry})
        await redis.sadd(sm_scope(scope, "sessions"), session_id)
        await redis.sadd(sm_pod(scope, pod_id, "sessions"), session_id)


async def end_sessions(
    redis: Redis, pod_id: str, session_ids: list[str], scope: str = SCOPE
) -> None:
    for session_id in session_ids:
        await redis.delete(sm_session(scope, session_id))
        await redis.zrem(sm_expiry(scope), session_id)
        await redis.srem(sm_scope(scope, "sessions"), session_id)
        await redis.srem(sm_pod(scope, pod_id, "sessions"), session_id)


async def assert_sessions_evicted(
    redis: Redis, pod_id: str, session_ids: list[str], scope: str = SCOPE
) -> None:
    for session_id in session_ids:
        assert not await redis.exists(sm_session(scope, session_id))
        assert await redis.zscore(sm_expiry(scope), session_id) is None
        assert not await redis.sismember(sm_scope(scope, "sessions"), session_id)
    assert await redis.scard(sm_pod(scope, pod_id, "sessions")) == 0
    assert not await redis.sismember(sm_pods_registered(scope), pod_id)
    assert await redis.zscore(sm_scope(scope, "pods"), pod_id) is None
    assert not await redis.exists(sm_pod(scope, pod_id, "info"))


async def assert_sessions_alive(
    redis: Redis, pod_id: str, session_ids: list[str], scope: str = SCOPE
) -> None:
    for session_id in session_ids:
        assert await redis.hget(sm_session(scope, session_id), "pod_id") == pod_id
        assert await redis.zscore(sm_expiry(scope), session_id) is not None
        assert await redis.sismember(sm_scope(scope, "sessions"), session_id)
        assert await redis.sismember(sm_pod(scope, pod_id, "sessions"), session_id)


# --- resource-side assertions --------------------------------------------------------------------


async def warm_set(redis: Redis, scope: str = SCOPE) -> set[str]:
    return set(await redis.smembers(rm_scope(scope, "idle")))


async def assert_warm(redis: Redis, pod_id: str, version: str, scope: str = SCOPE) -> None:
    assert await redis.sismember(rm_scope(scope, "idle"), pod_id)
    assert await redis.exists(rm_pod(scope, pod_id, "idle_since"))
    info = await redis.hgetall(rm_pod(scope, pod_id, "info"))
    assert info["phase"] == "idle" and info["deploy_ver"] == version and info["scope_id"] == scope
    assert await redis.zscore(rm_scope(scope, "pods"), pod_id) is not None
    assert await rm_pod_known(redis, pod_id)


async def assert_in_use(redis: Redis, pod_id: str, scope: str = SCOPE) -> None:
    assert await redis.hget(rm_pod(scope, pod_id, "info"), "phase") == "in_use"
    assert not await redis.sismember(rm_scope(scope, "idle"), pod_id)
    assert not await redis.exists(rm_pod(scope, pod_id, "idle_since"))
    assert await redis.zscore(rm_scope(scope, "pods"), pod_id) is not None


async def assert_purged(redis: Redis, pod_id: str, scope: str = SCOPE) -> None:
    keys = [k async for k in redis.scan_iter(match=rm_pod("*", pod_id, "*"))]
    assert keys == [], f"RM keys of {pod_id} left: {keys}"
    assert not await rm_pod_known(redis, pod_id)
    assert await redis.zscore(rm_scope(scope, "pods"), pod_id) is None
    assert not await redis.sismember(rm_scope(scope, "idle"), pod_id)


async def assert_pool_consistent(redis: Redis, scope: str = SCOPE) -> None:
    """Per pod: idle set ⟺ idle_since ⟺ phase idle; scope pods ⊆ pods:all; the cap holds."""
    pods = await redis.zrange(rm_scope(scope, "pods"), 0, -1)
    idle = await warm_set(redis, scope)
    assert idle <= set(pods)
    for pod_id in pods:
        assert await rm_pod_known(redis, pod_id)
        has_since = bool(await redis.exists(rm_pod(scope, pod_id, "idle_since")))
        phase = await redis.hget(rm_pod(scope, pod_id, "info"), "phase")
        assert (pod_id in idle) == has_since == (phase == "idle"), (pod_id, phase)
    max_pods = await redis.hget(rm_scope(scope, "config"), "max_pods")
    if max_pods is not None:
        assert len(pods) + await redis.scard(rm_scope(scope, "deploying")) <= int(max_pods)


async def wipe_rm_pod_state(redis: Redis) -> None:
    """Redis lost the resource manager's pod state (every RM key but the scope configs)."""
    doomed = [
        k async for k in redis.scan_iter(match="resource_manager:*") if not k.endswith(":config")
    ]
    if doomed:
        await redis.delete(*doomed)


# ================================================================================================
# autoscale
# ================================================================================================


async def test_autoscale_fills_the_floor_with_current_version_warm_pods(env: Env) -> None:
    await configure(env, min_idle=2, max_pods=4)
    assert await env.pool_jobs.autoscale_once() == 2
    await env.pool_jobs.wait_for_warm_deploys()

    assert env.k8s.deploy_calls == 2
    warm = await warm_set(env.redis)
    assert len(warm) == 2
    for pod_id in warm:
        await assert_warm(env.redis, pod_id, VER1)
        assert env.k8s.pods[pod_id].labels["agent-runtime/deploy-ver"] == VER1
    assert await env.redis.scard(rm_scope(SCOPE, "deploying")) == 0, "placeholders given back"

    assert await env.pool_jobs.autoscale_once() == 0, "floor met: nothing more"
    await env.pool_jobs.wait_for_warm_deploys()
    assert env.k8s.deploy_calls == 2
    await assert_pool_consistent(env.redis)


async def test_in_flight_warm_deploys_count_towards_the_floor(env: Env) -> None:
    env.k8s.ready_delay = 0.2
    await configure(env, min_idle=2, max_pods=6)
    assert await env.pool_jobs.autoscale_once() == 2
    # the deploys are still running: their placeholders are in `deploying`
    assert await env.redis.scard(rm_scope(SCOPE, "deploying")) == 2
    assert await env.pool_jobs.autoscale_once() == 0
    assert await env.pool_jobs.autoscale_once() == 0
    await env.pool_jobs.wait_for_warm_deploys()
    assert env.k8s.deploy_calls == 2
    assert len(await warm_set(env.redis)) == 2
    assert await env.redis.scard(rm_scope(SCOPE, "deploying")) == 0


async def test_autoscale_respects_max_pods_counting_in_use_pods_and_placeholders(
    env: Env,
) -> None:
    env.k8s.ready_delay = 0.05
    await configure(env, min_idle=3, max_pods=4)
    in_use = await take_in_use(env, "r-in-use")
    # an acquire's deploy in flight holds a slot too
    acquire_placeholder = await DeployState(env.state).add_placeholder(SCOPE, "r-other:tok", 60)
    assert acquire_placeholder is not None

    assert await env.pool_jobs.autoscale_once() == 2, "4 = 1 in use + 1 placeholder + 2 warm"
    await env.pool_jobs.wait_for_warm_deploys()
    assert len(await warm_set(env.redis)) == 2
    assert await env.pool_jobs.autoscale_once() == 0, "at max_pods"
    await env.pool_jobs.wait_for_warm_deploys()
    assert env.k8s.deploy_calls == 3  # the acquire + 2 warm
    await assert_in_use(env.redis, in_use)

    # the acquire's placeholder goes: one slot frees, the floor (3) is still unmet
    await DeployState(env.state).drop_placeholder(SCOPE, acquire_placeholder)
    assert await env.pool_jobs.autoscale_once() == 1
    await env.pool_jobs.wait_for_warm_deploys()
    assert len(await warm_set(env.redis)) == 3
    assert await env.redis.zcard(rm_scope(SCOPE, "pods")) == 4
    await assert_pool_consistent(env.redis)


async def test_old_version_warm_pods_do_not_count_towards_the_floor(env: Env) -> None:
    await configure(env, min_idle=2, max_pods=6)
    await env.pool_jobs.autoscale_once()
    await env.pool_jobs.wait_for_warm_deploys()
    old = await warm_set(env.redis)
    assert len(old) == 2

    await configure(env, V2, min_idle=2, max_pods=6)
    assert await env.pool_jobs.autoscale_once() == 2
    await env.pool_jobs.wait_for_warm_deploys()
    new = await warm_set(env.redis) - old
    assert len(new) == 2
    for pod_id in new:
        await assert_warm(env.redis, pod_id, VER2)
        assert env.k8s.pods[pod_id].labels["agent-runtime/deploy-ver"] == VER2
    for pod_id in old:
        await assert_warm(env.redis, pod_id, VER1)  # reclaim's business, not autoscale's
    assert await env.pool_jobs.autoscale_once() == 0


async def test_old_version_pods_holding_the_cap_are_replaced_after_reclaim(env: Env) -> None:
    await configure(env, min_idle=2, max_pods=2)
    await env.pool_jobs.autoscale_once()
    await env.pool_jobs.wait_for_warm_deploys()
    old = await warm_set(env.redis)

    await configure(env, V2, min_idle=2, max_pods=2)
    assert await env.pool_jobs.autoscale_once() == 0, "the old pods still hold max_pods"
    assert await env.pool_jobs.reclaim_once() == 2
    assert await env.pool_jobs.autoscale_once() == 2
    await env.pool_jobs.wait_for_warm_deploys()
    warm = await warm_set(env.redis)
    assert len(warm) == 2 and not warm & old
    for pod_id in warm:
        await assert_warm(env.redis, pod_id, VER2)
    await assert_pool_consistent(env.redis)


async def test_a_failed_warm_deploy_gives_its_placeholder_back(env: Env) -> None:
    await configure(env, min_idle=1, max_pods=1)
    env.k8s.fail_next_deploys = 1
    assert await env.pool_jobs.autoscale_once() == 1
    await env.pool_jobs.wait_for_warm_deploys()
    assert await env.redis.scard(rm_scope(SCOPE, "deploying")) == 0
    assert await env.redis.zcard(rm_scope(SCOPE, "pods")) == 0
    assert env.k8s.pods == {}

    # max_pods is 1: a leaked placeholder would block this retry
    assert await env.pool_jobs.autoscale_once() == 1
    await env.pool_jobs.wait_for_warm_deploys()
    assert len(await warm_set(env.redis)) == 1
    assert env.k8s.deploy_calls == 2


async def test_a_never_ready_warm_deploy_leaves_no_pod_and_no_placeholder(env: Env) -> None:
    env.k8s.never_ready = True
    await configure(env, spec(ready_timeout=0.2), min_idle=1, max_pods=1)
    assert await env.pool_jobs.autoscale_once() == 1
    await env.pool_jobs.wait_for_warm_deploys()
    assert env.k8s.pods == {} and len(env.k8s.deleted) == 1
    assert await env.redis.scard(rm_scope(SCOPE, "deploying")) == 0
    assert await env.redis.zcard(rm_scope(SCOPE, "pods")) == 0


async def test_scopes_without_a_floor_or_a_pod_spec_are_left_alone(env: Env) -> None:
    await configure(env, min_idle=0, max_pods=4)
    await configure(env, None, scope=OTHER_SCOPE, min_idle=2, max_pods=4)
    assert await env.pool_jobs.autoscale_once() == 0
    await env.pool_jobs.wait_for_warm_deploys()
    assert env.k8s.deploy_calls == 0
    for scope in (SCOPE, OTHER_SCOPE):
        assert await env.redis.scard(rm_scope(scope, "deploying")) == 0
        assert await env.redis.zcard(rm_scope(scope, "pods")) == 0


async def test_a_pool_config_the_scope_index_lacks_is_found_by_reconcile(env: Env) -> None:
    """The jobs list scopes from their own index (not a keyspace SCAN per tick); a config
    written without it (by an older version, or by hand) joins it at the next reconcile."""
    await configure(env, min_idle=1, max_pods=4)
    await env.redis.hset(
        rm_scope(OTHER_SCOPE, "config"),
        mapping={
            **{k: str(v) for k, v in pool(min_idle=1, max_pods=4).items()},
            "deploy_ver": VER1,
            "pod_spec_json": json.dumps(V1),
        },
    )
    assert await env.pool_jobs.autoscale_once() == 1, "only the indexed scope"
    await env.pool_jobs.wait_for_warm_deploys()
    await env.pool_jobs.reconcile_once()
    assert await env.pool_jobs.autoscale_once() == 1, "the other scope, indexed by reconcile"
    await env.pool_jobs.wait_for_warm_deploys()
    assert len(await warm_set(env.redis, OTHER_SCOPE)) == 1
    assert await PoolJobsState(env.state).index_scopes() == 0, "nothing left to add"


async def test_many_scopes_are_served_in_one_tick(env: Env) -> None:
    """More scopes than one read_many call: every one gets its warm pod."""
    scopes = [f"scope-many-{i}" for i in range(pool_jobs_state.SCRIPT_BATCH + 20)]
    for scope in scopes:
        await configure(env, scope=scope, min_idle=1, max_pods=2)
    started = 0
    while started < len(scopes):  # the warm deploy concurrency per tick at once
        n = await env.pool_jobs.autoscale_once()
        assert n > 0
        started += n
        await env.pool_jobs.wait_for_warm_deploys()
    assert await env.pool_jobs.autoscale_once() == 0
    for scope in scopes[:: pool_jobs_state.SCRIPT_BATCH // 4]:
        assert len(await warm_set(env.redis, scope)) == 1


# ================================================================================================
# reclaim
# ================================================================================================


async def test_old_version_idle_pods_are_reclaimed_at_once(env: Env) -> None:
    await configure(env, min_idle=2, max_pods=6, pod_ttl=3600)
    old = [await add_warm(env), await add_warm(env)]
    for pod_id in old:  # the session side knows them (not as candidates: they are warm)
        await add_sessions(env.redis, pod_id, [], candidate=False)
    await configure(env, V2, min_idle=2, max_pods=6, pod_ttl=3600)
    current = await add_warm(env, V2)

    assert await env.pool_jobs.reclaim_once() == 2
    assert sorted(env.k8s.deleted) == sorted(old)
    for pod_id in old:
        await assert_purged(env.redis, pod_id)
        await assert_sessions_evicted(env.redis, pod_id, [])
    assert sorted(env.sessions.dead) == sorted(old)
    await assert_warm(env.redis, current, VER2)
    assert await env.pool_jobs.reclaim_once() == 0
    await assert_pool_consistent(env.redis)


async def test_current_idle_pods_above_the_floor_go_after_pod_ttl_keeping_the_longest_idle(
    env: Env,
) -> None:
    await configure(env, min_idle=2, max_pods=6, pod_ttl=30)
    pods = [await add_warm(env) for _ in range(4)]
    ages = dict(zip(pods, [400, 300, 200, 5], strict=True))
    for pod_id, age in ages.items():
        await set_idle_age(env.redis, pod_id, age)

    assert await env.pool_jobs.reclaim_once() == 1
    # the floor keeps the two longest-idle; of the rest only the one past pod_ttl goes
    assert env.k8s.deleted == [pods[2]]
    await assert_purged(env.redis, pods[2])
    assert env.sessions.dead == [pods[2]]
    assert await warm_set(env.redis) == {pods[0], pods[1], pods[3]}

    assert await env.pool_jobs.reclaim_once() == 0, "the last one is still under pod_ttl"
    await set_idle_age(env.redis, pods[3], 31)
    assert await env.pool_jobs.reclaim_once() == 1
    assert await warm_set(env.redis) == {pods[0], pods[1]}, "the floor stays"
    assert await env.pool_jobs.reclaim_once() == 0
    await assert_pool_consistent(env.redis)


async def test_ttl_reclaim_runs_on_the_redis_clock(env: Env) -> None:
    await configure(env, min_idle=0, max_pods=2, pod_ttl=1)
    pod_id = await add_warm(env)
    assert await env.pool_jobs.reclaim_once() == 0, "just went idle"

    async def reclaimed() -> bool:
        return await env.pool_jobs.reclaim_once() == 1

    await eventually(reclaimed, within=4.0)
    assert env.k8s.deleted == [pod_id]
    await assert_purged(env.redis, pod_id)


async def test_reclaim_never_hands_a_deleted_pod_to_a_concurrent_acquire(env: Env) -> None:
    await configure(env, min_idle=0, max_pods=60, pod_ttl=1, pod_concurrency=1)
    handed_out: set[str] = set()
    for round_ in range(4):
        warm = [await add_warm(env) for _ in range(6)]
        for pod_id in warm:
            await set_idle_age(env.redis, pod_id, 100)
        deleted_before = len(env.k8s.deleted)
        results = await asyncio.gather(
            env.pool_jobs.reclaim_once(),
            *(
                env.facade.acquire(SCOPE, V1, pool(max_pods=60, pod_ttl=1, pod_concurrency=1), r)
                for r in [f"race-{round_}-{i}" for i in range(8)]
            ),
            return_exceptions=True,
        )
        assert isinstance(results[0], int)
        got = {r.pod_id for r in results[1:] if isinstance(r, AcquiredPod)}
        assert all(isinstance(r, AcquiredPod | MaxPodsReached) for r in results[1:]), results
        deleted = set(env.k8s.deleted[deleted_before:])
        assert results[0] == len(deleted)
        assert not got & deleted, "an acquire was handed a pod that reclaim deleted"
        # every warm pod went exactly one way: reclaimed, or handed out
        assert set(warm) <= got | deleted and not (set(warm) & got & deleted)
        for pod_id in got:
            await assert_in_use(env.redis, pod_id)
            assert pod_id in env.k8s.pods
        for pod_id in deleted:
            await assert_purged(env.redis, pod_id)
        handed_out |= got
        await assert_pool_consistent(env.redis)
    assert not handed_out & set(env.k8s.deleted)


async def test_a_failed_kubernetes_delete_puts_the_pod_back_into_the_warm_pool(env: Env) -> None:
    await configure(env, spec(namespace="team"), min_idle=0, max_pods=2, pod_ttl=1)
    pod_id = await add_warm(env, spec(namespace="team"))
    await set_idle_age(env.redis, pod_id, 100)
    env.k8s.forbidden_namespaces.add("team")

    assert await env.pool_jobs.reclaim_once() == 0
    assert pod_id in env.k8s.pods and env.k8s.deleted == []
    await assert_warm(env.redis, pod_id, spec_fields.deploy_ver(spec(namespace="team")))
    assert env.sessions.dead == [], "nothing to tell the session side: the pod lives"

    env.k8s.forbidden_namespaces.clear()
    await set_idle_age(env.redis, pod_id, 100)  # back in the pool restarted its clock
    assert await env.pool_jobs.reclaim_once() == 1
    assert env.k8s.deleted == [pod_id]
    await assert_purged(env.redis, pod_id)


async def test_reclaim_leaves_in_use_pods_alone(env: Env) -> None:
    await configure(env, min_idle=0, max_pods=4, pod_ttl=0)
    pod_id = await take_in_use(env, "r1")
    await configure(env, V2, min_idle=0, max_pods=4, pod_ttl=0)  # even an old version
    assert await env.pool_jobs.reclaim_once() == 0
    await assert_in_use(env.redis, pod_id)
    assert env.k8s.deleted == []


# ================================================================================================
# watch
# ================================================================================================


async def test_a_pod_removed_behind_our_back_is_purged_and_notified(env: Env) -> None:
    await configure(env, max_pods=4)
    gone = await take_in_use(env, "r1")
    kept = await add_warm(env)
    await add_sessions(env.redis, gone, ["s1", "s2"], candidate=True)
    env.k8s.remove(gone)

    assert await env.pool_jobs.watch_once() == 1
    await assert_purged(env.redis, gone)
    assert env.sessions.dead == [gone] and env.sessions.evicted[gone] == 2
    await assert_sessions_evicted(env.redis, gone, ["s1", "s2"])
    assert env.k8s.deleted == [], "nothing left to delete"
    await assert_warm(env.redis, kept, VER1)
    assert await env.pool_jobs.watch_once() == 0


@pytest.mark.parametrize(
    ("phase", "reason"),
    [
        ("Failed", None),
        ("Succeeded", None),
        ("Running", "CrashLoopBackOff"),
        ("Pending", "ImagePullBackOff"),
        ("Pending", "ErrImagePull"),
    ],
)
async def test_a_dead_pod_is_deleted_purged_and_its_sessions_evicted(
    env: Env, phase: str, reason: str | None
) -> None:
    await configure(env, max_pods=4)
    pod_id = await take_in_use(env, "r1")
    healthy = await take_in_use(env, "r2")
    await add_sessions(env.redis, pod_id, ["s1", "s2"], candidate=True)
    await add_sessions(env.redis, healthy, ["s3"], candidate=True)
    env.k8s.set_phase(pod_id, phase, reason)

    assert await env.pool_jobs.watch_once() == 1
    assert env.k8s.deleted == [pod_id] and pod_id not in env.k8s.pods
    await assert_purged(env.redis, pod_id)
    assert env.sessions.dead == [pod_id]
    await assert_sessions_evicted(env.redis, pod_id, ["s1", "s2"])
    await assert_sessions_alive(env.redis, healthy, ["s3"])
    await assert_in_use(env.redis, healthy)


async def test_the_session_side_is_told_the_scope_of_the_pods_record(env: Env) -> None:
    """The session side keeps no pod → scopes index: the scope comes with the pod, from the
    purged record, or from what a later door read of it before another door's purge."""
    await configure(env, max_pods=2)
    pod_id = await take_in_use(env, "r1")
    await add_sessions(env.redis, pod_id, ["s1"], candidate=True)
    # another door purged the record, and its word to the session side was lost
    assert await PoolJobsState(env.state).purge(pod_id) == SCOPE
    await env.pool_jobs.dead_pods.forget(pod_id)  # no record, no scope read: nobody to tell
    assert env.sessions.dead == []
    await assert_sessions_alive(env.redis, pod_id, ["s1"])
    await env.pool_jobs.dead_pods.forget(pod_id, SCOPE)  # a door that read the record first
    assert env.sessions.dead == [pod_id]
    await assert_sessions_evicted(env.redis, pod_id, ["s1"])


async def test_kill_is_dead(env: Env) -> None:
    await configure(env, max_pods=2)
    pod_id = await add_warm(env)
    env.k8s.kill(pod_id)
    assert await env.pool_jobs.watch_once() == 1
    assert env.k8s.deleted == [pod_id]
    await assert_purged(env.redis, pod_id)


async def test_pending_is_not_dead(env: Env) -> None:
    await configure(env, max_pods=2)
    pod_id = await take_in_use(env, "r1")
    await add_sessions(env.redis, pod_id, ["s1"], candidate=True)
    env.k8s.set_phase(pod_id, "Pending")
    env.k8s.unhealthy.add(pod_id)  # not Running: not probed either
    for _ in range(3):
        assert await env.pool_jobs.watch_once() == 0
    assert env.k8s.deleted == [] and env.sessions.dead == []
    await assert_in_use(env.redis, pod_id)
    assert not await env.redis.exists(rm_pod(SCOPE, pod_id, "health_fails"))
    await assert_sessions_alive(env.redis, pod_id, ["s1"])


async def test_two_failed_probes_in_a_row_make_a_pod_half_dead(env: Env) -> None:
    await configure(env, max_pods=2)
    pod_id = await take_in_use(env, "r1")
    await add_sessions(env.redis, pod_id, ["s1"], candidate=True)
    env.k8s.unhealthy.add(pod_id)

    assert await env.pool_jobs.watch_once() == 0
    assert await env.redis.get(rm_pod(SCOPE, pod_id, "health_fails")) == "1"
    assert env.k8s.deleted == [] and env.sessions.dead == []
    await assert_sessions_alive(env.redis, pod_id, ["s1"])

    assert await env.pool_jobs.watch_once() == 1
    assert env.k8s.deleted == [pod_id]
    await assert_purged(env.redis, pod_id)
    assert env.sessions.dead == [pod_id]
    await assert_sessions_evicted(env.redis, pod_id, ["s1"])


async def test_a_healthy_probe_resets_the_failure_count(env: Env) -> None:
    await configure(env, max_pods=2)
    pod_id = await take_in_use(env, "r1")
    env.k8s.unhealthy.add(pod_id)
    assert await env.pool_jobs.watch_once() == 0
    assert await env.redis.get(rm_pod(SCOPE, pod_id, "health_fails")) == "1"

    env.k8s.unhealthy.discard(pod_id)
    assert await env.pool_jobs.watch_once() == 0
    assert not await env.redis.exists(rm_pod(SCOPE, pod_id, "health_fails"))

    env.k8s.unhealthy.add(pod_id)
    assert await env.pool_jobs.watch_once() == 0, "fail, ok, fail is not two in a row"
    assert await env.redis.get(rm_pod(SCOPE, pod_id, "health_fails")) == "1"
    assert env.k8s.deleted == []
    await assert_in_use(env.redis, pod_id)


async def test_probes_run_at_most_probe_concurrency_at_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    await configure(env, max_pods=60, pod_concurrency=1)
    pods = [await take_in_use(env, f"r{i}") for i in range(40)]
    running = peak = 0
    probed: list[str] = []
    by_ip = {env.k8s.pods[p].pod_ip: p for p in pods}

    async def probe(pod_ip: str, port: int) -> bool:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.005)
        running -= 1
        probed.append(by_ip[pod_ip])
        return True

    monkeypatch.setattr(env.k8s, "probe_health", probe)
    assert await env.pool_jobs.watch_once() == 0
    assert sorted(probed) == sorted(pods), "each pod probed exactly once"
    assert peak == pool_jobs_module.PROBE_CONCURRENCY


async def test_a_running_pod_that_kubernetes_reports_not_ready_is_still_probed(env: Env) -> None:
    await configure(env, max_pods=4)
    sick = await take_in_use(env, "r1")
    fine = await take_in_use(env, "r2")
    await add_sessions(env.redis, sick, ["s1"], candidate=True)
    # a failing readiness probe turns Ready false; the pod keeps Running and its IP
    env.k8s.set_phase(sick, "Running", ready=False)
    env.k8s.set_phase(fine, "Running", ready=False)
    assert env.k8s.pods[sick].pod_ip and not env.k8s.pods[sick].ready
    env.k8s.unhealthy.add(sick)

    assert await env.pool_jobs.watch_once() == 0
    assert await env.redis.get(rm_pod(SCOPE, sick, "health_fails")) == "1"
    assert await env.pool_jobs.watch_once() == 1
    assert env.k8s.deleted == [sick]
    await assert_purged(env.redis, sick)
    await assert_sessions_evicted(env.redis, sick, ["s1"])
    # not Ready but answering /health: kept
    assert not await env.redis.exists(rm_pod(SCOPE, fine, "health_fails"))
    await assert_in_use(env.redis, fine)


async def test_a_failed_list_purges_nothing(env: Env) -> None:
    team = spec(namespace="team")
    await configure(env, team, max_pods=4)
    pods = [await take_in_use(env, "r1", team), await add_warm(env, team)]
    await add_sessions(env.redis, pods[0], ["s1"], candidate=True)
    env.k8s.forbidden_namespaces.add("team")
    env.k8s.remove(pods[1])  # even a pod really gone: unknown while the LIST fails
    env.k8s.unhealthy.add(pods[0])

    for _ in range(3):
        assert await env.pool_jobs.watch_once() == 0
        assert (await env.pool_jobs.reconcile_once())["purged"] == 0
    assert env.sessions.dead == [] and env.k8s.deleted == []
    await assert_in_use(env.redis, pods[0])
    await assert_warm(env.redis, pods[1], spec_fields.deploy_ver(team))
    assert not await env.redis.exists(rm_pod(SCOPE, pods[0], "health_fails")), (
        "no probe without a LIST"
    )
    await assert_sessions_alive(env.redis, pods[0], ["s1"])

    env.k8s.forbidden_namespaces.clear()
    assert await env.pool_jobs.watch_once() == 1
    await assert_purged(env.redis, pods[1])


async def test_watch_is_one_list_per_namespace(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    await configure(env, max_pods=6)
    for _ in range(4):
        await add_warm(env)
    await configure(env, spec(namespace="team"), scope=OTHER_SCOPE, max_pods=2)
    await add_warm(env, spec(namespace="team"), scope=OTHER_SCOPE)
    calls: list[str] = []
    original = env.k8s.list_pods

    async def counting(
        namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> list[PodStatus]:
        calls.append(namespace)
        return await original(namespace, label_selector, cluster=cluster)

    async def no_get(
        pod_id: str, namespace: str, *, cluster: str | None = None
    ) -> PodStatus | None:
        raise AssertionError("watch must LIST, not GET per pod")

    monkeypatch.setattr(env.k8s, "list_pods", counting)
    monkeypatch.setattr(env.k8s, "get_pod", no_get)
    assert await env.pool_jobs.watch_once() == 0
    assert sorted(calls) == ["default", "team"]


# ================================================================================================
# a pod with live sessions is never deleted, except dead or half-dead
# ================================================================================================


async def test_no_job_deletes_or_releases_a_pod_with_live_sessions(env: Env) -> None:
    await configure(env, min_idle=1, max_pods=6, pod_ttl=0)
    sunset = await take_in_use(env, "r1")
    serving = await take_in_use(env, "r2")
    await add_sessions(env.redis, sunset, ["s1", "s2"], candidate=False)
    await add_sessions(env.redis, serving, ["s3"], candidate=True)
    # a deploy change: both are of the old version now; the floor refills with new pods
    await configure(env, V2, min_idle=1, max_pods=6, pod_ttl=0)

    for _ in range(3):
        await env.pool_jobs.autoscale_once()
        await env.pool_jobs.wait_for_warm_deploys()
        await env.pool_jobs.reclaim_once()
        await env.pool_jobs.watch_once()
        await env.pool_jobs.reconcile_once()
    assert sunset in env.k8s.pods and serving in env.k8s.pods
    assert sunset not in env.k8s.deleted and serving not in env.k8s.deleted
    assert env.sessions.dead == []
    await assert_in_use(env.redis, sunset)
    await assert_in_use(env.redis, serving)
    await assert_sessions_alive(env.redis, sunset, ["s1", "s2"])
    await assert_sessions_alive(env.redis, serving, ["s3"])

    # once the sunset pod's sessions end: released on the second reconcile, then reclaimed
    await end_sessions(env.redis, sunset, ["s1", "s2"])
    assert (await env.pool_jobs.reconcile_once())["released"] == 0
    assert (await env.pool_jobs.reconcile_once())["released"] == 1
    await assert_warm(env.redis, sunset, VER1)
    assert await env.pool_jobs.reclaim_once() == 1
    assert sunset in env.k8s.deleted
    await assert_purged(env.redis, sunset)

    # the dead rule does delete a pod with sessions
    env.k8s.kill(serving)
    assert await env.pool_jobs.watch_once() == 1
    await assert_sessions_evicted(env.redis, serving, ["s3"])
    await assert_pool_consistent(env.redis)


# ================================================================================================
# reconcile
# ================================================================================================


async def test_a_pod_in_redis_but_not_in_kubernetes_is_purged_and_notified(env: Env) -> None:
    await configure(env, max_pods=4)
    gone = await take_in_use(env, "r1")
    kept = await take_in_use(env, "r2")
    gone_warm = await add_warm(env)
    await add_sessions(env.redis, gone, ["s1"], candidate=True)
    await add_sessions(env.redis, kept, ["s2"], candidate=True)
    env.k8s.remove(gone)
    env.k8s.remove(gone_warm)

    counts = await env.pool_jobs.reconcile_once()
    assert counts["purged"] == 2 and counts["deleted"] == 0 and counts["adopted"] == 0
    for pod_id in (gone, gone_warm):
        await assert_purged(env.redis, pod_id)
    assert sorted(env.sessions.dead) == sorted([gone, gone_warm])
    await assert_sessions_evicted(env.redis, gone, ["s1"])
    await assert_in_use(env.redis, kept)
    await assert_sessions_alive(env.redis, kept, ["s2"])
    assert (await env.pool_jobs.reconcile_once())["purged"] == 0


async def test_unused_in_use_pods_are_released_on_the_second_pass_only(env: Env) -> None:
    await configure(env, max_pods=6)
    unused = await take_in_use(env, "r1")
    with_sessions = await take_in_use(env, "r2")
    candidate = await take_in_use(env, "r3")
    late = await take_in_use(env, "r4")
    await add_sessions(env.redis, with_sessions, ["s1"], candidate=False)
    await add_sessions(env.redis, candidate, [], candidate=True)

    first = await env.pool_jobs.reconcile_once()
    assert first["released"] == 0, "the first pass only notes"
    for pod_id in (unused, with_sessions, candidate, late):
        await assert_in_use(env.redis, pod_id)

    # the session side registers `late` between the passes (acquire → register_pod)
    await add_sessions(env.redis, late, [], candidate=True)
    second = await env.pool_jobs.reconcile_once()
    assert second["released"] == 1
    await assert_warm(env.redis, unused, VER1)
    for pod_id in (with_sessions, candidate, late):
        await assert_in_use(env.redis, pod_id)

    for _ in range(2):
        assert (await env.pool_jobs.reconcile_once())["released"] == 0
    await assert_sessions_alive(env.redis, with_sessions, ["s1"])
    assert env.k8s.deleted == [] and env.sessions.dead == []
    await assert_pool_consistent(env.redis)


async def test_a_pod_used_again_between_passes_needs_two_new_passes(env: Env) -> None:
    await configure(env, max_pods=2)
    pod_id = await take_in_use(env, "r1")
    assert (await env.pool_jobs.reconcile_once())["released"] == 0
    await add_sessions(env.redis, pod_id, ["s1"], candidate=True)
    assert (await env.pool_jobs.reconcile_once())["released"] == 0
    await end_sessions(env.redis, pod_id, ["s1"])
    await env.redis.zrem(sm_scope(SCOPE, "pods"), pod_id)
    assert (await env.pool_jobs.reconcile_once())["released"] == 0, "unused for one pass only"
    assert (await env.pool_jobs.reconcile_once())["released"] == 1
    await assert_warm(env.redis, pod_id, VER1)


async def test_after_a_redis_wipe_ready_current_pods_are_adopted_as_warm(env: Env) -> None:
    team = spec(namespace="team")
    ver = spec_fields.deploy_ver(team)
    await configure(env, team, min_idle=2, max_pods=3)
    in_use = await take_in_use(env, "r1", team)
    await env.pool_jobs.autoscale_once()
    await env.pool_jobs.wait_for_warm_deploys()
    pods = sorted([*await warm_set(env.redis), in_use])
    urls = {p: await env.redis.hget(rm_pod(SCOPE, p, "info"), "pod_sse_url") for p in pods}
    await wipe_rm_pod_state(env.redis)
    assert await env.state.pool_config(SCOPE) is not None

    counts = await env.pool_jobs.reconcile_once()
    assert counts == {
        "purged": 0,
        "released": 0,
        "adopted": 3,
        "deleted": 0,
        "expired": 0,
        "foreign": 0,
    }
    assert env.k8s.deleted == []
    assert sorted(await env.redis.zrange(rm_scope(SCOPE, "pods"), 0, -1)) == pods
    for pod_id in pods:
        await assert_warm(env.redis, pod_id, ver)
        info = await env.redis.hgetall(rm_pod(SCOPE, pod_id, "info"))
        assert info["namespace"] == "team"
        assert info["pod_ip"] == env.k8s.pods[pod_id].pod_ip
        assert info["pod_sse_url"] == urls[pod_id]
    assert await env.redis.scard(rm_scope(SCOPE, "deploying")) == 0

    assert await env.pool_jobs.reconcile_once() == {
        "purged": 0,
        "released": 0,
        "adopted": 0,
        "deleted": 0,
        "expired": 0,
        "foreign": 0,
    }
    # adopted pods serve: an acquire takes one without deploying
    calls = env.k8s.deploy_calls
    assert await take_in_use(env, "r2", team) in pods
    assert env.k8s.deploy_calls == calls
    await assert_pool_consistent(env.redis)


async def test_after_a_redis_wipe_pods_over_max_pods_are_deleted(env: Env) -> None:
    await configure(env, min_idle=3, max_pods=3)
    await env.pool_jobs.autoscale_once()
    await env.pool_jobs.wait_for_warm_deploys()
    pods = await warm_set(env.redis)
    await wipe_rm_pod_state(env.redis)
    await configure(env, min_idle=2, max_pods=2)

    counts = await env.pool_jobs.reconcile_once()
    assert counts["adopted"] == 2 and counts["deleted"] == 1
    adopted = await warm_set(env.redis)
    assert len(adopted) == 2 and adopted < pods
    assert set(env.k8s.deleted) == pods - adopted
    assert set(env.k8s.pods) == adopted
    await assert_pool_consistent(env.redis)


async def test_unknown_pods_of_an_old_version_or_not_ready_are_deleted(env: Env) -> None:
    """Ours (their identity verifies), unknown to Redis, in a scope with a pool config: only
    a Ready pod of the current version is adopted; a scope without a config (Redis lost it
    too) adopts what it has (tests/test_pod_identity.py)."""
    await configure(env, max_pods=6)
    old = env.k8s.add_pod(identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER2)
    not_ready = env.k8s.add_pod(identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER1, ready=False)
    pending = env.k8s.add_pod(identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER1, phase="Pending")
    good = env.k8s.add_pod(identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER1)

    counts = await env.pool_jobs.reconcile_once()
    assert counts["adopted"] == 1 and counts["deleted"] == 3
    assert sorted(env.k8s.deleted) == sorted(p.pod_id for p in (old, not_ready, pending))
    await assert_warm(env.redis, good.pod_id, VER1)
    for pod in (old, not_ready, pending):
        await assert_purged(env.redis, pod.pod_id)
    assert env.sessions.dead == [], "never in Redis: nothing to tell"


async def test_an_unknown_pod_that_still_holds_sessions_is_kept_in_use(env: Env) -> None:
    """Only the resource manager's keys were lost: the session side still has sessions on an
    old-version pod of a full scope. It is re-adopted in use, never deleted."""
    await configure(env, max_pods=1)
    full = env.k8s.add_pod(identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER1)
    await env.pool_jobs.reconcile_once()  # adopted warm: the scope is at max_pods now
    old = env.k8s.add_pod(identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER2)
    await add_sessions(env.redis, old.pod_id, ["s1", "s2"], candidate=False)

    counts = await env.pool_jobs.reconcile_once()
    assert counts["adopted"] == 1 and counts["deleted"] == 0
    assert old.pod_id in env.k8s.pods and old.pod_id not in env.k8s.deleted
    await assert_in_use(env.redis, old.pod_id)
    assert await env.redis.hget(rm_pod(SCOPE, old.pod_id, "info"), "deploy_ver") == VER2
    await assert_sessions_alive(env.redis, old.pod_id, ["s1", "s2"])
    assert full.pod_id in env.k8s.pods


async def test_an_unknown_dead_pod_is_not_adopted_but_deleted(env: Env) -> None:
    await configure(env, max_pods=6)
    crashing = env.k8s.add_pod(identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER1)
    env.k8s.set_phase(crashing.pod_id, "Running", "CrashLoopBackOff", ready=True)
    failed = env.k8s.add_pod(
        identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER1, phase="Failed", ready=True
    )
    terminating = env.k8s.add_pod(identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER1)
    env.k8s.set_phase(terminating.pod_id, "Terminating", ready=True)

    counts = await env.pool_jobs.reconcile_once()
    assert counts["adopted"] == 0
    for pod in (crashing, failed, terminating):
        await assert_purged(env.redis, pod.pod_id)
    # a dead pod of ours that Redis does not know would otherwise stay forever: no leak
    assert sorted(env.k8s.deleted) == sorted([crashing.pod_id, failed.pod_id])
    assert counts["deleted"] == 2
    assert terminating.pod_id in env.k8s.pods, "already being deleted: left to Kubernetes"


async def test_a_dead_pod_whose_delete_failed_in_watch_is_deleted_by_reconcile(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    await configure(env, max_pods=2)
    pod_id = await take_in_use(env, "r1")
    await add_sessions(env.redis, pod_id, ["s1"], candidate=True)
    env.k8s.kill(pod_id)

    async def refuse(pod_id: str, namespace: str, *, cluster: str | None = None) -> bool:
        raise K8sApiError("fake: 500 Internal Server Error", status=500)

    with monkeypatch.context() as patched:
        patched.setattr(env.k8s, "delete", refuse)
        assert await env.pool_jobs.watch_once() == 1
    # Redis and the session side forget it at once; Kubernetes still has it
    await assert_purged(env.redis, pod_id)
    await assert_sessions_evicted(env.redis, pod_id, ["s1"])
    assert pod_id in env.k8s.pods

    counts = await env.pool_jobs.reconcile_once()
    assert counts["deleted"] == 1 and counts["adopted"] == 0
    assert env.k8s.deleted == [pod_id] and pod_id not in env.k8s.pods


async def test_a_scope_with_a_deploy_in_flight_is_left_alone(env: Env) -> None:
    await configure(env, max_pods=6)
    stranger = env.k8s.add_pod(identity=IDENTITY, scope_id=SCOPE, deploy_ver=VER1, phase="Pending")
    placeholder = await DeployState(env.state).add_placeholder(SCOPE, "r-deploying:tok", 60)
    assert placeholder is not None
    counts = await env.pool_jobs.reconcile_once()
    assert counts["adopted"] == counts["deleted"] == 0
    assert stranger.pod_id in env.k8s.pods and env.k8s.deleted == []
    await DeployState(env.state).drop_placeholder(SCOPE, placeholder)
    assert (await env.pool_jobs.reconcile_once())["deleted"] == 1


async def test_reconcile_during_a_real_deploy_does_not_touch_its_pod(env: Env) -> None:
    env.k8s.ready_delay = 0.2
    await configure(env, max_pods=2)
    task = asyncio.create_task(take_in_use(env, "r1"))

    async def pending_pod_listed() -> bool:
        return bool(env.k8s.pods)

    await eventually(pending_pod_listed)
    (pod_id,) = env.k8s.pods
    assert env.k8s.pods[pod_id].phase == "Pending"
    counts = await env.pool_jobs.reconcile_once()
    assert counts["adopted"] == counts["deleted"] == 0
    assert await task == pod_id
    assert env.k8s.deleted == []
    await assert_in_use(env.redis, pod_id)


async def test_pods_without_our_scope_label_are_never_touched(env: Env) -> None:
    await configure(env, min_idle=1, max_pods=4, pod_ttl=0)
    foreign_labels = pod_labels("foreign-1", SCOPE, VER1)
    del foreign_labels["agent-runtime/scope"]
    foreign = PodStatus("foreign-1", "default", "Failed", False, "10.9.9.9", foreign_labels)
    not_agentserver = env.k8s.add_pod(
        scope_id=SCOPE, deploy_ver="other", labels={"jiuwenclaw-component": "gateway"}
    )
    env.k8s.pods[foreign.pod_id] = foreign

    for _ in range(2):
        await env.pool_jobs.autoscale_once()
        await env.pool_jobs.wait_for_warm_deploys()
        await env.pool_jobs.reclaim_once()
        await env.pool_jobs.watch_once()
        await env.pool_jobs.reconcile_once()
    assert env.k8s.pods[foreign.pod_id] == foreign
    assert not_agentserver.pod_id in env.k8s.pods
    assert foreign.pod_id not in env.k8s.deleted and not_agentserver.pod_id not in env.k8s.deleted
    for pod_id in (foreign.pod_id, not_agentserver.pod_id):
        assert not await rm_pod_known(env.redis, pod_id)


# ================================================================================================
# JobRunner
# ================================================================================================


def counting_job(name: str, counter: dict[str, int], key: str, interval: float = 0.05) -> Job:
    async def tick() -> None:
        counter[key] = counter.get(key, 0) + 1

    return Job(name, interval, tick)


async def test_two_runners_one_leader_per_tick_and_takeover_after_stop(redis: Redis) -> None:
    client = other_client(redis)
    ran: dict[str, int] = {}
    a = JobRunner(redis=redis, jobs=[counting_job("exclusive", ran, "a")])
    b = JobRunner(redis=client, jobs=[counting_job("exclusive", ran, "b")])
    try:
        for i in range(10):
            order = [a, b] if i % 2 else [b, a]
            ticked = [await r.run_once("exclusive") for r in order]
            assert ticked.count(True) == 1, f"tick {i}: {ticked}"
        assert ran == {"a": 10} or ran == {"b": 10}, "leadership stays put while alive"
        leader, follower = (a, b) if "a" in ran else (b, a)
        assert await leader.is_leader("exclusive") and not await follower.is_leader("exclusive")
        assert await redis.pttl(job_lock("exclusive")) > 0

        await leader.stop()
        assert not await redis.exists(job_lock("exclusive")), "stop gives the lock back"
        assert await follower.run_once("exclusive"), "the other one takes over at once"
        assert await follower.is_leader("exclusive")
        assert not await leader.run_once("exclusive")
    finally:
        await a.stop()
        await b.stop()
        await client.aclose()
    assert not await redis.exists(job_lock("exclusive"))


async def test_running_runners_never_tick_the_same_job_at_once(redis: Redis) -> None:
    client = other_client(redis)
    active = 0
    overlap = 0
    ticks: dict[str, int] = {}
    stopping = False  # once set, leadership may move (the stopped runner gives its lock back)

    def job(who: str) -> Job:
        async def tick() -> None:
            nonlocal active, overlap
            if stopping:
                return
            active += 1
            try:
                overlap = max(overlap, active)
                ticks[who] = ticks.get(who, 0) + 1
                await asyncio.sleep(0.01)
            finally:  # a tick cancelled by stop() must not look like one still running
                active -= 1

        return Job("shared", 0.02, tick)

    a = JobRunner(redis=redis, jobs=[job("a")])
    b = JobRunner(redis=client, jobs=[job("b")])
    a.start()
    b.start()
    try:

        async def enough() -> bool:
            return sum(ticks.values()) >= 10

        await eventually(enough)
    finally:
        stopping = True
        await a.stop()
        await b.stop()
        await client.aclose()
    assert overlap == 1
    assert len(ticks) == 1, f"one leader while both live: {ticks}"
    assert not await redis.exists(job_lock("shared"))


async def test_a_crashed_leader_is_replaced_within_its_lock_ttl(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_module, "MIN_LOCK_TTL", 0.3)
    client = other_client(redis)
    ran: dict[str, int] = {}
    a = JobRunner(redis=redis, jobs=[counting_job("lapse", ran, "a")])
    b = JobRunner(redis=client, jobs=[counting_job("lapse", ran, "b")])
    try:
        assert await a.run_once("lapse")
        assert not await b.run_once("lapse")
        # `a` stops ticking without giving the lock back (its process died)
        started = time.monotonic()

        async def b_leads() -> bool:
            return await b.run_once("lapse")

        await eventually(b_leads, within=3.0)
        assert time.monotonic() - started < 1.5
        assert not await a.run_once("lapse"), "the old leader does not tick any more"
        assert ran["a"] == 1
    finally:
        await a.stop()
        await b.stop()
        await client.aclose()


async def test_a_failing_tick_is_counted_and_the_loop_goes_on(redis: Redis) -> None:
    calls = 0

    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError(f"tick {calls} failed")

    runner = JobRunner(redis=redis, jobs=[Job("flaky", 0.05, flaky)])
    job = runner.jobs["flaky"]
    runner.start()
    assert runner.running
    try:

        async def some_ticks() -> bool:
            return job.runs >= 4

        await eventually(some_ticks)
        assert runner.running, "the loop survived the failures"
        assert await redis.exists(job_lock("flaky"))
    finally:
        await runner.stop()
    assert job.failures == 2
    assert job.last_success is not None
    assert job.runs == calls >= 4
    assert not runner.running
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("job:")]
    assert not await redis.exists(job_lock("flaky")), "stop gives the lock back"


async def test_a_tick_that_overruns_its_timeout_is_cut_off(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_module, "MIN_LOCK_TTL", 0.6)
    slow = True
    cancelled = False

    async def tick() -> None:
        nonlocal cancelled
        if not slow:
            return
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled = True
            raise

    runner = JobRunner(redis=redis, jobs=[Job("slow", 0.05, tick)])
    job = runner.jobs["slow"]
    assert job.tick_timeout < job.lock_ttl
    try:
        started = time.monotonic()
        assert await runner.run_once("slow")
        elapsed = time.monotonic() - started
        assert cancelled, "the tick was cancelled, not left running"
        assert job.tick_timeout * 0.9 <= elapsed < job.tick_timeout + 1.0
        assert job.failures == 1 and job.last_success is None
        slow = False
        assert await runner.run_once("slow"), "still the leader after a cut-off tick"
        assert job.failures == 1 and job.last_success is not None
    finally:
        await runner.stop()


async def test_the_runner_drives_the_sweeper(env: Env) -> None:
    await configure(env, min_idle=2, max_pods=4, pod_ttl=3600)
    runner = JobRunner(
        redis=env.redis,
        jobs=[
            Job("rm_autoscale", 0.05, env.pool_jobs.autoscale_once),
            Job("rm_reclaim", 0.05, env.pool_jobs.reclaim_once),
        ],
    )
    runner.start()
    try:

        async def floor_of(version: str) -> bool:
            warm = await PoolJobsState(env.state).idle_pods(SCOPE)
            versions = await PoolJobsState(env.state).pod_versions(dict.fromkeys(warm, SCOPE))
            return sorted(versions.values()) == [version, version]

        await eventually(lambda: floor_of(VER1))
        old = await warm_set(env.redis)
        await configure(env, V2, min_idle=2, max_pods=4, pod_ttl=3600)
        await eventually(lambda: floor_of(VER2))

        async def old_reclaimed() -> bool:
            # a reclaim takes a pod out of the pool before it deletes it: on a loaded machine
            # the new floor can be seen in between, so wait for the deletes themselves
            return old <= set(env.k8s.deleted)

        await eventually(old_reclaimed, within=20.0)
    finally:
        await runner.stop()
        await env.pool_jobs.wait_for_warm_deploys()
    for name in ("rm_autoscale", "rm_reclaim"):
        assert runner.jobs[name].failures == 0
        assert not await env.redis.exists(job_lock(name))
    await assert_pool_consistent(env.redis)


async def test_a_pod_reclaimed_during_the_reconcile_pass_is_not_adopted_back(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reconcile LISTs Kubernetes, then reads what Redis knows. A pod reclaimed (deleted and
    forgotten) by another job in between looks like an orphan in the stale LIST: it must not
    come back into the warm pool."""
    await configure(env, min_idle=0, max_pods=3)
    pod_id = await add_warm(env)
    list_pods = env.k8s.list_pods

    async def list_then_reclaim(
        namespace: str, selector: str, *, cluster: str | None = None
    ) -> list[Any]:
        listed = await list_pods(namespace, selector, cluster=cluster)
        await set_idle_age(env.redis, pod_id, 3600)  # reclaim runs on another replica now
        await env.pool_jobs.reclaim_once()
        return listed

    monkeypatch.setattr(env.k8s, "list_pods", list_then_reclaim)
    counts = await env.pool_jobs.reconcile_once()
    assert counts["adopted"] == 0, counts
    assert pod_id not in await warm_set(env.redis)
    assert not await env.redis.exists(rm_pod(SCOPE, pod_id, "info"))


async def test_an_orphan_that_is_terminating_by_now_is_left_to_go(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LIST said Running, a GET right before adopting says it is being deleted."""
    await configure(env, min_idle=0, max_pods=3)
    pod_id = await add_warm(env)
    await wipe_rm_pod_state(env.redis)  # an orphan: Redis forgot it
    get_pod = env.k8s.get_pod

    async def terminating(pod: str, namespace: str, *, cluster: str | None = None) -> Any:
        found = await get_pod(pod, namespace, cluster=cluster)
        return dataclasses.replace(found, phase="Terminating") if found else None

    monkeypatch.setattr(env.k8s, "get_pod", terminating)
    counts = await env.pool_jobs.reconcile_once()
    assert counts["adopted"] == 0 and counts["deleted"] == 0, counts
    assert pod_id not in await warm_set(env.redis)


async def test_a_cold_acquire_at_the_cap_does_not_follow_a_warm_deploy(env: Env) -> None:
    """max_pods held by an in-use pod and a warm deploy in flight: the acquire is told
    DeployInProgress (wait and ask again), never handed to a follower room that waits for an
    in-use pod the warm deploy will not bring; once the warm pod is there it is taken."""
    await configure(env, min_idle=1, max_pods=2, pod_concurrency=2)
    env.k8s.ready_delay = 0.3
    in_use = await take_in_use(env, "r1")
    await env.pool_jobs.autoscale_once()  # the warm deploy starts
    assert await env.redis.scard(rm_scope(SCOPE, "deploying")) == 1
    with pytest.raises(DeployInProgress):
        await take_in_use(env, "r2")
    await env.pool_jobs.wait_for_warm_deploys()
    second = await take_in_use(env, "r3")
    assert second != in_use and env.k8s.deploy_calls == 2


@pytest.mark.parametrize("k8s", [GatedK8s()], ids=["gated"])
async def test_autoscale_keeps_within_the_replica_s_and_the_scope_s_deploy_concurrency(
    env: Env, k8s: GatedK8s
) -> None:
    """Deploys held at the gate: one replica starts at most its warm deploy concurrency
    (AGENT_RUNTIME_WARM_DEPLOY_CONCURRENCY) and a scope at most its deploy concurrency
    (AGENT_RUNTIME_SCOPE_DEPLOY_CONCURRENCY), counting its cold deploys; the rest come at later
    ticks."""
    k8s.gate = asyncio.Event()  # the instance is shared by the parameters: a closed gate
    await configure(env, min_idle=10, max_pods=20)

    def jobs_of(warm_deploy_concurrency: int) -> PoolJobs:
        return PoolJobs(
            state=env.state, k8s=k8s, orchestrator=env.orchestrator, sessions=env.sessions,
            default_namespace="default", identity=IDENTITY,
            warm_deploy_concurrency=warm_deploy_concurrency,
        )  # fmt: skip

    jobs = jobs_of(4)
    try:
        assert await jobs.autoscale_once() == 4, "the replica's bound"
        assert await jobs.autoscale_once() == 0, "still 4 running"
        env.orchestrator.scope_deploy_concurrency = 6
        seconds, _ = await env.redis.time()
        await env.redis.sadd(  # two cold deploys (routes') in flight
            f"resource_manager:resource:scope:{{{SCOPE}}}:deploying",
            f"r1:a@{seconds + 60}", f"r2:b@{seconds + 60}",
        )  # fmt: skip
        k8s.gate.set()
        await jobs.wait_for_warm_deploys()
        assert len(await warm_set(env.redis, SCOPE)) == 4
        jobs = jobs_of(64)  # the replica's bound out of the way: the scope's holds
        assert await jobs.autoscale_once() == 4, "6 at once in the scope, 2 of them cold"
        await jobs.wait_for_warm_deploys()
    finally:
        k8s.gate.set()
        await jobs.wait_for_warm_deploys()
