"""The cross-scope indexes of the resource manager, written beside the scope's scripts (another
slot) and repaired when a crash left them half done: the pod index (reconcile), the scope
index (after a scope's expiry), the leased scopes (the prune's slow walk) and the draining
pods (the drains job, reconcile). On fakeredis and real Redis.

A crash between a script and its index write is made here by writing what the script alone
would have written (or removing what only the index step writes).
"""

from __future__ import annotations

from redis.asyncio import Redis

from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.drain_state import DrainState
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import ResourceState
from contract_keys import (
    rm_draining,
    rm_draining_pods,
    rm_leased,
    rm_leased_scopes,
    rm_pod_known,
    rm_pod_scope,
    rm_pods_index,
    rm_scopes,
)

SID = "scope-ix"
CONFIG = {"min_idle_pods": 0, "max_pods": 4, "pod_ttl": 60, "pod_concurrency": 2}


async def registered(rs: ResourceState, pod: str, sid: str = SID) -> None:
    member = await DeployState(rs).add_placeholder(sid, f"t-{pod}", 600)
    assert member is not None
    assert await rs.register(
        scope_id=sid, pod_id=pod, placeholder=member, pod_sse_url="http://p", pod_ip="10.0.0.1",
        namespace="n", deploy_ver="v1", warm=True,
    )  # fmt: skip


async def test_reconcile_indexes_a_registered_pod_the_index_lost(
    rs: ResourceState, js: PoolJobsState, redis: Redis
) -> None:
    await rs.write_pool_config(SID, CONFIG, deploy_ver="v1", pod_spec={"i": "x"})
    await registered(rs, "p1")
    await redis.hdel(rm_pods_index("p1"), "p1")  # lost
    assert await rs.pod_info("p1") is None, "a pod-id-only door cannot find it"
    assert await js.index_pods() == (1, 0)
    assert await rm_pod_scope(redis, "p1") == SID
    assert (await rs.pod_info("p1")) is not None
    assert await js.index_pods() == (0, 0), "nothing more to do"


async def test_an_indexed_pod_nobody_registered_leaves_at_the_second_pass(
    rs: ResourceState, js: PoolJobsState, redis: Redis
) -> None:
    """A registration writes the index first: one pass may catch it between its two steps,
    so only a pod unregistered on two passes in a row leaves."""
    await rs.write_pool_config(SID, CONFIG, deploy_ver="v1", pod_spec={"i": "x"})
    await rs.index_pod(SID, "half")  # its registration died after the index write
    await rs.index_pod(SID, "slow")  # its registration runs between the two passes
    assert await js.index_pods() == (0, 0)
    await registered(rs, "slow")
    assert await js.index_pods() == (0, 1)
    assert not await rm_pod_known(redis, "half")
    assert await rm_pod_scope(redis, "slow") == SID


async def test_a_refused_adoption_leaves_no_index_entry(
    rs: ResourceState, js: PoolJobsState, redis: Redis
) -> None:
    await rs.write_pool_config(SID, CONFIG, deploy_ver="v2", pod_spec={"i": "x"})
    refused = await js.adopt(
        scope_id=SID, pod_id="old", pod_sse_url="u", pod_ip="10.0.0.2", namespace="n",
        deploy_ver="v1",
    )  # fmt: skip
    assert refused.action == "old_version"
    assert not await rm_pod_known(redis, "old")


async def test_the_scope_index_follows_the_config_and_its_expiry(
    rs: ResourceState, js: PoolJobsState, redis: Redis
) -> None:
    await rs.write_pool_config(SID, CONFIG, deploy_ver="v1", pod_spec={"i": "x"})
    assert await redis.sismember(rm_scopes(SID), SID)
    assert SID in await js.scopes_with_config()
    assert await rs.expire_scope(SID)
    assert not await redis.sismember(rm_scopes(SID), SID)
    # a crash after the config's write, before its index entry: reconcile's SCAN adds it
    await rs.write_pool_config(SID, CONFIG, deploy_ver="v1", pod_spec={"i": "x"})
    await redis.srem(rm_scopes(SID), SID)
    assert await js.index_scopes() == 1
    assert SID in await js.scopes_with_config()


async def test_the_prune_s_slow_walk_finds_a_lease_whose_mark_was_lost(
    rs: ResourceState, ds: DeployState, redis: Redis
) -> None:
    await rs.write_pool_config(SID, CONFIG, deploy_ver="v1", pod_spec={"i": "x"})
    assert await ds.add_placeholder(SID, "t1", 60) is not None
    await redis.delete(rm_leased(SID))  # the mark lost with its replica
    await ds.prune_leases()
    assert await rm_leased_scopes(redis) == {}, "the index alone does not know it"
    await ds.prune_leases(walk=[SID])
    leased = await rm_leased_scopes(redis)
    assert set(leased) == {SID}, "marked: looked at when its placeholder lapses"
    seconds, _ = await redis.time()
    assert seconds + 60 <= leased[SID] <= seconds + 62


async def test_a_draining_entry_without_a_drain_leaves_and_a_lost_one_comes_back(
    rs: ResourceState, js: PoolJobsState, redis: Redis
) -> None:
    await rs.write_pool_config(SID, CONFIG, deploy_ver="v1", pod_spec={"i": "x"})
    await registered(rs, "p1")
    await registered(rs, "p2")
    drains = DrainState(rs)
    assert await drains.begin("p1", SID, trigger="admin", pending=False, seconds=30)
    # a stale entry (its pod purged, the entry's removal lost) and a lost one (p1's)
    await redis.zadd(rm_draining(SID), {"gone": 1.0})
    deadline = (await rm_draining_pods(redis))["p1"]
    await redis.zrem(rm_draining(SID), "p1")
    assert await drains.drop_stale({"gone"}) == 1
    assert await rm_draining_pods(redis) == {}
    assert await drains.index_drains(await js.all_pods()) == 1
    assert await rm_draining_pods(redis) == {"p1": deadline}
    assert await drains.drop_stale({"p1"}) == 0, "a pod with a drain is put back"
    assert await rm_draining_pods(redis) == {"p1": deadline}
    assert await js.purge("p1") == SID
    assert await rm_draining_pods(redis) == {}, "the purge drops its entry"
