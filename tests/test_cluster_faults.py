"""Redis Cluster faults mid-load (issue 17, "Resharding and node failover"): two replicas over
a ``redis+cluster://`` client each, a gateway's load over three scopes with small caps
(``failover_load``), and, while it runs, the master serving one scope killed (SIGKILL; its
replica promoted) or that scope's slot migrated to another master (``cluster_faults``).

Asserted, whatever the fault lost: every answer is a contract answer (200, or a refusal with
``retry_after`` and its header; never a 500), no route names a pod that does not exist, every
replica answers again without a restart, no scope or pod over its cap (sampled during the load
and after), every session in all its places, nothing held once the leases ran out, and a
session with no call in flight around the fault keeps what it was told. The unavailability
window and what the kill lost are printed (docs/performance.md "Redis Cluster" has four runs').
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

import helpers
from agent_runtime.db.engine import Database
from cluster_faults import ClusterSet, slot_of
from failover_load import Outcome, Shape, one_failover, service

TIMEOUT = 300

pytestmark = [
    pytest.mark.real_backend,
    pytest.mark.timeout(TIMEOUT),
    pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True),
]


@pytest.fixture(autouse=True)
async def _tasks_shown_before_the_timeout() -> AsyncIterator[None]:
    """A run that hangs shows where: every task's stack, printed 30 s before pytest-timeout
    ends the test (which shows only the event loop's select)."""

    async def show() -> None:
        await asyncio.sleep(TIMEOUT - 30)
        for task in asyncio.all_tasks():
            print(f"task {task.get_name()}:", file=sys.stderr)
            task.print_stack(limit=15, file=sys.stderr)

    shower = asyncio.create_task(show())
    yield
    shower.cancel()


@pytest.fixture
async def cluster() -> AsyncIterator[Redis]:
    """The tests' cluster, owned by this run and emptied before and after."""
    client = await helpers.claim_cluster_whole()
    try:
        yield client
    finally:
        await helpers.release_cluster_whole(client)
        await client.aclose()


def assert_in_contract_and_consistent(out: Outcome, k8s_pods: set[str]) -> None:
    print("\n" + out.summary())
    assert out.bad == [], out.bad[:10]
    assert out.unexposed_anomalies == [], out.unexposed_anomalies[:5]
    assert out.over_cap_seen == [], out.over_cap_seen[:10]
    assert out.state is not None and out.state.consistent, out.state.problems()[:10]
    registered = set().union(*out.state.registered_pods.values())
    assert registered <= k8s_pods, registered - k8s_pods
    assert out.after is not None and out.after.leftovers == [], out.after.problems()
    assert out.after.sessions == 0 and out.after.consistent, out.after.problems()
    assert out.codes["OK"] > 100, out.codes  # the load ran across the fault


async def test_a_cluster_master_killed_mid_load_answers_in_contract_and_stays_consistent(
    cluster: Redis, db: Database
) -> None:
    shape = Shape()
    faults = ClusterSet(helpers.CLUSTER_URL)
    try:
        async with service(helpers.CLUSTER_URL, db, shape) as svc:
            slot = slot_of(svc.scope_ids[0])
            out = await one_failover(svc, lambda: faults.kill_master(slot), cluster, shape)
            fo = out.failover
            assert fo.new is not None and fo.new != fo.old and fo.named >= fo.promoted > 0, fo
            assert_in_contract_and_consistent(out, set(svc.k8s.pods))
    finally:
        await faults.restore()


async def test_a_slot_moved_mid_load_loses_nothing(cluster: Redis, db: Database) -> None:
    shape = Shape()
    faults = ClusterSet(helpers.CLUSTER_URL)
    async with service(helpers.CLUSTER_URL, db, shape) as svc:
        slot = slot_of(svc.scope_ids[0])
        before = await faults.owner(slot)
        out = await one_failover(svc, lambda: faults.move_slot(slot), cluster, shape)
        assert (await faults.owner(slot)).node_id != before.node_id
        assert_in_contract_and_consistent(out, set(svc.k8s.pods))
        # a migration loses no write: nothing the gateway was told is forgotten
        assert out.bindings_lost == 0 and out.eos_undone == 0, out.summary()
        assert out.pods_unregistered == 0 and out.seats_over_cap == 0, out.summary()
