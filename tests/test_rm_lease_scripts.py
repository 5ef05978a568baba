"""The deploy lease scripts of one cold deploy (deploy_lease_take, deploy_lease,
deploy_lease_end: each deploy has its own lock and record) and the prune job's lease_prune,
through ``ResourceState``, on fakeredis and real Redis: renewal by the
owner only, the lapse, a takeover that happens once however many take at once (the dead
leader's pod with it), replay, and the prune of expired members in slices. Assertions read the
Redis keys by their names (contract §4 and the internal ones of docs/design/hld.md §5)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.lease import DeployLease
from agent_runtime.resource_manager.models import LeaseLost
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.resource_manager.state_values import LeasePrune, OrphanPod
from contract_keys import rm_leased, rm_leased_scopes
from helpers import other_client

# every script it drives is of one slot: the single server, the Sentinel set and the cluster
pytestmark = pytest.mark.topologies

RULE_PREFIX = "resource_manager:budget:{budget}:rule:"
SID = "scope-l"
DID = "rq-1"  # the cold deploy the tests lead (a scope runs many; each is keyed by its id)
LEASE = 5.0  # seconds: nothing lapses during a test unless made to


class K:
    BUDGET = "resource_manager:budget:{budget}:pods"

    @staticmethod
    def pods(sid: str = SID) -> str:
        """The scope's pods: a pod registered for the scope is a member."""
        return f"resource_manager:resource:scope:{{{sid}}}:pods"

    @staticmethod
    def lock(sid: str = SID, did: str = DID) -> str:
        return f"resource_manager:lock:rm:deploy:{{{sid}}}:{did}"

    @staticmethod
    def record(sid: str = SID, did: str = DID) -> str:
        return f"resource_manager:resource:scope:{{{sid}}}:deploy_pod:{did}"

    @staticmethod
    def cold(sid: str = SID) -> str:
        return f"resource_manager:resource:scope:{{{sid}}}:cold_deploys"

    @staticmethod
    def deploying(sid: str = SID) -> str:
        return f"resource_manager:resource:scope:{{{sid}}}:deploying"

    @staticmethod
    def followers(sid: str = SID, did: str = DID) -> str:
        return f"resource_manager:resource:scope:{{{sid}}}:deploy_followers:{did}"

    @staticmethod
    def rule(rule_id: str) -> str:
        return f"{RULE_PREFIX}{rule_id}:pods"


async def configure(rs: ResourceState, sid: str = SID, *, max_pods: int = 2) -> None:
    pool = {"min_idle_pods": 0, "max_pods": max_pods, "pod_ttl": 60, "pod_concurrency": 4}
    await rs.write_pool_config(sid, pool, deploy_ver="v1", pod_spec={"image": "img:1"})


async def placeholder(rs: ResourceState, token: str, sid: str = SID) -> str:
    member = await DeployState(rs).add_placeholder(sid, token, 60)
    assert member is not None, "test setup: the scope is at max_pods"
    return member


async def rnow(redis: Redis) -> int:
    seconds, _ = await redis.time()
    return int(seconds)


async def lapsed(redis: Redis, key: str, within: float = 5.0) -> None:
    """Wait (polling) until Redis expired ``key``."""
    deadline = time.monotonic() + within
    while await redis.exists(key):
        assert time.monotonic() < deadline, f"{key} did not lapse"
        await asyncio.sleep(0.05)


def deadline_of(member: str) -> int:
    return int(member.rpartition("@")[2])


# --- deploy_lease_take -------------------------------------------------------------------------


async def test_take_makes_one_leader_and_tells_the_others_who_leads(
    ds: DeployState, redis: Redis
) -> None:
    first = await ds.take_deploy_lease(SID, DID, "tok-a@1.5", LEASE)
    assert first.leader and first.orphan is None
    assert await redis.get(K.lock()) == "tok-a@1.5"
    assert 0 < await redis.pttl(K.lock()) <= LEASE * 1000
    second = await ds.take_deploy_lease(SID, DID, "tok-b@2.0", LEASE)
    assert not second.leader and second.holder == "tok-a@1.5"
    again = await ds.take_deploy_lease(SID, DID, "tok-a@1.5", LEASE)  # a re-sent call
    assert again.leader and await redis.get(K.lock()) == "tok-a@1.5"


