"""deploy_claim.lua through ``DeployState.claim_deploy``, on fakeredis and real Redis: the one
step in which a cold acquire follows a deploy in flight or leads one. Concurrent claims come
from separate clients (replicas) at once: with pod_concurrency 1 every claim leads its own
deploy; with pod_concurrency 3 one lead per three claims; the scope's deploy concurrency and
the placeholders' max_pods hold; a duplicate of a demand joins its deploy; a lapsed deploy's
pod passes to exactly one new leader. Assertions read the Redis keys by their names."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from redis.asyncio import Redis

from agent_runtime.resource_manager.deploy_state import (
    DeployState,
    lock_started,
    lock_token,
)
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.resource_manager.state_values import DeployClaim
from helpers import other_client

# every script it drives is of one slot: the single server, the Sentinel set and the cluster
pytestmark = pytest.mark.topologies

SID = "scope-c"
CONFIG = f"resource_manager:resource:scope:{{{SID}}}:config"
# a claim's lease must outlive a whole burst (ten fresh cluster clients on a loaded CI machine
# took over 5 s: a leader's claim lapsed mid-burst and a fifth deploy was led in its place)
LEASE = 60.0


class K:
    BUDGET = "resource_manager:budget:{budget}:pods"
    PODS = f"resource_manager:resource:scope:{{{SID}}}:pods"  # registered: a member

    @staticmethod
    def lock(did: str) -> str:
        return f"resource_manager:lock:rm:deploy:{{{SID}}}:{did}"

    @staticmethod
    def record(did: str) -> str:
        return f"resource_manager:resource:scope:{{{SID}}}:deploy_pod:{did}"

    @staticmethod
    def room(did: str) -> str:
        return f"resource_manager:resource:scope:{{{SID}}}:deploy_followers:{did}"

    COLD = f"resource_manager:resource:scope:{{{SID}}}:cold_deploys"
    DEPLOYING = f"resource_manager:resource:scope:{{{SID}}}:deploying"


async def configure(rs: ResourceState, *, pod_concurrency: int, max_pods: int = 100) -> None:
    pool = {
        "min_idle_pods": 0, "max_pods": max_pods, "pod_ttl": 60,
        "pod_concurrency": pod_concurrency,
    }  # fmt: skip
    await rs.write_pool_config(SID, pool, deploy_ver="v1", pod_spec={"image": "img:1"})


async def cold_claim(
    rs: ResourceState, rid: str, *, concurrency: int = 32, token: str | None = None
) -> DeployClaim:
    pod_concurrency = int(await rs.redis.hget(CONFIG, "pod_concurrency") or 1)
    """What a cold acquire does: the acquire script (no warm pod: "cold"), then the claim —
    two script calls, as the orchestrator makes them."""
    assert (await rs.acquire(SID, rid, f"ph-{rid}", 60, cold_claim=True)).action == "cold"
    return await DeployState(rs).claim_deploy(
        SID, rid, token=token or f"lk-{rid}@1", lease=LEASE, placeholder_token=f"ph-{rid}",
        member=rid, seat_hold=5, room_ttl=60, concurrency=concurrency,
        pod_concurrency=pod_concurrency,
    )  # fmt: skip


async def burst(redis: Redis, n: int, *, concurrency: int = 32) -> list[DeployClaim]:
    """``n`` cold claims at once, each from its own client (a replica of its own)."""
    clients = [other_client(redis) for _ in range(n)]
    try:
        return list(
            await asyncio.gather(
                *(
                    cold_claim(ResourceState(c), f"rq-{i}", concurrency=concurrency)
                    for i, c in enumerate(clients)
                )
            )
        )
    finally:
        for c in clients:
            await c.aclose()


async def test_with_pod_concurrency_1_each_claim_leads_its_own_deploy(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, pod_concurrency=1)
    claims = await burst(redis, 12)
    assert Counter(c.action for c in claims) == {"lead": 12}
    assert sorted(c.deploy_id for c in claims) == sorted(f"rq-{i}" for i in range(12))
    assert await redis.zcard(K.COLD) == 12
    assert await redis.scard(K.DEPLOYING) == 12, "each leader keeps its placeholder"
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros // 1000
    for c in claims:
        assert await redis.get(K.lock(c.deploy_id)) == f"lk-{c.deploy_id}@1"
        assert c.placeholder is not None and c.placeholder.startswith(f"ph-{c.deploy_id}@")
        # the lock lapses with its placeholder: not before the end of its deadline's second
        slot_ends_ms = (int(c.placeholder.rpartition("@")[2]) + 1) * 1000
        assert slot_ends_ms - now_ms - 50 <= await redis.pttl(K.lock(c.deploy_id))
        assert await redis.pttl(K.lock(c.deploy_id)) <= (LEASE + 1) * 1000


async def test_with_pod_concurrency_3_one_deploy_per_three_claims(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, pod_concurrency=3)
    claims = await burst(redis, 9)
    assert Counter(c.action for c in claims) == {"lead": 3, "follow": 6}
    leads = {c.deploy_id for c in claims if c.action == "lead"}
    followed = Counter(c.deploy_id for c in claims if c.action == "follow")
    assert set(followed) == leads and set(followed.values()) == {2}, "two seats a deploy"
    for did in leads:
        assert await redis.zcard(K.room(did)) == 2
        assert 0 < await redis.ttl(K.room(did)) <= 60, "a room expires on its own"
    for c in claims:
        if c.action == "follow":
            assert c.holder == await redis.get(K.lock(c.deploy_id))
    assert await redis.scard(K.DEPLOYING) == 3, "a follower's placeholder went back"
    assert await redis.zcard(K.BUDGET) == 3, "and its budget unit with it"


async def test_the_scope_s_deploy_concurrency_holds_and_gives_back_what_it_refuses(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, pod_concurrency=1)
    claims = await burst(redis, 7, concurrency=3)
    assert Counter(c.action for c in claims) == {"lead": 3, "busy": 4}
    assert await redis.zcard(K.COLD) == 3
    assert await redis.scard(K.DEPLOYING) == 3
    assert await redis.zcard(K.BUDGET) == 3


async def test_max_pods_holds_across_leads_and_a_refused_claim_is_told_what_is_coming(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, pod_concurrency=1, max_pods=4)
    claims = await burst(redis, 10)
    assert Counter(c.action for c in claims) == {"lead": 4, "coming": 6}
    assert await redis.scard(K.DEPLOYING) == 4
    # the deploys end (their pods registered elsewhere); nothing is on its way any more
    await redis.delete(K.DEPLOYING)
    for i, c in enumerate(claims):
        if c.action == "lead":
            await redis.delete(K.lock(c.deploy_id))
            await redis.zadd(f"resource_manager:resource:scope:{{{SID}}}:pods", {f"agent-{i}": 1})
    assert (await cold_claim(rs, "late")).action == "max_reached"
    assert await redis.zcard(K.COLD) == 0, "deploys that ended left the index"


async def test_with_pod_concurrency_5_and_max_pods_2_two_deploys_hold_ten(
    rs: ResourceState, redis: Redis
) -> None:
    """The slot is reserved in the step that decides: however the claims interleave across
    replicas, the first pod's room fills before a second deploy is led, and a claim refused
    at max_pods is one the rooms had no seat for."""
    await configure(rs, pod_concurrency=5, max_pods=2)
    claims = await burst(redis, 14)
    assert Counter(c.action for c in claims) == {"lead": 2, "follow": 8, "coming": 4}
    assert await redis.scard(K.DEPLOYING) == 2


async def test_a_budget_refusal_says_which(rs: ResourceState, redis: Redis) -> None:
    await configure(rs, pod_concurrency=1)
    rs.pod_budget = 1
    try:
        assert (await cold_claim(rs, "rq-1")).action == "lead"
        assert (await cold_claim(rs, "rq-2")).action == "coming", "a deploy is on its way"
        await redis.delete(K.DEPLOYING)
        await redis.zadd(K.BUDGET, {"agent-1": "+inf"})  # its pod, registered
        await redis.delete(K.lock("rq-1"))
        claim = await cold_claim(rs, "rq-3")
        assert (claim.action, claim.budget) == ("budget_reached", "global")
    finally:
        rs.pod_budget = 1000


async def test_a_duplicate_of_a_demand_joins_its_deploy_whatever_its_room(
    rs: ResourceState, redis: Redis
) -> None:
    """pod_concurrency 1: no seats, yet a second call for the same demand (a duplicate of the
    request on another replica, or its own retry) never makes a second deploy."""
    await configure(rs, pod_concurrency=1)
    first = await cold_claim(rs, "rq-d", token="lk-a@1")
    assert first.action == "lead"
    again = await cold_claim(rs, "rq-d", token="lk-a@1")  # a re-sent call: the same answer
    assert again.action == "lead" and again.deploy_id == "rq-d"
    dup = await DeployState(rs).claim_deploy(
        SID, "rq-d", token="lk-b@2", lease=LEASE, placeholder_token="ph-dup", member="rq-d:dup",
        seat_hold=5, room_ttl=60, concurrency=32, pod_concurrency=1,
    )  # fmt: skip
    assert (dup.action, dup.deploy_id, dup.holder) == ("follow", "rq-d", "lk-a@1")
    assert await redis.zrange(K.room("rq-d"), 0, -1) == ["rq-d:dup"]
    assert await redis.zcard(K.COLD) == 1
    assert await redis.scard(K.DEPLOYING) == 1, "the duplicate reserved nothing"


async def test_a_lapsed_deploy_s_pod_passes_to_exactly_one_of_many_claims(
    rs: ResourceState, redis: Redis
) -> None:
    """Its leader recorded its pod and died: of eight cold claims at once one takes the
    deploy over (with the pod, under its own token); with pod_concurrency 1 the others lead
    deploys of their own."""
    await configure(rs, pod_concurrency=1)
    await redis.zadd(K.COLD, {"rq-dead": 1})
    await redis.hset(
        K.record("rq-dead"),
        mapping={"token": "dead@1", "pod_id": "agent-o", "namespace": "ns", "created": "7",
                 "uid": "uid-o"},
    )  # fmt: skip
    claims = await burst(redis, 8)
    takers = [c for c in claims if c.orphan is not None]
    assert len(takers) == 1 and takers[0].deploy_id == "rq-dead"
    orphan = takers[0].orphan
    assert orphan is not None and (orphan.pod_id, orphan.uid, orphan.created) == (
        "agent-o", "uid-o", 7.0,
    )  # fmt: skip
    holder = await redis.get(K.lock("rq-dead"))
    assert await redis.hget(K.record("rq-dead"), "token") == holder
    assert Counter(c.action for c in claims) == {"lead": 8}
    assert await redis.zcard(K.COLD) == 8


async def claim_as(
    rs: ResourceState, demand: str, token: str, placeholder: str, *, pod_concurrency: int
) -> DeployClaim:
    """One claim of ``demand`` (its own id) with its lock and placeholder tokens."""
    return await DeployState(rs).claim_deploy(
        SID, demand, token=token, lease=LEASE, placeholder_token=placeholder, member=placeholder,
        seat_hold=5, room_ttl=60, concurrency=32, pod_concurrency=pod_concurrency,
    )  # fmt: skip


async def dead_deploy(redis: Redis, did: str, token: str) -> None:
    """A deploy whose leader recorded its pod and died (its lock lapsed)."""
    await redis.zadd(K.COLD, {did: 1})
    await redis.hset(
        K.record(did),
        mapping={"token": token, "pod_id": f"agent-{did}", "namespace": "ns", "created": "7",
                 "uid": "uid"},
    )  # fmt: skip


async def test_after_a_takeover_a_demand_joins_the_deploy_its_holder_serves_not_its_id(
    rs: ResourceState, redis: Redis
) -> None:
    """B takes over dead deploy "A" (the id stays "A"). A duplicate of B joins deploy "A"
    (its holder serves B) instead of leading a second deploy "B"; A's own next round is not
    B's: it finds lock "A" held for another demand and leads a deploy of its own, under
    another id, without touching B's lock."""
    await configure(rs, pod_concurrency=1)
    await dead_deploy(redis, "A", lock_token("r0", 1.0, "A"))
    lock_b = lock_token("r1", 2.0, "B")
    taken = await claim_as(rs, "B", lock_b, "ph-b", pod_concurrency=1)
    assert (taken.action, taken.deploy_id) == ("lead", "A") and taken.orphan is not None

    dup = await claim_as(rs, "B", lock_token("r2", 3.0, "B"), "ph-b2", pod_concurrency=1)
    assert (dup.action, dup.deploy_id, dup.holder) == ("follow", "A", lock_b)
    assert await redis.get(K.lock("B")) is None, "no second deploy for demand B"
    assert await redis.zrange(K.room("A"), 0, -1) == ["ph-b2"]

    lock_a = lock_token("r0", 4.0, "A")
    again = await claim_as(rs, "A", lock_a, "ph-a2", pod_concurrency=1)
    assert again.action == "lead" and again.orphan is None
    assert again.deploy_id == "ph-a2", "demand A's id is B's deploy now"
    assert await redis.get(K.lock("A")) == lock_b and await redis.get(K.lock("ph-a2")) == lock_a
    assert await redis.zrange(K.room("A"), 0, -1) == ["ph-b2"], "A took no seat in B's room"
    assert await redis.zcard(K.COLD) == 2 and await redis.scard(K.DEPLOYING) == 2
    replay = await claim_as(rs, "A", lock_a, "ph-a2", pod_concurrency=1)
    assert (replay.action, replay.deploy_id, replay.placeholder) == (
        "lead", "ph-a2", again.placeholder,
    )  # fmt: skip


