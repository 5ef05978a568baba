"""Drains through the public interface: the admin calls (a pod, a node), Kubernetes' graceful
deletion and a node cordon seen by the watch, the floor's replacement warmed first, the admin
view and the metrics — over fakeredis and the real Redis, with the fake Kubernetes, jobs
ticked by hand (the pure reading of a pod's state: test_pod_condition.py).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from contract_keys import rm_draining_pods, rm_pod, rm_pod_scope, sm_scope
from helpers import running_app
from test_scenarios import SCOPE, World, eventually

pytestmark = pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)

ADMIN = {"Authorization": "Bearer adm-tok"}
GATEWAY = {"Authorization": "Bearer gw-tok"}
BASE = "/api/session/admin"


class DrainWorld(World):
    """The scenarios' world, with the admin token on every call."""

    async def drain(self, pod_id: str, body: Any = None, *, status: int = 200) -> dict[str, Any]:
        resp = await self.client.post(f"{BASE}/pods/{pod_id}/drain", json=body, headers=ADMIN)
        assert resp.status_code == status, resp.text
        answer: dict[str, Any] = resp.json()
        assert answer["ok"] is (status == 200), answer
        return answer["data"] if status == 200 else answer

    async def pod_view(self, pod_id: str) -> dict[str, Any]:
        resp = await self.client.get(f"{BASE}/pods/{pod_id}", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        view: dict[str, Any] = resp.json()["data"]
        return view

    async def drains_tick(self) -> int:
        return await self.svc.resources._drain_control().drains_once()


def drain_world(redis: Redis, db: Database, **settings: Any) -> Any:
    """The app with admin (and gateway) token ``adm-tok``, sent with every request."""

    @asynccontextmanager
    async def opened() -> Any:
        async with running_app(
            redis, db, admin_tokens="adm-tok", gateway_tokens="adm-tok", **settings
        ) as client:
            client.headers.update(ADMIN)
            yield DrainWorld(client, redis)

    return opened()


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as exposed
    line = f"{name}{{{wanted}}}" if labels else name
    for row in text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


# --- the admin drain of a pod ------------------------------------------------------------------


async def test_a_drained_pod_takes_no_new_session_keeps_its_own_until_the_deadline(
    redis: Redis, db: Database
) -> None:
    async with drain_world(redis, db) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=2)
        old = (await w.routed("s1"))["pod_id"]
        answer = await w.drain(old, {"deadline_seconds": 300})
        assert answer["pod_id"] == old and answer["state"] == "draining"
        assert answer["trigger"] == "admin" and answer["started"] is True
        assert answer["sessions"] == 1 and 290 < answer["deadline_in"] <= 300
        assert old not in await w.candidates()

        # a new session goes elsewhere (a deploy), the old one stays where it is
        new = await w.routed("s2")
        assert new["placement"] == "placed" and new["pod_id"] != old
        stays = await w.routed("s1")
        assert stays["placement"] == "refresh" and stays["pod_id"] == old
        assert await w.drains_tick() == 0
        assert old in w.k8s.pods

        # the view: state, deadline and what it still carries
        view = await w.pod_view(old)
        assert view["drain"]["state"] == "draining" and view["drain"]["trigger"] == "admin"
        listed = (await w.client.get(f"{BASE}/drains")).json()["data"]
        assert listed["count"] == 1 and listed["pods"][0]["pod_id"] == old
        assert listed["pods"][0]["sessions"] == 1 and listed["pods"][0]["scope_id"] == SCOPE
        metrics = (await w.client.get("/metrics")).text
        assert metric(metrics, "agent_runtime_pods", state="draining") == 1
        assert metric(metrics, "agent_runtime_drains_started_total", trigger="admin") == 1

        # again, sooner: the drain under way keeps going, its deadline comes forward
        again = await w.drain(old, {"deadline_seconds": 1})
        assert again["started"] is False and again["deadline"] < answer["deadline"]
        later = await w.drain(old)  # the default (300 s) never pushes it back
        assert later["deadline"] == again["deadline"]

        async def drained() -> bool:
            return await w.drains_tick() == 1

        await eventually(drained, "the drained pod's deadline passes")
        assert old in w.k8s.deleted and old not in w.k8s.pods
        await w.assert_pod_forgotten(old)
        r1 = await w.routed("s1")
        assert r1["placement"] == "rebound" and r1["previous_pod_id"] == old
        assert r1["pod_id"] != old
        assert await rm_draining_pods(redis) == {}
        metrics = (await w.client.get("/metrics")).text
        assert (
            metric(
                metrics, "agent_runtime_drains_finished_total", trigger="admin", outcome="deadline"
            )
            == 1
        )
        assert metric(metrics, "agent_runtime_pods", state="draining") == 0
        resp = await w.client.get(f"{BASE}/pods/{old}")
        assert resp.status_code == 404
        await w.assert_consistent()


