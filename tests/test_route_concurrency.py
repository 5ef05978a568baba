"""Route and touch under concurrency and across replicas (issue 4, "Concurrency and
invariants"; contract §2.3 and §4).

Two ``running_app``s over one Redis, one DB and one fake Kubernetes are two replicas. The
multi-replica tests run on the real Redis with MariaDB or PostgreSQL, and where in-process
fakeredis can play the part, on fakeredis + SQLite too. Every assertion about state reads the
contract's literal key names (``session_manager:…``, ``resource_manager:…``), never the
code's key helpers. Waits poll with deadlines; nothing sleeps for a fixed time and hopes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fakeredis import FakeAsyncRedis
from redis.asyncio import BlockingConnectionPool, Redis

from agent_runtime.db.engine import Database
from agent_runtime.redis_client import is_cluster
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.models import PodDeployInfo
from agent_runtime.session_manager import slow_route
from agent_runtime.wiring import Services, build_redis, redis_pool_size
from contract_keys import (
    rm_scope,
    route_marker,
    sm_expiry,
    sm_pod,
    sm_pods_registered,
    sm_scope,
    sm_session,
)
from helpers import (
    TcpProxy,
    both_redis_server_dbs,
    deploy_locks,
    envelope,
    follower_seats,
    make_settings,
    other_client,
    real_mariadb_and_fake,
    real_only,
    real_postgresql_and_fake,
    real_redis_url,
    running_app,
    sync_body,
    url_of,
)

# every script it drives is of one slot: the single server, the Sentinel set and the cluster
pytestmark = pytest.mark.topologies

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
SYNC = "/api/session/config_sync"
GROUP, BOT = "grp-c", "bot-c"
SID = hashlib.md5(f"{GROUP}\x00{BOT}".encode()).hexdigest()  # contract §1

STATUS = {  # route's failures (contract §2.2); each of them carries retry_after
    "SCOPE_QUEUE_FULL": 503,
    "NO_POD_AVAILABLE": 503,
    "BACKEND_UNAVAILABLE": 503,
    "SCOPE_FULL_TIMEOUT": 504,
}


# --- the contract's key names (§4), spelled out --------------------------------------------


# --- replicas ----------------------------------------------------------------------------------


@dataclass
class Replicas:
    a: httpx.AsyncClient
    b: httpx.AsyncClient
    k8s: FakeK8sPodClient
    redis: Redis  # an observer connection (the test's own)

    def services(self, client: httpx.AsyncClient) -> Services:
        svc: Services = client.app.state.services  # type: ignore[attr-defined]
        return svc

    def pick(self, i: int) -> httpx.AsyncClient:
        return self.a if i % 2 == 0 else self.b


@asynccontextmanager
async def two_replicas(
    redis: Redis,
    db: Database,
    *,
    k8s: FakeK8sPodClient | None = None,
    redis_url: str | None = None,
    redis_timeout: float = 2.0,
    **settings: Any,
) -> AsyncIterator[Replicas]:
    """Two replicas, each with its own Redis client built as the service builds it, over the
    fixture's Redis (or ``redis_url``, e.g. a proxy to it), one DB and one fake cluster."""
    cluster = k8s or FakeK8sPodClient()
    first = replica_client(redis, redis_url, redis_timeout)
    second = replica_client(redis, redis_url, redis_timeout)
    try:
        async with (
            running_app(first, db, k8s=cluster, instance_id="replica-a", **settings) as a,
            running_app(second, db, k8s=cluster, instance_id="replica-b", **settings) as b,
        ):
            yield Replicas(a, b, cluster, redis)
    finally:
        await first.aclose()
        await second.aclose()


def replica_client(redis: Redis, url: str | None = None, timeout: float = 2.0) -> Redis:
    """A replica's own Redis client, built as the service builds it (``build_redis``: its
    pool, timeouts and retries), on the fixture's server and db."""
    kwargs = {} if is_cluster(redis) else redis.connection_pool.connection_kwargs
    if "server" in kwargs:  # fakeredis: what build_redis does in local mode, on our server
        return FakeAsyncRedis(
            server=kwargs["server"],
            decode_responses=True,
            connection_pool_class=BlockingConnectionPool,
            max_connections=redis_pool_size(make_settings()),
        )
    return build_redis(make_settings(redis_url=url or url_of(redis), redis_timeout=timeout))


async def configure(
    client: httpx.AsyncClient, *, scope_concurrency: int, pod_concurrency: int, **fields: Any
) -> None:
    item = {
        "template_id": "tpl-c",
        "image": "agentserver:1",
        "scope_concurrency": scope_concurrency,
        "pod_concurrency": pod_concurrency,
        "ready_poll_interval": 0.02,
        **fields,
    }
    resp = await client.post(SYNC, json=sync_body("template", "create", item))
    assert resp.status_code == 200, resp.text
    rule = {"group_id": GROUP, "bot_id": BOT, "template_id": "tpl-c"}
    resp = await client.post(SYNC, json=sync_body("routing_rule", "create", rule))
    assert resp.status_code == 200, resp.text


def route_body(session_id: str, request_id: str | None = None) -> dict[str, Any]:
    return envelope(
        request_id=request_id or f"r-{uuid.uuid4().hex[:12]}",
        session_id=session_id,
        bot_id=BOT,
        extra={"group_id": GROUP},
    )


async def warm_resolve_cache(reps: Replicas) -> None:
    """Resolve the scope once, so that a burst reaches placement together instead of trickling
    through the DB pool (the scope stays cold: no pod)."""
    await reps.services(reps.a).config_store.resolve(SID, GROUP, BOT)
    assert await reps.redis.exists(sm_scope(SID, "config"))


async def route(client: httpx.AsyncClient, session_id: str, request_id: str | None = None) -> Any:
    return await client.post(ROUTE, json=route_body(session_id, request_id))