async def test_a_demand_with_slashes_and_ats_is_read_back_from_its_token(
    rs: ResourceState, redis: Redis
) -> None:
    """The demand is percent-encoded in the token: "/" and "@" in a request id neither make
    another demand look like it nor hide the acquire's start."""
    await configure(rs, pod_concurrency=1)
    lead = await claim_as(rs, "rq/1@x", lock_token("r/1", 2.5, "rq/1@x"), "ph-1",
                          pod_concurrency=1)  # fmt: skip
    assert (lead.action, lead.deploy_id) == ("lead", "rq/1@x")
    assert lock_started(await redis.get(K.lock("rq/1@x"))) == 2.5
    other = await claim_as(rs, "1@x", lock_token("r/2", 3.0, "1@x"), "ph-2", pod_concurrency=1)
    assert (other.action, other.deploy_id) == ("lead", "1@x"), "another demand"
    dup = await claim_as(rs, "rq/1@x", lock_token("r/3", 4.0, "rq/1@x"), "ph-3",
                         pod_concurrency=1)  # fmt: skip
    assert (dup.action, dup.deploy_id) == ("follow", "rq/1@x")


async def test_a_re_sent_claim_that_took_a_deploy_over_is_told_the_same(
    rs: ResourceState, redis: Redis
) -> None:
    """redis-py re-sends a claim whose reply timed out: the call that took dead deploy "D"
    over is told "lead" of "D" with its pod again — it neither follows "D" (pod_concurrency
    3: a free seat) nor leads a second deploy."""
    for pod_concurrency in (1, 3):
        await redis.delete(K.COLD, K.DEPLOYING, K.lock("D"), K.room("D"), K.lock("B"))
        await configure(rs, pod_concurrency=pod_concurrency)
        await dead_deploy(redis, "D", lock_token("r0", 1.0, "D"))
        lock_b = lock_token("r1", 2.0, "B")
        first = await claim_as(rs, "B", lock_b, "ph-b", pod_concurrency=pod_concurrency)
        again = await claim_as(rs, "B", lock_b, "ph-b", pod_concurrency=pod_concurrency)
        assert (first.action, first.deploy_id) == ("lead", "D") and first.orphan is not None
        assert (again.action, again.deploy_id, again.placeholder, again.orphan) == (
            "lead", "D", first.placeholder, first.orphan,
        ), f"pod_concurrency {pod_concurrency}"  # fmt: skip
        assert await redis.get(K.lock("D")) == lock_b and await redis.get(K.lock("B")) is None
        assert await redis.zcard(K.room("D")) == 0
        assert await redis.scard(K.DEPLOYING) == 1 and await redis.zcard(K.COLD) == 1


