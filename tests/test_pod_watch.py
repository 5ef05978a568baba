"""The watch stream (``pod_watch.py``) through the app: a dead pod is cleaned by the stream
alone, its sessions rebound at their next route.

Every app here runs its jobs with the watch pass and reconcile an hour apart (their first
tick runs at start, before any pod exists): only the stream can notice a death in time. The
fake Kubernetes emits an event for every change; ``drop_watches`` ends the open streams,
``compact_watches`` makes a resume 410. On fakeredis and the real Redis, SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.wiring import Services
from contract_keys import rm_pod_known, sm_pods_registered
from helpers import envelope, other_client, running_app, sync_body
from test_scenarios import eventually

pytestmark = pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)

GROUP, BOT = "grp-watch", "bot-1"
DEADLINE = 20.0  # any poll (a loaded machine)
TEMPLATE: dict[str, Any] = {
    "template_id": "tpl-watch",
    "image": "agentserver:1",
    "scope_concurrency": 8,
    "pod_concurrency": 2,
    "session_ttl": 600,
    "pod_ttl": 600,
    "min_idle_pods": 0,
    "ready_timeout": 5,
    "ready_poll_interval": 0.02,
}
# only the stream may notice: the pass and reconcile tick once at start, then in an hour
STREAM_ONLY = {
    "jobs_enabled": True,
    "watch_interval": 3600.0,
    "reconcile_interval": 3600.0,
    "reclaim_interval": 3600.0,
}


@dataclass
class App:
    client: httpx.AsyncClient

    @property
    def svc(self) -> Services:
        services: Services = self.client.app.state.services  # type: ignore[attr-defined]
        return services

    async def configure(self) -> None:
        for kind, item in (
            ("template", TEMPLATE),
            ("routing_rule", {"group_id": GROUP, "bot_id": BOT, "template_id": "tpl-watch"}),
        ):
            resp = await self.client.post(
                "/api/session/config_sync", json=sync_body(kind, "sync", item)
            )
            assert resp.status_code == 200, resp.text

    async def routed(self, session_id: str, **rawdata: Any) -> dict[str, Any]:
        body = envelope(
            rawdata,
            request_id=f"r-{uuid.uuid4().hex[:12]}",
            session_id=session_id,
            bot_id=BOT,
            extra={"group_id": GROUP},
        )
        resp = await self.client.post("/api/session/route", json=body)
        assert resp.status_code == 200, resp.text
        data: dict[str, Any] = resp.json()["data"]
        return data

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of the series of ``name`` that carry ``labels`` (0 when none)."""
        total = 0.0
        for line in (await self.client.get("/metrics")).text.splitlines():
            series, _, value = line.rpartition(" ")
            if series.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
        return total

    async def streaming(self) -> bool:
        streams = await self.metric("agent_runtime_pod_watch_streams")
        return self.svc.pod_watch.leading and streams > 0


@contextlib.asynccontextmanager
async def app(
    redis: Redis, db: Database, k8s: FakeK8sPodClient, **settings: Any
) -> AsyncIterator[App]:
    async with running_app(redis, db, k8s=k8s, **{**STREAM_ONLY, **settings}) as client:
        yield App(client)


async def rebound_from(a: App, session_id: str, dead: str) -> dict[str, Any]:
    """The session's next route, once the dead pod is forgotten: rebound, naming it."""
    redis = a.svc.backends.redis

    async def forgotten() -> bool:  # both sides: the session side is told last
        registered = [
            pod
            async for key in redis.scan_iter(match=sm_pods_registered("*"))
            for pod in await redis.smembers(key)
        ]
        return not await rm_pod_known(redis, dead) and dead not in registered

    await eventually(forgotten, f"the stream cleans {dead}")
    again = await a.routed(session_id)
    assert again["placement"] == "rebound" and again["previous_pod_id"] == dead, again
    assert again["pod_id"] != dead
    return again


@pytest.mark.parametrize("death", ["deleted", "failed", "succeeded", "crash_loop"])
async def test_a_dead_pod_is_cleaned_by_the_stream_alone(
    redis: Redis, db: Database, death: str
) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        await a.configure()
        await eventually(a.streaming, "the replica leads and streams")
        pod = (await a.routed("s1"))["pod_id"]
        assert (await a.routed("s2"))["pod_id"] == pod
        if death == "deleted":
            k8s.remove(pod)  # someone else deleted it
        elif death == "failed":
            k8s.kill(pod)
        elif death == "succeeded":
            k8s.set_phase(pod, "Succeeded")
        else:
            k8s.set_phase(pod, "Running", waiting_reason="CrashLoopBackOff")
        again = await rebound_from(a, "s1", pod)
        assert (await a.routed("s2")) == {**again, "placement": "rebound"}
        assert pod not in k8s.pods, "a dead pod that still exists is deleted"
        assert await a.metric("agent_runtime_dead_pods_cleaned_total", by="stream") == 1
        assert await a.metric("agent_runtime_dead_pods_cleaned_total", by="pass") == 0
        assert (await a.routed("s1"))["placement"] == "refresh"


