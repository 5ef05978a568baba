"""The drain scripts, on fakeredis and real Redis: ``drain_begin.lua`` (marked and out of the
warm pool in one step; idempotent; a deadline only comes forward; pending → draining),
``release.lua`` refusing a draining pod, ``purge.lua`` dropping a drain, and the session
side's ``retire_pod.lua`` (out of its scope's candidates, sessions counted, none touched).
Keys are read by their documented names (docs/reference/redis-keys.md), spelled out here.
"""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.drain_state import DrainState
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.session_manager.state import SessionState
from contract_keys import rm_draining, sm_pod, sm_scope

# every script it drives is of one slot: the single server, the Sentinel set and the cluster
pytestmark = pytest.mark.topologies

SID = "s" * 32
DRAINING = rm_draining(SID)  # the scope's bucket of the draining pods


def rm_pod(pod: str, what: str) -> str:
    return f"resource_manager:resource:pod:{{{SID}}}:{pod}:{what}"


def rm_scope(sid: str, what: str) -> str:
    return f"resource_manager:resource:scope:{{{sid}}}:{what}"


async def registered(rs: ResourceState, pod: str, *, warm: bool) -> None:
    await rs.write_pool_config(
        SID, {"min_idle_pods": 0, "max_pods": 10, "pod_ttl": 60, "pod_concurrency": 2}
    )
    member = await DeployState(rs).add_placeholder(SID, f"tok-{pod}", 600)
    assert member is not None
    await rs.register(
        scope_id=SID, pod_id=pod, placeholder=member, pod_sse_url=f"http://{pod}",
        pod_ip="10.0.0.1", namespace="agents", deploy_ver="v1", warm=warm,
    )  # fmt: skip


