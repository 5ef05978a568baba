"""The session side's facade for the resource manager, and the two scripts under it
(evict, cleanup_pod): atomic, idempotent, replay-safe — on fakeredis and the real Redis."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from agent_runtime.resource_manager.session_side import PodUsage
from agent_runtime.session_manager.facade import SessionManagerFacade
from agent_runtime.session_manager.state import (
    SessionState,
    pod_idle_notified_key,
    pod_info_key,
    pod_sessions_key,
    pods_registered_key,
    previous_pod_key,
    scope_expiry_key,
    scope_free_channel,
    scope_pods_key,
    scope_sessions_key,
    session_key,
    session_scope_key,
)

# on the Sentinel set and the Redis Cluster too: every script is of one slot (issue 17)
pytestmark = pytest.mark.topologies

SID = "scope-1"


async def register_pod(redis: Redis, scope_id: str, pod_id: str, order: int = 1) -> None:
    await redis.zadd(scope_pods_key(scope_id), {pod_id: order})
    await redis.hset(pod_info_key(scope_id, pod_id), mapping={"sse_url": "u", "deploy_ver": "v"})
    await redis.sadd(pods_registered_key(scope_id), pod_id)


async def place(redis: Redis, session_id: str, scope_id: str, pod_id: str) -> None:
    """A live session in its four places (what route_place commits), and the session-scope
    index (what route_place's caller writes)."""
    await redis.set(session_scope_key(session_id), scope_id, ex=120)
    await redis.hset(
        session_key(scope_id, session_id),
        mapping={
            "scope_id": scope_id,
            "pod_id": pod_id,
            "expiry": "9999999999",
            "session_ttl": "60",
        },
    )
    await redis.zadd(scope_expiry_key(scope_id), {session_id: 9999999999})
    await redis.sadd(scope_sessions_key(scope_id), session_id)
    await redis.sadd(pod_sessions_key(scope_id, pod_id), session_id)


async def in_four_places(redis: Redis, session_id: str, scope_id: str, pod_id: str) -> list[bool]:
    return [
        bool(await redis.exists(session_key(scope_id, session_id))),
        await redis.zscore(scope_expiry_key(scope_id), session_id) is not None,
        bool(await redis.sismember(scope_sessions_key(scope_id), session_id)),
        bool(await redis.sismember(pod_sessions_key(scope_id, pod_id), session_id)),
    ]


async def test_evict_leaves_all_four_places_and_signals_free(redis: Redis) -> None:
    state = SessionState(redis)
    await register_pod(redis, SID, "p1")
    await place(redis, "s1", SID, "p1")
    await place(redis, "s2", SID, "p1")
    pubsub = redis.pubsub()
    await pubsub.subscribe(scope_free_channel(SID))
    await pubsub.get_message(timeout=1)  # the subscribe confirmation

    assert await state.evict("s1") == (SID, "p1", 1)  # its scope: the session-scope index's
    assert await in_four_places(redis, "s1", SID, "p1") == [False] * 4
    assert await in_four_places(redis, "s2", SID, "p1") == [True] * 4
    message = None
    for _ in range(20):
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            break
    assert message is not None and message["data"] == "s1"
    await pubsub.aclose()

    # replay / unknown: nothing to do, nothing broken
    assert await state.evict("s1") is None
    assert await state.evict("never-seen") is None, "no index entry: no scope to look in"
    assert await in_four_places(redis, "s2", SID, "p1") == [True] * 4


async def test_evict_drops_a_stray_expiry_entry(redis: Redis) -> None:
    await redis.zadd(scope_expiry_key(SID), {"ghost": 1})
    assert await SessionState(redis).evict("ghost", scope_id=SID) is None
    assert await redis.zscore(scope_expiry_key(SID), "ghost") is None


async def test_cleanup_pod_refuses_while_sessions_remain_but_leaves_the_candidates(
    redis: Redis,
) -> None:
    state = SessionState(redis)
    await register_pod(redis, SID, "p1")
    await place(redis, "s1", SID, "p1")
    assert await state.cleanup_pod(SID, "p1") == -1
    assert await redis.zscore(scope_pods_key(SID), "p1") is None, "no new session may land"
    assert await redis.sismember(pods_registered_key(SID), "p1"), "still registered"
    assert await in_four_places(redis, "s1", SID, "p1") == [True] * 4

    await state.evict("s1")
    await redis.set(pod_idle_notified_key(SID, "p1"), "1")
    assert await state.cleanup_pod(SID, "p1") == 1
    for key in (pod_info_key(SID, "p1"), pod_idle_notified_key(SID, "p1")):
        assert not await redis.exists(key)
    assert not await redis.sismember(pods_registered_key(SID), "p1")
    assert await state.cleanup_pod(SID, "p1") == 0  # idempotent


async def test_notify_pod_dead_evicts_every_session_of_the_pod_in_its_scope(
    redis: Redis,
) -> None:
    facade = SessionManagerFacade(state=SessionState(redis))
    await register_pod(redis, SID, "p1")
    await register_pod(redis, "scope-2", "p1")  # the same pod id in another scope: not this pod
    await register_pod(redis, SID, "p2", order=2)
    for i in range(5):
        await place(redis, f"a{i}", SID, "p1")
    await place(redis, "b0", "scope-2", "p1")
    await place(redis, "a0", "scope-2", "p1")  # a0 in both scopes: the index names scope-2
    await place(redis, "c0", SID, "p2")

    assert await facade.notify_pod_dead(SID, "p1") == 5  # a0 too: the scope named, not the index's
    for i in range(5):
        assert await in_four_places(redis, f"a{i}", SID, "p1") == [False] * 4
        assert await redis.get(previous_pod_key(SID, f"a{i}")) == "p1", "rebound next"
    assert await in_four_places(redis, "b0", "scope-2", "p1") == [True] * 4, "another scope's"
    assert await in_four_places(redis, "c0", SID, "p2") == [True] * 4, "other pods untouched"
    assert await redis.zrange(scope_pods_key(SID), 0, -1) == ["p2"]
    assert await redis.smembers(pods_registered_key(SID)) == {"p2"}
    assert await redis.smembers(pods_registered_key("scope-2")) == {"p1"}
    assert await facade.notify_pod_dead(SID, "p1") == 0  # idempotent
    assert await facade.notify_pod_dead(SID, "never-seen") == 0
    assert await facade.notify_pod_dead("scope-2", "p1") == 2  # b0 and a0 there
    assert await redis.smembers(pods_registered_key("scope-2")) == set()


async def test_retire_pod_leaves_its_scopes_candidates_and_counts_its_sessions(
    redis: Redis,
) -> None:
    facade = SessionManagerFacade(state=SessionState(redis))
    await register_pod(redis, SID, "p1")
    await register_pod(redis, SID, "p2", order=2)
    await place(redis, "s1", SID, "p1")
    await place(redis, "s2", SID, "p1")
    assert await facade.retire_pod(SID, "p1") == 2
    assert await redis.zrange(scope_pods_key(SID), 0, -1) == ["p2"]
    assert await in_four_places(redis, "s1", SID, "p1") == [True] * 4, "sessions stay"
    assert await facade.retire_pod(SID, "p1") == 2  # idempotent
    assert await facade.retire_pod(SID, "never-seen") == 0


async def test_concurrent_notifications_evict_each_session_once(redis: Redis) -> None:
    facade = SessionManagerFacade(state=SessionState(redis))
    await register_pod(redis, SID, "p1")
    for i in range(20):
        await place(redis, f"s{i}", SID, "p1")
    counts = await asyncio.gather(*(facade.notify_pod_dead(SID, "p1") for _ in range(5)))
    assert sum(counts) == 20
    assert await redis.scard(scope_sessions_key(SID)) == 0
    assert not await redis.sismember(pods_registered_key(SID), "p1")


async def test_reconcile_pods_reports_candidates_and_sessions(redis: Redis) -> None:
    facade = SessionManagerFacade(state=SessionState(redis))
    await register_pod(redis, SID, "candidate")
    await register_pod(redis, SID, "busy", order=2)
    await place(redis, "s1", SID, "busy")
    await redis.zrem(scope_pods_key(SID), "busy")  # sunset: not a candidate, sessions stay
    usage = await facade.reconcile_pods({"candidate": SID, "busy": SID, "unknown": SID})
    assert usage["candidate"] == PodUsage(candidate=True, sessions=0)
    assert usage["busy"] == PodUsage(candidate=False, sessions=1) and not usage["busy"].unused
    assert usage["unknown"].unused
    assert await facade.reconcile_pods({}) == {}