async def test_an_empty_pod_is_deleted_at_once(redis: Redis, db: Database) -> None:
    async with drain_world(redis, db) as w:
        await w.configure()
        pod = (await w.routed("s1"))["pod_id"]
        await w.touch("s1", eos=True)
        answer = await w.drain(pod)
        assert answer["state"] == "deleted" and answer["sessions"] == 0
        assert pod in w.k8s.deleted
        await w.assert_pod_forgotten(pod)
        # idempotent: the pod is gone now, so a second drain is told so
        assert (await w.drain(pod, status=404))["error_code"] == "NOT_FOUND"


async def test_a_session_that_ends_lets_its_drained_pod_go(redis: Redis, db: Database) -> None:
    async with drain_world(redis, db) as w:
        await w.configure()
        pod = (await w.routed("s1"))["pod_id"]
        assert (await w.drain(pod))["state"] == "draining"
        await w.touch("s1", eos=True)
        assert await w.drains_tick() == 1
        assert pod in w.k8s.deleted
        metrics = (await w.client.get("/metrics")).text
        labels = {"trigger": "admin", "outcome": "empty"}
        assert metric(metrics, "agent_runtime_drains_finished_total", **labels) == 1


async def test_a_warm_pod_the_floor_needs_is_replaced_before_it_drains(
    redis: Redis, db: Database
) -> None:
    async with drain_world(redis, db) as w:
        await w.configure(min_idle_pods=1, scope_concurrency=4, pod_concurrency=1)
        await w.routed("s1")  # the scope's first route writes its pool config
        assert await w.autoscale() == 1
        (warm,) = await w.warm()
        answer = await w.drain(warm)
        assert answer["state"] == "pending" and answer["started"] is True
        # it still serves while its replacement comes up, and is not drained yet
        assert await w.drains_tick() == 0
        assert warm not in w.k8s.deleted
        assert await w.autoscale() == 1  # the pending pod counts for no floor
        assert await w.drains_tick() == 1  # the floor holds without it now
        assert warm in w.k8s.deleted
        idle = await w.warm()
        assert len(idle) == 1 and warm not in idle
        assert await w.autoscale() == 0


async def test_a_replacement_that_cannot_come_holds_the_drain_only_a_deploy_time(
    redis: Redis, db: Database
) -> None:
    """At max_pods the replacement cannot be deployed while the old pod exists: the pending
    drain goes on after the template's ready_timeout + 10 s, and autoscale refills after."""
    async with drain_world(redis, db) as w:
        await w.configure(min_idle_pods=1, scope_concurrency=1, pod_concurrency=1)  # max_pods 1
        pod = (await w.routed("s1"))["pod_id"]
        await w.touch("s1", eos=True)
        await w.age_pod(pod)
        await w.sweep()  # empty: handed back to the warm pool
        assert await w.warm() == {pod}
        assert (await w.drain(pod))["state"] == "pending"
        assert await w.autoscale() == 0  # no room for a replacement
        assert await w.drains_tick() == 0
        drain_key = rm_pod(str(await rm_pod_scope(redis, pod)), pod, "drain")
        since = float(await redis.hget(drain_key, "since") or 0)
        await redis.hset(drain_key, "since", f"{since - 13:.6f}")  # ready_timeout 2 + 10 s ago
        assert await w.drains_tick() == 1
        assert pod in w.k8s.deleted
        assert await w.autoscale() == 1
        assert len(await w.warm()) == 1


async def test_a_pod_in_use_drains_without_a_replacement(redis: Redis, db: Database) -> None:
    async with drain_world(redis, db) as w:
        await w.configure(min_idle_pods=1, scope_concurrency=4, pod_concurrency=1)
        pod = (await w.routed("s1"))["pod_id"]
        assert (await w.drain(pod))["state"] == "draining"