async def test_a_take_by_the_holder_extends_its_lease_and_keeps_its_pod(
    ds: DeployState, redis: Redis
) -> None:
    """Reconcile takes again before it adopts or deletes (nobody renews its lease): its own
    take extends the lock and answers the same pod; once another holds it, it is told so."""
    record = {"token": "dead@1", "pod_id": "agent-o", "namespace": "ns", "created": "7", "uid": "u"}
    await redis.hset(K.record(), mapping=record)
    first = await ds.take_deploy_lease(SID, DID, "reconcile//x@2", 0.5)
    assert first.leader and first.orphan is not None
    assert await redis.pttl(K.lock()) <= 500
    again = await ds.take_deploy_lease(SID, DID, "reconcile//x@2", LEASE)
    assert again.leader and again.orphan == first.orphan
    assert await redis.pttl(K.lock()) > 1000, "extended"
    await redis.set(K.lock(), "route/rq/y@3", px=5000)  # a route took it over after a lapse
    other = await ds.take_deploy_lease(SID, DID, "reconcile//x@2", LEASE)
    assert not other.leader and other.holder == "route/rq/y@3"


async def test_a_lapsed_leader_s_pod_passes_to_exactly_one_of_many_takers(redis: Redis) -> None:
    """The dead leader recorded its pod; its lease lapses; eight replicas try to take over at
    once: one leads and inherits the pod, the other seven follow it."""
    rs = ResourceState(redis)
    await configure(rs)
    member = await placeholder(rs, "dead-ph")
    assert (await DeployState(rs).take_deploy_lease(SID, DID, "dead@1.0", 0.3)).leader
    assert (
        await DeployState(rs).renew_deploy_claim(
            SID,
            "dead-ph",
            "dead@1.0",
            0.3,
            deploy_id=DID,
            pod=("agent-x", "ns-1", "uid-x"),
            record_ttl=60,
        )
    ).member
    assert await redis.hget(K.record(), "pod_id") == "agent-x"
    await lapsed(redis, K.lock())  # the dead leader renews no more
    assert member  # (its placeholder lapses with it; not needed to take over)

    clients = [other_client(redis) for _ in range(8)]
    try:
        takes = await asyncio.gather(
            *(
                DeployState(ResourceState(c)).take_deploy_lease(SID, DID, f"t{i}@9.0", LEASE)
                for i, c in enumerate(clients)
            )
        )
    finally:
        for client in clients:
            await client.aclose()
    leaders = [t for t in takes if t.leader]
    assert len(leaders) == 1
    assert leaders[0].orphan is not None
    orphan = leaders[0].orphan
    assert (orphan.pod_id, orphan.namespace, orphan.uid) == ("agent-x", "ns-1", "uid-x")
    holder = await redis.get(K.lock())
    assert all(t.holder == holder for t in takes if not t.leader)
    assert await redis.hget(K.record(), "token") == holder, "the record is the new leader's"


async def test_take_inherits_neither_a_failure_notice_nor_a_registered_pod(
    ds: DeployState, redis: Redis
) -> None:
    await redis.hset(K.record(), mapping={"token": "old@1", "failed": "1"})
    took = await ds.take_deploy_lease(SID, DID, "new@2", LEASE)
    assert took.leader and took.orphan is None
    assert not await redis.exists(K.record())
    await ds.end_deploy_lease(SID, DID, "new@2", "ok", 1)

    await redis.hset(K.record(), mapping={"token": "old@1", "pod_id": "agent-r", "namespace": "n"})
    await redis.zadd(K.pods(), {"agent-r": 1})  # registered meanwhile (e.g. adopted by reconcile)
    took = await ds.take_deploy_lease(SID, DID, "new@3", LEASE)
    assert took.leader and took.orphan is None
    assert not await redis.exists(K.record())


# --- deploy_lease (renew) ----------------------------------------------------------------------