async def test_a_claim_with_no_slot_never_takes_a_lapsed_deploy_over(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, pod_concurrency=1, max_pods=0)
    await redis.zadd(K.COLD, {"rq-dead": 1})
    await redis.hset(K.record("rq-dead"), mapping={"token": "dead@1", "pod_id": "agent-o"})
    assert (await cold_claim(rs, "rq-x")).action == "max_reached"
    assert await redis.hget(K.record("rq-dead"), "token") == "dead@1"
    assert await redis.zrange(K.COLD, 0, -1) == ["rq-dead"], "left for a claim that can lead"


async def test_ended_and_failed_deploys_leave_the_index_and_are_never_taken_over(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, pod_concurrency=2)
    await redis.zadd(K.COLD, {"died-early": 1, "failed": 1, "registered": 1})
    await redis.hset(K.record("failed"), mapping={"token": "x@1", "failed": "1"})
    await redis.hset(K.record("registered"), mapping={"token": "y@1", "pod_id": "agent-r"})
    await redis.zadd(K.PODS, {"agent-r": 1})
    claim = await cold_claim(rs, "rq-n")
    assert claim.action == "lead" and claim.orphan is None and claim.deploy_id == "rq-n"
    assert await redis.zrange(K.COLD, 0, -1) == ["rq-n"]


