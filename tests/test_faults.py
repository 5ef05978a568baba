"""Failure handling, tested: each test injects one fault and checks the invariant it threatens.

Faults: Redis slow (``TcpProxy.latency``), Redis losing its data (FLUSHDB of our claimed db),
the DB down (``TcpProxy`` stopped), Kubernetes API errors (the real client against an
in-process ``KubeSim``), route tasks cancelled mid-Redis-call, and replies of replay-safe
scripts lost so that redis-py's retry re-sends them (``TcpProxy.intercept``).

The invariants: an answer within a bound (never a hang), a contract error (503
BACKEND_UNAVAILABLE / NO_POD_AVAILABLE with retry_after, 502 K8S_ERROR), no over-admission
(scope_concurrency, pod_concurrency, max_pods), nothing held beyond its lease (queue seats,
reservations, pending markers, deploy placeholders and locks), one execution's effect for a
re-sent script, and recovery without a restart once the fault is gone.

State is read through the contract's literal key names. Waits poll with deadlines.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import random
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
from sqlalchemy.engine import make_url

from agent_runtime import lua
from agent_runtime.db.engine import Database
from agent_runtime.db.tables import routing_rule, service_config_template
from agent_runtime.resource_manager import k8s_deploy as k8s_module
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.k8s_real import RealK8sPodClient
from agent_runtime.resource_manager.models import SCOPE_LABEL
from agent_runtime.session_manager.state import ROUTE_LEASE
from agent_runtime.wiring import REDIS_RETRIES, Services, build_redis, redis_pool_size
from contract_keys import (
    rm_pods_known,
    rm_scope,
    route_marker,
    sm_expiry,
    sm_pod,
    sm_pods_registered,
    sm_scope,
    sm_session,
)
from helpers import (
    CLAIM_KEY,
    TcpProxy,
    deploy_locks,
    envelope,
    fake_only,
    follower_seats,
    make_settings,
    other_client,
    real_mariadb_and_fake,
    real_only,
    real_redis_url,
    redis_state,
    running_app,
    sync_body,
)
from kubesim import KubeSim

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
SYNC = "/api/session/config_sync"
CLEANUP = "/api/session/cleanup"
GROUP, BOT = "grp-f", "bot-f"
SID = hashlib.md5(f"{GROUP}\x00{BOT}".encode()).hexdigest()  # contract §1

STATUS = {
    "SCOPE_QUEUE_FULL": 503,
    "NO_POD_AVAILABLE": 503,
    "BACKEND_UNAVAILABLE": 503,
    "SCOPE_FULL_TIMEOUT": 504,
}


# --- the contract's key names (§4), spelled out --------------------------------------------


# --- apps, calls, checks ------------------------------------------------------------------------


def app_redis(redis: Redis, url: str | None = None, timeout: float = 2.0) -> Redis:
    """A replica's own Redis client, built as the service builds it (``build_redis``: pool,
    timeouts, retries), on the fixture's server and db, or at ``url`` (a proxy to it)."""
    kwargs = redis.connection_pool.connection_kwargs
    if "server" in kwargs:  # fakeredis: what build_redis does in local mode, on our server
        return FakeAsyncRedis(
            server=kwargs["server"],
            decode_responses=True,
            connection_pool_class=BlockingConnectionPool,
            max_connections=redis_pool_size(make_settings()),
        )
    return build_redis(make_settings(redis_url=url or real_redis_url(), redis_timeout=timeout))


def proxied_url(redis: Redis, proxy: TcpProxy) -> str:
    return f"redis://127.0.0.1:{proxy.port}/{redis.connection_pool.connection_kwargs.get('db', 0)}"


def redis_proxy(redis: Redis, **kwargs: Any) -> TcpProxy:
    conn = redis.connection_pool.connection_kwargs
    return TcpProxy(conn.get("host", "127.0.0.1"), conn.get("port", 6379), **kwargs)


@asynccontextmanager
async def app_over(
    redis: Redis,
    db: Database,
    *,
    url: str | None = None,
    redis_timeout: float = 2.0,
    k8s: K8sPodClient | None = None,
    **settings: Any,
) -> AsyncIterator[httpx.AsyncClient]:
    """One replica with its own production-built Redis client (closed afterwards)."""
    client = app_redis(redis, url, redis_timeout)
    try:
        async with running_app(client, db, k8s=k8s, **settings) as app:  # type: ignore[arg-type]
            yield app
    finally:
        await client.aclose()


def services(app: httpx.AsyncClient) -> Services:
    svc: Services = app.app.state.services  # type: ignore[attr-defined]
    return svc


def template(template_id: str = "tpl-f", **fields: Any) -> dict[str, Any]:
    return {
        "template_id": template_id,
        "image": "agentserver:1",
        "ready_poll_interval": 0.02,
        **fields,
    }


async def configure(
    app: httpx.AsyncClient, *, scope_concurrency: int, pod_concurrency: int, **fields: Any
) -> None:
    item = template(scope_concurrency=scope_concurrency, pod_concurrency=pod_concurrency, **fields)
    resp = await app.post(SYNC, json=sync_body("template", "create", item))
    assert resp.status_code == 200, resp.text
    rule = {"group_id": GROUP, "bot_id": BOT, "template_id": item["template_id"]}
    resp = await app.post(SYNC, json=sync_body("routing_rule", "create", rule))
    assert resp.status_code == 200, resp.text


def route_body(
    session_id: str, request_id: str | None = None, group: str = GROUP, bot: str = BOT
) -> dict[str, Any]:
    return envelope(
        request_id=request_id or f"r-{uuid.uuid4().hex[:12]}",
        session_id=session_id,
        bot_id=bot,
        extra={"group_id": group},
    )


async def route(
    app: httpx.AsyncClient, session_id: str, request_id: str | None = None, **where: str
) -> httpx.Response:
    return await app.post(ROUTE, json=route_body(session_id, request_id, **where))


async def touch(app: httpx.AsyncClient, session_id: str, *, eos: bool = False) -> dict[str, Any]:
    resp = await app.post(TOUCH, json=envelope({"eos": eos} if eos else {}, session_id=session_id))
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()["data"]
    return data