async def eos(client: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    body = envelope({"eos": True}, session_id=session_id)
    resp = await client.post(TOUCH, json=body)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()["data"]
    return data


def assert_error(resp: httpx.Response, code: str) -> None:
    """A failure envelope of the contract: the code's status, retry_after in body and header."""
    body = resp.json()
    assert resp.status_code == STATUS[code], resp.text
    assert body["ok"] is False and body["error_code"] == code, body
    assert body["error_message"], body
    assert isinstance(body["retry_after"], int) and body["retry_after"] >= 1, body
    assert resp.headers["retry-after"] == str(body["retry_after"])


async def eventually(
    check: Callable[[], Awaitable[bool]], within: float = 5.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {within} s")
        await asyncio.sleep(0.005)


async def seated(redis: Redis, member: str | None = None, sid: str = SID) -> bool:
    if member is None:
        return bool(await redis.zcard(sm_scope(sid, "waiters")))
    return await redis.zscore(sm_scope(sid, "waiters"), member) is not None


async def waiting(redis: Redis, member: str, sid: str = SID) -> bool:
    """In the queue, or holding a reservation of a pod being acquired."""
    reserved = await redis.zscore(sm_scope(sid, "reserved"), member) is not None
    return reserved or await seated(redis, member, sid)


# --- invariants ------------------------------------------------------------------------------


@dataclass
class Peaks:
    """Highest counts seen by sampling Redis (one MULTI per sample) while a burst runs."""

    scope_sessions: int = 0
    pod_sessions: int = 0
    waiters: int = 0
    followers: int = 0  # the fullest follower room (one per cold deploy)
    cold_deploys: int = 0
    deploying: int = 0
    samples: int = 0
    per_pod: dict[str, int] = field(default_factory=dict)


@asynccontextmanager
async def sampling(redis: Redis, sid: str = SID) -> AsyncIterator[Peaks]:
    peaks = Peaks()
    observer = other_client(redis)
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            pods = await observer.zrange(sm_scope(sid, "pods"), 0, -1)
            pods += [p for p in peaks.per_pod if p not in pods]
            # one follower room per cold deploy: the fullest one is the peak
            deploys = await observer.zrange(rm_scope(sid, "cold_deploys"), 0, -1)
            async with observer.pipeline(transaction=True) as pipe:
                pipe.scard(sm_scope(sid, "sessions"))
                pipe.zcard(sm_scope(sid, "waiters"))
                pipe.scard(rm_scope(sid, "deploying"))
                for deploy_id in deploys:
                    pipe.zcard(rm_scope(sid, f"deploy_followers:{deploy_id}"))
                for pod in pods:
                    pipe.scard(sm_pod(sid, pod, "sessions"))
                counts = await pipe.execute()
            peaks.scope_sessions = max(peaks.scope_sessions, counts[0])
            peaks.waiters = max(peaks.waiters, counts[1])
            peaks.deploying = max(peaks.deploying, counts[2])
            rooms = counts[3 : 3 + len(deploys)]
            peaks.followers = max(peaks.followers, *rooms) if rooms else peaks.followers
            peaks.cold_deploys = max(peaks.cold_deploys, len(deploys))
            for pod, n in zip(pods, counts[3 + len(deploys) :], strict=True):
                peaks.per_pod[pod] = max(peaks.per_pod.get(pod, 0), n)
                peaks.pod_sessions = max(peaks.pod_sessions, n)
            peaks.samples += 1
            await asyncio.sleep(0.002)

    task = asyncio.create_task(sample())
    try:
        yield peaks
    finally:
        stop.set()
        await task
        await observer.aclose()
    assert peaks.samples > 3, "the sampler did not run"


async def assert_four_places(redis: Redis, session_id: str, pod_id: str, sid: str = SID) -> None:
    binding = await redis.hgetall(sm_session(SID, session_id))
    assert binding.get("scope_id") == sid and binding.get("pod_id") == pod_id, binding
    assert await redis.zscore(sm_expiry(SID), session_id) is not None, session_id
    assert await redis.sismember(sm_scope(sid, "sessions"), session_id), session_id
    assert await redis.sismember(sm_pod(sid, pod_id, "sessions"), session_id), session_id


async def assert_in_no_place(redis: Redis, session_id: str, sid: str = SID) -> None:
    assert not await redis.exists(sm_session(SID, session_id)), session_id
    assert await redis.zscore(sm_expiry(SID), session_id) is None, session_id
    assert not await redis.sismember(sm_scope(sid, "sessions"), session_id), session_id
    for pod in await redis.zrange(sm_scope(sid, "pods"), 0, -1):
        assert not await redis.sismember(sm_pod(sid, pod, "sessions"), session_id), session_id


async def assert_nothing_held(
    redis: Redis, sid: str = SID, *, pending_ok: frozenset[str] = frozenset()
) -> None:
    """No queue seat, reservation, follower seat, deploy placeholder, deploy lock or pending
    marker (but the markers of ``pending_ok``)."""
    assert await redis.zrange(sm_scope(sid, "waiters"), 0, -1) == []
    assert await redis.zrange(sm_scope(sid, "reserved"), 0, -1) == []
    assert await follower_seats(redis, sid) == []
    assert await redis.smembers(rm_scope(sid, "deploying")) == set()
    assert await deploy_locks(redis, sid) == {}
    pending = [
        key
        async for key in redis.scan_iter(match=route_marker(sid, "*"), count=1000)
        if str(await redis.get(key) or "").startswith("pending:")
        and key.removeprefix(route_marker(sid, "")) not in pending_ok
    ]
    assert pending == [], pending


async def assert_limits(redis: Redis, scope_concurrency: int, pod_concurrency: int) -> None:
    members = await redis.smembers(sm_scope(SID, "sessions"))
    assert len(members) <= scope_concurrency
    on_pods: set[str] = set()
    for pod in await redis.zrange(sm_scope(SID, "pods"), 0, -1):
        sessions = await redis.smembers(sm_pod(SID, pod, "sessions"))
        assert len(sessions) <= pod_concurrency, (pod, len(sessions))
        assert not sessions & on_pods, "a session on two pods"
        on_pods |= sessions
    assert on_pods == members  # the scope set and the pod sets agree


@dataclass
class Outcome:
    session_id: str
    request_id: str
    replica: str
    resp: httpx.Response

    @property
    def code(self) -> str:
        return "OK" if self.resp.status_code == 200 else str(self.resp.json()["error_code"])


async def burst(
    reps: Replicas, n: int, prefix: str = "s"
) -> tuple[list[Outcome], collections.Counter[str]]:
    """``n`` routes for new sessions at once, alternating between the replicas."""

    async def one(i: int) -> Outcome:
        session_id, request_id = f"{prefix}-{i}", f"r-{prefix}-{i}-{uuid.uuid4().hex[:6]}"
        client = reps.pick(i)
        resp = await route(client, session_id, request_id)
        return Outcome(session_id, request_id, "a" if client is reps.a else "b", resp)

    outcomes = list(await asyncio.gather(*(one(i) for i in range(n))))
    return outcomes, collections.Counter(o.code for o in outcomes)


async def assert_burst_answers(redis: Redis, outcomes: list[Outcome], allowed: set[str]) -> None:
    """200 placed answers are what the replay cache holds; failures are contract errors
    whose replay markers are gone (a retry with the same request_id runs again)."""
    for o in outcomes:
        if o.resp.status_code == 200:
            body = o.resp.json()
            assert body["ok"] is True and body["request_id"] == o.request_id
            assert body["data"]["placement"] == "placed", body
            assert body["data"]["pod_sse_url"].startswith("http://"), body
            cached = await redis.get(route_marker(SID, o.request_id))
            assert cached is not None
            stored = json.loads(cached)
            assert stored.pop("request_hash"), "the answer is bound to its request"
            assert stored == body["data"]
        else:
            assert o.code in allowed, o.resp.text
            assert_error(o.resp, o.code)
            assert not await redis.exists(route_marker(SID, o.request_id)), o.request_id


# --- 200 concurrent routes over two replicas ---------------------------------------------------


@both_redis_server_dbs
async def test_two_hundred_concurrent_routes_never_exceed_the_limits(
    redis: Redis, db: Database
) -> None:
    sc, pc = 20, 4  # max_pods 5, queue 40
    k8s = FakeK8sPodClient(ready_delay=0.02)
    # five deploys one after the other, under the load of 200 calls in one event loop; the
    # scope's queue is under test, not the edge: a burst of 100 a replica may outlast the
    # default burst wait on a loaded machine, so the edge is given a long one
    async with two_replicas(
        redis, db, k8s=k8s, scope_full_timeout=2.0, admission_burst_wait=30
    ) as reps:
        await configure(reps.a, scope_concurrency=sc, pod_concurrency=pc)
        # a warm cache: with a cold one each replica's routes wait on one shared DB read and
        # re-run together, so one replica's batch can take every seat before the other's
        await warm_resolve_cache(reps)
        ended: list[str] = []
        stop_churn = asyncio.Event()

        async def churn() -> None:
            """Ends placed sessions on alternating replicas while the burst waits: waiters
            on either replica must take the freed slots without ever overshooting."""
            i = 0
            while not stop_churn.is_set() and len(ended) < 12:
                members = sorted(await redis.smembers(sm_scope(SID, "sessions")))
                if len(members) >= sc // 2:
                    victim = members[i % len(members)]
                    released = await eos(reps.pick(i + 1), victim)
                    if released["released"]:
                        ended.append(victim)
                    i += 1
                await asyncio.sleep(0.02)

        async with sampling(redis) as peaks:
            churner = asyncio.create_task(churn())
            outcomes, counts = await burst(reps, 200)
            stop_churn.set()
            await churner

        assert peaks.scope_sessions <= sc, peaks
        assert peaks.pod_sessions <= pc, peaks
        assert peaks.waiters <= 2 * sc, peaks
        assert peaks.followers <= pc - 1, peaks
        assert set(counts) <= {"OK", "SCOPE_QUEUE_FULL", "SCOPE_FULL_TIMEOUT"}, [
            o.resp.text for o in outcomes if o.code not in ("OK", "SCOPE_QUEUE_FULL")
        ]
        assert counts["OK"] >= sc, counts  # the scope filled up
        assert counts["OK"] <= sc + len(ended), (counts, len(ended), peaks)
        assert counts["SCOPE_QUEUE_FULL"] > 0 and counts["SCOPE_FULL_TIMEOUT"] > 0, counts
        assert ended, "the churn never ended a session: the test proves less than it says"
        await assert_burst_answers(redis, outcomes, {"SCOPE_QUEUE_FULL", "SCOPE_FULL_TIMEOUT"})

        await assert_limits(redis, sc, pc)
        live = await redis.smembers(sm_scope(SID, "sessions"))
        placed = {o.session_id: o.resp.json()["data"]["pod_id"] for o in outcomes if o.code == "OK"}
        assert set(ended) | live == set(placed) and not set(ended) & live
        for session_id in live:
            await assert_four_places(redis, session_id, placed[session_id])
        for session_id in ended:
            await assert_in_no_place(redis, session_id)
        # placed on both replicas, answered by both
        by_replica = collections.Counter((o.replica, o.code) for o in outcomes)
        assert {o.replica for o in outcomes if o.code == "OK"} == {"a", "b"}, by_replica
        assert len(set(placed.values())) <= len(k8s.pods) <= 5  # max_pods
        assert k8s.deploy_calls == len(k8s.pods)  # no deploy failed or left a pod behind
        assert set(await redis.zrange(sm_scope(SID, "pods"), 0, -1)) == set(k8s.pods)
        await assert_nothing_held(redis)


@real_mariadb_and_fake
async def test_a_burst_beyond_the_redis_pool_waits_for_a_connection_instead_of_failing(
    redis: Redis, db: Database
) -> None:
    """More concurrent calls on one replica than its Redis pool has connections: they queue
    for a connection (briefly) rather than fail with 503 BACKEND_UNAVAILABLE "Too many
    connections" while Redis is perfectly fine. Through ``build_redis`` itself."""
    fake = "server" in redis.connection_pool.connection_kwargs
    url = None if fake else real_redis_url()
    # the pool's wait for a free connection is redis_timeout: at its default (2 s) a loaded
    # 2-core machine (a busy loop on each core) served the last of the queue too late and 54
    # of 432 calls got BACKEND_UNAVAILABLE; what this test holds is that they queue at all
    client = build_redis(make_settings(redis_url=url, redis_timeout=30.0))
    try:
        # admission far above the pool: this is about the pool's own wait, not the edge's bound
        async with running_app(client, db, max_in_flight=1024) as app:
            await configure(app, scope_concurrency=1, pod_concurrency=1)
            assert (await route(app, "pool-1")).status_code == 200
            n = 3 * redis_pool_size(make_settings())
            answers = await asyncio.gather(*(route(app, "pool-1") for _ in range(n)))
            codes = collections.Counter(
                r.json()["data"]["placement"] if r.status_code == 200 else r.json()["error_code"]
                for r in answers
            )
            assert codes == {"refresh": n}, codes
    finally:
        await client.aclose()


# --- a cold burst deploys one pod ------------------------------------------------------------


@real_mariadb_and_fake
async def test_a_cold_burst_split_over_two_replicas_deploys_exactly_one_pod(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient(ready_delay=0.15)  # the whole burst arrives while it deploys
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=5.0) as reps:
        await configure(reps.a, scope_concurrency=24, pod_concurrency=12)  # max_pods 2
        await warm_resolve_cache(reps)
        async with sampling(redis) as peaks:
            outcomes, counts = await burst(reps, 12)
        assert counts == {"OK": 12}, [o.resp.text for o in outcomes if o.code != "OK"]
        assert k8s.deploy_calls == 1
        assert len(k8s.pods) == 1
        (pod_id,) = k8s.pods
        assert {o.resp.json()["data"]["pod_id"] for o in outcomes} == {pod_id}
        assert await redis.zrange(sm_scope(SID, "pods"), 0, -1) == [pod_id]
        assert await redis.smembers(sm_pods_registered(SID)) == {pod_id}
        assert peaks.deploying <= 2  # max_pods placeholders at most, one of them deploying
        for o in outcomes:
            await assert_four_places(redis, o.session_id, pod_id)
        await assert_nothing_held(redis)


def count_acquires(reps: Replicas, monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Calls of the resource manager's acquire, per replica, through its facade."""
    calls: collections.Counter[str] = collections.Counter()
    for name, client in (("a", reps.a), ("b", reps.b)):
        facade = reps.services(client).resources
        real = facade.acquire

        async def counted(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return await _real(*args, **kw)

        monkeypatch.setattr(facade, "acquire", counted)
    return calls


async def test_a_cold_burst_that_one_pod_holds_makes_one_deploy(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each route acquires for itself, on either replica; the claims seat all but the first
    in that first deploy's room (pod_concurrency 20: 19 seats): one deploy, every route
    placed by route_place on its pod."""
    k8s = FakeK8sPodClient(ready_delay=0.15)
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=5.0) as reps:
        await configure(reps.a, scope_concurrency=40, pod_concurrency=20)  # max_pods 2
        await warm_resolve_cache(reps)
        calls = count_acquires(reps, monkeypatch)
        outcomes, counts = await burst(reps, 20)
        assert counts == {"OK": 20}, [o.resp.text for o in outcomes if o.code != "OK"]
        assert k8s.deploy_calls == 1
        assert calls == {"a": 10, "b": 10}, calls  # one acquire per route
        assert len({o.resp.json()["data"]["pod_id"] for o in outcomes}) == 1
        for o in outcomes:
            await assert_four_places(redis, o.session_id, o.resp.json()["data"]["pod_id"])
        await assert_nothing_held(redis)


@pytest.mark.parametrize(("pod_concurrency", "routes", "deploys"), [(1, 12, 12), (3, 9, 3)])
async def test_a_cold_burst_makes_one_deploy_per_pod_it_needs_in_parallel(
    redis: Redis, db: Database, pod_concurrency: int, routes: int, deploys: int
) -> None:
    """Two replicas, a burst of new sessions on a scope with no pod: one deploy per pod the
    burst needs (pod_concurrency 1: one per route), all at once (more than one deploy in
    flight), every route placed, each pod holding at most pod_concurrency."""
    k8s = FakeK8sPodClient(ready_delay=0.5)
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=20.0) as reps:
        await configure(
            reps.a, scope_concurrency=routes, pod_concurrency=pod_concurrency, ready_timeout=30
        )
        await warm_resolve_cache(reps)
        async with sampling(redis) as peaks:
            outcomes, counts = await burst(reps, routes)
        assert counts == {"OK": routes}, [o.resp.text for o in outcomes if o.code != "OK"]
        assert k8s.deploy_calls == len(k8s.pods) == deploys
        assert peaks.cold_deploys > 1, "the deploys ran one after another"
        assert peaks.pod_sessions <= pod_concurrency
        pods = collections.Counter(o.resp.json()["data"]["pod_id"] for o in outcomes)
        assert sorted(pods.values()) == [pod_concurrency] * deploys
        await assert_nothing_held(redis)


async def test_a_cold_burst_past_max_pods_makes_max_pods_deploys_and_queues_the_rest(
    redis: Redis, db: Database
) -> None:
    """pod_concurrency 1, max_pods 4 (scope_concurrency 4), 10 new sessions: 4 deploys, 4
    placed; the other 6 wait in the queue and time out (nothing frees a slot), never a fifth
    deploy."""
    k8s = FakeK8sPodClient(ready_delay=0.3)
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=2.0) as reps:
        await configure(reps.a, scope_concurrency=4, pod_concurrency=1, ready_timeout=30)
        await warm_resolve_cache(reps)
        _, counts = await burst(reps, 10)
        assert counts["OK"] == 4 and k8s.deploy_calls == len(k8s.pods) == 4, counts
        assert set(counts) <= {"OK", "SCOPE_FULL_TIMEOUT", "SCOPE_QUEUE_FULL"}, counts
        await assert_nothing_held(redis)


async def test_a_leader_whose_route_goes_away_still_brings_its_followers_their_pod(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The route that leads the deploy goes away mid-deploy: the deploy goes on, and its pod,
    with followers waiting in its room, is theirs (in use), not the warm pool's."""
    # the pod is Ready only when the test says so: the followers seated, the leader gone
    k8s = FakeK8sPodClient(ready_delay=0.05)
    k8s.never_ready = True
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=30.0) as reps:
        await configure(reps.a, scope_concurrency=20, pod_concurrency=10)
        await warm_resolve_cache(reps)
        calls = count_acquires(reps, monkeypatch)
        first = asyncio.create_task(route(reps.a, "starter", "r-starter"))
        await eventually(lambda: _true(k8s.deploy_calls == 1), what="the leader's deploy started")
        others = [asyncio.create_task(route(reps.a, f"o-{i}", f"r-o-{i}")) for i in range(5)]
        room = rm_scope(SID, "deploy_followers:r-starter")
        await eventually(lambda: _seated(redis, room, 5), what="five followers seated")
        first.cancel()  # the client of the starting route goes away mid-deploy
        with contextlib.suppress(asyncio.CancelledError):
            await first
        k8s.never_ready = False
        answers = await asyncio.gather(*others)
        assert [a.status_code for a in answers] == [200] * 5, [a.text for a in answers]
        assert calls["a"] == 6 and k8s.deploy_calls == 1
        assert len({a.json()["data"]["pod_id"] for a in answers}) == 1
        # given back by the cancelled route, or at worst lapsed with its lease (ROUTE_LEASE,
        # 3 s): a loaded box may take a while either way
        await eventually(
            lambda: _no_marker(redis, "r-starter"),
            within=20.0,
            what="the starter's marker given back",
        )
        await assert_nothing_held(redis)


async def _true(value: bool) -> bool:
    return value


async def _seated(redis: Redis, room: str, n: int) -> bool:
    return int(await redis.zcard(room)) >= n


async def _no_marker(redis: Redis, request_id: str) -> bool:
    return await redis.get(route_marker(SID, request_id)) is None


# --- the worked example ------------------------------------------------------------


async def _worked_example(redis: Redis, db: Database) -> tuple[collections.Counter[str], Any]:
    """60 concurrent new sessions, cold scope, scope_concurrency 10, pod_concurrency 5."""
    k8s = FakeK8sPodClient(ready_delay=0.1)
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=1.0) as reps:
        await configure(reps.a, scope_concurrency=10, pod_concurrency=5)  # max_pods 2, queue 20
        await warm_resolve_cache(reps)  # all 60 arrive together
        async with sampling(redis) as peaks:
            outcomes, counts = await burst(reps, 60)
        placed = [o for o in outcomes if o.code == "OK"]
        pods = collections.Counter(o.resp.json()["data"]["pod_id"] for o in placed)
        # what holds whatever the split between queue and refusal
        assert len(placed) == 10, counts
        assert sorted(pods.values()) == [5, 5], pods
        assert k8s.deploy_calls == 2 and len(k8s.pods) == 2
        assert peaks.scope_sessions <= 10 and peaks.pod_sessions <= 5, peaks
        assert peaks.waiters == 20, peaks  # the queue (2 × scope_concurrency) filled up
        assert set(counts) == {"OK", "SCOPE_QUEUE_FULL", "SCOPE_FULL_TIMEOUT"}, counts
        assert counts["SCOPE_FULL_TIMEOUT"] <= 20, counts
        await assert_burst_answers(redis, outcomes, {"SCOPE_QUEUE_FULL", "SCOPE_FULL_TIMEOUT"})
        await assert_limits(redis, 10, 5)
        for o in placed:
            await assert_four_places(redis, o.session_id, o.resp.json()["data"]["pod_id"])
        await assert_nothing_held(redis)
        return counts, peaks


@real_mariadb_and_fake
async def test_worked_example_places_ten_queues_twenty_and_refuses_thirty(
    redis: Redis, db: Database
) -> None:
    """The issue's numbers exactly: 10 routes hold reservations of the two pods to come (they
    are placed, 5 per pod), 20 wait in the queue (2 × scope_concurrency) and time out, 30
    find the queue full. Queued routes cannot take the slots promised to the 10."""
    counts, _ = await _worked_example(redis, db)
    assert counts == {"OK": 10, "SCOPE_FULL_TIMEOUT": 20, "SCOPE_QUEUE_FULL": 30}, counts


# --- the window between the resource manager's registration and the session manager's ------
#
# A leader's pod is registered by the resource manager first, then made a placement
# candidate on the session side (by the acquire's on_ready hook, still under the deploy
# lock). A route deciding inside that window must not be told "no pod", and must not deploy
# a second pod for a session that fits on the first.


@real_mariadb_and_fake
async def test_a_follower_that_joins_after_the_leaders_pod_registered_still_gets_it(
    redis: Redis, db: Database
) -> None:
    async with two_replicas(redis, db, scope_full_timeout=5.0) as reps:
        await configure(reps.a, scope_concurrency=4, pod_concurrency=2)  # max_pods 2, room 1
        rm_state = reps.services(reps.a).resource_state
        cache_result = rm_state.cache_result
        in_window, leave_window = asyncio.Event(), asyncio.Event()

        async def held_cache_result(*args: Any) -> None:
            in_window.set()  # registered in RM, deploy lock still held
            await leave_window.wait()
            await cache_result(*args)

        rm_state.cache_result = held_cache_result  # type: ignore[method-assign]
        leader = asyncio.create_task(route(reps.a, "s-leader"))
        await asyncio.wait_for(in_window.wait(), 5)
        follower = asyncio.create_task(route(reps.b, "s-follower"))

        async def followed() -> bool:  # waiting for the leader, or served already
            return follower.done() or len(await follower_seats(redis, SID)) == 1

        await eventually(followed, what="the second route following the leader")
        leave_window.set()
        first, second = await leader, await follower
        assert first.status_code == 200, first.text
        assert second.status_code == 200, second.text  # not NO_POD_AVAILABLE
        assert first.json()["data"]["pod_id"] == second.json()["data"]["pod_id"]
        assert reps.k8s.deploy_calls == 1
        await assert_nothing_held(redis)


@real_mariadb_and_fake
async def test_max_pods_held_by_a_pod_about_to_become_a_candidate_is_waited_for(
    redis: Redis, db: Database
) -> None:
    """At max_pods the same window gives "max_pods reached" from the resource manager while
    the session side still sees a free pod slot: the route waits for the candidate (it
    signals ``free``) instead of answering 503 NO_POD_AVAILABLE."""
    async with two_replicas(redis, db, scope_full_timeout=5.0) as reps:
        await configure(reps.a, scope_concurrency=2, pod_concurrency=2)  # max_pods 1
        sm_state = reps.services(reps.a).session_state
        register_pod = sm_state.register_pod
        in_window, leave_window = asyncio.Event(), asyncio.Event()

        async def held_register_pod(*args: Any) -> bool:
            in_window.set()  # registered in RM (the cap is reached), not yet a candidate
            await leave_window.wait()
            return await register_pod(*args)

        sm_state.register_pod = held_register_pod  # type: ignore[method-assign]
        leader = asyncio.create_task(route(reps.a, "s-leader"))
        await asyncio.wait_for(in_window.wait(), 5)
        late = asyncio.create_task(route(reps.b, "s-late", "r-s-late"))
        # it follows the leader's deploy (the leader publishes its pod before it lets go of
        # the deploy lock) or waits on its reservation; either way it is not refused
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(late), 0.5)
        leave_window.set()
        first, second = await leader, await late
        assert first.status_code == 200, first.text
        assert second.status_code == 200, second.text  # not NO_POD_AVAILABLE
        assert second.json()["data"]["pod_id"] == first.json()["data"]["pod_id"]
        assert reps.k8s.deploy_calls == 1
        await assert_nothing_held(redis)


@real_mariadb_and_fake
async def test_a_route_between_the_two_registrations_does_not_deploy_a_second_pod(
    redis: Redis, db: Database
) -> None:
    async with two_replicas(redis, db, scope_full_timeout=5.0) as reps:
        await configure(reps.a, scope_concurrency=4, pod_concurrency=2)  # max_pods 2
        sm_state = reps.services(reps.a).session_state
        register_pod = sm_state.register_pod
        in_window, leave_window = asyncio.Event(), asyncio.Event()

        async def held_register_pod(*args: Any) -> bool:
            in_window.set()  # registered in RM, lock released, not yet a candidate
            await leave_window.wait()
            return await register_pod(*args)

        sm_state.register_pod = held_register_pod  # type: ignore[method-assign]
        leader = asyncio.create_task(route(reps.a, "s-leader"))
        await asyncio.wait_for(in_window.wait(), 5)
        late = asyncio.create_task(route(reps.b, "s-late"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(late), 0.5)
        leave_window.set()
        first, second = await leader, await late
        assert first.status_code == 200 and second.status_code == 200
        assert reps.k8s.deploy_calls == 1, "a second pod was deployed for a session that fits"


# --- replay across replicas ------------------------------------------------------------------


@real_postgresql_and_fake
async def test_a_replay_on_the_other_replica_returns_the_identical_answer(
    redis: Redis, db: Database
) -> None:
    async with two_replicas(redis, db) as reps:
        await configure(reps.a, scope_concurrency=4, pod_concurrency=2)
        first = await route(reps.a, "s-replay", "r-replay")
        assert first.status_code == 200, first.text
        again = await route(reps.b, "s-replay", "r-replay")
        assert again.status_code == 200
        assert again.json() == first.json()
        assert first.json()["data"]["placement"] == "placed"  # not "refresh": nothing ran
        assert reps.k8s.deploy_calls == 1
        assert await redis.smembers(sm_scope(SID, "sessions")) == {"s-replay"}
        # a new request_id for the same session does run: it refreshes, on the same pod
        fresh = await route(reps.b, "s-replay", "r-replay-2")
        assert fresh.json()["data"]["placement"] == "refresh"
        assert fresh.json()["data"]["pod_id"] == first.json()["data"]["pod_id"]
        await assert_four_places(redis, "s-replay", first.json()["data"]["pod_id"])


@real_postgresql_and_fake
async def test_concurrent_duplicates_on_two_replicas_place_once_and_answer_alike(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient(ready_delay=0.3)  # the first call is still deploying
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=5.0) as reps:
        await configure(reps.a, scope_concurrency=4, pod_concurrency=2)
        first = asyncio.create_task(route(reps.a, "s-dup", "r-dup"))

        async def first_is_running() -> bool:
            return str(await redis.get(route_marker(SID, "r-dup")) or "").startswith("pending:")

        await eventually(first_is_running, what="the first call's pending marker")
        duplicate = await route(reps.b, "s-dup", "r-dup")
        original = await first
        assert original.status_code == 200, original.text
        assert duplicate.status_code == 200, duplicate.text
        assert duplicate.json() == original.json()
        assert reps.k8s.deploy_calls == 1
        assert await redis.smembers(sm_scope(SID, "sessions")) == {"s-dup"}
        await assert_four_places(redis, "s-dup", original.json()["data"]["pod_id"])
        await assert_nothing_held(redis)


@real_postgresql_and_fake
async def test_simultaneous_duplicates_on_two_replicas_place_once(
    redis: Redis, db: Database
) -> None:
    """Same request_id fired at both replicas at once, many times, warm and cold."""
    async with two_replicas(redis, db, scope_full_timeout=5.0) as reps:
        await configure(reps.a, scope_concurrency=40, pod_concurrency=10)
        for i in range(12):
            rid, sid = f"r-twin-{i}", f"s-twin-{i}"
            one, two = await asyncio.gather(route(reps.a, sid, rid), route(reps.b, sid, rid))
            assert one.status_code == two.status_code == 200, (one.text, two.text)
            assert one.json() == two.json()
            assert one.json()["data"]["placement"] == "placed"
        assert await redis.scard(sm_scope(SID, "sessions")) == 12
        assert reps.k8s.deploy_calls == 2  # 12 sessions, 10 per pod
        await assert_limits(redis, 40, 10)
        await assert_nothing_held(redis)


# --- configuration seen across replicas ------------------------------------------------------


@real_mariadb_and_fake
async def test_a_policy_change_on_one_replica_governs_the_others_next_route(
    redis: Redis, db: Database
) -> None:
    async with two_replicas(redis, db, scope_full_timeout=0.3) as reps:
        await configure(reps.a, scope_concurrency=1, pod_concurrency=1)
        first = await route(reps.b, "s-cfg-1")  # B resolves and caches the scope's policy
        assert first.status_code == 200, first.text
        assert_error(await route(reps.b, "s-cfg-2"), "SCOPE_FULL_TIMEOUT")

        update = {
            "template_id": "tpl-c",
            "image": "agentserver:1",
            "scope_concurrency": 4,
            "pod_concurrency": 4,
            "ready_poll_interval": 0.02,
        }
        resp = await reps.a.post(SYNC, json=sync_body("template", "update", update))
        assert resp.status_code == 200, resp.text
        assert resp.json()["data"]["change_class"] == "policy"

        second = await route(reps.b, "s-cfg-2")  # B's very next route: new limits
        assert second.status_code == 200, second.text
        assert second.json()["data"]["pod_id"] == first.json()["data"]["pod_id"]
        assert reps.k8s.deploy_calls == 1  # pod_concurrency 4: the same pod takes it
        cache = await redis.hgetall(sm_scope(SID, "config"))
        assert cache["scope_concurrency"] == "4" and cache["pod_concurrency"] == "4"


# --- background jobs -------------------------------------------------------------------------


@real_only
async def test_each_job_tick_runs_on_one_replica_only(redis: Redis, db: Database) -> None:
    intervals = {
        "sweep_interval": 0.05,
        "autoscale_interval": 0.05,
        "reclaim_interval": 0.05,
        "watch_interval": 0.05,
        "reconcile_interval": 0.05,
        "scope_expiry_interval": 0.05,
        "drain_interval": 0.05,
    }
    async with two_replicas(redis, db, jobs_enabled=True, **intervals) as reps:
        runners = {"a": reps.services(reps.a).jobs, "b": reps.services(reps.b).jobs}
        names = list(runners["a"].jobs)
        assert len(names) == len(intervals)
        ticking: dict[str, str | None] = dict.fromkeys(names)
        overlaps: list[str] = []

        def spy(replica: str, name: str) -> None:
            job = runners[replica].jobs[name]
            inner = job.tick

            async def tick() -> object:
                if ticking[name] not in (None, replica):
                    overlaps.append(f"{name}: {replica} while {ticking[name]}")
                ticking[name] = replica
                try:
                    return await inner()
                finally:
                    ticking[name] = None

            job.tick = tick

        for replica in runners:
            for name in names:
                spy(replica, name)
        before = {r: {n: runners[r].jobs[n].runs for n in names} for r in runners}

        async def ticked_enough() -> bool:
            return all(
                sum(runners[r].jobs[n].runs - before[r][n] for r in runners) >= 5 for n in names
            )

        await eventually(ticked_enough, within=10, what="five ticks of every job")
        assert overlaps == []
        for name in names:
            ran = {r for r in runners if runners[r].jobs[name].runs > 0}
            assert len(ran) == 1, (name, {r: runners[r].jobs[name].runs for r in runners})
            (leader,) = ran
            lock = await redis.get(f"agent_runtime:job:{name}")
            assert lock is not None and await runners[leader].is_leader(name)
            assert runners[leader].jobs[name].failures == 0
        # run_once on the follower refuses: the tick belongs to the leader
        for name in names:
            follower = next(r for r in runners if runners[r].jobs[name].runs == 0)
            assert await runners[follower].run_once(name) is False


# --- the wait queue across replicas ----------------------------------------------------------


@pytest.fixture
def slow_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue's safety-net poll made far longer than any assertion's bound, so only the
    ``free`` signal can wake a waiter in time."""
    monkeypatch.setattr(slow_route, "POLL", 30.0)


@real_mariadb_and_fake
async def test_an_eos_on_one_replica_wakes_a_waiter_on_the_other_within_milliseconds(
    redis: Redis, db: Database, slow_poll: None
) -> None:
    async with two_replicas(redis, db, scope_full_timeout=10.0) as reps:
        await configure(reps.a, scope_concurrency=1, pod_concurrency=1)
        first = await route(reps.a, "s-held")
        pod_id = first.json()["data"]["pod_id"]
        waiting = asyncio.create_task(route(reps.b, "s-waits", "r-waits"))
        await eventually(lambda: seated(redis, "r-waits"), what="the waiter's seat")
        await asyncio.sleep(0.05)  # it is asleep in the queue now, not about to re-check

        started = time.monotonic()
        assert await eos(reps.a, "s-held") == {"touched": True, "released": True}
        resp = await waiting
        elapsed = time.monotonic() - started
        assert resp.status_code == 200, resp.text
        assert resp.json()["data"]["pod_id"] == pod_id
        assert elapsed < 0.25, f"woken after {elapsed:.3f} s: the free signal did not cross"
        await assert_four_places(redis, "s-waits", pod_id)
        await assert_in_no_place(redis, "s-held")
        await assert_nothing_held(redis)


@real_mariadb_and_fake
async def test_a_slot_freed_just_before_the_waiter_listens_is_not_missed(
    redis: Redis, db: Database, slow_poll: None
) -> None:
    """The eos lands between the waiter's ``scope_full`` and its first wait (here: while it
    takes its seat). The signal is gone by then, so the waiter must re-check after it starts
    listening instead of sleeping a whole poll."""
    async with two_replicas(redis, db, scope_full_timeout=10.0) as reps:
        await configure(reps.a, scope_concurrency=1, pod_concurrency=1)
        assert (await route(reps.a, "s-held")).status_code == 200
        state = reps.services(reps.b).session_state
        take_seat = state.take_waiter_seat

        async def eos_first(*args: Any, **kwargs: Any) -> bool:
            await eos(reps.a, "s-held")
            await asyncio.sleep(0.05)  # the signal reaches B's notifier, nobody listens yet
            return await take_seat(*args, **kwargs)

        state.take_waiter_seat = eos_first  # type: ignore[method-assign]
        started = time.monotonic()
        resp = await route(reps.b, "s-late")
        elapsed = time.monotonic() - started
        assert resp.status_code == 200, resp.text
        assert elapsed < 0.5, f"placed after {elapsed:.3f} s: a free signal was lost"
        await assert_nothing_held(redis)


async def asgi_route(
    app: Any, body: dict[str, Any], disconnect: asyncio.Event
) -> tuple[int, dict[str, Any]]:
    """POST a route straight through ASGI with a client that can hang up: ``receive`` gives
    the body, then ``http.disconnect`` once ``disconnect`` is set (as uvicorn does)."""
    payload = json.dumps(body).encode()
    given = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": ROUTE,
        "raw_path": ROUTE.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("test", 80),
        "state": {},
    }
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(raw) if raw else {}


@real_mariadb_and_fake
async def test_a_waiter_whose_client_disconnects_leaves_the_queue(
    redis: Redis, db: Database
) -> None:
    async with two_replicas(redis, db, scope_full_timeout=10.0) as reps:
        await configure(reps.a, scope_concurrency=1, pod_concurrency=1)
        assert (await route(reps.a, "s-held")).status_code == 200
        hang_up = asyncio.Event()
        app = reps.b.app  # type: ignore[attr-defined]
        call = asyncio.create_task(asgi_route(app, route_body("s-gone", "r-gone"), hang_up))
        await eventually(lambda: seated(redis, "r-gone"), what="the waiter's seat")
        started = time.monotonic()
        hang_up.set()
        status, _ = await asyncio.wait_for(call, 2.0)
        assert time.monotonic() - started < 1.0  # noticed within a poll, not at the deadline
        assert status == 499  # nobody reads it; what an access log shows
        assert not await seated(redis)
        assert not await redis.exists(route_marker(SID, "r-gone"))
        await assert_in_no_place(redis, "s-gone")
        await assert_nothing_held(redis)


@real_mariadb_and_fake
async def test_a_cancelled_waiter_leaves_the_queue_and_its_request_id_runs_again(
    redis: Redis, db: Database
) -> None:
    async with two_replicas(redis, db, scope_full_timeout=10.0) as reps:
        await configure(reps.a, scope_concurrency=1, pod_concurrency=1)
        first = await route(reps.a, "s-held")
        waiting = asyncio.create_task(route(reps.b, "s-cancel", "r-cancel"))
        await eventually(lambda: seated(redis, "r-cancel"), what="the waiter's seat")
        assert str(await redis.get(route_marker(SID, "r-cancel"))).startswith("pending:")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not await seated(redis)
        assert not await redis.exists(route_marker(SID, "r-cancel"))

        await eos(reps.a, "s-held")
        retry = await route(reps.a, "s-cancel", "r-cancel")  # same request_id, other replica
        assert retry.status_code == 200, retry.text
        assert retry.json()["data"]["placement"] == "placed"
        assert retry.json()["data"]["pod_id"] == first.json()["data"]["pod_id"]
        await assert_four_places(redis, "s-cancel", first.json()["data"]["pod_id"])
        await assert_nothing_held(redis)


@real_mariadb_and_fake
async def test_a_timed_out_route_leaves_no_seat_and_its_request_id_runs_again(
    redis: Redis, db: Database
) -> None:
    async with two_replicas(redis, db, scope_full_timeout=0.3) as reps:
        await configure(reps.a, scope_concurrency=1, pod_concurrency=1)
        first = await route(reps.a, "s-held")
        late = await route(reps.b, "s-late", "r-late")
        assert_error(late, "SCOPE_FULL_TIMEOUT")
        assert not await seated(redis)
        assert not await redis.exists(route_marker(SID, "r-late"))
        await eos(reps.b, "s-held")
        retry = await route(reps.a, "s-late", "r-late")
        assert retry.status_code == 200, retry.text
        assert retry.json()["data"]["pod_id"] == first.json()["data"]["pod_id"]
        again = await route(reps.b, "s-late", "r-late")  # now it replays, on either replica
        assert again.json() == retry.json()


# --- failures in the middle of a flow --------------------------------------------------------


class SlowFailingK8s(FakeK8sPodClient):
    """A deploy takes ``latency`` seconds before it starts, so that the whole burst gathers
    behind the leader before an injected failure (``fail_next_deploys``) hits."""

    def __init__(self, latency: float) -> None:
        super().__init__()
        self.latency = latency

    async def deploy(self, **kwargs: Any) -> PodDeployInfo:
        await asyncio.sleep(self.latency)
        return await super().deploy(**kwargs)


@real_mariadb_and_fake
async def test_a_failed_deploy_fails_the_leader_and_its_followers_and_leaks_nothing(
    redis: Redis, db: Database
) -> None:
    k8s = SlowFailingK8s(latency=0.2)
    k8s.fail_next_deploys = 1
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=5.0) as reps:
        await configure(reps.a, scope_concurrency=16, pod_concurrency=8)  # max_pods 2
        async with sampling(redis) as peaks:
            outcomes, counts = await burst(reps, 8, prefix="fail")
        assert counts == {"NO_POD_AVAILABLE": 8}, counts
        assert peaks.followers >= 1  # followers were there to be failed
        assert k8s.deploy_calls == 1  # the followers did not each try again
        await assert_burst_answers(redis, outcomes, {"NO_POD_AVAILABLE"})
        assert k8s.pods == {}
        assert await redis.scard(sm_scope(SID, "sessions")) == 0
        assert await redis.zcard(sm_scope(SID, "pods")) == 0
        assert await redis.zcard(rm_scope(SID, "pods")) == 0
        await assert_nothing_held(redis)

        later = await route(reps.b, "fail-0")  # the next one deploys and succeeds
        assert later.status_code == 200, later.text
        assert k8s.deploy_calls == 2 and len(k8s.pods) == 1
        await assert_four_places(redis, "fail-0", later.json()["data"]["pod_id"])
        await assert_nothing_held(redis)


@real_mariadb_and_fake
async def test_a_deploy_that_never_gets_ready_leaves_no_pod_and_no_reservation(
    redis: Redis, db: Database
) -> None:
    k8s = FakeK8sPodClient()
    k8s.never_ready = True
    async with two_replicas(redis, db, k8s=k8s, scope_full_timeout=5.0) as reps:
        await configure(reps.a, scope_concurrency=12, pod_concurrency=6, ready_timeout=0.3)
        outcomes, counts = await burst(reps, 6, prefix="nr")
        assert counts == {"NO_POD_AVAILABLE": 6}, counts
        await assert_burst_answers(redis, outcomes, {"NO_POD_AVAILABLE"})
        assert k8s.deploy_calls == 1 and k8s.pods == {} and len(k8s.deleted) == 1
        await assert_nothing_held(redis)
        k8s.never_ready = False
        later = await route(reps.a, "nr-1")
        assert later.status_code == 200, later.text
        await assert_nothing_held(redis)


async def kill_connections(redis: Redis, kind: str) -> int:
    """CLIENT KILL every ``kind`` (normal | pubsub) connection of the test's own db index
    (other test runs on other db indexes of the same server keep theirs), except this one."""
    me = await redis.client_id()
    db_index = int(redis.connection_pool.connection_kwargs.get("db", 0))
    killed = 0
    for client in await redis.client_list(_type=kind):
        if int(client["db"]) == db_index and int(client["id"]) != me:
            killed += int(await redis.execute_command("CLIENT", "KILL", "ID", client["id"]))
    return killed


async def our_connections(redis: Redis, kind: str) -> int:
    db_index = int(redis.connection_pool.connection_kwargs.get("db", 0))
    return sum(int(c["db"]) == db_index for c in await redis.client_list(_type=kind))


@real_only
async def test_redis_connections_killed_mid_wait_end_in_contract_errors_and_leak_no_seat(
    redis: Redis, db: Database
) -> None:
    timeout = 1.0
    async with two_replicas(redis, db, scope_full_timeout=timeout) as reps:
        await configure(reps.a, scope_concurrency=2, pod_concurrency=2)
        held = await asyncio.gather(route(reps.a, "k-held-1"), route(reps.b, "k-held-2"))
        assert all(r.status_code == 200 for r in held)
        waiting = [
            asyncio.create_task(route(reps.pick(i), f"k-wait-{i}", f"r-k-{i}")) for i in range(4)
        ]
        await eventually(lambda: _zcard_is(redis, sm_scope(SID, "waiters"), 4), what="four seats")
        now = await _redis_now(redis)
        seats = await redis.zrange(sm_scope(SID, "waiters"), 0, -1, withscores=True)
        assert all(deadline <= now + timeout + 5 + 0.5 for _, deadline in seats), seats

        # both replicas' pools lose every link while the routes wait and poll
        assert await kill_connections(redis, "normal") >= 2
        answers = await asyncio.gather(*waiting)
        for resp in answers:  # a lost link is re-made (retries): they wait out their time
            assert_error(resp, resp.json().get("error_code", "?"))
            assert resp.json()["error_code"] in {"SCOPE_FULL_TIMEOUT", "BACKEND_UNAVAILABLE"}
        assert await redis.zrange(sm_scope(SID, "waiters"), 0, -1) == []
        await assert_nothing_held(redis)
        for i in range(4):
            assert not await redis.exists(route_marker(SID, f"r-k-{i}"))

        # the notifiers' pub/sub links too (each subscribed to the scope's channel while
        # something there listens to it): they reconnect, and the free signal works again
        async with contextlib.AsyncExitStack() as listening:
            for replica in (reps.a, reps.b):
                notifier = reps.services(replica).notifier
                await listening.enter_async_context(notifier.listen(sm_scope(SID, "free")))
            assert await kill_connections(redis, "pubsub") >= 2

            async def resubscribed() -> bool:
                return await our_connections(redis, "pubsub") >= 2

            await eventually(resubscribed, what="both notifiers subscribed again")
            waiter = asyncio.create_task(route(reps.b, "k-after", "r-k-after"))
            await eventually(lambda: seated(redis, "r-k-after"), what="a new waiter")
            await asyncio.sleep(0.05)
            started = time.monotonic()
            await eos(reps.a, "k-held-1")
            resp = await waiter
            assert resp.status_code == 200, resp.text
            assert time.monotonic() - started < 0.4  # the signal, not the 500 ms poll
        await assert_nothing_held(redis)


@real_only
async def test_redis_unreachable_mid_wait_is_503_and_a_seat_it_could_not_give_back_expires(
    redis: Redis, db: Database
) -> None:
    """Redis goes away while routes wait: they end with 503 BACKEND_UNAVAILABLE (not a hang,
    not a 500). The seats they could not give back carry their deadline (scope_full_timeout
    + 5 s), so the queue sheds them by itself once Redis is back."""
    timeout = 0.5
    conn = redis.connection_pool.connection_kwargs
    async with TcpProxy(conn.get("host", "127.0.0.1"), conn.get("port", 6379)) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/{conn.get('db', 0)}"
        async with two_replicas(
            redis, db, redis_url=url, redis_timeout=0.5, scope_full_timeout=timeout
        ) as reps:
            await configure(reps.a, scope_concurrency=1, pod_concurrency=1)  # queue of 2
            assert (await route(reps.a, "u-held")).status_code == 200
            waiting = [
                asyncio.create_task(route(reps.pick(i), f"u-wait-{i}", f"r-u-{i}"))
                for i in range(2)
            ]
            await eventually(lambda: _zcard_is(redis, sm_scope(SID, "waiters"), 2), what="2 seats")
            now = await _redis_now(redis)
            await proxy.stop()
            answers = await asyncio.wait_for(asyncio.gather(*waiting), 10)
            for resp in answers:
                assert_error(resp, "BACKEND_UNAVAILABLE")
            left = await redis.zrange(sm_scope(SID, "waiters"), 0, -1, withscores=True)
            assert {member for member, _ in left} <= {"r-u-0", "r-u-1"}
            assert all(deadline <= now + timeout + 5 + 0.5 for _, deadline in left), left

            await proxy.start()
            # their replay markers could not be given back either: they lapse with the route
            # lease (see test_a_route_that_failed_in_an_outage_runs_again_on_retry)
            for rid in ("r-u-0", "r-u-1"):
                assert await redis.pttl(route_marker(SID, rid)) <= 3000
            # while the stale seats hold the queue (2 × 1) full, a new waiter is refused ...
            if len(left) == 2:
                assert_error(await route(reps.b, "u-new"), "SCOPE_QUEUE_FULL")

            # ... and once their deadline passed the gate drops them: the queue works again
            async def shed() -> bool:
                return await _redis_now(redis) > max((d for _, d in left), default=0)

            await eventually(shed, within=timeout + 7, what="the seats' deadline")

            async def resubscribed() -> bool:  # else the wake-up is the 0.5 s poll = timeout
                return all(reps.services(r).notifier.connected for r in (reps.a, reps.b))

            await eventually(resubscribed, what="pub/sub back on both replicas")
            late = asyncio.create_task(route(reps.b, "u-later", "r-u-later"))
            await eventually(lambda: seated(redis, "r-u-later"), what="a seat after the shed")
            assert set(await redis.zrange(sm_scope(SID, "waiters"), 0, -1)) == {"r-u-later"}
            await eos(reps.a, "u-held")
            assert (await late).status_code == 200
            await assert_nothing_held(redis, pending_ok=frozenset({"r-u-0", "r-u-1"}))


@real_only
async def test_a_route_that_failed_in_an_outage_runs_again_on_retry(
    redis: Redis, db: Database
) -> None:
    """A route that lost Redis cannot give back its pending marker; the marker lives only
    the route lease (3 s, renewed while the route runs), and a retry told ``in_flight``
    waits out that lease too, then runs itself instead of answering 504."""
    conn = redis.connection_pool.connection_kwargs
    async with TcpProxy(conn.get("host", "127.0.0.1"), conn.get("port", 6379)) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/{conn.get('db', 0)}"
        async with two_replicas(
            redis, db, redis_url=url, redis_timeout=0.5, scope_full_timeout=0.5
        ) as reps:
            await configure(reps.a, scope_concurrency=1, pod_concurrency=1)
            assert (await route(reps.a, "o-held")).status_code == 200
            waiting = asyncio.create_task(route(reps.b, "o-retry", "r-o-retry"))
            await eventually(lambda: seated(redis, "r-o-retry"), what="the waiter's seat")
            await proxy.stop()
            assert_error(await asyncio.wait_for(waiting, 10), "BACKEND_UNAVAILABLE")
            await proxy.start()
            await eos(reps.a, "o-held")
            retry = await route(reps.a, "o-retry", "r-o-retry")  # the gateway retries
            assert retry.status_code == 200, retry.text


async def _zcard_is(redis: Redis, key: str, n: int) -> bool:
    return int(await redis.zcard(key)) == n


async def _redis_now(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return float(seconds) + micros / 1_000_000


# --- draining (SIGTERM) ------------------------------------------------------------------------


@real_mariadb_and_fake
async def test_a_draining_replica_answers_its_waiters_refuses_new_routes_and_keeps_touch(
    redis: Redis, db: Database
) -> None:
    """What the stop signal starts (``Services.drain``): /healthz 503 at once, a waiting route
    answered 503 BACKEND_UNAVAILABLE + retry_after within a poll (its seat given back), a new
    route refused the same way — while the other replica goes on serving."""
    async with two_replicas(redis, db, scope_full_timeout=10.0) as reps:
        await configure(reps.a, scope_concurrency=1, pod_concurrency=1)
        assert (await route(reps.a, "d-held")).status_code == 200
        waiting = asyncio.create_task(route(reps.a, "d-wait", "r-d-wait"))
        await eventually(lambda: seated(redis, "r-d-wait"), what="the waiter's seat")
        loop = asyncio.get_running_loop()
        started = loop.time()
        reps.services(reps.a).drain()
        assert (await reps.a.get("/healthz")).status_code == 503
        answer = await asyncio.wait_for(waiting, 5)
        assert loop.time() - started < 2.0, "answered at the next poll, not at the timeout"
        assert_error(answer, "BACKEND_UNAVAILABLE")
        assert not await seated(redis, "r-d-wait")
        assert_error(await route(reps.a, "d-new"), "BACKEND_UNAVAILABLE")
        touched = await reps.a.post(TOUCH, json=envelope({}, session_id="d-held"))
        assert touched.json()["data"] == {"touched": True}
        # the retry lands on the other replica, which serves it once a slot frees
        retry = asyncio.create_task(route(reps.b, "d-wait", "r-d-wait-2"))
        await eventually(lambda: seated(redis, "r-d-wait-2"), what="the retry's seat")
        await eos(reps.a, "d-held")
        assert (await retry).status_code == 200
        await assert_nothing_held(redis)