async def test_renew_moves_the_placeholder_deadline_and_the_lock_with_its_budget_units(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs)
    await rs.acquire(SID, "r1", "warmup", 60, rule_id="rule-1")  # links the scope to rule-1
    member = await placeholder(rs, "ph-1")
    assert (await ds.take_deploy_lease(SID, DID, "lk@1", 0.5)).leader
    before = await redis.pttl(K.lock())
    renewed = (await ds.renew_deploy_claim(SID, "ph-1", "lk@1", 30, deploy_id=DID)).member
    assert renewed is not None and renewed.startswith("ph-1@")
    assert deadline_of(renewed) >= await rnow(redis) + 29
    assert member not in await redis.smembers(K.deploying())
    assert renewed in await redis.smembers(K.deploying())
    assert await redis.pttl(K.lock()) > before
    unit = f"{SID}:ph-1"  # the reservation: "{sid}:{placeholder token}", moved with the lease
    margin = 1  # a reservation outlives its placeholder by a second (two clocks on a cluster)
    assert await redis.zscore(K.BUDGET, unit) == deadline_of(renewed) + margin
    assert await redis.zscore(K.rule("rule-1"), unit) == deadline_of(renewed) + margin
    # a re-sent call renews the same placeholder again: still one
    again = (await ds.renew_deploy_claim(SID, "ph-1", "lk@1", 30, deploy_id=DID)).member
    assert again is not None
    assert [m for m in await redis.smembers(K.deploying()) if m.startswith("ph-1@")] == [again]


async def test_only_the_lock_owner_renews_a_loser_stops_claiming(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs)
    await placeholder(rs, "ph-old")
    await redis.set(K.lock(), "new-leader@2", px=5000)  # took over after our lease lapsed
    lost = (
        await ds.renew_deploy_claim(
            SID, "ph-old", "old@1", LEASE, deploy_id=DID, pod=("p", "n", "u")
        )
    ).member
    assert lost is None
    assert await redis.get(K.lock()) == "new-leader@2"
    assert not await redis.exists(K.record()), "a loser records nothing"
    assert await redis.scard(K.deploying()) == 0, "the loser's placeholder is given back"
    assert await redis.zcard(K.BUDGET) == 0


