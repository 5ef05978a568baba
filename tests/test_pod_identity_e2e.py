"""A full Redis data loss under real processes: ``agent-runtime serve --mode server`` over the
real Redis and MariaDB, its Kubernetes ``agent-runtime kubesim`` (each its own process, as
``test_server_e2e.py`` starts them), the pod identity secret left unset (so the one the
installation generated into the DB is the one in use).

Sessions are placed on several scopes with a warm floor, a pod that is not ours is created
with our labels and a copy of one of our pods' annotations, then the claimed Redis db is
wiped (FLUSHDB) while the server runs. Reconcile (every 0.5 s) must adopt every pod of ours
and delete none, leave the foreign one, and the sessions routed again must land on the
adopted pods without a deploy. The numbers (pods before, adopted, deleted) are printed; they
are the ones docs/operations.md gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from agent_runtime.util import scope_id_of
from contract_keys import rm_pods_known
from helpers import CLAIM_KEY, envelope, sync_body
from test_local_mode import free_port
from test_server_e2e import Stack, serving

pytestmark = pytest.mark.timeout(180)

ADMIN_TOKEN, GATEWAY_TOKEN = "e2e-admin", "e2e-gateway"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
GATEWAY = {"authorization": f"Bearer {GATEWAY_TOKEN}"}
SETTINGS = {
    "AGENT_RUNTIME_ADMIN_TOKENS": ADMIN_TOKEN,
    "AGENT_RUNTIME_GATEWAY_TOKENS": GATEWAY_TOKEN,
    "AGENT_RUNTIME_DEFAULT_NAMESPACE": "default",
    "AGENT_RUNTIME_SWEEP_INTERVAL": "0.2",
    "AGENT_RUNTIME_AUTOSCALE_INTERVAL": "0.2",
    "AGENT_RUNTIME_RECLAIM_INTERVAL": "0.2",
    "AGENT_RUNTIME_WATCH_INTERVAL": "0.25",
    "AGENT_RUNTIME_RECONCILE_INTERVAL": "0.5",
    "AGENT_RUNTIME_SHUTDOWN_TIMEOUT": "10",
}
SCOPES = 4
SESSIONS = 3  # per scope, pod_concurrency 1: a pod each, and the warm floor of 1 on top
DEADLINE = 30.0
BOT = "bot-1"
SCOPE_LABEL = "agent-runtime/scope"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with contextlib.ExitStack() as undo:
        running = serving(tmp_path_factory.mktemp("e2e-data-loss"), "mariadb", SETTINGS, undo)
        yield running
        assert running.server is not None
        stopped = running.server.stop(), running.server.killed
    assert stopped == (0, False), f"SIGTERM: (exit status, killed) {stopped}"


@dataclass
class World:
    stack: Stack
    http: httpx.AsyncClient
    sim: httpx.AsyncClient
    redis: Redis
    tag: str

    def group(self, i: int) -> str:
        return f"grp-loss-{self.tag}-{i}"

    async def eventually(self, check: Any, what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not await check():
            if time.monotonic() > deadline:
                pytest.fail(
                    f"not within {DEADLINE:g} s: {what}\n{self.stack.server.log()[-20000:]}"
                )
            await asyncio.sleep(0.1)

    async def route(self, i: int, session: str) -> dict[str, Any]:
        body = envelope(
            request_id=f"r-{uuid.uuid4().hex[:10]}", session_id=f"{session}-{self.tag}",
            bot_id=BOT, extra={"group_id": self.group(i)},
        )  # fmt: skip
        resp = await self.http.post("/api/session/route", json=body, headers=GATEWAY)
        assert resp.status_code == 200, resp.text
        data: dict[str, Any] = resp.json()["data"]
        return data

    async def pods(self) -> dict[str, dict[str, Any]]:
        """Our scopes' pods in Kubernetes (those being deleted included), by name."""
        scopes = {scope_id_of(self.group(i), BOT) for i in range(SCOPES)}
        resp = await self.sim.get("/_sim/state")
        assert resp.status_code == 200, resp.text
        return {p["name"]: p for p in resp.json()["pods"] if p["labels"].get(SCOPE_LABEL) in scopes}


@pytest.fixture
async def w(stack: Stack) -> AsyncIterator[World]:
    async with (
        httpx.AsyncClient(base_url=stack.base_url, timeout=30, trust_env=False) as http,
        httpx.AsyncClient(base_url=stack.sim_url, timeout=10, trust_env=False) as sim,
    ):
        redis = Redis.from_url(stack.redis_url, decode_responses=True)
        try:
            yield World(stack, http, sim, redis, uuid.uuid4().hex[:6])
        finally:
            await redis.aclose()