def assert_error(resp: httpx.Response, code: str) -> None:
    """A failure envelope of the contract: the code's status, retry_after in body and header."""
    body = resp.json()
    assert resp.status_code == STATUS[code], resp.text
    assert body["ok"] is False and body["error_code"] == code, body
    assert body["error_message"] and "Traceback" not in body["error_message"], body
    assert isinstance(body["retry_after"], int) and body["retry_after"] >= 1, body
    assert resp.headers["retry-after"] == str(body["retry_after"])


def pod_of(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    pod: str = resp.json()["data"]["pod_id"]
    return pod


async def eventually(
    check: Callable[[], Awaitable[bool]], within: float = 5.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {within} s")
        await asyncio.sleep(0.01)


async def redis_now(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return float(seconds) + micros / 1_000_000


async def assert_limits(redis: Redis, scope_concurrency: int, pod_concurrency: int) -> None:
    """The scope and pod limits hold, and the four places of every live session agree."""
    members = await redis.smembers(sm_scope(SID, "sessions"))
    assert len(members) <= scope_concurrency, members
    on_pods: set[str] = set()
    registered = set(await redis.smembers(sm_pods_registered(SID)))
    for pod in registered | set(await redis.zrange(sm_scope(SID, "pods"), 0, -1)):
        sessions = await redis.smembers(sm_pod(SID, pod, "sessions"))
        assert len(sessions) <= pod_concurrency, (pod, sessions)
        assert not sessions & on_pods, "a session on two pods"
        on_pods |= sessions
    assert on_pods == members, (on_pods, members)
    for session_id in members:
        binding = await redis.hgetall(sm_session(SID, session_id))
        assert binding.get("scope_id") == SID, (session_id, binding)
        assert session_id in await redis.smembers(sm_pod(SID, binding["pod_id"], "sessions"))
        assert await redis.zscore(sm_expiry(SID), session_id) is not None, session_id


async def assert_four_places(redis: Redis, session_id: str, pod_id: str) -> None:
    binding = await redis.hgetall(sm_session(SID, session_id))
    assert binding.get("scope_id") == SID and binding.get("pod_id") == pod_id, binding
    assert await redis.zscore(sm_expiry(SID), session_id) is not None, session_id
    assert await redis.sismember(sm_scope(SID, "sessions"), session_id), session_id
    assert await redis.sismember(sm_pod(SID, pod_id, "sessions"), session_id), session_id


async def held(redis: Redis) -> dict[str, Any]:
    """What routes and acquires of the scope hold that is still live: queue seats and
    reservations whose deadline has not passed, follower seats, unexpired deploy
    placeholders, deploy locks, pending replay markers."""
    now = await redis_now(redis)
    placeholders = [
        m
        for m in await redis.smembers(rm_scope(SID, "deploying"))
        if float(m.rpartition("@")[2] or 0) >= int(now)
    ]
    pending = [
        key
        async for key in redis.scan_iter(match="session_manager:route:*", count=1000)
        if str(await redis.get(key) or "").startswith("pending:")
    ]
    found = {
        "waiters": await redis.zrangebyscore(sm_scope(SID, "waiters"), now, "+inf"),
        "reserved": await redis.zrangebyscore(sm_scope(SID, "reserved"), now, "+inf"),
        "followers": await follower_seats(redis, SID),
        "placeholders": placeholders,
        "budget_reservations": [  # a pod on its way's unit (a pod's own is +inf)
            u
            for u in await redis.zrangebyscore(BUDGET_PODS, now, "(+inf")
            if u.startswith(f"{SID}:")
        ],
        "deploy_locks": await deploy_locks(redis, SID),
        "pending": pending,
    }
    return {k: v for k, v in found.items() if v}


async def nothing_held_within(redis: Redis, within: float) -> None:
    """Everything taken is given back, or lapses with its lease, by ``within`` seconds."""
    last: dict[str, Any] = {}

    async def empty() -> bool:
        nonlocal last
        last = await held(redis)
        return not last

    deadline = time.monotonic() + within
    while not await empty():
        if time.monotonic() > deadline:
            pytest.fail(f"still held after {within} s: {last}")
        await asyncio.sleep(0.05)


def script_sha(package: str, name: str, prelude: str | tuple[str, ...] | None = None) -> bytes:
    """The SHA1 redis-py's EVALSHA sends for one of our scripts."""
    return hashlib.sha1(lua.source(package, name, prelude=prelude).encode()).hexdigest().encode()


SM, RM = "agent_runtime.session_manager", "agent_runtime.resource_manager"
BUDGET_PODS = "resource_manager:budget:{budget}:pods"  # the installation's pod budget
SCRIPTS = {  # each module's scripts come after its key builders (lua/_keys.lua)
    "route_place": (SM, "route_place", ("_keys", "_session")),
    "touch": (SM, "touch", ("_keys", "_session")),
    "waiter_gate": (lua.SHARED, "seat_gate", None),  # the shared seat gate, as the queue's
    "acquire": (RM, "acquire", ("_keys", "_placeholders")),
    "deploy_claim": (RM, "deploy_claim", ("_keys", "_placeholders")),
    "budget_reserve": (RM, "budget_reserve", ("_keys", "_budget")),
}
ROUTE_PLACE_SHA = script_sha(*SCRIPTS["route_place"])
TOUCH_SHA = script_sha(*SCRIPTS["touch"])
WAITER_GATE_SHA = script_sha(*SCRIPTS["waiter_gate"])
ACQUIRE_SHA = script_sha(*SCRIPTS["acquire"])
CLAIM_SHA = script_sha(*SCRIPTS["deploy_claim"])
RESERVE_SHA = script_sha(*SCRIPTS["budget_reserve"])


async def load_scripts(redis: Redis) -> None:
    """Loaded on the server first: an intercepted EVALSHA is the script's own call, not a
    NOSCRIPT answer followed by a load."""
    for package, name, prelude in SCRIPTS.values():
        await redis.script_load(lua.source(package, name, prelude=prelude))


def first_match(*needles: bytes, action: str, times: int = 1) -> Callable[[bytes], str | None]:
    """An intercept for ``TcpProxy``: ``action`` for the first ``times`` requests that contain
    every needle."""
    left = times

    def intercept(chunk: bytes) -> str | None:
        nonlocal left
        if left > 0 and all(n in chunk for n in needles):
            left -= 1
            return action
        return None

    return intercept


# --- 1. Redis slow --------------------------------------------------------------------------
#
# build_redis: command and connect timeout = redis_timeout, Retry(ExponentialBackoff(cap=0.1),
# retries=REDIS_RETRIES) on ConnectionError and TimeoutError, no health-check PING. redis-py
# uses that one Retry for the command and for connect(), so on a connection it has to make the
# attempts multiply: attempts² × (timeout + backoff) per command is what "never hangs" can
# promise; on a connection already made, attempts × timeout. A route that fails on a Redis
# error makes ONE command (route_place): it gives back nothing else (the lease does).

REDIS_TIMEOUT = 0.5
SLOW = 2.0  # injected latency per chunk, far beyond the command timeout
ATTEMPTS, BACKOFF_CAP = REDIS_RETRIES + 1, 0.1


def policy_bound(timeout: float, commands: int = 1) -> float:
    return commands * (ATTEMPTS * timeout + (ATTEMPTS - 1) * BACKOFF_CAP) + 0.5


def hard_bound(timeout: float, commands: int = 1) -> float:
    return commands * ATTEMPTS**2 * (timeout + BACKOFF_CAP) + 1.0


async def slow_routes(
    app: httpx.AsyncClient, calls: list[tuple[str, str]], within: float
) -> list[tuple[httpx.Response, float]]:
    """The routes at once; each answer with the seconds it took."""
    started = time.monotonic()

    async def timed(session_id: str, request_id: str) -> tuple[httpx.Response, float]:
        resp = await route(app, session_id, request_id)
        return resp, time.monotonic() - started

    return list(await asyncio.wait_for(asyncio.gather(*(timed(*c) for c in calls)), within))


@real_only
async def test_slow_redis_is_a_503_that_never_hangs_admits_within_limits_and_recovers(
    redis: Redis, db: Database
) -> None:
    sc = pc = 4  # one pod; room for the warm session, the late ones and the recovery
    async with (
        redis_proxy(redis) as proxy,
        app_over(
            redis,
            db,
            url=proxied_url(redis, proxy),
            redis_timeout=REDIS_TIMEOUT,
            scope_full_timeout=1.0,
        ) as app,
    ):
        await configure(app, scope_concurrency=sc, pod_concurrency=pc)
        pod = pod_of(await route(app, "slow-warm"))

        proxy.latency = SLOW
        calls = [("slow-warm", "r-slow-0"), ("slow-new-1", "r-slow-1"), ("slow-new-2", "r-slow-2")]
        bound = hard_bound(REDIS_TIMEOUT)
        answers = await slow_routes(app, calls, within=bound + 5)
        for resp, elapsed in answers:
            assert_error(resp, "BACKEND_UNAVAILABLE")
            assert elapsed <= bound, f"{elapsed:.1f} s for a 503 (bound {bound:.1f} s)"
        touched = await app.post(TOUCH, json=envelope({}, session_id="slow-warm"))
        assert_error(touched, "BACKEND_UNAVAILABLE")

        # the latency goes; requests whose callers gave up still reach Redis when their wait
        # ends: replay-safe scripts, so whatever they write stays within the limits
        proxy.latency = 0.0

        async def drained() -> bool:
            return proxy.delayed == 0

        await eventually(drained, within=SLOW + 2, what="the delayed requests delivered")
        await assert_limits(redis, sc, pc)
        await nothing_held_within(redis, ROUTE_LEASE + 1)  # late scope_full markers lapse

        # recovery, without a restart
        deadline = time.monotonic() + 10
        while (after := await route(app, "slow-after")).status_code != 200:
            assert_error(after, "BACKEND_UNAVAILABLE")
            assert time.monotonic() < deadline, "no recovery within 10 s"
            await asyncio.sleep(0.1)
        assert pod_of(after) == pod
        # the gateway retries the failed calls with their request ids: one answer each, on
        # the one pod (a late placement replays as "placed", the warm session refreshes)
        for session_id, request_id in calls:
            retry = await route(app, session_id, request_id)
            assert pod_of(retry) == pod
            again = await route(app, session_id, request_id)
            assert again.json() == retry.json()
        assert await redis.smembers(sm_scope(SID, "sessions")) == {
            "slow-warm",
            "slow-new-1",
            "slow-new-2",
            "slow-after",
        }
        assert await touch(app, "slow-warm") == {"touched": True}
        await assert_limits(redis, sc, pc)


@real_only
async def test_slow_redis_503_comes_within_the_retry_policy_bound(
    redis: Redis, db: Database
) -> None:
    timeout = 0.25
    async with (
        redis_proxy(redis) as proxy,
        app_over(redis, db, url=proxied_url(redis, proxy), redis_timeout=timeout) as app,
    ):
        await configure(app, scope_concurrency=4, pod_concurrency=4)
        pod_of(await route(app, "policy-warm"))
        # a Redis that turned slow has cost the replica its connections: they are re-made
        await services(app).backends.redis.connection_pool.disconnect()
        proxy.latency = SLOW
        calls = [("policy-warm", "r-policy-0"), ("policy-new", "r-policy-1")]
        answers = await slow_routes(app, calls, within=hard_bound(timeout) + 5)
        proxy.latency = 0.0
        for resp, _ in answers:
            assert_error(resp, "BACKEND_UNAVAILABLE")
        slowest = max(elapsed for _, elapsed in answers)
        assert slowest <= policy_bound(timeout), f"{slowest:.2f} s > {policy_bound(timeout):.2f} s"


# --- 2. Redis loses its data -----------------------------------------------------------------

FAST_JOBS: dict[str, Any] = {
    "jobs_enabled": True,
    "sweep_interval": 0.1,
    "autoscale_interval": 0.1,
    "reclaim_interval": 0.1,
    "watch_interval": 0.2,
    "reconcile_interval": 0.2,
}


async def wipe(redis: Redis) -> None:
    """FLUSHDB of our own db: the real one keeps its claim marker (one transaction)."""
    owner = await redis.get(CLAIM_KEY)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.flushdb()
        if owner is not None:
            pipe.set(CLAIM_KEY, owner)
        await pipe.execute()


@dataclass
class Peaks:
    """Highest counts seen by sampling Redis (one MULTI per sample) while routes run."""

    scope_sessions: int = 0
    pod_sessions: int = 0
    rm_pods: int = 0
    candidates: int = 0
    samples: int = 0
    per_pod: dict[str, int] = field(default_factory=dict)


@asynccontextmanager
async def sampling(redis: Redis) -> AsyncIterator[Peaks]:
    peaks = Peaks()
    observer = other_client(redis)
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            registered = await observer.smembers(sm_pods_registered(SID))
            pods = sorted(set(registered) | set(peaks.per_pod))
            async with observer.pipeline(transaction=True) as pipe:
                pipe.scard(sm_scope(SID, "sessions"))
                pipe.zcard(rm_scope(SID, "pods"))
                pipe.zcard(sm_scope(SID, "pods"))
                for pod in pods:
                    pipe.scard(sm_pod(SID, pod, "sessions"))
                counts = await pipe.execute()
            peaks.scope_sessions = max(peaks.scope_sessions, counts[0])
            peaks.rm_pods = max(peaks.rm_pods, counts[1])
            peaks.candidates = max(peaks.candidates, counts[2])
            for pod, n in zip(pods, counts[3:], strict=True):
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


@real_mariadb_and_fake
async def test_redis_losing_its_data_over_admits_nothing_and_reconcile_heals(
    redis: Redis, db: Database
) -> None:
    sc, pc = 4, 2  # max_pods 2
    k8s = FakeK8sPodClient()
    settings: dict[str, Any] = {"k8s": k8s, "scope_full_timeout": 0.5, **FAST_JOBS}
    async with (
        app_over(redis, db, instance_id="replica-a", **settings) as a,
        app_over(redis, db, instance_id="replica-b", **settings) as b,
    ):
        await configure(a, scope_concurrency=sc, pod_concurrency=pc, pod_ttl=1)
        before = [await route((a, b)[i % 2], f"old-{i}") for i in range(sc)]
        old_pods = {pod_of(r) for r in before}
        assert len(old_pods) == 2 and set(k8s.pods) == old_pods

        await wipe(redis)  # both replicas running, their jobs ticking every 0.1-0.2 s
        assert await touch(b, "old-0") == {"touched": False}  # the gateway routes again
        again = await route(a, "old-0")
        assert again.status_code == 200, again.text
        assert again.json()["data"]["placement"] == "placed"

        async with sampling(redis) as peaks:
            calls = [(f"new-{i}", (a, b)[i % 2]) for i in range(8)]
            calls += [(f"old-{i}", (b, a)[i % 2]) for i in range(1, sc)]
            answers = await asyncio.gather(*(route(app, s) for s, app in calls))
        codes = collections.Counter(
            "OK" if r.status_code == 200 else r.json()["error_code"] for r in answers
        )
        assert set(codes) <= {"OK", "SCOPE_QUEUE_FULL", "SCOPE_FULL_TIMEOUT", "NO_POD_AVAILABLE"}
        for resp in answers:
            if resp.status_code != 200:
                assert_error(resp, resp.json()["error_code"])
        assert 1 <= codes["OK"] <= sc - 1, codes
        assert peaks.scope_sessions <= sc and peaks.pod_sessions <= pc, peaks
        assert peaks.rm_pods <= 2 and peaks.candidates <= 2, peaks
        placed = {s: pod_of(r) for (s, _), r in zip(calls, answers, strict=True) if r.is_success}
        placed["old-0"] = pod_of(again)
        for session_id, pod in placed.items():
            assert (await redis.hgetall(sm_session(SID, session_id)))["pod_id"] == pod
        await assert_limits(redis, sc, pc)

        # reconcile: each pod Kubernetes still has is adopted or deleted; in the end Redis and
        # Kubernetes agree, within max_pods, and no pod with a live session was deleted
        async def converged() -> bool:
            known = set(await rm_pods_known(redis))
            return known == set(k8s.pods) and not await held(redis)

        await eventually(converged, within=10, what="Redis and Kubernetes agreeing")
        assert len(k8s.pods) <= 2
        for pod in old_pods:
            assert pod in k8s.pods or pod in k8s.deleted, pod
        live = await redis.smembers(sm_scope(SID, "sessions"))
        assert live == set(placed)
        for session_id in live:
            assert placed[session_id] in k8s.pods, "a pod with a live session was deleted"

        assert await touch(b, "old-0") == {"touched": True}
        await assert_limits(redis, sc, pc)


# --- 3. the DB down ----------------------------------------------------------------------------


async def db_rows(db: Database) -> dict[str, list[tuple[Any, ...]]]:
    def read(conn: Any) -> dict[str, list[tuple[Any, ...]]]:
        return {
            table.name: sorted(tuple(row) for row in conn.execute(table.select()))
            for table in (service_config_template, routing_rule)
        }

    return await db.read(read)


@pytest.mark.parametrize(
    ("redis", "sql_backend"), [("real", "mariadb"), ("fake", "postgresql")], indirect=True
)
async def test_db_down_cached_scopes_route_uncached_get_503_config_sync_changes_nothing(
    redis: Redis, db: Database, migrated_url: str
) -> None:
    url = make_url(migrated_url)
    default_port = 3306 if url.get_backend_name() in ("mysql", "mariadb") else 5432
    async with TcpProxy(url.host or "127.0.0.1", url.port or default_port) as proxy:
        through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        proxied = Database.from_url(through, pool_size=2, connect_timeout=1)
        try:
            async with app_over(redis, proxied, scope_full_timeout=1.0) as app:
                # pod_concurrency 1: a second session needs a pod deployed from the cache alone
                await configure(app, scope_concurrency=3, pod_concurrency=1)
                rule = {"group_id": "*", "bot_id": "*", "template_id": "tpl-f"}
                resp = await app.post(SYNC, json=sync_body("routing_rule", "create", rule))
                assert resp.status_code == 200, resp.text
                first = pod_of(await route(app, "db-1"))  # the scope's policy is now cached

                await proxy.stop()
                started = time.monotonic()
                refresh = await route(app, "db-1")
                assert pod_of(refresh) == first
                assert refresh.json()["data"]["placement"] == "refresh"
                placed = await route(app, "db-2")
                assert placed.json()["data"]["placement"] == "placed", placed.text
                assert pod_of(placed) != first  # deployed with the cached pod spec
                assert await touch(app, "db-1") == {"touched": True}

                uncached = await route(app, "db-x", group="grp-other", bot="bot-other")
                assert_error(uncached, "BACKEND_UNAVAILABLE")
                before_db, before_redis = await db_rows(db), await redis_state(redis)
                update = {"template_id": "tpl-f", "scope_concurrency": 1}
                resp = await app.post(SYNC, json=sync_body("template", "update", update))
                assert resp.status_code == 503, resp.text
                assert resp.json()["error_code"] == "BACKEND_UNAVAILABLE"
                assert int(resp.headers["retry-after"]) >= 1
                assert time.monotonic() - started < 10, "a dead DB is a fast answer"
                assert await db_rows(db) == before_db
                assert await redis_state(redis) == before_redis
                await assert_limits(redis, 3, 1)

                await proxy.start()
                deadline = time.monotonic() + 10
                while (
                    back := await route(app, "db-x", group="grp-other", bot="bot-other")
                ).status_code != 200:
                    assert_error(back, "BACKEND_UNAVAILABLE")
                    assert time.monotonic() < deadline, "the DB came back, routes did not"
                    await asyncio.sleep(0.1)
                resp = await app.post(SYNC, json=sync_body("template", "update", update))
                assert resp.status_code == 200, resp.text
                assert resp.json()["data"]["change_class"] == "policy"
                config = await services(app).config_store.resolve(SID, GROUP, BOT)
                assert config.scope_concurrency == 1  # the next route sees the new policy
                assert (await route(app, "db-1")).json()["data"]["placement"] == "refresh"
        finally:
            await proxied.close()


# --- 4. Kubernetes API errors (the real client against the simulator) ------------------------


@dataclass
class Cluster:
    sim: KubeSim
    app: httpx.AsyncClient
    redis: Redis

    def ours(self, namespace: str | None = None) -> list[str]:
        return sorted(
            p["metadata"]["name"]
            for p in self.sim.pods(namespace)
            if (p["metadata"].get("labels") or {}).get(SCOPE_LABEL) == SID
        )


@pytest.fixture
async def cluster(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster]:
    """The app with RealK8sPodClient on an in-process KubeSim (its kubeconfig); jobs by hand."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)  # kubernetes_asyncio honours them (trust_env)
    monkeypatch.delenv("all_proxy", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # never in-cluster here
    async with KubeSim(
        ready_delay=0.05, grace_period=0.3, probe_period=0.05, namespaces=("default",), seed=7
    ) as sim:
        client = RealK8sPodClient(kubeconfig=str(sim.kubeconfig_path), default_namespace="default")
        try:
            async with running_app(redis, db, k8s=client) as app:  # type: ignore[arg-type]
                yield Cluster(sim, app, redis)
        finally:
            await client.close()


def k8s_template(**fields: Any) -> dict[str, Any]:
    return {
        "pod_name": "agent",
        "image": "registry.local/agent:1.0",
        "sse_port": 8080,
        "ready_poll_interval": 0.03,
        **fields,
    }


async def configure_k8s(
    c: Cluster, *, scope_concurrency: int, pod_concurrency: int, **fields: Any
) -> None:
    await configure(
        c.app,
        scope_concurrency=scope_concurrency,
        pod_concurrency=pod_concurrency,
        **k8s_template(**fields),
    )


async def assert_cold_scope_left_clean(c: Cluster) -> None:
    """A failed cold route gave back what it took, at once: no session, reservation, seat,
    placeholder, lock or pending marker, and no pod in the cluster."""
    assert await held(c.redis) == {}
    assert await c.redis.scard(sm_scope(SID, "sessions")) == 0
    assert await c.redis.zcard(rm_scope(SID, "pods")) == 0
    assert c.ours() == []


@fake_only
async def test_k8s_403_on_create_is_a_fast_503_that_leaves_nothing(cluster: Cluster) -> None:
    c = cluster
    await configure_k8s(c, scope_concurrency=1, pod_concurrency=1, ready_timeout=5)  # max_pods 1
    c.sim.faults.add("api_error", status=403, verb="create")
    started = time.monotonic()
    resp = await route(c.app, "k-403")
    assert_error(resp, "NO_POD_AVAILABLE")
    assert time.monotonic() - started < 2.0, "a 403 is final: not retried until ready_timeout"
    assert c.sim.requests["create pods"] == 1
    await assert_cold_scope_left_clean(c)

    c.sim.faults.clear()
    again = await route(c.app, "k-403")  # max_pods 1: a leaked placeholder would refuse it
    assert again.status_code == 200, again.text
    assert again.json()["data"]["placement"] == "placed", again.text
    assert c.ours() == [pod_of(again)]


@fake_only
async def test_k8s_5xx_and_429_on_create_are_retried_within_ready_timeout(
    cluster: Cluster,
) -> None:
    c = cluster
    ready_timeout = 2.5
    await configure_k8s(c, scope_concurrency=1, pod_concurrency=1, ready_timeout=ready_timeout)
    # failing for longer than ready_timeout: a clean failure at the deadline
    c.sim.faults.add("api_error", status=500, verb="create")
    started = time.monotonic()
    assert_error(await route(c.app, "k-5xx"), "NO_POD_AVAILABLE")
    assert time.monotonic() - started < ready_timeout + 1.5
    assert c.sim.requests["create pods"] >= 2, "retried"
    await assert_cold_scope_left_clean(c)

    # failing for a while: retried (Retry-After honoured), then placed on one pod
    c.sim.faults.clear()
    c.sim.requests.clear()
    c.sim.faults.add("api_error", status=503, verb="create", count=2)
    c.sim.faults.add("api_error", status=429, verb="create", count=1, retry_after=1)
    started = time.monotonic()
    resp = await route(c.app, "k-5xx")
    assert resp.json()["data"]["placement"] == "placed", resp.text
    assert 1.0 <= time.monotonic() - started < ready_timeout + 1.0
    assert c.sim.requests["create pods"] == 4
    assert c.ours() == [pod_of(resp)], "one pod, however many creates"
    assert await held(c.redis) == {}


@fake_only
async def test_k8s_api_that_hangs_is_a_bounded_failure_that_releases_capacity(
    cluster: Cluster,
) -> None:
    c = cluster
    ready_timeout = 1.0
    await configure_k8s(c, scope_concurrency=1, pod_concurrency=1, ready_timeout=ready_timeout)
    for verb in ("create", "get"):  # the create hangs; or it lands and readiness reads hang
        fault = c.sim.faults.add("latency", seconds=10, verb=verb)
        started = time.monotonic()
        assert_error(await route(c.app, f"k-hang-{verb}"), "NO_POD_AVAILABLE")
        assert time.monotonic() - started < ready_timeout + 1.5, verb
        c.sim.faults.remove(fault.id)
        # no pod: the hanging create was cut at the deadline; a pod whose readiness reads
        # hung was deleted at once (grace 0) by the failed deploy
        await assert_cold_scope_left_clean(c)

    resp = await route(c.app, "k-hang-after")  # max_pods 1: the capacity is all back
    assert resp.json()["data"]["placement"] == "placed", resp.text
    assert c.ours() == [pod_of(resp)]


@fake_only
async def test_k8s_409_name_clash_is_placed_under_a_new_name(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = cluster
    await configure_k8s(c, scope_concurrency=1, pod_concurrency=1, ready_timeout=5)
    taken, fresh = "agent-taken00000-aaaaa", "agent-fresh00000-bbbbb"
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": taken, "labels": {"app": "someone-else"}},
        "spec": {"containers": [{"name": "other", "image": "other:1"}]},
    }
    async with httpx.AsyncClient(base_url=c.sim.url, trust_env=False) as http:
        created = await http.post("/api/v1/namespaces/default/pods", json=body)
    assert created.status_code == 201, created.text
    uid = created.json()["metadata"]["uid"]
    names = iter([taken, fresh])
    monkeypatch.setattr(k8s_module, "new_pod_name", lambda _: next(names))

    resp = await route(c.app, "k-409")
    assert resp.json()["data"]["placement"] == "placed", resp.text
    assert pod_of(resp) == fresh
    assert c.sim.requests["create pods"] == 3  # the foreign pod, the clash, the new name
    other = c.sim.pod("default", taken)
    assert other is not None and other["metadata"]["uid"] == uid, "another's pod is never touched"
    assert "deletionTimestamp" not in other["metadata"]
    assert c.ours() == [fresh]
    await assert_four_places(c.redis, "k-409", fresh)


@fake_only
async def test_k8s_watch_and_reconcile_while_list_answers_500_delete_nothing(
    cluster: Cluster,
) -> None:
    c = cluster
    await configure_k8s(c, scope_concurrency=2, pod_concurrency=1, ready_timeout=5)
    pods = {s: pod_of(await route(c.app, s)) for s in ("k-w-1", "k-w-2")}
    assert c.ours() == sorted(pods.values())
    pool_jobs = services(c.app).pool_jobs

    c.sim.faults.add("api_error", status=500, verb="list")
    for _ in range(3):  # more than the two passes that make a pod half-dead
        assert await pool_jobs.watch_once() == 0
        counts = await pool_jobs.reconcile_once()
        assert counts["purged"] == counts["deleted"] == 0, counts
    assert c.sim.injected["api_error 500"] >= 6
    assert c.sim.requests["delete pods"] == 0
    assert c.ours() == sorted(pods.values())
    for session_id, pod in pods.items():
        assert await touch(c.app, session_id) == {"touched": True}
        await assert_four_places(c.redis, session_id, pod)

    c.sim.faults.clear()
    assert await pool_jobs.watch_once() == 0  # the pods are fine: nothing to clean
    for session_id, pod in pods.items():
        resp = await route(c.app, session_id)
        assert pod_of(resp) == pod and resp.json()["data"]["placement"] == "refresh"


@fake_only
async def test_k8s_cleanup_refused_delete_is_502_missing_namespace_is_0(cluster: Cluster) -> None:
    """(namespace_forbidden → 502 and a namespace that never existed → 0 are in
    test_k8s_real_sim.py.) Here: LIST allowed but DELETE forbidden (RBAC without delete) is
    502 K8S_ERROR, never a silent count; a namespace that disappears → cleaned 0."""
    c = cluster
    await configure_k8s(c, scope_concurrency=2, pod_concurrency=1, ready_timeout=5)
    for s in ("k-c-1", "k-c-2"):
        pod_of(await route(c.app, s))
    before = c.ours()

    c.sim.faults.add("api_error", status=403, verb="delete")
    resp = await c.app.post(CLEANUP, json=envelope({}))
    assert resp.status_code == 502, resp.text
    assert resp.json()["error_code"] == "K8S_ERROR" and "403" in resp.json()["error_message"]
    assert "retry_after" not in resp.json()
    assert c.ours() == before

    c.sim.faults.clear()
    c.sim.faults.add("namespace_missing", namespace="default")
    resp = await c.app.post(CLEANUP, json=envelope({"namespace": "default"}))
    assert resp.status_code == 200 and resp.json()["data"] == {"cleaned": 0}, resp.text
    c.sim.faults.clear()
    assert c.ours() == before, "nothing was deleted"
    resp = await c.app.post(CLEANUP, json=envelope({}))
    assert resp.json()["data"] == {"cleaned": len(before)}


# --- 5. cancellation mid-Redis-call on the hot path ------------------------------------------


@real_mariadb_and_fake
async def test_routes_cancelled_at_random_points_hold_nothing_beyond_the_lease(
    redis: Redis, db: Database
) -> None:
    """Six pods of one session each (pod_concurrency 1), all candidates: every placement is
    route_place's alone (no acquire), and a pod holds one session at a time, so an answer
    delivered to the wrong call would name a pod its session is not on. (A cancel that lands
    inside an acquire is the targeted test below, where two such windows leak: at random
    they would make this test flaky rather than failing.)"""
    sc = 6
    rng = random.Random(4242)
    async with (
        app_over(redis, db, instance_id="replica-a", scope_full_timeout=1.0) as a,
        app_over(redis, db, instance_id="replica-b", scope_full_timeout=1.0) as b,
    ):
        await configure(a, scope_concurrency=sc, pod_concurrency=1)
        warm = await asyncio.gather(*(route((a, b)[i % 2], f"warm-{i}") for i in range(sc)))
        pods = {pod_of(r) for r in warm}
        assert len(pods) == sc
        for i in range(sc // 2):  # half the slots free again; the pods stay candidates
            await touch((a, b)[i % 2], f"warm-{i}", eos=True)

        calls: list[tuple[str, str, httpx.AsyncClient]] = []
        for i in range(36):
            session_id = f"c-{i % 24}"  # twelve sessions twice: refresh, replay or in_flight
            again = i >= 24 and i % 3 != 0  # a new request id; else the first one's again
            request_id = f"r-{session_id}-{int(again)}"
            calls.append((session_id, request_id, (a, b)[rng.randrange(2)]))
        calls += [(f"warm-{i}", f"r-warm-{i}", a) for i in range(sc // 2, sc)]  # refreshes
        rng.shuffle(calls)
        tasks = [asyncio.create_task(route(app, s, r)) for s, r, app in calls]
        doomed = rng.sample(range(len(tasks)), len(tasks) // 2)

        hit: list[int] = []

        async def cancel_later(i: int, delay: float) -> None:
            await asyncio.sleep(delay)
            if tasks[i].cancel():
                hit.append(i)

        ended: set[str] = set()

        async def churn() -> None:  # slots free up while routes wait: waiters get placed
            for _ in range(6):
                await asyncio.sleep(0.05)
                members = sorted(await redis.smembers(sm_scope(SID, "sessions")))
                if members:
                    victim = rng.choice(members)
                    ended.add(victim)
                    await touch(b, victim, eos=True)

        killers = [cancel_later(i, rng.uniform(0, 0.06)) for i in doomed]
        await asyncio.gather(*killers, churn())
        results = await asyncio.gather(*tasks, return_exceptions=True)

        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        answered = [
            (call, r)
            for call, r in zip(calls, results, strict=True)
            if isinstance(r, httpx.Response)
        ]
        # cancels that reached running calls (on Python 3.11 some are swallowed on the way:
        # redis-py's send goes through asyncio.wait_for, and fakeredis absorbs most; such a
        # call just runs to its end, so it must leave nothing behind either)
        # (how many cancels land before their call ends depends on the machine's load; the
        # invariants below are what the test is about, so some hit and some answered is enough)
        assert hit and answered, (len(hit), cancelled, len(answered))
        for (session_id, request_id, _), resp in answered:
            if resp.status_code != 200:
                assert_error(resp, resp.json()["error_code"])
                continue
            body = resp.json()
            assert body["request_id"] == request_id
            data = body["data"]
            assert data["pod_id"] in pods, data
            # the request id's own answer: what the replay cache holds for it
            cached = await redis.get(route_marker(SID, request_id))
            assert cached is not None, request_id
            stored = json.loads(cached)
            assert stored.pop("request_hash"), "the answer is bound to its request"
            assert stored == data, (request_id, cached, data)
            if session_id not in ended:  # placed once and never ended: where its answer said
                binding = await redis.hgetall(sm_session(SID, session_id))
                assert binding.get("pod_id") == data["pod_id"], (session_id, binding, data)
        await assert_limits(redis, sc, 1)
        await nothing_held_within(redis, ROUTE_LEASE + 1.5)
        # the scope is not blocked by anything a cancelled call left
        live = await redis.scard(sm_scope(SID, "sessions"))
        for i in range(sc - live):
            assert pod_of(await route(a, f"after-{i}")) in pods
        await assert_limits(redis, sc, 1)


@pytest.mark.parametrize(
    "call",
    [
        "route_place",
        "waiter_gate",
        "acquire",
        "deploy_claim",
        "budget_reserve",
    ],
)
@real_only
async def test_a_route_cancelled_while_a_reply_is_in_flight_holds_nothing_beyond_the_lease(
    redis: Redis, db: Database, call: str
) -> None:
    """The call ran in Redis, its reply is still on the way (held by the proxy) when the
    route is cancelled: whatever that call took must be given back, or lapse with the route
    lease."""
    needles = {
        "route_place": (b"EVALSHA", ROUTE_PLACE_SHA),
        "waiter_gate": (b"EVALSHA", WAITER_GATE_SHA),
        "acquire": (b"EVALSHA", ACQUIRE_SHA),
        "deploy_claim": (b"EVALSHA", CLAIM_SHA),
        "budget_reserve": (b"EVALSHA", RESERVE_SHA),
    }[call]
    async with (
        redis_proxy(redis) as proxy,
        app_over(redis, db, url=proxied_url(redis, proxy), redis_timeout=5.0) as app,
    ):
        await configure(app, scope_concurrency=1, pod_concurrency=1, ready_timeout=5)
        if call == "waiter_gate":
            pod_of(await route(app, "held"))  # the scope is full: the next route queues
        else:  # cache and pool config in place: the first acquire takes a placeholder
            config = await services(app).config_store.resolve(SID, GROUP, BOT)
            await services(app).resources.update_pool_config(
                SID, config.pool_config(), config.pod_spec
            )
        await load_scripts(redis)
        proxy.intercept = first_match(*needles, action="hold")
        task = asyncio.create_task(route(app, "cancelled", "r-cancelled"))

        async def in_flight() -> bool:
            return proxy.replies_held >= 1 or task.done()

        await eventually(in_flight, what="the reply held in flight")
        assert not task.done(), task.result().text
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        proxy.release_held()

        await nothing_held_within(redis, ROUTE_LEASE + 1)
        assert not await redis.exists(sm_session(SID, "cancelled"))
        await assert_limits(redis, 1, 1)


# --- 6. replay safety under redis-py's retry -------------------------------------------------


@asynccontextmanager
async def lossy_app(
    redis: Redis, db: Database, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, TcpProxy]]:
    """One replica whose Redis link can lose replies (``proxy.intercept``)."""
    await load_scripts(redis)
    async with (
        redis_proxy(redis) as proxy,
        app_over(redis, db, url=proxied_url(redis, proxy), **settings) as app,
    ):
        yield app, proxy


def every_other(*needles: bytes) -> Callable[[bytes], str | None]:
    """Drop the reply of the 1st, 3rd, 5th … matching request: every call's first attempt
    is lost and its retry (redis-py re-sends it) gets through."""
    seen = 0

    def intercept(chunk: bytes) -> str | None:
        nonlocal seen
        if all(n in chunk for n in needles):
            seen += 1
            return "drop" if seen % 2 else None
        return None

    return intercept


@real_only
async def test_route_place_whose_reply_is_lost_places_once(redis: Redis, db: Database) -> None:
    async with lossy_app(redis, db, scope_full_timeout=2.0) as (app, proxy):
        sc, pc = 4, 2
        await configure(app, scope_concurrency=sc, pod_concurrency=pc)
        # every route_place of a cold route, slow path included, loses its first reply
        proxy.intercept = every_other(b"EVALSHA", ROUTE_PLACE_SHA, b"r-cold")
        cold = await route(app, "replay-cold", "r-cold")
        assert cold.json()["data"]["placement"] == "placed", cold.text
        assert proxy.replies_dropped >= 3  # need_config, need_acquire, placed: each re-sent
        pod = pod_of(cold)

        # the hot path: one EVALSHA that places, its reply lost, re-sent → the replay of it
        dropped = proxy.replies_dropped
        proxy.intercept = first_match(b"EVALSHA", ROUTE_PLACE_SHA, b"r-hot", action="drop")
        hot = await route(app, "replay-hot", "r-hot")
        assert proxy.replies_dropped == dropped + 1
        assert hot.json()["data"] == {
            "pod_id": pod,
            "pod_sse_url": cold.json()["data"]["pod_sse_url"],
            "placement": "placed",  # what one execution answers, not "refresh"
        }, hot.text
        assert (await route(app, "replay-hot", "r-hot")).json() == hot.json()
        assert await redis.smembers(sm_scope(SID, "sessions")) == {"replay-cold", "replay-hot"}
        assert await redis.smembers(sm_pod(SID, pod, "sessions")) == {"replay-cold", "replay-hot"}
        assert await redis.zcard(rm_scope(SID, "pods")) == 1, "one deploy"
        for session_id in ("replay-cold", "replay-hot"):
            await assert_four_places(redis, session_id, pod)
        await assert_limits(redis, sc, pc)
        assert await held(redis) == {}


@real_only
async def test_touch_whose_reply_is_lost_extends_once(redis: Redis, db: Database) -> None:
    ttl = 30
    async with lossy_app(redis, db) as (app, proxy):
        await configure(app, scope_concurrency=2, pod_concurrency=2, session_ttl=ttl)
        pod_of(await route(app, "touched"))
        proxy.intercept = first_match(b"EVALSHA", TOUCH_SHA, b"touched", action="drop")
        assert await touch(app, "touched") == {"touched": True}  # not "unknown"
        assert proxy.replies_dropped == 1
        expiry = float((await redis.hgetall(sm_session(SID, "touched")))["expiry"])
        now = await redis_now(redis)
        assert now + ttl - 2 <= expiry <= now + ttl, "extended by its ttl once, from now"
        assert await redis.zscore(sm_expiry(SID), "touched") == pytest.approx(expiry, abs=1e-3)


@real_only
async def test_eos_whose_reply_is_lost_ends_the_session_once_and_wakes_a_waiter(
    redis: Redis, db: Database
) -> None:
    async with lossy_app(redis, db, scope_full_timeout=5.0) as (app, proxy):
        await configure(app, scope_concurrency=1, pod_concurrency=1)
        pod = pod_of(await route(app, "ending"))
        waiter = asyncio.create_task(route(app, "next", "r-next"))

        async def seated() -> bool:
            return await redis.zscore(sm_scope(SID, "waiters"), "r-next") is not None

        await eventually(seated, what="a waiter")
        proxy.intercept = first_match(b"EVALSHA", TOUCH_SHA, b"ending", action="drop")
        resp = await app.post(TOUCH, json=envelope({"eos": True}, session_id="ending"))
        assert resp.status_code == 200, resp.text
        assert proxy.replies_dropped == 1
        assert not await redis.exists(sm_session(SID, "ending"))
        placed = await asyncio.wait_for(waiter, 5)
        assert pod_of(placed) == pod
        assert await redis.smembers(sm_scope(SID, "sessions")) == {"next"}
        await assert_limits(redis, 1, 1)
        assert await held(redis) == {}


@real_only
async def test_eos_whose_reply_is_lost_answers_as_one_execution(redis: Redis, db: Database) -> None:
    async with lossy_app(redis, db) as (app, proxy):
        await configure(app, scope_concurrency=1, pod_concurrency=1)
        pod_of(await route(app, "ending"))
        proxy.intercept = first_match(b"EVALSHA", TOUCH_SHA, b"ending", action="drop")
        answer = await touch(app, "ending", eos=True)
        assert proxy.replies_dropped == 1
        assert answer == {"touched": True, "released": True}


@real_only
async def test_waiter_gate_whose_reply_is_lost_keeps_one_seat_or_refuses_again(
    redis: Redis, db: Database
) -> None:
    async with lossy_app(redis, db, scope_full_timeout=5.0) as (app, proxy):
        await configure(app, scope_concurrency=1, pod_concurrency=1)  # a queue of 2
        pod = pod_of(await route(app, "w-held"))

        async def seats() -> list[str]:
            members: list[str] = await redis.zrange(sm_scope(SID, "waiters"), 0, -1)
            return members

        proxy.intercept = first_match(b"EVALSHA", WAITER_GATE_SHA, b"r-w-1", action="drop")
        first = asyncio.create_task(route(app, "w-1", "r-w-1"))

        async def seated_once() -> bool:
            return await seats() == ["r-w-1"]

        await eventually(seated_once, what="the first waiter's seat")
        await eventually(lambda: _true(proxy.replies_dropped == 1), what="the lost reply")
        second = asyncio.create_task(route(app, "w-2", "r-w-2"))
        await eventually(lambda: _len_is(seats(), 2), what="the second seat")

        # the queue is full: a refused gate whose reply is lost is refused again
        proxy.intercept = first_match(b"EVALSHA", WAITER_GATE_SHA, b"r-w-3", action="drop")
        refused = await route(app, "w-3", "r-w-3")
        assert proxy.replies_dropped == 2
        assert_error(refused, "SCOPE_QUEUE_FULL")
        assert sorted(await seats()) == ["r-w-1", "r-w-2"]

        waiting = {first: "w-1", second: "w-2"}
        await touch(app, "w-held", eos=True)
        for _ in range(2):  # each freed slot places one of the two (in no promised order)
            done, _ = await asyncio.wait(waiting, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1, done
            task = done.pop()
            assert pod_of(task.result()) == pod
            await touch(app, waiting.pop(task), eos=True)
        assert await seats() == []
        await assert_limits(redis, 1, 1)
        assert await held(redis) == {}


async def _true(value: bool) -> bool:
    return value


async def _len_is(members: Awaitable[list[str]], n: int) -> bool:
    return len(await members) == n