async def test_a_lapsed_seat_frees_its_place_in_the_room(rs: ResourceState, redis: Redis) -> None:
    await configure(rs, pod_concurrency=2)
    assert (await cold_claim(rs, "rq-l")).action == "lead"
    seconds, _ = await redis.time()
    await redis.zadd(K.room("rq-l"), {"gone": seconds - 1})  # a follower's replica died
    claim = await cold_claim(rs, "rq-f")
    assert (claim.action, claim.deploy_id) == ("follow", "rq-l")
    assert await redis.zrange(K.room("rq-l"), 0, -1) == ["rq-f"]
    assert (await cold_claim(rs, "rq-g")).action == "lead", "the room is full: a deploy more"


async def test_a_route_s_acquire_reserves_nothing_and_says_cold(
    rs: ResourceState, redis: Redis
) -> None:
    """acquire.lua with cold_claim: a warm pod is still handed out; without one it answers
    "cold" and reserves no slot (the claim does, in the step that decides)."""
    await configure(rs, pod_concurrency=1)
    assert (await rs.acquire(SID, "r1", "t1", 60, cold_claim=True)).action == "cold"
    assert await redis.scard(K.DEPLOYING) == 0 and await redis.zcard(K.BUDGET) == 0
    await rs.register(
        scope_id=SID, pod_id="agent-w", placeholder=None, pod_sse_url="http://w/sse",
        pod_ip="10.0.0.1", namespace="default", deploy_ver="v1", warm=True,
    )  # fmt: skip
    warm = await rs.acquire(SID, "r2", "t2", 60, cold_claim=True)
    assert (warm.action, warm.pod_id) == ("reuse", "agent-w")