async def flushdb(redis: Redis) -> None:
    """Redis loses its data: FLUSHDB of the db this test process claimed (marker kept)."""
    me = f"{socket.gethostname()}:{os.getpid()}"
    assert await redis.get(CLAIM_KEY) == me, "never flush a db that is not ours"
    async with redis.pipeline(transaction=True) as pipe:
        pipe.flushdb()
        pipe.set(CLAIM_KEY, me)
        await pipe.execute()


async def test_a_full_redis_data_loss_adopts_every_pod_of_ours_and_deletes_none(w: World) -> None:
    sse_port = free_port()
    template = {
        "template_id": f"tpl-loss-{w.tag}", "image": "agentserver:1", "pod_name": "e2e-loss",
        "container_port": sse_port, "sse_port": sse_port, "sse_path": "/sse",
        "scope_concurrency": 8, "pod_concurrency": 1, "session_ttl": 120, "pod_ttl": 300,
        "min_idle_pods": 1, "ready_timeout": 10, "ready_poll_interval": 0.05,
    }  # fmt: skip
    resp = await w.http.post(
        "/api/session/config_sync", json=sync_body("template", "sync", template), headers=ADMIN
    )
    assert resp.status_code == 200, resp.text
    for i in range(SCOPES):
        rule = {"group_id": w.group(i), "bot_id": BOT, "template_id": template["template_id"]}
        resp = await w.http.post(
            "/api/session/config_sync", json=sync_body("routing_rule", "sync", rule), headers=ADMIN
        )
        assert resp.status_code == 200, resp.text
    placed: dict[tuple[int, int], str] = {}
    for i in range(SCOPES):
        for n in range(SESSIONS):
            placed[(i, n)] = (await w.route(i, f"s{i}-{n}"))["pod_id"]
    expected = SCOPES * (SESSIONS + 1)

    async def warm_floors() -> bool:
        live = [p for p in (await w.pods()).values() if not p["deleting"] and p["ready"]]
        return len(live) == expected

    await w.eventually(warm_floors, f"{expected} pods: sessions' and each scope's warm one")
    before = set(await w.pods())
    # a pod that is not ours, with our labels and a copy of one of our pods' annotations
    stolen = (await w.sim.get(f"/api/v1/namespaces/default/pods/{placed[(0, 0)]}")).json()
    foreign = f"x-loss-{w.tag}"
    body = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": foreign, "labels": {**stolen["metadata"]["labels"], "app": foreign},
            "annotations": stolen["metadata"]["annotations"],
        },
        "spec": {"containers": [{"name": "agentserver", "image": "attacker/agent",
                                 "ports": [{"containerPort": sse_port}]}]},
    }  # fmt: skip
    resp = await w.sim.post("/api/v1/namespaces/default/pods", json=body)
    assert resp.status_code == 201, resp.text
    creates = (await w.sim.get("/_sim/state")).json()["requests"].get("create pods", 0)

    await flushdb(w.redis)
    started = time.monotonic()

    async def adopted() -> bool:
        return set(await rm_pods_known(w.redis)) >= before

    await w.eventually(adopted, "reconcile adopts every pod of ours")
    seconds = time.monotonic() - started
    # a few more passes: nothing of ours is deleted afterwards either
    await asyncio.sleep(1.5)
    now = await w.pods()
    deleted = {p for p in before if p not in now or now[p]["deleting"]}
    registered = set(await rm_pods_known(w.redis))
    print(
        f"\nredis data loss: {len(before)} pods of ours before, {len(before & registered)} "
        f"adopted, {len(deleted)} deleted, foreign left: {foreign in now} "
        f"(adopted within {seconds:.1f} s, reconcile every 0.5 s)"
    )
    assert deleted == set() and before <= registered
    assert foreign in now and foreign not in registered

    # the gateway routes its sessions again: onto the adopted pods, nothing deployed
    for i, n in placed:
        data = await w.route(i, f"s{i}-{n}")
        assert data["placement"] == "placed" and data["pod_id"] in before
        assert data["pod_id"] != foreign
    await asyncio.sleep(1.0)  # autoscale ticks: the warm floors are the adopted pods
    state = (await w.sim.get("/_sim/state")).json()
    assert state["requests"].get("create pods", 0) == creates, "no deploy after the loss"
    report = (await w.http.get("/api/session/admin/foreign_pods", headers=ADMIN)).json()["data"]
    assert foreign in {p["pod_id"] for p in report["pods"]}
    metrics = (await w.http.get("/metrics")).text
    assert 'agent_runtime_reconcile_pods_total{action="adopted"}' in metrics

    scopes = ",".join(sorted(scope_id_of(w.group(i), BOT) for i in range(SCOPES)))
    selector = {"label_selector": f"{SCOPE_LABEL} in ({scopes})"}
    resp = await w.http.post("/api/session/cleanup", json=envelope(selector), headers=ADMIN)
    assert resp.status_code == 200, resp.text
    assert resp.json()["data"]["cleaned"] == len(before) + 1, "ours and the foreign one"
