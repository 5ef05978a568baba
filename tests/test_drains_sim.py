"""Drains against the Kubernetes simulator, through the real client (kubernetes_asyncio) and
the app over the ``redis`` fixture (fakeredis and the real Redis): nodes listed with their
cordons, a graceful deletion with a grace period drained until just before the kill, a
cordoned node's pods drained, and the admin node drain finding a node's pods by
``spec.nodeName``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

import test_k8s_real_sim as real_sim
from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.models import COMPONENT_SELECTOR
from agent_runtime.wiring import Services
from helpers import envelope, running_app, sync_body
from kubesim import KubeSim
from test_scenarios import eventually

# the fixtures of test_k8s_real_sim: no proxy for the local simulator; the real client on `sim`
_direct = real_sim._direct
client = real_sim.client

ADMIN = {"Authorization": "Bearer adm"}
BASE = "/api/session/admin"
GROUP, BOT = "g-drain", "b-drain"
DEADLINE = 30.0


@pytest.fixture
async def sim() -> AsyncIterator[KubeSim]:
    """Two nodes (``client`` from test_k8s_real_sim opens the real client on this one)."""
    async with KubeSim(
        # AgentServers listen on their pod IP's port 8080: a range of this process's own, so
        # another test run on the machine (the default range starts at 127.0.0.2) takes none
        first_pod_ip=f"127.{64 + os.getpid() % 128}.7.2",
        ready_delay=0.1,
        grace_period=0.3,
        probe_period=0.05,
        sse_interval=0.05,
        nodes=2,
        seed=5,
    ) as s:
        yield s


def node_of(sim: KubeSim, pod_id: str) -> str:
    (pod,) = [p for p in sim.pods("default") if p["metadata"]["name"] == pod_id]
    node: str = pod["spec"]["nodeName"]
    return node


async def test_nodes_and_their_cordons_are_read(sim: KubeSim, client: RealK8sPodClient) -> None:
    nodes = {n.name: n.unschedulable for n in await client.list_nodes()}
    assert nodes == {"kubesim-node": False, "kubesim-node-2": False}
    sim.nodes.cordon("kubesim-node-2")
    nodes = {n.name: n.unschedulable for n in await client.list_nodes()}
    assert nodes == {"kubesim-node": False, "kubesim-node-2": True}


async def route(app: httpx.AsyncClient, session: str) -> dict[str, Any]:
    body = envelope(session_id=session, bot_id=BOT, extra={"group_id": GROUP})
    resp = await app.post("/api/session/route", json=body)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()["data"]
    return data


@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_kubernetes_drains_move_sessions_before_the_kill(
    sim: KubeSim, client: RealK8sPodClient, redis: Redis, db: Database
) -> None:
    async with running_app(
        redis,
        db,
        k8s=client,  # type: ignore[arg-type]
        admin_tokens="adm",
        gateway_tokens="adm",
        drain_margin=1.0,
        drain_timeout=2.0,
    ) as app:
        app.headers.update(ADMIN)
        svc: Services = app.app.state.services  # type: ignore[attr-defined]
        template = {
            "template_id": "t-drain", "image": "agentserver:1", "scope_concurrency": 4,
            "pod_concurrency": 1, "ready_timeout": 10, "ready_poll_interval": 0.03,
        }  # fmt: skip
        rule = {"group_id": GROUP, "bot_id": BOT, "template_id": "t-drain"}
        for kind, item in (("template", template), ("routing_rule", rule)):
            resp = await app.post("/api/session/config_sync", json=sync_body(kind, "create", item))
            assert resp.status_code == 200, resp.text
        first = (await route(app, "s1"))["pod_id"]
        second = (await route(app, "s2"))["pod_id"]
        assert {node_of(sim, first), node_of(sim, second)} == {"kubesim-node", "kubesim-node-2"}
        drains = svc.resources._drain_control()

        # a graceful deletion with a 6 s grace: drained, not dead; sessions stay meanwhile
        await sim.delete_pod("default", first, 6, capped=False)
        assert await svc.pool_jobs.watch_once() == 0
        view = (await app.get(f"{BASE}/pods/{first}")).json()["data"]
        assert view["drain"]["trigger"] == "graceful_delete", view
        assert (await route(app, "s1"))["pod_id"] == first
        third = await route(app, "s3")
        assert third["pod_id"] not in (first, second)

        async def moved() -> bool:
            return await drains.drains_once() >= 1

        await eventually(moved, "the graceful deletion's drain deadline", DEADLINE)
        assert any(p["metadata"]["name"] == first for p in sim.pods("default")), (
            "the sessions moved before Kubernetes killed the pod"
        )
        rebound = await route(app, "s1")
        assert rebound["placement"] == "rebound" and rebound["previous_pod_id"] == first

        # a cordon: the node's pods drain with the default timeout (2 s here)
        node = node_of(sim, second)
        sim.nodes.cordon(node)
        assert await svc.pool_jobs.watch_once() == 0
        listed = (await app.get(f"{BASE}/drains")).json()["data"]
        cordoned = {p["pod_id"]: p for p in listed["pods"] if p["trigger"] == "cordon"}
        assert second in cordoned and cordoned[second]["sessions"] == 1
        on_node = {
            p["metadata"]["name"]
            for p in sim.pods("default")
            if p["spec"].get("nodeName") == node and not p["metadata"].get("deletionTimestamp")
        }
        # the admin node drain finds the same pods (already draining: kept as they are)
        resp = await app.post(f"{BASE}/nodes/{node}/drain")
        assert resp.status_code == 200, resp.text
        answered = resp.json()["data"]["pods"]
        assert {p["pod_id"] for p in answered if p["state"] != "deleted"} <= on_node
        assert any(p["pod_id"] == second and p["started"] is False for p in answered)

        async def second_moved() -> bool:
            await drains.drains_once()
            return not any(p["metadata"]["name"] == second for p in sim.pods("default"))

        await eventually(second_moved, "the cordon's drain deadline", DEADLINE)
        rebound = await route(app, "s2")
        assert rebound["placement"] == "rebound" and rebound["previous_pod_id"] == second
        assert node_of(sim, rebound["pod_id"]) != node, "the new pod is not on the cordoned node"
        listed_pods = await client.list_pods("default", COMPONENT_SELECTOR)
        assert second not in {p.pod_id for p in listed_pods}