# --- a node ------------------------------------------------------------------------------------


async def test_a_node_drain_drains_every_pod_of_ours_on_it(redis: Redis, db: Database) -> None:
    async with drain_world(redis, db, k8s=FakeK8sPodClient(nodes=2)) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=1)
        pods = [(await w.routed(f"s{i}"))["pod_id"] for i in range(4)]
        on_node = {p for p in pods if w.k8s.pods[p].node == "fake-node-0"}
        assert 0 < len(on_node) < 4
        resp = await w.client.post(f"{BASE}/nodes/fake-node-0/drain", json={"deadline_seconds": 60})
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
        assert data["node"] == "fake-node-0"
        assert {p["pod_id"] for p in data["pods"]} == on_node
        assert all(p["state"] == "draining" and p["sessions"] == 1 for p in data["pods"])
        assert set(await w.candidates()).isdisjoint(on_node)
        resp = await w.client.post(f"{BASE}/nodes/no-such-node/drain")
        assert resp.status_code == 200 and resp.json()["data"]["pods"] == []
        for bad in ("Upper", "-dash", "a" * 254, "a_b"):
            resp = await w.client.post(f"{BASE}/nodes/{bad}/drain")
            assert resp.status_code == 400, (bad, resp.text)
            assert resp.json()["error_code"] == "VALIDATION"
        w.k8s.unreachable_clusters.add(None)
        resp = await w.client.post(f"{BASE}/nodes/fake-node-1/drain")
        assert resp.status_code == 502 and resp.json()["error_code"] == "K8S_ERROR"
        w.k8s.unreachable_clusters.clear()
        assert len(await w.svc.resource_views.drains(200)) == 2


# --- Kubernetes drains a pod by itself ---------------------------------------------------------


async def test_a_graceful_deletion_drains_until_kubernetes_kills_the_pod(
    redis: Redis, db: Database
) -> None:
    async with drain_world(redis, db, drain_margin=1.0) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=2)
        old = (await w.routed("s1"))["pod_id"]
        w.k8s.begin_graceful_delete(old, 4.0)
        kill_at = w.k8s.pods[old].deletion_at
        assert kill_at is not None
        assert await w.svc.pool_jobs.watch_once() == 0  # not dead: draining
        drain = (await w.pod_view(old))["drain"]
        assert drain["trigger"] == "graceful_delete" and drain["state"] == "draining"
        assert abs(drain["deadline"] - (kill_at - 1.0)) < 0.01
        assert (await w.routed("s1"))["pod_id"] == old  # its session stays meanwhile
        assert (await w.routed("s2"))["pod_id"] != old
        assert await w.svc.pool_jobs.watch_once() == 0  # seen again: nothing new

        async def drained() -> bool:
            return await w.drains_tick() == 1

        await eventually(drained, "the graceful deletion's deadline passes")
        r1 = await w.routed("s1")
        assert r1["placement"] == "rebound" and r1["previous_pod_id"] == old
        metrics = (await w.client.get("/metrics")).text
        assert metric(metrics, "agent_runtime_drains_started_total", trigger="graceful_delete") == 1


async def test_a_deletion_without_time_left_is_a_death(redis: Redis, db: Database) -> None:
    async with drain_world(redis, db, drain_margin=5.0) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=2)
        old = (await w.routed("s1"))["pod_id"]
        w.k8s.begin_graceful_delete(old, 2.0)  # less than the margin: no time to move
        assert await w.svc.pool_jobs.watch_once() == 1
        r1 = await w.routed("s1")
        assert r1["placement"] == "rebound" and r1["previous_pod_id"] == old


async def test_a_cordoned_node_drains_its_pods(redis: Redis, db: Database) -> None:
    async with drain_world(redis, db, drain_timeout=1.0, k8s=FakeK8sPodClient(nodes=2)) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=1)
        first = (await w.routed("s1"))["pod_id"]
        second = (await w.routed("s2"))["pod_id"]
        node = w.k8s.pods[first].node
        assert w.k8s.pods[second].node != node
        w.k8s.cordon(node)
        assert await w.svc.pool_jobs.watch_once() == 0
        drain = (await w.pod_view(first))["drain"]
        assert drain["trigger"] == "cordon" and drain["state"] == "draining"
        assert "drain" not in await w.pod_view(second)
        w.k8s.uncordon(node)  # a drain under way goes on (documented)

        async def drained() -> bool:
            return await w.drains_tick() == 1

        await eventually(drained, "the cordon's default deadline passes")
        r1 = await w.routed("s1")
        assert r1["placement"] == "rebound" and r1["previous_pod_id"] == first
        assert (await w.routed("s2"))["placement"] == "refresh"


