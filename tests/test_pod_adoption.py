"""Reconcile over pods Redis does not know, through the app (route, admin views, /metrics):
a pod that carries our labels but not our identity is never adopted, routed to or deleted,
and is reported; one of ours is adopted, also after Redis lost everything; an adopted pod
whose scope never comes back goes after ``adopted_pod_ttl``. On the in-process fake
Kubernetes (fakeredis and the real Redis) and on kubesim through the real client.

Key names are the contract's (§4), spelled out as the other job tests do.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import fakeredis
import httpx
import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.identity import INCARNATION_ANNOTATION
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.util import scope_id_of
from agent_runtime.wiring import Services
from contract_keys import (
    rm_pod_known,
    rm_pods_known,
    rm_scope,
)
from helpers import envelope, fake_only, running_app, sync_body
from kubesim import KubeSim
from test_faults import wipe
from test_local_mode import free_port

ROUTE = "/api/session/route"
SYNC = "/api/session/config_sync"
ADMIN = "/api/session/admin"
BOT = "bot-1"
BUDGET_PODS = "resource_manager:budget:{budget}:pods"
TEMPLATE = {
    "template_id": "tpl-id",
    "image": "agentserver:1",
    "pod_name": "agent",
    "scope_concurrency": 4,
    "pod_concurrency": 1,
    "pod_ttl": 300,
    "min_idle_pods": 0,
    "ready_timeout": 5,
    "ready_poll_interval": 0.02,
}
ATTACKER = "attacker/agent"


def services(app: httpx.AsyncClient) -> Services:
    svc: Services = app.app.state.services  # type: ignore[attr-defined]
    return svc


async def configure(app: httpx.AsyncClient, groups: list[str], **fields: Any) -> str:
    """The template and a rule per group; returns the template's deploy_ver."""
    item = {**TEMPLATE, **fields}
    resp = await app.post(SYNC, json=sync_body("template", "sync", item))
    assert resp.status_code == 200, resp.text
    for group in groups:
        rule = {"group_id": group, "bot_id": BOT, "template_id": item["template_id"]}
        resp = await app.post(SYNC, json=sync_body("routing_rule", "sync", rule))
        assert resp.status_code == 200, resp.text
    config = await services(app).config_store.resolve(scope_id_of(groups[0], BOT), groups[0], BOT)
    return config.deploy_ver


async def routed(app: httpx.AsyncClient, group: str, session_id: str) -> dict[str, Any]:
    body = envelope(
        request_id=f"r-{uuid.uuid4().hex[:10]}", session_id=session_id, bot_id=BOT,
        extra={"group_id": group},
    )  # fmt: skip
    resp = await app.post(ROUTE, json=body)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()["data"]
    return data


async def admin(app: httpx.AsyncClient, path: str) -> dict[str, Any]:
    resp = await app.get(f"{ADMIN}{path}")
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()["data"]
    return data