async def test_a_graceful_deletion_seen_by_the_stream_is_a_drain_not_a_death(
    redis: Redis, db: Database
) -> None:
    """The stream judges as the pass does (``pod_condition``): a pod Kubernetes deletes with
    time left is drained — out of the candidates, its session kept — never cleaned."""
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        await a.configure()
        await eventually(a.streaming, "the replica leads and streams")
        pod = (await a.routed("s1"))["pod_id"]
        k8s.begin_graceful_delete(pod, 600.0)

        async def drained() -> bool:
            return (
                await a.metric("agent_runtime_drains_started_total", trigger="graceful_delete") == 1
            )

        await eventually(drained, "the stream starts the drain")
        assert (await a.routed("s1")) == {**(await a.routed("s1")), "pod_id": pod}
        assert (await a.routed("s1"))["placement"] == "refresh", "its session stays"
        assert (await a.routed("s2"))["pod_id"] != pod, "no new session on a draining pod"
        assert await a.metric("agent_runtime_dead_pods_cleaned_total") == 0
        assert pod in k8s.pods


async def test_a_live_pod_changing_is_left_alone(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        await a.configure()
        await eventually(a.streaming, "the replica leads and streams")
        pod = (await a.routed("s1"))["pod_id"]
        seen = await a.metric("agent_runtime_pod_watch_events_total")
        k8s.set_phase(pod, "Running", ready=False)  # not Ready is not dead (the pass probes)
        k8s.set_phase(pod, "Running")

        async def both_seen() -> bool:
            return await a.metric("agent_runtime_pod_watch_events_total") >= seen + 2

        await eventually(both_seen, "the stream sees both changes")
        assert (await a.routed("s1")) == {**(await a.routed("s1")), "pod_id": pod}
        assert (await a.routed("s1"))["placement"] == "refresh"
        assert await a.metric("agent_runtime_dead_pods_cleaned_total") == 0


async def test_a_dropped_stream_resumes_and_still_sees_deaths(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        await a.configure()
        await eventually(a.streaming, "the replica leads and streams")
        pod = (await a.routed("s1"))["pod_id"]
        relists = await a.metric("agent_runtime_pod_watch_relists_total")
        k8s.drop_watches()

        async def resumed() -> bool:
            return await a.metric("agent_runtime_pod_watch_restarts_total", reason="ended") >= 1

        await eventually(resumed, "the dropped stream ends")
        k8s.kill(pod)
        await rebound_from(a, "s1", pod)
        # resumed from its resourceVersion: no LIST was needed
        assert await a.metric("agent_runtime_pod_watch_relists_total") == relists


async def test_a_410_lists_again_and_finds_a_death_missed_while_disconnected(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        await a.configure()
        await eventually(a.streaming, "the replica leads and streams")
        pod = (await a.routed("s1"))["pod_id"]
        relists = await a.metric("agent_runtime_pod_watch_relists_total")
        # in one go (no await between): the stream is cut, the pod dies, and the history
        # that would have told it is compacted; the resume gets 410
        k8s.drop_watches()
        k8s.kill(pod)
        k8s.compact_watches()
        await rebound_from(a, "s1", pod)
        assert await a.metric("agent_runtime_pod_watch_restarts_total", reason="expired") >= 1
        assert await a.metric("agent_runtime_pod_watch_relists_total") >= relists + 1
        assert await a.metric("agent_runtime_dead_pods_cleaned_total", by="stream") == 1


async def test_a_refused_watch_is_retried_with_a_list(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s) as a:
        await a.configure()
        await eventually(a.streaming, "the replica leads and streams")
        pod = (await a.routed("s1"))["pod_id"]
        k8s.watches_refused = True
        k8s.drop_watches()

        async def refused() -> bool:
            return await a.metric("agent_runtime_pod_watch_restarts_total", reason="error") >= 1

        await eventually(refused, "the refused watch is counted")
        k8s.kill(pod)  # while no stream is open: the next LIST finds it
        k8s.watches_refused = False
        await rebound_from(a, "s1", pod)


async def test_another_replica_takes_over_when_the_leader_stops(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    first_redis, second_redis = other_client(redis), other_client(redis)
    try:
        async with contextlib.AsyncExitStack() as first_stack:
            a = await first_stack.enter_async_context(
                app(first_redis, db, k8s, instance_id="replica-a")
            )
            await a.configure()
            await eventually(a.streaming, "replica a leads (it started first)")
            async with app(second_redis, db, k8s, instance_id="replica-b") as b:
                await asyncio.sleep(1.5)  # b tried to take the lock a few times meanwhile
                assert not b.svc.pod_watch.leading, "one leader at a time"
                assert await b.metric("agent_runtime_pod_watch_streams") == 0
                pod = (await b.routed("s1"))["pod_id"]
                await first_stack.aclose()  # the leader stops
                await eventually(b.streaming, "replica b takes the streams over")
                k8s.kill(pod)
                await rebound_from(b, "s1", pod)
                assert await b.metric("agent_runtime_dead_pods_cleaned_total", by="stream") == 1
    finally:
        await first_redis.aclose()
        await second_redis.aclose()


async def test_the_stream_can_be_turned_off(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    async with app(redis, db, k8s, pod_watch_stream=False) as a:
        await a.configure()
        pod = (await a.routed("s1"))["pod_id"]
        k8s.kill(pod)
        await asyncio.sleep(1.5)  # the stream would have cleaned it by now
        assert not a.svc.pod_watch.leading
        assert (await a.routed("s1"))["pod_id"] == pod, "only the pass cleans: an hour away"
        assert await a.svc.pool_jobs.watch_once() == 1
        assert (await a.routed("s1"))["placement"] == "rebound"