async def test_a_lapse_nobody_took_is_taken_again(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    """Renewals failed for longer than the lease (Redis away) and nobody took over: the next
    renewal that gets through takes the lock again; a swept placeholder comes back within the
    cap, and not beyond it."""
    await configure(rs, max_pods=1)
    await placeholder(rs, "ph-1")
    assert (await ds.take_deploy_lease(SID, DID, "lk@1", 0.2)).leader
    await lapsed(redis, K.lock())
    assert (
        await ds.renew_deploy_claim(SID, "ph-1", "lk@1", LEASE, deploy_id=DID)
    ).member is not None
    assert await redis.get(K.lock()) == "lk@1"

    await redis.delete(K.deploying())  # swept (an acquire dropped it after it expired)
    back = (await ds.renew_deploy_claim(SID, "ph-1", "lk@1", LEASE, deploy_id=DID)).member
    assert back is not None and await redis.smembers(K.deploying()) == {back}

    await redis.delete(K.deploying())
    await placeholder(rs, "someone-else")  # took the only slot meanwhile
    assert (await ds.renew_deploy_claim(SID, "ph-1", "lk@1", LEASE, deploy_id=DID)).member is None
    assert {m.rpartition("@")[0] for m in await redis.smembers(K.deploying())} == {"someone-else"}


async def test_a_late_renewal_never_takes_back_a_deploy_another_leader_took_and_ended(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    """Leader A stalled past its lease; B took deploy DID over with A's pod, registered it and
    ended "ok" (the lock is free again). A's keeper renews late: the claim is lost — no lock,
    no record under A's token, no index entry, no placeholder (the pod is B's). Once the
    record itself is gone, the registered pod still tells A it lost."""
    await configure(rs)
    await placeholder(rs, "ph-a")
    assert (await ds.take_deploy_lease(SID, DID, "lk-a@1", LEASE)).leader
    pod = ("agent-p", "ns-a", "uid-p")
    assert (await ds.renew_deploy_claim(SID, "ph-a", "lk-a@1", LEASE, deploy_id=DID, pod=pod,
                                       record_ttl=40)).member  # fmt: skip
    await redis.delete(K.lock())  # A's lease lapsed
    took = await ds.take_deploy_lease(SID, DID, "lk-b@2", LEASE)
    assert took.leader and took.orphan is not None and took.orphan.pod_id == "agent-p"
    await redis.zadd(K.pods(), {"agent-p": 1})  # B registered it
    assert await ds.end_deploy_lease(SID, DID, "lk-b@2", "ok", LEASE)
    assert await redis.zcard(K.cold()) == 0

    late = (await ds.renew_deploy_claim(SID, "ph-a", "lk-a@1", LEASE, deploy_id=DID, pod=pod,
                                       record_ttl=40)).member  # fmt: skip
    assert late is None
    assert await redis.get(K.lock()) is None
    assert await redis.hget(K.record(), "token") == "lk-b@2"
    assert await redis.zcard(K.cold()) == 0, "the deploy is not indexed again"
    assert await redis.scard(K.deploying()) == 0 and await redis.zcard(K.BUDGET) == 0

    await redis.delete(K.record())  # the "ok" record lapsed; the pod stays registered
    await placeholder(rs, "ph-a2")
    late = (
        await ds.renew_deploy_claim(SID, "ph-a2", "lk-a@1", LEASE, deploy_id=DID, pod=pod)
    ).member
    assert late is None
    assert await redis.get(K.lock()) is None and not await redis.exists(K.record())
    assert await redis.scard(K.deploying()) == 0


async def test_a_lost_claim_says_whether_another_leader_took_it_or_no_room_was_left(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    """ "no_room": nobody holds the lapsed lock but the scope's only slot went to another
    placeholder — the recorded pod is nobody's: its record and index entry stay (for the next
    taker or reconcile) and ``LeaseLost.taken`` is False. "taken": another leader holds the
    lock — the pod is its: ``taken`` is True."""
    await configure(rs, max_pods=1)
    member = await placeholder(rs, "ph-1")
    assert (await ds.take_deploy_lease(SID, DID, "lk@1", LEASE)).leader
    lease = DeployLease(ds, SID, member, seconds=LEASE, lock_token="lk@1", deploy_id=DID,
                        record_ttl=40)  # fmt: skip
    await lease.record_pod("agent-p", "ns-a", "uid-p")
    assert await redis.zrange(K.cold(), 0, -1) == [DID]
    await redis.delete(K.lock(), K.deploying())  # lapsed, and its placeholder swept
    await placeholder(rs, "someone-else")  # took the only slot meanwhile
    renewal = await ds.renew_deploy_claim(SID, "ph-1", "lk@1", LEASE, deploy_id=DID)
    assert (renewal.member, renewal.lost) == (None, "no_room")
    with pytest.raises(LeaseLost) as lost:
        await lease.confirm()
    assert not lost.value.taken
    assert await redis.get(K.lock()) is None
    assert await redis.hget(K.record(), "pod_id") == "agent-p"
    assert await redis.zrange(K.cold(), 0, -1) == [DID], "left to a taker"
    assert await lease.end("none") is None and await redis.exists(K.record())

    await redis.set(K.lock(), "other@2", px=5000)
    renewal = await ds.renew_deploy_claim(SID, "ph-1", "lk@1", LEASE, deploy_id=DID)
    assert (renewal.member, renewal.lost) == (None, "taken")
    taken = DeployLease(ds, SID, member, seconds=LEASE, lock_token="lk@1", deploy_id=DID)
    with pytest.raises(LeaseLost) as lost:
        await taken.confirm()
    assert lost.value.taken


async def test_renew_records_the_pod_under_its_own_lock_once(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs)
    await placeholder(rs, "ph-1")
    assert (await ds.take_deploy_lease(SID, DID, "lk@1", LEASE)).leader
    pod = ("agent-p", "ns-a", "uid-p")
    assert (
        await ds.renew_deploy_claim(
            SID, "ph-1", "lk@1", LEASE, deploy_id=DID, pod=pod, record_ttl=40
        )
    ).member
    record = await redis.hgetall(K.record())
    assert record["token"] == "lk@1" and record["pod_id"] == "agent-p"
    assert record["namespace"] == "ns-a" and int(record["created"]) <= await rnow(redis)
    assert record["uid"] == "uid-p", "the incarnation: a pod re-created under the name is not it"
    assert await ds.deploy_records(SID) == {
        DID: OrphanPod("agent-p", "ns-a", int(record["created"]), "uid-p")
    }, "the renewal indexed the deploy; its record reads back by its id"
    assert 30 < await redis.ttl(K.record()) <= 40
    await redis.hset(K.record(), "created", "1")  # so that a rewrite would show
    assert (
        await ds.renew_deploy_claim(
            SID, "ph-1", "lk@1", LEASE, deploy_id=DID, pod=pod, record_ttl=40
        )
    ).member
    assert await redis.hget(K.record(), "created") == "1", "a replay keeps the first record"


async def test_the_record_names_the_pod_s_cluster_and_a_taker_inherits_it(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    """A pod created in a named cluster is recorded with it (a taker looks for the pod
    there); a record without the field (the default cluster, or written before pods recorded
    their cluster) reads as None."""
    await configure(rs)
    await placeholder(rs, "ph-1")
    assert (await ds.take_deploy_lease(SID, DID, "lk@1", 0.3)).leader
    pod = ("agent-e", "ns-a", "uid-e")
    assert (
        await ds.renew_deploy_claim(
            SID, "ph-1", "lk@1", 0.3, deploy_id=DID, pod=pod, record_ttl=40, cluster="east"
        )
    ).member
    assert await redis.hget(K.record(), "cluster") == "east"
    recorded = (await ds.deploy_records(SID)).get(DID)
    assert recorded is not None and recorded.cluster == "east"
    await lapsed(redis, K.lock())
    took = await ds.take_deploy_lease(SID, DID, "lk@2", LEASE)
    assert took.leader and took.orphan is not None
    assert (took.orphan.pod_id, took.orphan.uid, took.orphan.cluster) == (
        "agent-e",
        "uid-e",
        "east",
    )

    await redis.hdel(K.record(), "cluster")  # a record of the default cluster, or an old one
    recorded = (await ds.deploy_records(SID)).get(DID)
    assert recorded is not None and recorded.cluster is None
    again = await ds.take_deploy_lease(SID, DID, "lk@2", LEASE)  # the holder asks again
    assert again.orphan is not None and again.orphan.cluster is None


async def test_a_warm_deploy_renews_its_placeholder_and_touches_no_lock(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs)
    member = await placeholder(rs, "warm:abc")
    renewed = (
        await ds.renew_deploy_claim(SID, "warm:abc", "", 20, pod=("ignored", "n", "u"))
    ).member
    assert renewed is not None and renewed != member
    assert deadline_of(renewed) >= await rnow(redis) + 19
    assert not await redis.exists(K.lock()) and not await redis.exists(K.record())
    assert await redis.smembers(K.deploying()) == {renewed}


# --- deploy_lease_end --------------------------------------------------------------------------


async def test_end_gives_back_only_its_own_lock_and_leaves_the_index(
    ds: DeployState, redis: Redis
) -> None:
    """ "ok": the lock goes, the deploy leaves the scope's index (nobody new joins it), and its
    record stays one notice long: it names the registered pod, for the followers still
    looking. A replay, or an end by a leader another took over from, changes nothing."""
    assert (await ds.take_deploy_lease(SID, DID, "lk@1", LEASE)).leader
    await redis.zadd(K.cold(), {DID: 1})
    await redis.hset(K.record(), mapping={"token": "lk@1", "pod_id": "p", "namespace": "n"})
    assert await ds.end_deploy_lease(SID, DID, "lk@1", "ok", 3)
    assert not await redis.exists(K.lock()) and not await redis.exists(K.cold())
    assert await redis.hget(K.record(), "pod_id") == "p"
    assert 0 < await redis.pttl(K.record()) <= 3000
    view = await ds.deploy_view(SID, DID)
    assert (view.leader, view.failed, view.pod_id) == (None, False, "p")
    assert not await ds.end_deploy_lease(SID, DID, "lk@1", "ok", 3), "a replay: no longer ours"

    await redis.set(K.lock(), "other@2", px=5000)
    await redis.zadd(K.cold(), {DID: 1})
    await redis.hset(K.record(), mapping={"token": "other@2", "pod_id": "q", "namespace": "n"})
    assert not await ds.end_deploy_lease(SID, DID, "lk@1", "failed", 3)
    assert await redis.get(K.lock()) == "other@2"
    assert await redis.hget(K.record(), "pod_id") == "q", "the new leader's record is kept"
    assert await redis.zrange(K.cold(), 0, -1) == [DID], "and its place in the index"


async def test_a_failed_end_leaves_a_short_notice(ds: DeployState, redis: Redis) -> None:
    assert (await ds.take_deploy_lease(SID, DID, "lk@1", LEASE)).leader
    await redis.hset(K.record(), mapping={"token": "lk@1", "pod_id": "p", "namespace": "n"})
    assert await ds.end_deploy_lease(SID, DID, "lk@1", "failed", 2)
    assert await redis.hgetall(K.record()) == {"token": "lk@1", "failed": "1"}
    assert 0 < await redis.pttl(K.record()) <= 2000
    view = await ds.deploy_view(SID, DID)
    assert view.leader is None and view.failed and view.pod_id is None
    # reconcile done with a pod leaves none
    assert (await ds.take_deploy_lease(SID, DID, "lk@2", LEASE)).leader
    await redis.zadd(K.cold(), {DID: 1})
    assert await ds.end_deploy_lease(SID, DID, "lk@2", "done", 2)
    assert not await redis.exists(K.record()) and not await redis.exists(K.cold())


async def test_a_stopped_end_gives_back_only_the_lock_and_leaves_the_pod_to_a_taker(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    """ "none" (the leader stopped: cancelled, or lost): the lock goes, its record and its
    place in the index stay, and the next cold claim of the scope takes the deploy over with
    its pod. By another token, or replayed, it changes nothing."""
    await configure(rs)
    await placeholder(rs, "ph-1")
    assert (await ds.take_deploy_lease(SID, DID, "lk@1", LEASE)).leader
    pod = ("agent-p", "ns-a", "uid-p")
    assert (await ds.renew_deploy_claim(SID, "ph-1", "lk@1", LEASE, deploy_id=DID, pod=pod,
                                       record_ttl=40)).member  # fmt: skip
    assert not await ds.end_deploy_lease(SID, DID, "other@2", "none", 2)
    assert await redis.get(K.lock()) == "lk@1"
    assert await ds.end_deploy_lease(SID, DID, "lk@1", "none", 2)
    assert not await ds.end_deploy_lease(SID, DID, "lk@1", "none", 2), "a replay"
    assert await redis.get(K.lock()) is None
    assert await redis.hget(K.record(), "pod_id") == "agent-p"
    assert 30 < await redis.ttl(K.record()) <= 40, "the record keeps the pod's deadline"
    assert await redis.zrange(K.cold(), 0, -1) == [DID]
    await ds.drop_placeholders_of(SID, "ph-1")  # the stopped leader gave its slot back
    claim = await ds.claim_deploy(
        SID, "rq-2", token="lk-2@3", lease=LEASE, placeholder_token="ph-2", member="rq-2",
        seat_hold=5, room_ttl=60, concurrency=32, pod_concurrency=1,
    )  # fmt: skip
    assert claim.action == "lead" and claim.deploy_id == DID
    assert claim.orphan is not None and claim.orphan.pod_id == "agent-p"


# --- live placeholders -------------------------------------------------------------------------


async def test_live_deploying_counts_only_live_placeholders(
    js: PoolJobsState, redis: Redis
) -> None:
    now = await rnow(redis)
    await redis.sadd(K.deploying(), f"dead@{now - 1}", f"warm:w@{now + 30}")
    await redis.sadd(K.deploying(), f"r1:cold@{now + 30}")
    live = await js.live_deploying_of([SID, "other"])
    assert sorted(live[SID]) == sorted([f"warm:w@{now + 30}", f"r1:cold@{now + 30}"])
    assert live["other"] == []


# --- lease_prune -------------------------------------------------------------------------------


async def test_prune_drops_expired_seats_and_placeholders_and_keeps_live_ones(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs)
    await configure(rs, "scope-m")
    linked = await rs.acquire(SID, "r0", "link", 60, rule_id="rule-1")  # a live one too
    live = await placeholder(rs, "alive")
    now = await rnow(redis)
    # a live deploy in each scope, each with a live and a dead seat
    for sid in (SID, "scope-m"):
        await redis.set(K.lock(sid), "lk@1", px=30_000)
        await redis.zadd(K.cold(sid), {DID: now})
        await redis.zadd(K.followers(sid), {"f-live": now + 30, "f-dead": now - 2})
        await redis.zadd(rm_leased(sid), {sid: 0})  # due
    dead = f"dead@{now - 2}"
    await redis.sadd(K.deploying(), dead)
    await redis.zadd(K.BUDGET, {f"{SID}:dead": now - 2})  # its reservation lapsed with it

    assert await ds.prune_leases() == LeasePrune(2, 1)
    assert await redis.smembers(K.deploying()) == {live, linked.placeholder}
    assert await redis.zrange(K.followers(), 0, -1) == ["f-live"]
    # the budget counts the live reservations only (the lapsed one goes at the next count)
    assert await redis.zscore(K.BUDGET, f"{SID}:alive") is not None
    assert await rs.budget.used() == 2
    leased = await rm_leased_scopes(redis)
    assert set(leased) == {SID, "scope-m"}, "live deploys keep their scope"
    assert min(leased.values()) > now, "looked at again later, not at every pass"

    # the deploy of scope-m ends: its leader died before its create (no record); its time
    # to be looked at again comes
    await redis.delete(K.lock("scope-m"))
    await redis.zadd(rm_leased("scope-m"), {"scope-m": now})
    assert await ds.prune_leases() == LeasePrune(0, 0)
    assert not await redis.exists(K.cold("scope-m"))
    assert set(await rm_leased_scopes(redis)) == {SID}, "an empty scope leaves the index"


async def test_prune_keeps_a_lapsed_deploy_with_a_pod_to_take_over_and_drops_a_done_one(
    ds: DeployState, redis: Redis
) -> None:
    """A deploy whose leader died after its create stays indexed (the next claim takes it
    over, with the pod); once the pod is registered (reconcile adopted it) it goes, record and
    all."""
    await redis.zadd(K.cold(), {DID: 1})
    await redis.hset(K.record(), mapping={"token": "dead@1", "pod_id": "agent-o", "uid": "u"})
    await redis.zadd(rm_leased(SID), {SID: 0})
    assert await ds.prune_leases() == LeasePrune(0, 0)
    assert await redis.zrange(K.cold(), 0, -1) == [DID]
    assert set(await rm_leased_scopes(redis)) == {SID}
    await redis.zadd(K.pods(), {"agent-o": 1})
    assert await ds.prune_leases(walk=[SID]) == LeasePrune(0, 0), "the slow walk looks too"
    assert not await redis.exists(K.cold()) and not await redis.exists(K.record())
    await redis.zadd(rm_leased(SID), {SID: 0})
    assert await ds.prune_leases() == LeasePrune(0, 0)
    assert await rm_leased_scopes(redis) == {}


async def test_prune_works_through_more_scopes_than_one_slice(
    ds: DeployState, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_runtime.resource_manager import deploy_state

    monkeypatch.setattr(deploy_state, "LEASE_PRUNE_BATCH", 2)  # due scopes a bucket a pass
    now = await rnow(redis)
    n = 230  # more than two a bucket (64 buckets)
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.zadd(K.cold(f"s{i}"), {DID: now - 10})  # its leader died before its create
            pipe.zadd(K.followers(f"s{i}"), {"gone": now - 1})
            pipe.sadd(K.deploying(f"s{i}"), f"gone@{now - 1}")
            pipe.zadd(rm_leased(f"s{i}"), {f"s{i}": 0})
        await pipe.execute()
    first = await ds.prune_leases()
    assert first.seats < n, "a pass looks at LEASE_PRUNE_BATCH scopes a bucket"
    seats, placeholders = first.seats, first.placeholders
    for _ in range(n):
        if not (more := await ds.prune_leases()).seats:
            break
        seats, placeholders = seats + more.seats, placeholders + more.placeholders
    assert (seats, placeholders) == (n, n)
    assert await rm_leased_scopes(redis) == {}
    assert not await redis.exists(K.followers("s0"), K.deploying(f"s{n - 1}"), K.cold("s9"))


async def test_claims_and_placeholders_put_their_scope_in_the_index(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await configure(rs, "scope-a")
    await configure(rs, "scope-b")
    await configure(rs, "scope-c")
    assert (await rs.acquire("scope-a", "r1", "t1", 60)).action == "need_deploy"
    assert await ds.add_placeholder("scope-b", "warm:1", 60)
    claim = await ds.claim_deploy(
        "scope-c", "rq-c", token="lk@1", lease=LEASE, placeholder_token="t2", member="rq-c",
        seat_hold=5, room_ttl=60, concurrency=4, pod_concurrency=4,
    )  # fmt: skip
    assert claim.action == "lead"
    assert set(await rm_leased_scopes(redis)) == {"scope-a", "scope-b", "scope-c"}