async def test_a_renewal_keeps_the_lock_to_the_end_of_its_placeholder_s_second(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, pod_concurrency=1)
    claim = await cold_claim(rs, "rq-r")
    assert claim.action == "lead" and claim.placeholder is not None
    member = (
        await DeployState(rs).renew_deploy_claim(
            SID, "ph-rq-r", "lk-rq-r@1", LEASE, deploy_id="rq-r"
        )
    ).member
    assert member is not None
    seconds, micros = await redis.time()
    slot_ends_ms = (int(member.rpartition("@")[2]) + 1) * 1000
    pttl = await redis.pttl(K.lock("rq-r"))
    assert slot_ends_ms - (seconds * 1000 + micros // 1000) - 50 <= pttl <= (LEASE + 1) * 1000
    assert await redis.zrange(K.COLD, 0, -1) == ["rq-r"]


async def test_a_scope_with_a_cold_deploy_indexed_is_not_expired(
    rs: ResourceState, redis: Redis
) -> None:
    await configure(rs, pod_concurrency=1)
    assert (await cold_claim(rs, "rq-x")).action == "lead"
    await redis.delete(K.DEPLOYING)  # its placeholder gone: the index alone keeps the scope
    assert not await rs.expire_scope(SID)
    await redis.delete(K.COLD)
    assert await rs.expire_scope(SID)
    assert not await redis.exists(CONFIG)


# --- follower_leave: a served follower keeps its place in the room's count -----------------------


async def test_followers_that_leave_with_the_pod_still_fill_the_room(
    rs: ResourceState, redis: Redis
) -> None:
    """pod_concurrency 3: the leader and two followers. Both followers take the pod and leave
    (served) while the leader still holds its lock: a late claim is not seated on that pod; a
    follower that leaves without it (a failure) gives its place back; a re-sent leave counts
    nothing twice; a record that is gone is not made again by a leave."""
    await configure(rs, pod_concurrency=3, max_pods=1)
    ds = DeployState(rs)
    lead = await cold_claim(rs, "rq-lead")
    assert lead.action == "lead"
    did = lead.deploy_id
    await redis.hset(K.record(did), mapping={"token": "lk-rq-lead@1", "pod_id": "agent-1"})
    a, b = await cold_claim(rs, "rq-a"), await cold_claim(rs, "rq-b")
    assert (a.action, a.deploy_id, b.action, b.deploy_id) == ("follow", did, "follow", did)
    assert (await cold_claim(rs, "rq-full")).action == "coming", "the room is full"
    for member in ("rq-a", "rq-b"):
        await ds.leave_follower_seat(SID, did, member, served=True)
    await ds.leave_follower_seat(SID, did, "rq-a", served=True)  # re-sent: counted once
    assert await redis.zcard(K.room(did)) == 0
    assert await redis.hget(K.record(did), "served") == "2"
    assert (await cold_claim(rs, "rq-late")).action == "coming", "served followers hold places"
    # one served follower less (as if it had failed instead): one place again
    await redis.hset(K.record(did), "served", 1)
    late = await cold_claim(rs, "rq-late-2")
    assert (late.action, late.deploy_id) == ("follow", did)
    await ds.leave_follower_seat(SID, did, "rq-late-2", served=False)  # without the pod
    assert await redis.hget(K.record(did), "served") == "1"
    await redis.delete(K.record(did))
    await ds.leave_follower_seat(SID, did, "rq-late-2", served=True)
    assert not await redis.exists(K.record(did)), "a leave never makes a record"