def metric(text: str, name: str) -> float:
    """An unlabelled sample of the /metrics text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within:g} s: {what}")
        await asyncio.sleep(0.05)


# --- foreign pods: the reproduction ----------------------------------------------------


@fake_only
async def test_a_foreign_pod_with_our_labels_is_never_adopted_routed_to_or_deleted(
    redis: Redis, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    k8s = FakeK8sPodClient()
    async with running_app(redis, db, k8s=k8s) as app:
        svc = services(app)
        ver = await configure(app, ["g-a"])
        sid = scope_id_of("g-a", BOT)
        first = (await routed(app, "g-a", "s-1"))["pod_id"]
        ours = k8s.pods[first]
        # everything an attacker can read from one of our pods: labels and annotations
        bare = k8s.add_pod(scope_id=sid, deploy_ver=ver, image=ATTACKER)
        stolen = k8s.add_pod(
            scope_id=sid, deploy_ver=ver, image=ATTACKER, annotations=dict(ours.annotations)
        )
        forged = k8s.add_pod(
            scope_id=sid, deploy_ver=ver, image=ATTACKER,
            annotations={**ours.annotations, "agent-runtime/identity": "v1:" + "0" * 64},
        )  # fmt: skip
        foreign = {bare.pod_id, stolen.pod_id, forged.pod_id}
        orphan = k8s.add_pod(scope_id=sid, deploy_ver=ver, identity=svc.identity).pod_id

        caplog.set_level(logging.WARNING, logger="agent_runtime.resource_manager.orphans")
        counts = await svc.pool_jobs.reconcile_once()
        assert (counts["foreign"], counts["adopted"], counts["deleted"]) == (3, 1, 0)
        assert (await svc.pool_jobs.reconcile_once())["foreign"] == 3
        assert foreign <= set(k8s.pods) and k8s.deleted == []
        assert set(await rm_pods_known(redis)) == {first, orphan}
        warned = [r for r in caplog.records if "not provably ours" in r.getMessage()]
        assert len(warned) == 3, "once per pod, not once per pass"
        assert all(ATTACKER in r.getMessage() for r in warned)

        # the tenant's next sessions: our adopted orphan, then a pod we deploy; never theirs
        calls = k8s.deploy_calls
        second = (await routed(app, "g-a", "s-2"))["pod_id"]
        assert second == orphan and k8s.deploy_calls == calls
        third = (await routed(app, "g-a", "s-3"))["pod_id"]
        assert third not in foreign and k8s.pods[third].image == TEMPLATE["image"]

        report = await admin(app, "/foreign_pods")
        assert report["count"] == 3
        assert {p["pod_id"] for p in report["pods"]} == foreign
        assert {p["image"] for p in report["pods"]} == {ATTACKER}
        assert {p["reason"] for p in report["pods"]} == {
            "no identity annotation",
            "identity does not verify",
        }
        view = await admin(app, f"/pods/{bare.pod_id}")
        assert (
            view["owned"] is False and view["info"] == {} and view["foreign"][0]["scope_id"] == sid
        )
        assert (await admin(app, f"/pods/{orphan}"))["owned"] is True

        text = (await app.get("/metrics")).text
        assert metric(text, "agent_runtime_foreign_pods_total") == 3
        assert metric(text, "agent_runtime_foreign_pods_seen") == 3
        assert 'agent_runtime_reconcile_pods_total{action="foreign"} 6.0' in text
        assert 'agent_runtime_reconcile_pods_total{action="adopted"} 1.0' in text

        # they leave; the next pass says so
        for pod_id in foreign:
            k8s.remove(pod_id)
        assert (await svc.pool_jobs.reconcile_once())["foreign"] == 0
        assert (await admin(app, "/foreign_pods")) == {"count": 0, "pods": []}


@fake_only
async def test_a_pod_recreated_under_one_of_our_names_is_deleted_never_adopted(
    redis: Redis, db: Database
) -> None:
    """Our pod is gone; someone creates theirs under its freed name with a copy of its
    annotations. The create signature verifies, the uid-bound one cannot: never routed to."""
    k8s = FakeK8sPodClient()
    async with running_app(redis, db, k8s=k8s) as app:
        svc = services(app)
        ver = await configure(app, ["g-r"])
        sid = scope_id_of("g-r", BOT)
        gone = k8s.pods[(await routed(app, "g-r", "s-1"))["pod_id"]]
        k8s.remove(gone.pod_id)
        assert (await svc.pool_jobs.reconcile_once())["purged"] == 1
        replay = k8s.add_pod(
            pod_id=gone.pod_id, scope_id=sid, deploy_ver=ver, image=ATTACKER,
            annotations=dict(gone.annotations),
        )  # fmt: skip
        assert replay.uid != gone.uid and INCARNATION_ANNOTATION in replay.annotations

        counts = await svc.pool_jobs.reconcile_once()
        assert (counts["adopted"], counts["deleted"], counts["foreign"]) == (0, 1, 0)
        assert k8s.deleted == [gone.pod_id] and not await rm_pod_known(redis, gone.pod_id)
        assert (await routed(app, "g-r", "s-1"))["pod_id"] != gone.pod_id


# --- a full Redis data loss --------------------------------------------------------------------


async def test_after_redis_lost_everything_our_pods_are_adopted_and_serve(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    groups = [f"g-{i}" for i in range(3)]
    async with running_app(redis, db, k8s=k8s) as app:
        svc = services(app)
        ver = await configure(app, groups)
        before: dict[str, set[str]] = {}
        for group in groups:
            before[group] = {
                (await routed(app, group, f"{group}-s{n}"))["pod_id"] for n in range(2)
            }
        pods = set().union(*before.values())
        assert len(pods) == 6 and set(k8s.pods) == pods
        foreign = k8s.add_pod(scope_id=scope_id_of("g-0", BOT), deploy_ver=ver, image=ATTACKER)
        calls = k8s.deploy_calls

        await wipe(redis)
        counts = await svc.pool_jobs.reconcile_once()
        assert (counts["adopted"], counts["deleted"], counts["foreign"]) == (6, 0, 1)
        assert set(await rm_pods_known(redis)) == pods and k8s.deleted == []
        assert await redis.zcard(BUDGET_PODS) == 6, "the budget counts adopted pods"
        for group in groups:
            sid = scope_id_of(group, BOT)
            assert set(await redis.smembers(rm_scope(sid, "idle"))) == before[group]
            assert not await redis.exists(rm_scope(sid, "config")), "the next route writes it"
        # a second pass changes nothing (nothing expires before adopted_pod_ttl)
        again = await svc.pool_jobs.reconcile_once()
        assert (again["adopted"], again["deleted"], again["expired"]) == (0, 0, 0)

        # the gateway routes its sessions again: onto the adopted pods, nothing deployed
        for group in groups:
            for n in range(2):
                data = await routed(app, group, f"{group}-s{n}")
                assert data["placement"] == "placed" and data["pod_id"] in before[group]
        assert k8s.deploy_calls == calls and foreign.pod_id in k8s.pods
        await PoolJobsState(svc.resource_state).repair_budgets()
        assert await svc.resource_views.budget_used() == 6


@fake_only
async def test_an_adopted_pod_of_an_old_version_goes_once_its_scope_is_configured_again(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    async with running_app(redis, db, k8s=k8s) as app:
        svc = services(app)
        ver = await configure(app, ["g-o"])
        sid = scope_id_of("g-o", BOT)
        current = k8s.pods[(await routed(app, "g-o", "s-1"))["pod_id"]].pod_id
        old = k8s.add_pod(scope_id=sid, deploy_ver="0ld0ld0ld0ld0ld0", identity=svc.identity)
        await wipe(redis)
        assert (await svc.pool_jobs.reconcile_once())["adopted"] == 2
        assert (await routed(app, "g-o", "s-1"))["pod_id"] == current  # writes the config
        assert await svc.pool_jobs.reclaim_once() == 1, "ours, of an old version, idle: it goes"
        assert k8s.deleted == [old.pod_id] and ver != "0ld0ld0ld0ld0ld0"


@fake_only
async def test_an_adopted_pod_whose_scope_never_routes_again_goes_after_adopted_pod_ttl(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    async with running_app(redis, db, k8s=k8s, adopted_pod_ttl=1.0) as app:
        svc = services(app)
        await configure(app, ["g-t", "g-u"])
        left = (await routed(app, "g-t", "s-1"))["pod_id"]
        back = (await routed(app, "g-u", "s-1"))["pod_id"]
        await wipe(redis)
        assert (await svc.pool_jobs.reconcile_once())["adopted"] == 2
        assert (await routed(app, "g-u", "s-1"))["pod_id"] == back  # this scope comes back
        assert (await svc.pool_jobs.reconcile_once())["expired"] == 0, "not before the ttl"

        async def expired() -> bool:
            await svc.pool_jobs.reconcile_once()
            return left not in k8s.pods

        await eventually(expired, "the unclaimed adopted pod deleted")
        assert k8s.deleted == [left] and back in k8s.pods
        assert set(await rm_pods_known(redis)) == {back}
        assert await svc.resource_views.budget_used() == 1


# --- the same on kubesim, through the real client ----------------------------------------------


@pytest.fixture
async def sim() -> Any:
    async with KubeSim(
        ready_delay=0.05, grace_period=0.2, probe_period=0.05, namespaces=("default",), seed=3
    ) as s:
        yield s


async def started_client(sim: KubeSim, monkeypatch: pytest.MonkeyPatch) -> RealK8sPodClient:
    """The real client, started against kubesim (no proxy or in-cluster setting in the way)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    client = RealK8sPodClient(kubeconfig=str(sim.kubeconfig_path), default_namespace="default")
    await client.start()
    return client