async def test_nodes_the_service_may_not_read_only_hide_cordons(redis: Redis, db: Database) -> None:
    async with drain_world(redis, db) as w:
        await w.configure()
        pod = (await w.routed("s1"))["pod_id"]
        w.k8s.nodes_forbidden = True
        w.k8s.cordon(w.k8s.pods[pod].node)
        assert await w.svc.pool_jobs.watch_once() == 0
        assert "drain" not in await w.pod_view(pod)
        w.k8s.kill(pod)  # the rest of the watch goes on
        assert await w.svc.pool_jobs.watch_once() == 1


# --- refusals ----------------------------------------------------------------------------------


async def test_drain_refusals(redis: Redis, db: Database) -> None:
    async with drain_world(redis, db) as w:
        await w.configure()
        pod = (await w.routed("s1"))["pod_id"]
        for headers in ({}, {"Authorization": "Bearer nope"}):
            resp = await w.client.post(
                f"{BASE}/pods/{pod}/drain", headers={"Authorization": "", **headers}
            )
            assert resp.status_code == 401 and resp.json()["error_code"] == "UNAUTHORIZED"
        assert (await w.drain("no-such-pod", status=404))["error_code"] == "NOT_FOUND"
        for body in (
            {"deadline_seconds": -1},
            {"deadline_seconds": 86_401},
            {"deadline_seconds": "5"},
            {"deadline_seconds": 1.5},
            {"other": 1},
            [1],
        ):
            answer = await w.drain(pod, body, status=400)
            assert answer["error_code"] == "VALIDATION", body
        resp = await w.client.post(f"{BASE}/pods/{pod}/drain", content=b"{not json")
        assert resp.status_code == 400
        resp = await w.client.post(f"{BASE}/pods/{pod}/drain?x=1")
        assert resp.status_code == 400
        assert "drain" not in await w.pod_view(pod)  # a refused call changed nothing
        # a foreign pod (our labels, no identity) that reconcile reported: never drained
        foreign = w.k8s.add_pod(scope_id=SCOPE, deploy_ver="v0")
        await w.svc.pool_jobs.reconcile_once()
        answer = await w.drain(foreign.pod_id, status=409)
        assert answer["error_code"] == "CONFLICT"
        assert foreign.pod_id in w.k8s.pods


async def test_the_drain_calls_are_documented(redis: Redis, db: Database) -> None:
    async with drain_world(redis, db) as w:
        schema = (await w.client.get("/openapi.json")).json()
        for path in (f"{BASE}/pods/{{pod_id}}/drain", f"{BASE}/nodes/{{node}}/drain"):
            op = schema["paths"][path]["post"]
            assert op["requestBody"]["required"] is False
            assert {"200", "400", "401"} <= set(op["responses"])
        pod_drain = schema["paths"][f"{BASE}/pods/{{pod_id}}/drain"]["post"]["responses"]
        assert {"404", "409"} <= set(pod_drain)
        assert "502" in schema["paths"][f"{BASE}/nodes/{{node}}/drain"]["post"]["responses"]
        assert "get" in schema["paths"][f"{BASE}/drains"]


async def test_a_drained_pod_stays_out_of_the_sweep_and_reconcile(
    redis: Redis, db: Database
) -> None:
    """The sweeper's hand-back and reconcile's release never return a draining pod."""
    async with drain_world(redis, db) as w:
        await w.configure()
        pod = (await w.routed("s1"))["pod_id"]
        await w.drain(pod, {"deadline_seconds": 300})
        await w.age_pod(pod)
        for _ in range(2):
            await w.sweep()
            await w.svc.pool_jobs.reconcile_once()
        assert not await redis.sismember(f"resource_manager:resource:scope:{{{SCOPE}}}:idle", pod)
        assert await redis.zscore(sm_scope(SCOPE, "pods"), pod) is None
        assert (await w.routed("s1"))["pod_id"] == pod
