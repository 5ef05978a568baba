"""Redis Cluster: every resource-manager script call is given keys of one hash slot.

Every script the resource manager registers (its ``lua/`` scripts and the shared DueIndex
scripts it uses) is wrapped to record the KEYS of each call; a flow through every state
method that runs a script (acquire, claims and leases, registration, release, drains, reports,
the jobs' reads and repairs, the migration's indexes) then must have given each call keys of
one slot (``redis.cluster.key_slot``), the state's bulk reads cut by slot as on a cluster.

The pod budgets are a step of their own: their keys share one tag (``budget:{budget}:…``),
and only the budget scripts take them, never beside a scope's keys; the test holds that list
exactly.

On the tests' real Redis Cluster (``redis_cluster``) the same flow runs end to end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.cluster import key_slot

from agent_runtime import lua
from agent_runtime.resource_manager import state as state_module
from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.drain_state import DrainState
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.report_state import ReportState
from agent_runtime.resource_manager.state import ResourceState
from contract_keys import rm_pod, rm_pod_scope, rm_scope

BUDGET_KEYS = "resource_manager:budget:{budget}:"  # the budget keys: their own tag, one slot
BUDGET_LINKS = f"{BUDGET_KEYS}links"


def budget_units(sid: str) -> str:
    return f"{BUDGET_KEYS}scope:{sid}:units"


# the scripts that take the budget keys: those keys only
BUDGETED = {
    "budget_confirm",
    "budget_link",
    "budget_release",
    "budget_renew",
    "budget_repair",
    "budget_reserve",
}
CONFIG = {"min_idle_pods": 0, "max_pods": 4, "pod_ttl": 60, "pod_concurrency": 2}


class Calls:
    """(script, keys) of every call of a script registered while recording."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[str]]] = []

    def wrap(self, name: str, script: Any) -> Any:
        async def call(keys: Any = None, args: Any = None, client: Any = None) -> Any:
            self.seen.append((name, [str(k) for k in keys or []]))
            return await script(keys=keys, args=args, client=client)

        return call

    def slots(self) -> Iterator[tuple[str, list[str], set[int]]]:
        for name, keys in self.seen:
            yield name, keys, {key_slot(k.encode()) for k in keys}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    recorded = Calls()
    register = lua.register

    def recording(redis: Redis, package: str, name: str, **kw: Any) -> Any:
        return recorded.wrap(name, register(redis, package, name, **kw))

    monkeypatch.setattr(lua, "register", recording)
    # the bulk reads cut by slot, as the state does on a Redis Cluster
    monkeypatch.setattr(state_module, "is_cluster", lambda redis: True)
    return recorded


async def flow(rs: ResourceState, sid: str, other: str, *, installation_wide: bool = True) -> None:
    """Every state method that runs a script, over two scopes (so that a call mixing them
    shows); ``installation_wide``: the reconcile repairs over every scope and the foreign
    report too."""
    ds, js, drains, reports = DeployState(rs), PoolJobsState(rs), DrainState(rs), ReportState(rs)
    for scope in (sid, other):
        assert await rs.write_pool_config(scope, CONFIG, deploy_ver="v1", pod_spec={"i": "x"})
    need = await rs.acquire(sid, "r1", "t1", 60)
    assert need.action == "need_deploy" and need.placeholder
    assert await rs.register(
        scope_id=sid, pod_id=f"p1{sid}", placeholder=need.placeholder, pod_sse_url="http://p1",
        pod_ip="10.0.0.1", namespace="n", deploy_ver="v1", warm=True,
    )  # fmt: skip
    assert (await rs.acquire(sid, "r2", "t2", 60)).action == "reuse"
    assert await rs.release(sid, f"p1{sid}")
    member = await ds.add_placeholder(other, "warm:1", 60)
    assert member is not None
    await ds.drop_placeholder(other, member)
    claim = await ds.claim_deploy(
        other, "rq", token="o/rq/u@1", lease=5, placeholder_token="t3", member="rq",
        seat_hold=5, room_ttl=60, concurrency=2, pod_concurrency=2,
    )  # fmt: skip
    assert claim.action == "lead"
    assert (await ds.renew_deploy_claim(other, "t3", "o/rq/u@1", 5, deploy_id="rq")).member
    await ds.leave_follower_seat(other, "rq", "f-1", served=True)
    assert await ds.end_deploy_lease(other, "rq", "o/rq/u@1", "none", 1)
    assert (await ds.take_deploy_lease(other, "rq", "reconcile//u@2", 5)).leader
    assert await ds.end_deploy_lease(other, "rq", "reconcile//u@2", "done", 1)
    assert await ds.drop_placeholders_of(other, "t3") == 1
    await ds.prune_leases(walk=[sid, other])
    await rs.record_deploy_time(sid, 3.5)
    await drains.begin(f"p1{sid}", sid, trigger="admin", pending=False, seconds=30)
    assert [d.pod_id for d in await drains.drains(await drains.draining_pods())] == [f"p1{sid}"]
    assert (await reports.claim(sid, f"p1{sid}", 1.0)).probe
    await reports.answer(sid, f"p1{sid}", "healthy")
    pods = await js.all_pods()
    assert pods == {f"p1{sid}": sid}
    assert set(await js.pool_configs([sid, other])) == {sid, other}
    await js.pod_phases(pods)
    await js.idle_pods_of([sid, other])
    await js.pod_counts_of([sid, other])
    await js.deploy_times_of([sid, other])
    adopted = await js.adopt(
        scope_id=other, pod_id=f"p2{other}", pod_sse_url="http://p2", pod_ip="10.0.0.2",
        namespace="n", deploy_ver="v1",
    )  # fmt: skip
    assert adopted.action == "adopted"
    if installation_wide:
        await js.repair_budgets()
        await js.index_pods()
        await js.report_foreign(1, {"n/x": {"pod_id": "x"}})
    assert await js.purge(f"p1{sid}") == sid
    assert await js.purge(f"p2{other}") == other
    for scope in (sid, other):
        assert await rs.expire_scope(scope)