async def test_on_kubesim_a_foreign_pod_is_left_alone_and_ours_are_adopted_after_a_wipe(
    sim: KubeSim, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await started_client(sim, monkeypatch)
    db = Database.from_url(f"sqlite:///{tmp_path / 'config.db'}")
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    try:
        async with running_app(redis, db, k8s=client) as app:  # type: ignore[arg-type]
            svc = services(app)
            port = free_port()  # the simulated AgentServers listen there
            ver = await configure(app, ["g-k"], sse_port=port, container_port=port)
            sid = scope_id_of("g-k", BOT)
            first = (await routed(app, "g-k", "s-1"))["pod_id"]
            stolen = sim.pod("default", first)
            assert stolen is not None
            labels = dict(stolen["metadata"]["labels"], app="x-attacker")
            body = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": "x-attacker", "labels": labels,
                    "annotations": dict(stolen["metadata"]["annotations"]),
                },
                "spec": {"containers": [{"name": "agentserver", "image": ATTACKER,
                                         "ports": [{"containerPort": port}]}]},
            }  # fmt: skip
            async with httpx.AsyncClient(base_url=sim.url, trust_env=False) as http:
                created = await http.post("/api/v1/namespaces/default/pods", json=body)
                assert created.status_code == 201, created.text

            async def attacker_ready() -> bool:
                pod = sim.pod("default", "x-attacker") or {}
                return bool(pod.get("status", {}).get("podIP"))

            await eventually(attacker_ready, "the attacker's pod Running")
            counts = await svc.pool_jobs.reconcile_once()
            assert (counts["foreign"], counts["adopted"], counts["deleted"]) == (1, 0, 0)
            second = (await routed(app, "g-k", "s-2"))["pod_id"]
            assert second not in (first, "x-attacker")
            assert sim.pod("default", "x-attacker") is not None
            report = await admin(app, "/foreign_pods")
            assert [(p["pod_id"], p["image"]) for p in report["pods"]] == [("x-attacker", ATTACKER)]
            assert ver == labels["agent-runtime/deploy-ver"]

            creates = sim.requests["create pods"]  # our two, the attacker's
            await wipe(redis)
            counts = await svc.pool_jobs.reconcile_once()
            assert (counts["adopted"], counts["deleted"], counts["foreign"]) == (2, 0, 1)
            assert set(await redis.smembers(rm_scope(sid, "idle"))) == {first, second}
            again = (await routed(app, "g-k", "s-1"))["pod_id"]
            assert again in (first, second)
            assert sim.requests["create pods"] == creates, "nothing deployed after the wipe"
    finally:
        await client.close()
        await db.close()
        await redis.aclose()
