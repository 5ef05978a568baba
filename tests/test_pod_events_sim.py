"""What an operator sees: the service's decisions about pods as Kubernetes Events, read with
the real ``kubectl`` (``describe pod``, ``get events``) from the Kubernetes simulator that the
service drives through its real client (kubernetes_asyncio), over the app's HTTP API and its
jobs ticked by hand. A cold route deploys → Deployed; a killed pod → DeletedDead; an admin
drain → DrainStarted, then Drained; a warm pod past its plan → Reclaimed; a foreign pod with
our labels → ForeignPodIgnored once, counted up on each reconcile pass (not repeated).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

import test_k8s_real_sim as real_sim
from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.models import COMPONENT_LABEL, COMPONENT_VALUE, SCOPE_LABEL
from agent_runtime.wiring import Services
from helpers import envelope, running_app, sync_body
from kubesim import KubeSim
from test_kubesim_events import run_kubectl
from test_scenarios import eventually

_direct = real_sim._direct
client = real_sim.client

ADMIN = {"Authorization": "Bearer adm"}
BASE = "/api/session/admin"
GROUP, BOT = "g-events", "b-events"
TEMPLATE = {
    "template_id": "t-events", "image": "agentserver:1", "scope_concurrency": 8,
    "pod_concurrency": 1, "ready_timeout": 10, "ready_poll_interval": 0.03, "min_idle_pods": 0,
    "pod_ttl": 60,
}  # fmt: skip
WAIT = 30.0


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    async with KubeSim(
        # a loopback range of this process's own (another test run takes none of it)
        first_pod_ip=f"127.{64 + os.getpid() % 128}.9.2",
        ready_delay=0.1,
        grace_period=0.3,
        probe_period=0.05,
        sse_interval=0.05,
        seed=11,
    ) as s:
        yield s


async def route(app: httpx.AsyncClient, session: str) -> str:
    body = envelope(session_id=session, bot_id=BOT, extra={"group_id": GROUP})
    resp = await app.post("/api/session/route", json=body)
    assert resp.status_code == 200, resp.text
    pod: str = resp.json()["data"]["pod_id"]
    return pod


async def sync(app: httpx.AsyncClient, kind: str, item: dict[str, Any]) -> None:
    resp = await app.post("/api/session/config_sync", json=sync_body(kind, "sync", item))
    assert resp.status_code == 200, resp.text


async def described(sim: KubeSim, pod: str) -> str:
    """The Events section of ``kubectl describe pod``."""
    out = await asyncio.to_thread(run_kubectl, sim, "describe", "pod", pod)
    return out[out.index("Events:") :]


async def events_of(sim: KubeSim, pod: str) -> list[dict[str, Any]]:
    """``kubectl get events`` of a pod by name (it may be gone: describe cannot find it)."""
    out = await asyncio.to_thread(
        run_kubectl, sim, "get", "events", "--field-selector", f"involvedObject.name={pod}",
        "-o", "json",
    )  # fmt: skip
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


async def sent(svc: Services) -> None:
    assert await svc.pod_events.wait_sent(WAIT), "the recorder did not catch up"


@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_kubectl_shows_why_each_pod_came_or_went(
    sim: KubeSim, client: RealK8sPodClient, redis: Redis, db: Database
) -> None:
    async with running_app(
        redis, db, k8s=client, admin_tokens="adm", gateway_tokens="adm",  # type: ignore[arg-type]
        instance_id="replica-e",
    ) as app:  # fmt: skip
        app.headers.update(ADMIN)
        svc: Services = app.app.state.services  # type: ignore[attr-defined]
        await sync(app, "template", TEMPLATE)
        await sync(
            app, "routing_rule", {"group_id": GROUP, "bot_id": BOT, "template_id": "t-events"}
        )

        # a cold route deploys: Deployed, on this incarnation (describe selects by uid)
        first = await route(app, "s1")
        await sent(svc)
        shown = await described(sim, first)
        assert "Normal" in shown and "Deployed" in shown and "agent-runtime" in shown, shown
        assert "deployed for scope" in shown

        # a killed pod is deleted as dead
        second = await route(app, "s2")
        await sim.kill("default", second, mode="fail")
        assert await svc.pool_jobs.watch_once() == 1
        await sent(svc)
        reasons = [e["reason"] for e in await events_of(sim, second)]
        assert sorted(reasons) == ["DeletedDead", "Deployed"], reasons
        (dead,) = [e for e in await events_of(sim, second) if e["reason"] == "DeletedDead"]
        assert dead["type"] == "Warning" and dead["source"]["host"] == "replica-e"

        # an admin drain: DrainStarted while the pod lives, Drained once its time ran out
        resp = await app.post(f"{BASE}/pods/{first}/drain", json={"deadline_seconds": 1})
        assert resp.status_code == 200, resp.text
        await sent(svc)
        assert "DrainStarted" in await described(sim, first)

        async def drained() -> bool:
            return await svc.pool_jobs.drains.drains_once() >= 1

        await eventually(drained, "the drain's deadline", WAIT)
        await sent(svc)
        reasons = [e["reason"] for e in await events_of(sim, first)]
        assert sorted(reasons) == ["Deployed", "DrainStarted", "Drained"], reasons

        # a warm pod above its plan, idle past pod_ttl: reclaimed
        await sync(app, "template", {**TEMPLATE, "min_idle_pods": 1})
        assert await svc.pool_jobs.autoscale_once() == 1
        await svc.pool_jobs.wait_for_warm_deploys()
        warm = {p["metadata"]["name"] for p in sim.pods("default")} - {first, second}
        warm = {p for p in warm if not (sim.pod("default", p) or {}).get("metadata", {}).get(
            "deletionTimestamp"
        )}  # fmt: skip
        (warm_pod,) = warm
        await sync(app, "template", {**TEMPLATE, "min_idle_pods": 0, "pod_ttl": 1})
        started = time.monotonic()

        async def reclaimed() -> bool:
            return await svc.pool_jobs.reclaim_once() >= 1

        await eventually(reclaimed, "the warm pod's pod_ttl", WAIT)
        assert time.monotonic() - started < WAIT
        await sent(svc)
        reasons = [e["reason"] for e in await events_of(sim, warm_pod)]
        assert "Reclaimed" in reasons and "Deployed" in reasons, reasons

        # a foreign pod with our labels: one event, counted up on every pass
        labels = {COMPONENT_LABEL: COMPONENT_VALUE, SCOPE_LABEL: "someone-else", "app": "x"}
        await real_sim.post_pod(sim, "x-foreign", labels)
        for _ in range(3):
            await svc.pool_jobs.reconcile_once()
        await sent(svc)
        (foreign,) = await events_of(sim, "x-foreign")
        assert (foreign["reason"], foreign["type"], foreign["count"]) == (
            "ForeignPodIgnored", "Warning", 3,
        )  # fmt: skip
        shown = await described(sim, "x-foreign")
        assert "ForeignPodIgnored" in shown and "(x3 over" in shown, shown
        assert any(p["metadata"]["name"] == "x-foreign" for p in sim.pods("default")), (
            "never deleted"
        )
