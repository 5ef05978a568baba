"""Issue 14 §2 at the HTTP edge, two replicas over one Redis: every kind of waiting route —
the wait queue, a follower room, a route waiting on its own deploy — is answered 503
BACKEND_UNAVAILABLE + Retry-After at its replica's stop signal, while the deploy it waited
for is still held back (never an HTTP 500, never a wait for the deploy); and a route waits
for a pod at most its own deadline, once, and says how long."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from contract_keys import rm_pods_known, rm_scope, sm_scope
from helpers import GatedK8s, deploy_locks, follower_seats, real_mariadb_and_fake
from test_route_concurrency import (
    SID,
    assert_error,
    assert_nothing_held,
    configure,
    eventually,
    route,
    seated,
    two_replicas,
)


async def reservations(redis: Redis) -> int:
    return int(await redis.zcard(sm_scope(SID, "reserved")))


@real_mariadb_and_fake
async def test_every_waiting_route_is_answered_503_at_its_replica_s_stop_signal(
    redis: Redis, db: Database
) -> None:
    k8s = GatedK8s()
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=30.0) as reps:
        # max_pods 2, pods of 2: two deploys, each with a follower room of one; then the queue
        await configure(reps.a, scope_concurrency=4, pod_concurrency=2)
        calls: dict[str, asyncio.Task[httpx.Response]] = {}

        def start(client: httpx.AsyncClient, name: str) -> None:
            calls[name] = asyncio.create_task(route(client, name, f"r-{name}"))

        start(reps.b, "b-leader")  # leads: waits on its own deploy
        await eventually(lambda: _has(deploy_locks(redis, SID), 1), what="a deploy leader")
        view = await reps.a.get(f"/api/session/admin/scopes/{SID}")  # who leads, for operators
        assert view.json()["data"]["pool"]["deploy_leader"].startswith("replica-b/"), view.text
        start(reps.a, "a-follower")  # a's route follows b's deploy: its follower room
        await eventually(lambda: _has(follower_seats(redis, SID), 1), what="a follower")
        start(reps.a, "a-leader")  # the room is full: a second deploy, a's own
        await eventually(lambda: _has(deploy_locks(redis, SID), 2), what="a second leader")
        start(reps.b, "b-follower")  # follows a's deploy
        await eventually(lambda: _has(follower_seats(redis, SID), 2), what="a second follower")
        start(reps.a, "a-queued")  # the scope is full of reservations: the wait queue
        await eventually(lambda: seated(redis, "r-a-queued"), what="a queued route")

        for replica, names in ((reps.a, ("a-follower", "a-leader", "a-queued")),
                               (reps.b, ("b-leader", "b-follower"))):  # fmt: skip
            reps.services(replica).drain()  # what SIGTERM starts (cli: DrainingServer)
            answers = await asyncio.gather(*(asyncio.wait_for(calls[n], 10) for n in names))
            assert not k8s.gate.is_set() and k8s.pods == {}, "answered without the deploy"
            for name, answer in zip(names, answers, strict=True):
                assert_error(answer, "BACKEND_UNAVAILABLE")
                assert answer.json()["request_id"] == f"r-{name}", name

        # the seats and reservations went with the answers; the drained followers left their
        # rooms at their next look; only the deploys themselves still hold their leases
        assert await redis.zcard(sm_scope(SID, "waiters")) == 0
        assert await reservations(redis) == 0
        await eventually(lambda: _has(follower_seats(redis, SID), 0), what="the rooms empty")
        assert len(await deploy_locks(redis, SID)) == 2
        k8s.gate.set()  # the deploys finish in the background: their pods are kept, not leaked

        async def deployed() -> bool:
            return len(k8s.pods) == 2 and not await deploy_locks(redis, SID)

        await eventually(deployed, within=10, what="the deploys finished")
        known = set(await rm_pods_known(redis))
        assert set(k8s.pods) <= set(known), "a deployed pod nobody tracks"
        await assert_nothing_held(redis)


@real_mariadb_and_fake
async def test_a_route_waits_for_its_pod_once_and_says_how_long(redis: Redis, db: Database) -> None:
    """ready_timeout 1: a route waits at most 1 + 10 s from its first ask for a pod — the
    leader on its own deploy, a follower on another replica and one on its own —
    and the answer says how long it waited (not a second round, not a number it did not wait)."""
    k8s = GatedK8s()
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=30.0) as reps:
        await configure(reps.a, scope_concurrency=4, pod_concurrency=2, ready_timeout=1)

        async def timed(client: httpx.AsyncClient, name: str) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            answer = await route(client, name)
            return answer, time.monotonic() - started

        lead = asyncio.create_task(timed(reps.a, "lead"))
        await eventually(lambda: _has(deploy_locks(redis, SID), 1), what="a deploy leader")
        others = [timed(reps.a, "follower-a"), timed(reps.b, "follower-b")]
        answers = await asyncio.gather(lead, *others)
        for answer, took in answers:
            assert_error(answer, "NO_POD_AVAILABLE")
            message = answer.json()["error_message"]
            waited = int(message.split("waited ")[1].split(" s")[0])
            assert abs(waited - took) <= 1, f"{message}, but it took {took:.1f} s"
            assert took < 2 * 11, f"{took:.1f} s: a route waited the deploy time twice"
        assert answers[0][1] >= 11, "the leader's route waits its whole deadline"
        k8s.gate.set()
        await eventually(lambda: _eq(redis.scard(rm_scope(SID, "deploying")), 0), within=10)
        await assert_nothing_held(redis)


@real_mariadb_and_fake
async def test_routes_waiting_on_a_deploy_give_back_their_places_while_they_wait(
    redis: Redis, db: Database
) -> None:
    """The stop-signal guard runs in the route's own task: the leader waiting on its deploy
    and the followers waiting in its room all park their in-flight places while they wait
    (a burst's K leaders and their followers would fill max_in_flight), and the drain still
    answers all of them."""
    k8s = GatedK8s()
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=30.0, max_in_flight=8) as reps:
        await configure(reps.a, scope_concurrency=4, pod_concurrency=4)
        calls = [asyncio.create_task(route(reps.a, f"s-{i}", f"r-s-{i}")) for i in range(3)]
        await eventually(lambda: _ge(reservations(redis), 3), what="a leader and two followers")
        # the leader waits on its deploy, the followers on the leader: none holds a place
        await eventually(lambda: _gauge_is(reps.a, "agent_runtime_http_parked", 3))
        assert await _gauge(reps.a, "agent_runtime_http_in_flight") == 0
        reps.services(reps.a).drain()
        for answer in await asyncio.gather(*(asyncio.wait_for(c, 10) for c in calls)):
            assert_error(answer, "BACKEND_UNAVAILABLE")
        k8s.gate.set()
        await eventually(lambda: _eq(redis.scard(rm_scope(SID, "deploying")), 0), within=10)


async def _gauge(client: httpx.AsyncClient, name: str) -> float:
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        if family.name == name:
            return float(family.samples[0].value)
    raise AssertionError(f"{name} not on /metrics")


async def _gauge_is(client: httpx.AsyncClient, name: str, value: float) -> bool:
    return await _gauge(client, name) == value


async def _has(items: Any, n: int) -> bool:
    return len(await items) == n


async def _ge(value: Any, n: int) -> bool:
    return int(await value) >= n


async def _eq(value: Any, n: int) -> bool:
    return int(await value) == n


pytestmark = pytest.mark.timeout(120)