async def rnow(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return seconds + micros / 1_000_000


async def test_drain_begin_marks_and_takes_out_of_the_warm_pool(
    redis: Redis, rs: ResourceState
) -> None:
    await registered(rs, "p1", warm=True)
    assert await redis.sismember(rm_scope(SID, "idle"), "p1")
    before = await rnow(redis)
    begun = await DrainState(rs).begin("p1", SID, trigger="admin", pending=False, seconds=30)
    assert begun is not None and begun.started and begun.state == "draining"
    assert begun.trigger == "admin"
    assert before + 30 <= begun.deadline <= await rnow(redis) + 30
    assert not await redis.sismember(rm_scope(SID, "idle"), "p1")
    assert not await redis.exists(rm_pod("p1", "idle_since"))
    assert await redis.hget(rm_pod("p1", "info"), "phase") == "draining"
    drain = await redis.hgetall(rm_pod("p1", "drain"))
    assert drain["state"] == "draining" and drain["trigger"] == "admin"
    assert drain["scope_id"] == SID
    assert float(drain["deadline"]) == begun.deadline
    assert await redis.zscore(DRAINING, "p1") == begun.deadline
    # an acquire finds no warm pod: the scope has to deploy
    outcome = await rs.acquire(SID, "r1", "t1", 600)
    assert outcome.action == "need_deploy"


async def test_drain_begin_is_idempotent_and_only_brings_the_deadline_forward(
    redis: Redis, rs: ResourceState
) -> None:
    await registered(rs, "p1", warm=False)
    drains = DrainState(rs)
    first = await drains.begin("p1", SID, trigger="cordon", pending=False, seconds=300)
    assert first is not None and first.started
    later = await drains.begin("p1", SID, trigger="admin", pending=False, seconds=900)
    assert later is not None and not later.started
    assert later.deadline == first.deadline and later.trigger == "cordon"
    soon = await rnow(redis) + 5
    sooner = await drains.begin("p1", SID, trigger="graceful_delete", pending=False, deadline=soon)
    assert sooner is not None and not sooner.started
    assert abs(sooner.deadline - soon) < 1e-3
    assert abs(await redis.zscore(DRAINING, "p1") - soon) < 1e-3
    assert (await redis.hgetall(rm_pod("p1", "drain")))["trigger"] == "cordon"


async def test_a_pending_drain_keeps_the_pod_warm_until_it_drains(
    redis: Redis, rs: ResourceState
) -> None:
    await registered(rs, "p1", warm=True)
    drains = DrainState(rs)
    pending = await drains.begin("p1", SID, trigger="admin", pending=True, seconds=60)
    assert pending is not None and pending.state == "pending"
    assert await redis.sismember(rm_scope(SID, "idle"), "p1")
    assert await redis.hget(rm_pod("p1", "info"), "phase") == "idle"
    assert await redis.zscore(DRAINING, "p1") == pending.deadline
    # a repeat asking for pending again changes nothing
    again = await drains.begin("p1", SID, trigger="admin", pending=True, seconds=60)
    assert again is not None and again.state == "pending" and again.deadline == pending.deadline
    now_draining = await drains.begin(
        "p1", SID, trigger="admin", pending=False, deadline=pending.deadline
    )
    assert now_draining is not None and now_draining.state == "draining"
    assert not now_draining.started
    assert not await redis.sismember(rm_scope(SID, "idle"), "p1")
    assert await redis.hget(rm_pod("p1", "info"), "phase") == "draining"


async def test_drain_begin_of_an_unknown_pod_writes_nothing(
    redis: Redis, rs: ResourceState
) -> None:
    assert (
        await DrainState(rs).begin("ghost", SID, trigger="admin", pending=False, seconds=5) is None
    )
    assert not await redis.exists(rm_pod("ghost", "drain"), DRAINING)


async def test_release_never_puts_a_draining_pod_back(redis: Redis, rs: ResourceState) -> None:
    await registered(rs, "p1", warm=False)
    await DrainState(rs).begin("p1", SID, trigger="admin", pending=False, seconds=30)
    assert not await rs.release(SID, "p1")
    assert not await redis.sismember(rm_scope(SID, "idle"), "p1")
    assert await redis.hget(rm_pod("p1", "info"), "phase") == "draining"


async def test_purge_drops_the_drain(redis: Redis, rs: ResourceState) -> None:
    await registered(rs, "p1", warm=False)
    await registered(rs, "p2", warm=False)
    drains = DrainState(rs)
    await drains.begin("p1", SID, trigger="admin", pending=False, seconds=30)
    await drains.begin("p2", SID, trigger="admin", pending=False, seconds=60)
    assert await drains.draining_pods() == ["p1", "p2"]
    assert await PoolJobsState(rs).purge("p1") == SID
    assert not await redis.exists(rm_pod("p1", "drain"))
    assert await redis.zrange(DRAINING, 0, -1) == ["p2"]
    assert [d.pod_id for d in await drains.drains(["p1", "p2"])] == ["p2"]


async def test_concurrent_drain_begins_start_one_drain(redis: Redis, rs: ResourceState) -> None:
    await registered(rs, "p1", warm=True)
    drains = DrainState(rs)
    begun = await asyncio.gather(
        *(drains.begin("p1", SID, trigger="admin", pending=False, seconds=30 + i) for i in range(8))
    )
    assert sum(1 for b in begun if b is not None and b.started) == 1
    assert await redis.zcard(DRAINING) == 1
    # whatever the order, the drain keeps the earliest deadline asked for, in both keys
    final = await redis.zscore(DRAINING, "p1")
    assert float(await redis.hget(rm_pod("p1", "drain"), "deadline")) == final
    assert all(b is not None and b.deadline >= final for b in begun)
    assert min(b.deadline for b in begun if b is not None) == final


# --- the session side: retire_pod.lua ----------------------------------------------------------


async def sm_pod_registered(redis: Redis, state: SessionState, sid: str, pod: str) -> None:
    await redis.hset(
        sm_scope(sid, "config"),
        mapping={"scope_concurrency": "10", "pod_concurrency": "4", "max_pods": "3",
                 "session_ttl": "600", "deploy_ver": "v1"},
    )  # fmt: skip
    assert await state.register_pod(sid, pod, f"http://{pod}", "v1")


async def test_retire_pod_leaves_its_scopes_candidates_and_counts_sessions(redis: Redis) -> None:
    state = SessionState(redis)
    other = "o" * 32
    await sm_pod_registered(redis, state, SID, "p1")
    await sm_pod_registered(redis, state, other, "p1")  # the same pod id in another scope
    await sm_pod_registered(redis, state, SID, "p2")
    placed = await state.route_place(
        request_id="r1", session_id="s1", scope_id=SID, token="t", slow=False
    )
    assert placed.pod_id == "p1"
    assert await state.retire_pod(SID, "p1") == 1
    assert await redis.zrange(sm_scope(SID, "pods"), 0, -1) == ["p2"]
    assert await redis.zrange(sm_scope(other, "pods"), 0, -1) == ["p1"], "only its own scope"
    # the registration and the session stay
    assert await redis.exists(sm_pod(SID, "p1", "info"))
    assert await redis.smembers(sm_pod(SID, "p1", "sessions")) == {"s1"}
    assert await state.retire_pod(SID, "p1") == 1  # idempotent
    # the next new session goes to p2, the old one stays on p1
    again = await state.route_place(
        request_id="r2", session_id="s2", scope_id=SID, token="t", slow=False
    )
    assert again.pod_id == "p2"
    refresh = await state.route_place(
        request_id="r3", session_id="s1", scope_id=SID, token="t", slow=False
    )
    assert refresh.pod_id == "p1"
    assert await state.retire_pod(SID, "unknown") == 0
