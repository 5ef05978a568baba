"""``invariants.py`` finds each kind of fault it reports: a state written by hand (through the
contract's key names) with one of each, and the same state repaired."""

from __future__ import annotations

from redis.asyncio import Redis

import invariants
from contract_keys import (
    rm_deploy_lock,
    rm_scope,
    route_marker,
    sm_expiry,
    sm_pod,
    sm_scope,
    sm_session,
)

SID = "0123456789abcdef0123456789abcdef"


async def place(redis: Redis, session_id: str, pod: str, *, expiry: bool = True) -> None:
    await redis.hset(sm_session(SID, session_id), mapping={"scope_id": SID, "pod_id": pod})
    if expiry:
        await redis.zadd(sm_expiry(SID), {session_id: 9e9})
    await redis.sadd(sm_scope(SID, "sessions"), session_id)
    await redis.sadd(sm_pod(SID, pod, "sessions"), session_id)


async def scope(redis: Redis, *pods: str) -> None:
    await redis.hset(
        sm_scope(SID, "config"), mapping={"scope_concurrency": "2", "pod_concurrency": "1"}
    )
    for i, pod in enumerate(pods):
        await redis.zadd(sm_scope(SID, "pods"), {pod: i})
        await redis.hset(sm_pod(SID, pod, "info"), mapping={"sse_url": f"http://10.0.0.{i}:1/"})


async def test_a_consistent_state_reports_nothing(redis: Redis) -> None:
    await scope(redis, "p1", "p2")
    await place(redis, "a", "p1")
    await place(redis, "b", "p2")
    report = await invariants.check(redis, [SID])
    assert report.consistent and report.leftovers == [] and report.problems() == []
    assert report.sessions == 2 and report.bindings == {"a": (SID, "p1"), "b": (SID, "p2")}
    assert report.caps[SID] == invariants.Caps(2, 1)
    assert report.registered_pods[SID] == {"p1", "p2"}
    assert await invariants.check_caps(redis, [SID]) == []


async def test_each_fault_is_reported(redis: Redis) -> None:
    await scope(redis, "p1", "p2")
    await place(redis, "a", "p1")
    await place(redis, "b", "p1", expiry=False)  # p1 over its cap, b not in session_expiry
    await place(redis, "c", "p2")  # the scope over its cap (3 > 2)
    await redis.sadd(sm_pod(SID, "p2", "sessions"), "ghost")  # a member without a hash
    await place(redis, "d", "p9")  # a pod nobody registered
    now = await invariants.redis_now(redis)
    await redis.zadd(sm_scope(SID, "waiters"), {"r-wait": now + 30})
    await redis.zadd(sm_scope(SID, "reserved"), {"r-res": now - 5})
    await redis.zadd(rm_scope(SID, "deploy_followers:d1"), {"r-fol": now + 30})
    await redis.sadd(rm_scope(SID, "deploying"), f"tok@{now + 30}")
    await redis.set(rm_deploy_lock(SID, "d1"), "leader", px=30_000)
    await redis.set(route_marker(SID, "r-pend"), "pending:tok", px=30_000)

    report = await invariants.check(redis, [SID])
    assert not report.consistent
    assert invariants.OverCap(SID, "", 4, 2) in report.scopes_over_cap
    assert invariants.OverCap(SID, "p1", 2, 1) in report.pods_over_cap
    missing = {(m.session_id, m.missing) for m in report.misplaced}
    assert ("b", ("session_expiry",)) in missing
    assert ("ghost", ("hash",)) in missing
    assert ("d", ("pod_registered",)) in missing
    kinds = {x.kind: x for x in report.leftovers}
    assert set(kinds) == {
        "waiter",
        "reservation",
        "follower",
        "placeholder",
        "deploy_lock",
        "pending_route",
    }
    live = {x.kind for x in report.live_leftovers()}
    assert live == set(kinds) - {"reservation"}  # its lease ran out: a prune's to take
    over = await invariants.check_caps(redis, [SID])
    assert {(o.pod_id, o.sessions) for o in over} >= {("", 4), ("p1", 2)}


async def test_settle_waits_for_the_leftovers_to_go(redis: Redis) -> None:
    await scope(redis, "p1")
    await place(redis, "a", "p1")
    now = await invariants.redis_now(redis)
    await redis.zadd(sm_scope(SID, "waiters"), {"r-wait": now + 30})
    ticks = 0

    async def prune() -> None:  # the third tick takes the seat out
        nonlocal ticks
        ticks += 1
        if ticks == 3:
            await redis.zrem(sm_scope(SID, "waiters"), "r-wait")

    report = await invariants.settle(redis, [SID], within=30, tick=prune)
    assert ticks == 3 and report.leftovers == [] and report.consistent
    await redis.zadd(sm_scope(SID, "waiters"), {"r-stuck": now + 30})
    report = await invariants.settle(redis, [SID], within=0.5)
    assert [x.member for x in report.leftovers] == ["r-stuck"]  # bounded: the last look
