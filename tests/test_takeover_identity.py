"""A dead deploy leader's pod and pod identity: the leader dies between its create and the
incarnation patch, so its pod carries our first signature only (UNFINISHED: what reconcile
deletes when nothing else proves the pod ours). The deploy record, written by our replica
under the lease the taker now holds and naming the pod's uid, is that proof: the taker signs
the pod for its incarnation before registering it, so that a later Redis data loss finds a
pod of ours (adopted), not an unfinished one (deleted while in use). A pod re-created under
the recorded name is another incarnation: never inherited, signed or deleted by the taker.

The dying replica is test_rm_takeover's (its Redis fails every command once its pod is
recorded); on the in-process fake Kubernetes and on kubesim through the real client, on
fakeredis and the real Redis.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from agent_runtime.resource_manager.identity import INCARNATION_ANNOTATION, Ownership
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from contract_keys import rm_pod_known
from helpers import IDENTITY
from kubesim import KubeSim
from test_faults import wipe
from test_local_mode import free_port
from test_pod_adoption import started_client
from test_rm_takeover import (
    dying_and_healthy,
    eventually,
    finished,
    lapsed,
    ownership,
    pool_jobs_of,
    rm,
    spec,
    started_leading,
)


async def test_a_taken_over_pod_is_signed_so_a_later_redis_data_loss_adopts_it(
    redis: Redis,
) -> None:
    """The taker registers the dead leader's pod signed for its incarnation: after Redis
    loses everything, reconcile adopts it (registered, not deleted). Unsigned it would be
    UNFINISHED there, and deleted while its sessions use it."""
    k8s = FakeK8sPodClient(ready_delay=0.3)
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a"))
        orphan = await started_leading(dying, redis)
        assert ownership(k8s, orphan) is Ownership.UNFINISHED
        assert (await b.acquire("r-b")).pod_id == orphan
        assert ownership(k8s, orphan) is Ownership.OURS
        await finished(leading)

        await wipe(redis)
        counts = await pool_jobs_of(b, k8s).reconcile_once()
        assert (counts["adopted"], counts["deleted"]) == (1, 0)
        assert orphan in k8s.pods and k8s.deleted == []
        assert await rm_pod_known(redis, orphan)


async def test_a_pod_re_created_under_the_recorded_name_is_not_inherited(redis: Redis) -> None:
    """The dead leader's pod goes and someone creates theirs under its name with a copy of
    its annotations (a new uid). The record names the old uid: the taker neither signs,
    registers nor deletes the newcomer, and deploys anew; reconcile then deletes the replay as
    an unfinished pod of ours (identity.py), never adopts it."""
    k8s = FakeK8sPodClient(ready_delay=0.3)
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a"))
        orphan = await started_leading(dying, redis)
        original = k8s.pods[orphan]
        k8s.remove(orphan)
        replay = k8s.add_pod(
            pod_id=orphan, scope_id=original.scope_id or "", deploy_ver=original.deploy_ver or "",
            annotations=dict(original.annotations), image="attacker/agent",
        )  # fmt: skip
        assert replay.uid != original.uid

        got = await b.acquire("r-b")
        assert got.pod_id != orphan and k8s.deploy_calls == 2, "deployed anew"
        assert orphan in k8s.pods and orphan not in k8s.deleted, "left alone by the taker"
        assert INCARNATION_ANNOTATION not in k8s.pods[orphan].annotations, "never signed"
        assert not await rm_pod_known(redis, orphan)
        await finished(leading)

        counts = await pool_jobs_of(b, k8s).reconcile_once()
        assert (counts["adopted"], counts["deleted"]) == (0, 1)
        assert orphan not in k8s.pods and got.pod_id in k8s.pods


async def test_reconcile_does_not_adopt_a_re_created_pod_under_a_dead_leader_s_record(
    redis: Redis,
) -> None:
    """No route comes: the record names a name whose pod was replaced (another uid, a copy of
    the first signature). Reconcile does not take it as the dead leader's: deleted as an
    unfinished orphan, never signed or adopted."""
    k8s = FakeK8sPodClient(ready_delay=0.1)
    async with dying_and_healthy(redis, k8s) as (a, dying, b):
        leading = asyncio.create_task(a.acquire("r-a"))
        orphan = await started_leading(dying, redis)
        original = k8s.pods[orphan]
        k8s.remove(orphan)
        k8s.add_pod(
            pod_id=orphan, scope_id=original.scope_id or "", deploy_ver=original.deploy_ver or "",
            annotations=dict(original.annotations),
        )  # fmt: skip
        await eventually(lambda: lapsed(redis), "the dead leader's lease lapsed")
        counts = await pool_jobs_of(b, k8s).reconcile_once()
        assert (counts["adopted"], counts["deleted"]) == (0, 1)
        assert orphan not in k8s.pods and not await rm_pod_known(redis, orphan)
        assert await redis.zcard(rm("pods")) == 0
        await finished(leading)


# --- on kubesim, through the real client (create, then PATCH) ----------------------------------


@pytest.fixture
async def sim() -> Any:
    async with KubeSim(
        ready_delay=0.3, grace_period=0.2, probe_period=0.05, namespaces=("default",), seed=5
    ) as s:
        yield s


async def test_on_kubesim_the_taker_patches_the_incarnation_and_a_data_loss_keeps_the_pod(
    redis: Redis, sim: KubeSim, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await started_client(sim, monkeypatch)
    port = free_port()  # the simulated AgentServer listens there
    pod_spec = spec(sse_port=port, container_port=port)
    try:
        async with dying_and_healthy(redis, client) as (a, dying, b):  # type: ignore[arg-type]
            leading = asyncio.create_task(a.acquire("r-a", pod_spec=pod_spec))
            orphan = await started_leading(dying, redis)
            found = await client.get_pod(orphan, "default")
            assert found is not None and INCARNATION_ANNOTATION not in found.annotations
            assert IDENTITY.verify(found).ownership is Ownership.UNFINISHED
            patches = sim.requests["patch pods"]

            assert (await b.acquire("r-b", pod_spec=pod_spec)).pod_id == orphan
            assert sim.requests["patch pods"] == patches + 1, "one PATCH, by the taker"
            signed = await client.get_pod(orphan, "default")
            assert signed is not None and signed.uid == found.uid
            assert IDENTITY.verify(signed).ownership is Ownership.OURS
            assert sim.requests["create pods"] == 1, "nothing deployed anew"
            await finished(leading)

            await wipe(redis)
            counts = await pool_jobs_of(b, client).reconcile_once()
            assert (counts["adopted"], counts["deleted"]) == (1, 0)
            assert sim.pod("default", orphan) is not None
            assert await rm_pod_known(redis, orphan)
    finally:
        await client.close()