async def test_every_resource_manager_script_call_is_given_keys_of_one_slot(
    redis: Redis, calls: Calls
) -> None:
    await flow(ResourceState(redis), "s-slot-a", "s-slot-b")
    names = {name for name, _ in calls.seen}
    assert {"acquire", "register", "release", "deploy_claim", "lease_prune", "drain_begin",
            "follower_leave",
            "pod_report", "pod_fields", "read_many", "pool_config", "scope_expire",
            "bucket_due", "bucket_mark", "bucket_settle"} <= names, names  # fmt: skip
    budgeted: set[str] = set()
    for name, keys, slots in calls.slots():
        assert len(slots) <= 1, f"{name}: keys of {len(slots)} slots: {keys}"
        if any(k.startswith(BUDGET_KEYS) for k in keys):
            budgeted.add(name)
            assert all(k.startswith(BUDGET_KEYS) for k in keys), f"{name}: {keys}"
    assert budgeted == BUDGETED, "the scripts that take the budget keys"


async def test_a_pod_s_keys_share_its_scope_s_slot_and_the_index_names_the_scope(
    redis: Redis, rs: ResourceState
) -> None:
    await flow_until_registered(rs, "s-slot-c")
    pod = "p1s-slot-c"
    slot = key_slot(rm_scope("s-slot-c", "pods").encode())
    for what in ("info", "idle_since", "health_fails", "drain", "reported"):
        assert key_slot(rm_pod("s-slot-c", pod, what).encode()) == slot
    assert await rm_pod_scope(redis, pod) == "s-slot-c"


async def flow_until_registered(rs: ResourceState, sid: str) -> None:
    assert await rs.write_pool_config(sid, CONFIG, deploy_ver="v1", pod_spec={"i": "x"})
    need = await rs.acquire(sid, "r1", "t1", 60)
    assert await rs.register(
        scope_id=sid, pod_id=f"p1{sid}", placeholder=need.placeholder, pod_sse_url="http://p1",
        pod_ip="10.0.0.1", namespace="n", deploy_ver="v1", warm=False,
    )  # fmt: skip


async def test_on_the_redis_cluster_every_script_runs_and_the_budgets_count(
    redis_cluster: Redis, cluster_tag: str
) -> None:
    """The real test cluster (shared with other test processes: the installation-wide
    repairs stay out): the whole flow runs, and the budget units it took are given back."""
    rs = ResourceState(redis_cluster)
    sid, other = f"s-{cluster_tag}", f"o-{cluster_tag}"
    try:
        await flow(rs, sid, other, installation_wide=False)
        for scope in (sid, other):
            assert await redis_cluster.zcard(budget_units(scope)) == 0
            assert not await redis_cluster.hexists(BUDGET_LINKS, scope)
    finally:
        for scope in (sid, other):
            units = await redis_cluster.zrange(budget_units(scope), 0, -1)
            await rs.budget.release(scope, *units)
            await rs.budget.forget(scope)
            await redis_cluster.srem(state_module.scope_index_key(scope), scope)
            await redis_cluster.zrem(rs.leased.key(scope), scope)
