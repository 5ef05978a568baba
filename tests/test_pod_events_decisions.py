"""The decisions the kubectl test (``test_pod_events_sim.py``) does not reach, through the app
over HTTP with the fake Kubernetes (which keeps the Events it is sent): a half-dead pod's
DeletedHalfDead (with its uid), reconcile's Adopted after a resource-manager wipe and its
DeletedOrphan for a pod of ours it cannot adopt, a deploy whose pod never became Ready
(DeployFailed on the pod it made and deleted), and ``AGENT_RUNTIME_POD_EVENTS=false``
recording nothing while every decision still happens.
"""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from contract_keys import rm_pod
from test_scenarios import BASE_TEMPLATE, SCOPE, World, world

WAIT = 10.0
pytestmark = pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)


async def events_on(w: World, pod_id: str) -> list[dict[str, Any]]:
    assert await w.svc.pod_events.wait_sent(WAIT), "the recorder did not catch up"
    return w.k8s.kube_events.of_pod(pod_id)


async def test_a_half_dead_pod_is_deleted_with_its_reason(redis: Redis, db: Database) -> None:
    async with world(redis, db, instance_id="replica-h") as w:
        await w.configure(scope_concurrency=4, pod_concurrency=2)
        sick = (await w.routed("s1"))["pod_id"]
        uid = w.k8s.pods[sick].uid
        w.k8s.unhealthy.add(sick)
        assert await w.svc.pool_jobs.watch_once() == 0
        assert await w.svc.pool_jobs.watch_once() == 1
        deployed, deleted = await events_on(w, sick)
        assert deployed["reason"] == "Deployed" and deployed["type"] == "Normal"
        assert "in use" in deployed["message"]
        assert (deleted["reason"], deleted["type"]) == ("DeletedHalfDead", "Warning")
        assert deleted["involvedObject"]["uid"] == uid
        assert deleted["source"] == {"component": "agent-runtime", "host": "replica-h"}
        assert "the watch pass" in deleted["message"]


async def test_a_deploy_that_never_gets_ready_records_why_its_pod_went(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=2, ready_timeout=0.5)
        w.k8s.never_ready = True
        resp = await w.route("s1")
        assert resp.status_code == 503 and resp.json()["error_code"] == "NO_POD_AVAILABLE"
        (pod,) = w.k8s.deleted  # the one pod the deploy made, deleted by the client
        (failed,) = await events_on(w, pod)
        assert (failed["reason"], failed["type"]) == ("DeployFailed", "Warning")
        assert failed["involvedObject"]["uid"]  # the incarnation that was made
        assert "not Ready within" in failed["message"], failed["message"]
        assert "pod deleted" in failed["message"], failed["message"]


async def test_reconcile_records_its_adoptions_and_deletions(redis: Redis, db: Database) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=1)
        pod = (await w.routed("s1"))["pod_id"]
        assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
        await w.age_pod(pod)
        assert (await w.sweep())["idle"] == 1
        # Redis loses the resource manager's keys; the config comes back with a re-sync
        doomed = [k async for k in redis.scan_iter(match="resource_manager:*")]
        assert rm_pod(SCOPE, pod, "info") in doomed
        await redis.delete(*doomed)
        await w.sync(
            "template", "sync", {**BASE_TEMPLATE, "scope_concurrency": 2, "pod_concurrency": 1}
        )
        # and a pod of ours of an old version nobody knows
        old = w.k8s.add_pod(
            scope_id=SCOPE, deploy_ver="old-version", identity=w.svc.identity,
            pod_spec=BASE_TEMPLATE,
        )  # fmt: skip
        counts = await w.svc.pool_jobs.reconcile_once()
        assert (counts["adopted"], counts["deleted"]) == (1, 1), counts
        reasons = [e["reason"] for e in await events_on(w, pod)]
        assert reasons == ["Deployed", "Adopted"], reasons
        (adopted,) = [e for e in await events_on(w, pod) if e["reason"] == "Adopted"]
        assert "warm pool" in adopted["message"]
        (gone,) = await events_on(w, old.pod_id)
        assert (gone["reason"], gone["involvedObject"]["uid"]) == ("DeletedOrphan", old.uid)
        assert old.pod_id in w.k8s.deleted


async def test_turned_off_the_decisions_happen_and_nothing_is_recorded(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db, pod_events=False) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=2)
        sick = (await w.routed("s1"))["pod_id"]
        w.k8s.unhealthy.add(sick)
        await w.svc.pool_jobs.watch_once()
        assert await w.svc.pool_jobs.watch_once() == 1
        assert await w.svc.pod_events.wait_sent(WAIT)
        assert w.k8s.kube_events.all() == []
