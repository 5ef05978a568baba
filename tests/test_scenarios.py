"""Scenarios A–N of ``docs/design/hld.md`` §4, end to end through HTTP.

Every test drives the app through route, touch, config_sync and cleanup (``running_app``,
fake Kubernetes), ticks the background jobs by hand (one test lets them run by themselves),
and checks both the HTTP answers and the Redis keys of contract §4 — spelled out literally
here (``session_manager:…``, ``resource_manager:…``) so that the tests hold the code to the
contract, not to itself. They run on fakeredis AND the real Redis; SQLite is enough for the
config side (the SQL backends have their own tests). Waits are polls with deadlines; instead
of sleeping, a test moves a timestamp back (a session's expiry, a pod's ``registered_at`` or
``idle_since``). Wake-ups are checked with the waiters' safety-net poll stretched to 30 s, so
only the ``free`` signal can wake them in time.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.scope_buckets import bucket_of
from agent_runtime.session_manager.replies import RoutePlacement
from agent_runtime.wiring import Services
from contract_keys import (
    rm_pod,
    rm_pod_known,
    rm_scope,
    sm_bucket,
    sm_expiry,
    sm_pod,
    sm_pods_registered,
    sm_scope,
    sm_session,
)
from helpers import envelope, running_app, sync_body

# every test: fakeredis and the real Redis (the `redis` fixture), on SQLite
pytestmark = [
    pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True),
    pytest.mark.topologies,  # the single server, the Sentinel set and the cluster
]

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
SYNC = "/api/session/config_sync"
CLEANUP = "/api/session/cleanup"

GROUP, BOT = "grp-9", "bot-1"
TEMPLATE_ID = "tpl"
DEADLINE = 20.0  # seconds any poll waits before the test fails (generous: a loaded machine)

# a template with small numbers: max_pods = ceil(4 / 2) = 2
BASE_TEMPLATE: dict[str, Any] = {
    "template_id": TEMPLATE_ID,
    "image": "agentserver:1",
    "scope_concurrency": 4,
    "pod_concurrency": 2,
    "session_ttl": 60,
    "pod_ttl": 60,
    "min_idle_pods": 0,
    "ready_timeout": 2,
    "ready_poll_interval": 0.05,
}


def scope_of(group_id: str, bot_id: str) -> str:
    """Contract §1: md5(group_id + "\\x00" + bot_id), hex."""
    return hashlib.md5(f"{group_id}\x00{bot_id}".encode()).hexdigest()


SCOPE = scope_of(GROUP, BOT)


# --- contract §4 key names, literally ----------------------------------------------------------


# --- the world of one test ---------------------------------------------------------------------


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, within: float = DEADLINE
) -> None:
    """Poll ``check`` until it holds; fail the test after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within:g} s: {what}")
        await asyncio.sleep(0.01)


@dataclass
class World:
    client: httpx.AsyncClient
    redis: Redis

    @property
    def svc(self) -> Services:
        services: Services = self.client.app.state.services  # type: ignore[attr-defined]
        return services

    @property
    def k8s(self) -> FakeK8sPodClient:
        k8s = self.svc.backends.k8s
        assert isinstance(k8s, FakeK8sPodClient)
        return k8s

    # --- HTTP ---

    async def sync(
        self, kind: str, op: str, item: dict[str, Any], *, status: int = 200
    ) -> dict[str, Any]:
        resp = await self.client.post(SYNC, json=sync_body(kind, op, item))
        assert resp.status_code == status, resp.text
        body: dict[str, Any] = resp.json()
        return body["data"] if status == 200 else body

    async def configure(self, **fields: Any) -> None:
        """The scenario's template and a routing rule for (GROUP, BOT)."""
        await self.sync("template", "sync", {**BASE_TEMPLATE, **fields})
        rule = {"group_id": GROUP, "bot_id": BOT, "template_id": TEMPLATE_ID}
        await self.sync("routing_rule", "sync", rule)

    async def route(
        self, session_id: str, request_id: str | None = None, **headers: str
    ) -> httpx.Response:
        body = envelope(
            request_id=request_id or f"r-{uuid.uuid4().hex[:12]}",
            session_id=session_id,
            bot_id=BOT,
            extra={"group_id": GROUP},
        )
        return await self.client.post(ROUTE, json=body, headers=headers)

    async def routed(self, session_id: str, request_id: str | None = None) -> dict[str, Any]:
        """A successful route's ``data`` (checked against the success envelope)."""
        rid = request_id or f"r-{uuid.uuid4().hex[:12]}"
        resp = await self.route(session_id, rid)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["ok"] is True and body["request_id"] == rid, body
        data: dict[str, Any] = body["data"]
        assert data["placement"] in ("refresh", "placed", "rebound"), data
        expected = {"pod_id", "pod_sse_url", "placement"}
        if data["placement"] == "rebound":
            expected.add("previous_pod_id")
        assert set(data) == expected, data
        return data

    async def touch(self, session_id: str, *, eos: bool = False) -> dict[str, Any]:
        rawdata = {"eos": True} if eos else {}
        resp = await self.client.post(TOUCH, json=envelope(rawdata, session_id=session_id))
        assert resp.status_code == 200, resp.text
        data: dict[str, Any] = resp.json()["data"]
        return data

    # --- jobs, ticked by hand ---

    async def sweep(self) -> dict[str, int]:
        """One sm_sweep tick, and its idle notices delivered."""
        result = await self.svc.session_sweeper.sweep_once()
        await self.svc.session_sweeper.wait_for_notices()
        return result

    async def autoscale(self) -> int:
        started = await self.svc.pool_jobs.autoscale_once()
        await self.svc.pool_jobs.wait_for_warm_deploys()
        return started

    # --- Redis ---

    async def now(self) -> float:
        seconds, micros = await self.redis.time()
        return seconds + micros / 1_000_000

    async def expiry(self, session_id: str) -> float:
        value = await self.redis.hget(sm_session(SCOPE, session_id), "expiry")
        assert value is not None, f"session {session_id} has no binding"
        score = await self.redis.zscore(sm_expiry(SCOPE), session_id)
        assert score is not None and abs(score - float(value)) < 1e-3, (value, score)
        return float(value)

    async def set_expiry(self, session_id: str, expiry: float) -> None:
        """Move a session's expiry (hash and ZSET together), instead of waiting for it."""
        await self.redis.hset(sm_session(SCOPE, session_id), "expiry", f"{expiry:.6f}")
        await self.redis.zadd(sm_expiry(SCOPE), {session_id: expiry})
        # as time passing would: the scope's expiry mark is due by then at the latest
        await self.redis.zadd(sm_bucket("expiry_due", bucket_of(SCOPE)), {SCOPE: expiry}, lt=True)

    async def age_pod(self, pod_id: str, seconds: float = 60.0) -> None:
        """Registered ``seconds`` ago: past the sweeper's grace for a new pod."""
        key = sm_pod(SCOPE, pod_id, "info")
        registered_at = float(await self.redis.hget(key, "registered_at") or 0)
        assert registered_at > 0, f"pod {pod_id} is not registered"
        await self.redis.hset(key, "registered_at", f"{registered_at - seconds:.6f}")

    async def places(self, session_id: str, pod_id: str, scope_id: str = SCOPE) -> list[bool]:
        """The four places of a live session (contract §4 invariant)."""
        return [
            bool(await self.redis.exists(sm_session(SCOPE, session_id))),
            await self.redis.zscore(sm_expiry(SCOPE), session_id) is not None,
            bool(await self.redis.sismember(sm_scope(scope_id, "sessions"), session_id)),
            bool(await self.redis.sismember(sm_pod(scope_id, pod_id, "sessions"), session_id)),
        ]

    async def assert_live(self, session_id: str, pod_id: str) -> None:
        assert await self.places(session_id, pod_id) == [True] * 4
        binding = await self.redis.hgetall(sm_session(SCOPE, session_id))
        assert binding["scope_id"] == SCOPE and binding["pod_id"] == pod_id, binding

    async def assert_gone(self, session_id: str, pod_id: str) -> None:
        assert await self.places(session_id, pod_id) == [False] * 4

    async def candidates(self) -> list[str]:
        return [str(p) for p in await self.redis.zrange(sm_scope(SCOPE, "pods"), 0, -1)]

    async def warm(self) -> set[str]:
        return {str(p) for p in await self.redis.smembers(rm_scope(SCOPE, "idle"))}

    async def live_sessions(self) -> set[str]:
        return {str(s) for s in await self.redis.smembers(sm_scope(SCOPE, "sessions"))}

    async def waiters(self) -> int:
        return int(await self.redis.zcard(sm_scope(SCOPE, "waiters")))

    def waiting(self, n: int) -> Callable[[], Awaitable[bool]]:
        """A check for ``eventually``: n routes hold a seat in the scope's queue."""

        async def check() -> bool:
            return await self.waiters() == n

        return check

    async def assert_pod_known(self, pod_id: str) -> None:
        """Registered on both sides."""
        assert await self.redis.sismember(sm_pods_registered(SCOPE), pod_id)
        assert await self.redis.exists(sm_pod(SCOPE, pod_id, "info"))
        assert await rm_pod_known(self.redis, pod_id)
        assert await self.redis.zscore(rm_scope(SCOPE, "pods"), pod_id) is not None
        info = await self.redis.hgetall(rm_pod(SCOPE, pod_id, "info"))
        assert info["scope_id"] == SCOPE, info

    async def assert_pod_forgotten(self, pod_id: str) -> None:
        """No key of either module names the pod any more."""
        assert not await self.redis.sismember(sm_pods_registered(SCOPE), pod_id)
        assert await self.redis.zscore(sm_scope(SCOPE, "pods"), pod_id) is None
        for what in ("info", "sessions", "idle_notified"):
            assert not await self.redis.exists(sm_pod(SCOPE, pod_id, what)), what
        assert not await rm_pod_known(self.redis, pod_id)
        assert await self.redis.zscore(rm_scope(SCOPE, "pods"), pod_id) is None
        assert not await self.redis.sismember(rm_scope(SCOPE, "idle"), pod_id)
        for what in ("info", "idle_since", "health_fails"):
            assert not await self.redis.exists(rm_pod(SCOPE, pod_id, what)), what

    async def assert_consistent(self) -> None:
        """Every live session of the scope is in its four places, every pod's session set
        holds exactly its live sessions, and no limit is exceeded."""
        config = await self.redis.hgetall(sm_scope(SCOPE, "config"))
        sessions = await self.live_sessions()
        if config:
            assert len(sessions) <= int(config["scope_concurrency"])
        per_pod: dict[str, set[str]] = {}
        for session_id in sessions:
            pod_id = await self.redis.hget(sm_session(SCOPE, session_id), "pod_id")
            assert pod_id is not None, session_id
            assert await self.places(session_id, str(pod_id)) == [True] * 4, session_id
            per_pod.setdefault(str(pod_id), set()).add(session_id)
        for pod_id in await self.redis.smembers(sm_pods_registered(SCOPE)):
            on_pod = await self.redis.smembers(sm_pod(SCOPE, pod_id, "sessions"))
            assert on_pod == per_pod.pop(pod_id, set()), pod_id
            if config:
                assert len(on_pod) <= int(config["pod_concurrency"])
        assert per_pod == {}, f"sessions on unregistered pods: {per_pod}"
        assert await self.redis.zcard(sm_expiry(SCOPE)) == len(
            [k async for k in self.redis.scan_iter(match=sm_session(SCOPE, "*"))]
        )
        rm_config = await self.redis.hgetall(rm_scope(SCOPE, "config"))
        if rm_config:  # ZCARD pods + SCARD deploying <= max_pods
            pods = await self.redis.zcard(rm_scope(SCOPE, "pods"))
            deploying = await self.redis.scard(rm_scope(SCOPE, "deploying"))
            assert pods + deploying <= int(rm_config["max_pods"]), (pods, rm_config)


@asynccontextmanager
async def world(redis: Redis, db: Database, **settings: Any) -> AsyncIterator[World]:
    async with running_app(redis, db, **settings) as client:
        yield World(client, redis)


def assert_failure(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body: dict[str, Any] = resp.json()
    assert body["ok"] is False and body["error_code"] == code, body
    return body


def assert_retry_after(resp: httpx.Response) -> None:
    body = resp.json()
    assert isinstance(body["retry_after"], int) and body["retry_after"] >= 1, body
    assert resp.headers["retry-after"] == str(body["retry_after"])


# ================================================================================================
# A — cold start
# ================================================================================================


async def test_a_cold_start_deploys_exactly_one_pod(redis: Redis, db: Database) -> None:
    async with world(redis, db) as w:
        await w.configure()
        assert w.k8s.deploy_calls == 0 and w.k8s.pods == {}

        data = await w.routed("s1")

        assert data["placement"] == "placed"
        assert w.k8s.deploy_calls == 1 and list(w.k8s.pods) == [data["pod_id"]]
        pod = w.k8s.pods[data["pod_id"]]
        assert pod.phase == "Running" and pod.ready
        assert data["pod_sse_url"] == f"http://{pod.pod_ip}:8080/sse"
        assert pod.labels["agent-runtime/scope"] == SCOPE
        assert pod.labels["jiuwenclaw-component"] == "agentserver"
        await w.assert_live("s1", data["pod_id"])
        assert await w.candidates() == [data["pod_id"]]
        await w.assert_pod_known(data["pod_id"])
        sm_info = await redis.hgetall(sm_pod(SCOPE, data["pod_id"], "info"))
        rm_info = await redis.hgetall(rm_pod(SCOPE, data["pod_id"], "info"))
        assert sm_info["sse_url"] == rm_info["pod_sse_url"] == data["pod_sse_url"]
        assert (
            sm_info["deploy_ver"] == rm_info["deploy_ver"] == pod.labels["agent-runtime/deploy-ver"]
        )
        assert rm_info["phase"] == "in_use" and rm_info["pod_ip"] == pod.pod_ip
        assert await redis.hget(sm_scope(SCOPE, "config"), "scope_concurrency") == "4"
        await w.assert_consistent()


async def test_a_cold_burst_deploys_one_pod_at_a_time_and_never_overfills(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db, scope_full_timeout=1.5) as w:
        await w.configure(scope_concurrency=3, pod_concurrency=2)  # max_pods 2
        w.k8s.ready_delay = 0.1  # the burst arrives while the first pod is deploying

        # 7: one deploys, the others wait (follower room or queue: 6 seats), never refused
        resps = await asyncio.gather(*(w.route(f"s{i}") for i in range(7)))

        placed = [r.json()["data"] for r in resps if r.status_code == 200]
        refused = [r for r in resps if r.status_code != 200]
        assert len(placed) == 3, [r.text for r in refused]
        assert {d["placement"] for d in placed} == {"placed"}
        for resp in refused:  # the rest waited in the queue and timed out
            assert_failure(resp, 504, "SCOPE_FULL_TIMEOUT")
        pods = {d["pod_id"] for d in placed}
        assert len(pods) == 2 and w.k8s.deploy_calls == 2 and set(w.k8s.pods) == pods
        counts = [await redis.scard(sm_pod(SCOPE, p, "sessions")) for p in await w.candidates()]
        assert counts == [2, 1], "first fit: the first pod is full"
        assert await w.waiters() == 0
        assert await redis.scard(rm_scope(SCOPE, "deploying")) == 0
        await w.assert_consistent()


# ================================================================================================
# B — affinity
# ================================================================================================


async def test_b_same_session_same_pod_and_expiry_extended(redis: Redis, db: Database) -> None:
    async with world(redis, db) as w:
        await w.configure(session_ttl=60)
        first = await w.routed("s1")
        # bring the expiry close, so that the refresh visibly extends it by the session's ttl
        await w.set_expiry("s1", await w.now() + 5)
        before = await w.expiry("s1")

        again = await w.routed("s1")

        assert again == {**first, "placement": "refresh"}
        after = await w.expiry("s1")
        now = await w.now()
        assert after > before + 50 and now + 59 <= after <= now + 60.5, (before, after, now)
        assert w.k8s.deploy_calls == 1
        await w.assert_live("s1", first["pod_id"])
        assert await redis.scard(sm_scope(SCOPE, "sessions")) == 1
        await w.assert_consistent()


# ================================================================================================
# C — first-fit packing
# ================================================================================================


async def test_c_first_fit_fills_pod_one_then_deploys_pod_two(redis: Redis, db: Database) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=6, pod_concurrency=2)  # max_pods 3
        s1, s2 = await w.routed("s1"), await w.routed("s2")
        pod1 = s1["pod_id"]
        assert s2["pod_id"] == pod1 and s2["placement"] == "placed"
        assert w.k8s.deploy_calls == 1

        s3 = await w.routed("s3")
        pod2 = s3["pod_id"]
        assert pod2 != pod1 and w.k8s.deploy_calls == 2
        assert await w.candidates() == [pod1, pod2]  # arrival order
        assert await redis.scard(sm_pod(SCOPE, pod1, "sessions")) == 2

        # both pods have room now: the first one in arrival order is filled first
        assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
        assert (await w.routed("s4"))["pod_id"] == pod1
        assert (await w.routed("s5"))["pod_id"] == pod2
        assert w.k8s.deploy_calls == 2
        s6 = await w.routed("s6")
        pod3 = s6["pod_id"]
        assert pod3 not in (pod1, pod2) and w.k8s.deploy_calls == 3
        assert await w.candidates() == [pod1, pod2, pod3]

        # slots free on pod 2, then on pod 1: still the first pod first, not the latest freed
        for session_id in ("s3", "s2"):
            assert await w.touch(session_id, eos=True) == {"touched": True, "released": True}
        assert (await w.routed("s7"))["pod_id"] == pod1
        assert (await w.routed("s8"))["pod_id"] == pod2
        assert (await w.routed("s9"))["pod_id"] == pod3
        assert w.k8s.deploy_calls == 3
        for session_id, pod_id in (("s4", pod1), ("s7", pod1), ("s5", pod2), ("s8", pod2)):
            await w.assert_live(session_id, pod_id)
        for session_id in ("s6", "s9"):
            await w.assert_live(session_id, pod3)
        await w.assert_consistent()


# ================================================================================================
# D — expiry
# ================================================================================================


async def test_d_untouched_session_is_evicted_by_the_sweeper_and_its_slot_freed(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db, scope_full_timeout=0.3) as w:
        await w.configure(scope_concurrency=1, pod_concurrency=1, session_ttl=1)
        pod = (await w.routed("s1"))["pod_id"]
        assert (await w.sweep())["expired"] == 0, "not expired yet"
        await w.assert_live("s1", pod)
        # the scope is full while s1 lives
        assert_failure(await w.route("s2"), 504, "SCOPE_FULL_TIMEOUT")

        # a real session_ttl of 1 s passes; only the sweeper may evict it (nobody touches it)
        expired = 0

        async def swept() -> bool:
            nonlocal expired
            expired += (await w.sweep())["expired"]
            return expired > 0

        await eventually(swept, "the sweeper evicts s1 after its session_ttl")

        assert expired == 1
        await w.assert_gone("s1", pod)
        assert await redis.scard(sm_scope(SCOPE, "sessions")) == 0
        # the slot is free: a new session is placed (on the same pod, no deploy)
        s2 = await w.routed("s2")
        assert s2["placement"] == "placed" and s2["pod_id"] == pod
        assert w.k8s.deploy_calls == 1
        await w.assert_live("s2", pod)
        await w.assert_consistent()


async def test_d_an_expired_session_routed_before_the_sweep_is_placed_anew(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=1, pod_concurrency=1)
        pod = (await w.routed("s1"))["pod_id"]
        await w.set_expiry("s1", await w.now() - 1)

        data = await w.routed("s1")  # expired: evicted lazily, then placed again

        assert data["placement"] == "placed", "an expired binding is not refreshed"
        assert data["pod_id"] == pod
        now = await w.now()
        assert now + 59 <= await w.expiry("s1") <= now + 60.5
        assert (await w.sweep())["expired"] == 0
        await w.assert_live("s1", pod)
        await w.assert_consistent()


# ================================================================================================
# E — touch
# ================================================================================================


async def test_e_touch_extends_and_unknown_or_expired_is_false(redis: Redis, db: Database) -> None:
    async with world(redis, db) as w:
        await w.configure(session_ttl=60)
        pod = (await w.routed("s1"))["pod_id"]
        await w.set_expiry("s1", await w.now() + 5)

        assert await w.touch("s1") == {"touched": True}
        now = await w.now()
        assert now + 59 <= await w.expiry("s1") <= now + 60.5
        await w.assert_live("s1", pod)

        assert await w.touch("nobody") == {"touched": False}
        assert not await redis.exists(sm_session(SCOPE, "nobody"))

        # expired but not swept yet: false, and the session is gone on the spot
        await w.routed("s2")
        await w.set_expiry("s2", await w.now() - 1)
        assert await w.touch("s2") == {"touched": False}
        await w.assert_gone("s2", pod)
        # it stays gone: touch never brings a session back
        assert await w.touch("s2") == {"touched": False}
        await w.assert_live("s1", pod)
        await w.assert_consistent()


async def test_e_eos_frees_the_slot_and_wakes_a_waiting_route(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the waiter's safety-net poll is made long, so only the free signal can wake it in time
    monkeypatch.setattr("agent_runtime.session_manager.slow_route.POLL", 30.0)
    async with world(redis, db, scope_full_timeout=20) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=2)
        pod = (await w.routed("s1"))["pod_id"]
        await w.routed("s2")
        waiter = asyncio.create_task(w.route("s3"))
        await eventually(w.waiting(1), "s3 waits in the scope's queue")
        assert not waiter.done()

        started = time.monotonic()
        assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
        resp = await asyncio.wait_for(waiter, DEADLINE)
        elapsed = time.monotonic() - started

        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
        assert data["placement"] == "placed" and data["pod_id"] == pod
        assert elapsed < 1.0, f"woken after {elapsed:.2f} s: by a poll, not the free signal"
        await w.assert_gone("s1", pod)
        await w.assert_live("s3", pod)
        assert await w.waiters() == 0
        # eos of a session that is gone: nothing released
        assert await w.touch("s1", eos=True) == {"touched": False, "released": False}
        assert w.k8s.deploy_calls == 1
        await w.assert_consistent()


async def test_e_a_slot_freed_on_one_replica_wakes_a_waiter_on_another(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent_runtime.session_manager.slow_route.POLL", 30.0)
    async with (
        world(redis, db, scope_full_timeout=20) as w,
        world(redis, db, scope_full_timeout=20, instance_id="test-2") as other,
    ):
        await w.configure(scope_concurrency=1, pod_concurrency=1)
        pod = (await w.routed("s1"))["pod_id"]
        waiter = asyncio.create_task(other.route("s2"))
        await eventually(w.waiting(1), "s2 waits on the other replica")

        started = time.monotonic()
        assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
        resp = await asyncio.wait_for(waiter, DEADLINE)
        elapsed = time.monotonic() - started

        assert resp.status_code == 200, resp.text
        assert resp.json()["data"]["pod_id"] == pod
        assert elapsed < 1.0, f"woken after {elapsed:.2f} s: by a poll, not the free signal"
        assert other.k8s.deploy_calls == 0
        await w.assert_live("s2", pod)
        assert await w.waiters() == 0


# ================================================================================================
# F — scope full
# ================================================================================================


async def test_f_waiter_is_placed_when_the_sweeper_frees_a_slot(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent_runtime.session_manager.slow_route.POLL", 30.0)
    async with world(redis, db, scope_full_timeout=20) as w:
        await w.configure(scope_concurrency=1, pod_concurrency=1)
        pod = (await w.routed("s1"))["pod_id"]
        waiter = asyncio.create_task(w.route("s2"))
        await eventually(w.waiting(1), "s2 waits")

        await w.set_expiry("s1", await w.now() - 1)
        assert (await w.sweep())["expired"] == 1

        resp = await asyncio.wait_for(waiter, DEADLINE)
        assert resp.status_code == 200, resp.text
        assert resp.json()["data"]["placement"] == "placed"
        assert resp.json()["data"]["pod_id"] == pod
        await w.assert_gone("s1", pod)
        await w.assert_live("s2", pod)
        assert await w.waiters() == 0
        await w.assert_consistent()


async def test_f_queue_full_is_503_with_retry_after(redis: Redis, db: Database) -> None:
    async with world(redis, db, scope_full_timeout=20) as w:
        await w.configure(scope_concurrency=1, pod_concurrency=1)  # queue: 2 × 1 seats
        await w.routed("s1")
        waiters = [asyncio.create_task(w.route(f"w{i}")) for i in (1, 2)]
        await eventually(w.waiting(2), "two routes wait")

        resp = await w.route("w3", request_id="r-w3")
        body = assert_failure(resp, 503, "SCOPE_QUEUE_FULL")
        assert body["request_id"] == "r-w3"
        assert_retry_after(resp)
        assert await w.waiters() == 2, "the refused route keeps no seat"
        assert not await redis.exists(sm_session(SCOPE, "w3"))

        # the waiters are served one by one as slots free
        for served in (1, 2):
            (session,) = await w.live_sessions()
            assert await w.touch(session, eos=True) == {"touched": True, "released": True}
            await eventually(_done(waiters, served), f"{served} waiter(s) took a freed slot")
            assert await w.waiters() == 2 - served
        for task in waiters:
            assert task.result().status_code == 200, task.result().text
        await w.assert_consistent()


def _done(tasks: list[asyncio.Task[Any]], n: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return sum(t.done() for t in tasks) == n

    return check


async def test_f_no_slot_within_scope_full_timeout_is_504(redis: Redis, db: Database) -> None:
    async with world(redis, db, scope_full_timeout=0.5) as w:
        # max_pods = ceil(3 / 2) = 2: the second pod has room, but the scope is full
        await w.configure(scope_concurrency=3, pod_concurrency=2)
        for session_id in ("s1", "s2", "s3"):
            await w.routed(session_id)
        (_, pod2) = await w.candidates()
        assert await redis.scard(sm_pod(SCOPE, pod2, "sessions")) == 1

        started = time.monotonic()
        resp = await w.route("s4")
        elapsed = time.monotonic() - started

        assert_failure(resp, 504, "SCOPE_FULL_TIMEOUT")
        assert_retry_after(resp)
        assert 0.45 <= elapsed < 3, elapsed
        assert await w.waiters() == 0, "the seat is given back"
        assert not await redis.exists(sm_session(SCOPE, "s4"))
        assert await w.live_sessions() == {"s1", "s2", "s3"}
        assert w.k8s.deploy_calls == 2
        await w.assert_consistent()

        # an error is not replayed: the gateway's retry with the same request id runs again
        assert_failure(await w.route("s4", request_id="r-4"), 504, "SCOPE_FULL_TIMEOUT")
        assert await w.touch("s3", eos=True) == {"touched": True, "released": True}
        assert (await w.routed("s4", request_id="r-4"))["placement"] == "placed"


async def test_f_a_cancelled_waiting_route_leaves_the_queue(redis: Redis, db: Database) -> None:
    async with world(redis, db, scope_full_timeout=20) as w:
        await w.configure(scope_concurrency=1, pod_concurrency=1)
        pod = (await w.routed("s1"))["pod_id"]
        waiter = asyncio.create_task(w.route("s2", request_id="r-gone"))
        await eventually(w.waiting(1), "s2 waits")
        # and its seat is marked for the prune (the call after the seat's: fakeredis would
        # absorb a cancellation that lands inside it)
        leased = sm_bucket("leased_scopes", bucket_of(SCOPE))

        async def marked() -> bool:
            return await redis.zscore(leased, SCOPE) is not None

        await eventually(marked, "the seat is marked")

        waiter.cancel()  # the caller goes away (httpx runs the app in the caller's task)
        with pytest.raises(asyncio.CancelledError):
            await waiter

        await eventually(w.waiting(0), "the cancelled route left the queue")
        assert not await redis.exists(sm_scope(SCOPE, "waiters"))
        assert not await redis.exists(sm_session(SCOPE, "s2"))
        # the cancelled request left no pending marker: its retry (same request_id) runs
        assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
        data = await w.routed("s2", request_id="r-gone")
        assert data["placement"] == "placed" and data["pod_id"] == pod
        await w.assert_consistent()


async def test_f_a_route_cancelled_while_taking_its_seat_gives_the_seat_back(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with world(redis, db, scope_full_timeout=20) as w:
        await w.configure(scope_concurrency=1, pod_concurrency=1)
        await w.routed("s1")
        taken = asyncio.Event()
        take_seat = w.svc.session_state.take_waiter_seat

        async def slow_reply(*args: Any, **kwargs: Any) -> bool:
            seated = await take_seat(*args, **kwargs)  # the seat is taken in Redis ...
            taken.set()
            await asyncio.Event().wait()  # ... and the reply is slow to come back
            return seated

        monkeypatch.setattr(w.svc.session_state, "take_waiter_seat", slow_reply)
        waiter = asyncio.create_task(w.route("s2"))
        await asyncio.wait_for(taken.wait(), DEADLINE)
        assert await w.waiters() == 1

        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

        await eventually(w.waiting(0), "the seat taken just before the cancel is given back")


async def test_f_a_route_cancelled_on_its_first_step_can_be_retried_at_once(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with world(redis, db, scope_full_timeout=20) as w:
        await w.configure()
        answered = asyncio.Event()
        route_place = w.svc.session_state.route_place

        async def first_reply_slow(**kwargs: Any) -> RoutePlacement:
            reply = await route_place(**kwargs)  # need_config: the request is marked pending
            if not answered.is_set():
                answered.set()
                await asyncio.Event().wait()  # ... and the caller goes away before the reply
            return reply

        monkeypatch.setattr(w.svc.session_state, "route_place", first_reply_slow)
        first = asyncio.create_task(w.route("s1", request_id="r-retry"))
        await asyncio.wait_for(answered.wait(), DEADLINE)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first

        # the gateway retries with the same request id: it is served, not told to wait for
        # the cancelled call's answer (which never comes)
        resp = await asyncio.wait_for(w.route("s1", request_id="r-retry"), DEADLINE)
        assert resp.status_code == 200, resp.text
        assert resp.json()["data"]["placement"] == "placed"


# ================================================================================================
# G — pod death
# ================================================================================================


async def test_g_dead_pod_sessions_are_evicted_and_rebound_on_another_pod(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=2)
        dead = (await w.routed("s1"))["pod_id"]
        assert (await w.routed("s2"))["pod_id"] == dead

        w.k8s.kill(dead)  # phase Failed
        assert await w.svc.pool_jobs.watch_once() == 1

        await w.assert_gone("s1", dead)
        await w.assert_gone("s2", dead)
        await w.assert_pod_forgotten(dead)
        assert dead in w.k8s.deleted and dead not in w.k8s.pods
        assert await redis.scard(sm_scope(SCOPE, "sessions")) == 0

        r1 = await w.routed("s1")
        assert r1["placement"] == "rebound" and r1["previous_pod_id"] == dead
        new = r1["pod_id"]
        assert new != dead and w.k8s.deploy_calls == 2
        assert r1["pod_sse_url"] == f"http://{w.k8s.pods[new].pod_ip}:8080/sse"
        r2 = await w.routed("s2")
        assert r2 == {**r1, "placement": "rebound"}
        # a rebound is told once: the session now lives on its new pod
        assert (await w.routed("s1"))["placement"] == "refresh"
        # a session that never was on the dead pod is simply placed
        assert set(await w.routed("s3")) == {"pod_id", "pod_sse_url", "placement"}
        for session_id in ("s1", "s2"):
            await w.assert_live(session_id, new)
        await w.assert_consistent()


async def test_g_a_pod_death_frees_slots_for_waiting_routes(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent_runtime.session_manager.slow_route.POLL", 30.0)
    async with world(redis, db, scope_full_timeout=20) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=2)  # max_pods 1
        dead = (await w.routed("s1"))["pod_id"]
        await w.routed("s2")
        waiter = asyncio.create_task(w.route("s3"))
        await eventually(w.waiting(1), "s3 waits: the scope is full")

        w.k8s.kill(dead)
        assert await w.svc.pool_jobs.watch_once() == 1
        resp = await asyncio.wait_for(waiter, DEADLINE)

        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
        assert data["placement"] == "placed" and data["pod_id"] != dead
        assert w.k8s.deploy_calls == 2 and set(w.k8s.pods) == {data["pod_id"]}
        assert await w.live_sessions() == {"s3"}
        assert await w.waiters() == 0
        await w.assert_consistent()


# ================================================================================================
# H — warm pool
# ================================================================================================


async def test_h_a_new_pod_is_taken_from_the_warm_pool_without_a_deploy(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=2, min_idle_pods=1)
        assert await w.autoscale() == 0, "the scope is not known before its first route"
        pod1 = (await w.routed("s1"))["pod_id"]

        assert await w.autoscale() == 1
        assert w.k8s.deploy_calls == 2
        (warm,) = await w.warm()
        assert warm != pod1 and w.k8s.pods[warm].ready
        assert await redis.exists(rm_pod(SCOPE, warm, "idle_since"))
        assert await redis.hget(rm_pod(SCOPE, warm, "info"), "phase") == "idle"
        assert await w.candidates() == [pod1], "a warm pod is no placement candidate"
        assert await w.autoscale() == 0, "the floor is met"

        assert (await w.routed("s2"))["pod_id"] == pod1  # room on pod 1 first
        s3 = await w.routed("s3")  # needs a new pod: the warm one

        assert s3["placement"] == "placed" and s3["pod_id"] == warm
        assert s3["pod_sse_url"] == f"http://{w.k8s.pods[warm].pod_ip}:8080/sse"
        assert w.k8s.deploy_calls == 2, "no deploy"
        assert await w.warm() == set()
        assert not await redis.exists(rm_pod(SCOPE, warm, "idle_since"))
        assert await redis.hget(rm_pod(SCOPE, warm, "info"), "phase") == "in_use"
        assert await w.candidates() == [pod1, warm]
        await w.assert_live("s3", warm)
        # at max_pods (2): the floor cannot be refilled
        assert await w.autoscale() == 0 and w.k8s.deploy_calls == 2
        await w.assert_consistent()


# ================================================================================================
# I — idle transition
# ================================================================================================


async def test_i_an_empty_pod_goes_to_the_warm_pool_and_is_reused(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=1)
        pod = (await w.routed("s1"))["pod_id"]
        await w.age_pod(pod)
        assert (await w.sweep())["idle"] == 0, "a pod with a session is never handed back"

        assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
        await w.age_pod(pod, -60)  # registered just now again: inside the grace
        assert (await w.sweep())["idle"] == 0, "a just-registered pod is left alone"
        assert await w.candidates() == [pod]

        await w.age_pod(pod, 60)
        assert (await w.sweep())["idle"] == 1

        assert await w.candidates() == [], "out of the placement candidates"
        assert await redis.exists(sm_pod(SCOPE, pod, "idle_notified"))
        assert await redis.sismember(sm_pods_registered(SCOPE), pod)
        assert await w.warm() == {pod}
        assert await redis.exists(rm_pod(SCOPE, pod, "idle_since"))
        assert await redis.hget(rm_pod(SCOPE, pod, "info"), "phase") == "idle"
        assert (await w.sweep())["idle"] == 0, "one notice per pod"
        assert pod in w.k8s.pods and w.k8s.deleted == []

        s2 = await w.routed("s2")

        assert s2["placement"] == "placed" and s2["pod_id"] == pod
        assert w.k8s.deploy_calls == 1, "reused, not deployed"
        assert await w.candidates() == [pod]
        assert await w.warm() == set()
        assert not await redis.exists(sm_pod(SCOPE, pod, "idle_notified"))
        assert await redis.hget(rm_pod(SCOPE, pod, "info"), "phase") == "in_use"
        await w.assert_live("s2", pod)
        await w.assert_consistent()


# ================================================================================================
# J — watch
# ================================================================================================


async def test_j_pods_deleted_behind_our_back_or_crash_looping_are_cleaned(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=3, pod_concurrency=1)  # one pod per session
        removed = (await w.routed("s1"))["pod_id"]
        looping = (await w.routed("s2"))["pod_id"]
        healthy = (await w.routed("s3"))["pod_id"]
        assert await w.svc.pool_jobs.watch_once() == 0, "nothing wrong yet"

        w.k8s.remove(removed)  # someone else deleted it
        w.k8s.set_phase(looping, "Running", "CrashLoopBackOff")
        assert await w.svc.pool_jobs.watch_once() == 2

        for session_id, pod_id in (("s1", removed), ("s2", looping)):
            await w.assert_gone(session_id, pod_id)
            await w.assert_pod_forgotten(pod_id)
        assert w.k8s.deleted == [looping], "a crash-looping pod is deleted, a missing one is not"
        await w.assert_live("s3", healthy)
        await w.assert_pod_known(healthy)
        assert await w.candidates() == [healthy]
        assert await w.svc.pool_jobs.watch_once() == 0, "idempotent"

        # their sessions come back on a new pod and are told so
        r1 = await w.routed("s1")
        assert r1["placement"] == "rebound" and r1["previous_pod_id"] == removed
        assert r1["pod_id"] not in (removed, looping, healthy)
        await w.assert_consistent()


# ================================================================================================
# K — reclaim
# ================================================================================================


async def test_k_idle_pods_above_the_floor_are_deleted_after_pod_ttl(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=3, pod_concurrency=1, min_idle_pods=1, pod_ttl=60)
        pods = [(await w.routed(f"s{i}"))["pod_id"] for i in (1, 2, 3)]
        for i, pod in enumerate(pods, 1):
            assert await w.touch(f"s{i}", eos=True) == {"touched": True, "released": True}
            await w.age_pod(pod)
        assert (await w.sweep())["idle"] == 3
        assert await w.warm() == set(pods)
        assert await w.svc.pool_jobs.reclaim_once() == 0, "idle for less than pod_ttl"

        # idle for longer than pod_ttl; pods[1] the longest: the floor of one keeps it
        now = int(await w.now())
        for pod, ago in zip(pods, (100, 300, 200), strict=True):
            await redis.set(rm_pod(SCOPE, pod, "idle_since"), str(now - ago))
        assert await w.svc.pool_jobs.reclaim_once() == 2

        kept = pods[1]
        assert sorted(w.k8s.deleted) == sorted([pods[0], pods[2]])
        assert list(w.k8s.pods) == [kept]
        for pod in (pods[0], pods[2]):
            await w.assert_pod_forgotten(pod)
        assert await w.warm() == {kept}
        await w.assert_pod_known(kept)
        assert await w.svc.pool_jobs.reclaim_once() == 0, "the floor is never reclaimed"

        s4 = await w.routed("s4")
        assert s4["pod_id"] == kept and w.k8s.deploy_calls == 3
        await w.assert_consistent()


# ================================================================================================
# L — reconcile
# ================================================================================================


async def test_l_a_redis_pod_missing_in_kubernetes_is_purged(redis: Redis, db: Database) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=1)
        gone = (await w.routed("s1"))["pod_id"]
        kept = (await w.routed("s2"))["pod_id"]
        w.k8s.remove(gone)

        counts = await w.svc.pool_jobs.reconcile_once()

        assert counts == {
            "purged": 1,
            "released": 0,
            "adopted": 0,
            "deleted": 0,
            "expired": 0,
            "foreign": 0,
        }
        await w.assert_pod_forgotten(gone)
        await w.assert_gone("s1", gone)
        await w.assert_pod_known(kept)
        await w.assert_live("s2", kept)
        r1 = await w.routed("s1")
        assert r1["placement"] == "rebound" and r1["previous_pod_id"] == gone
        await w.assert_consistent()


async def test_l_after_a_resource_manager_wipe_a_ready_current_pod_is_adopted_as_warm(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=1)
        pod = (await w.routed("s1"))["pod_id"]
        url = (await redis.hgetall(rm_pod(SCOPE, pod, "info")))["pod_sse_url"]
        assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
        await w.age_pod(pod)
        assert (await w.sweep())["idle"] == 1
        assert await w.warm() == {pod}

        # Redis loses every resource_manager key; the pool config comes back with the next
        # config push (here: the claw manager re-syncs the template)
        doomed = [k async for k in redis.scan_iter(match="resource_manager:*")]
        assert rm_pod(SCOPE, pod, "info") in doomed
        await redis.delete(*doomed)
        data = await w.sync(
            "template", "sync", {**BASE_TEMPLATE, "scope_concurrency": 2, "pod_concurrency": 1}
        )
        assert data["affected_scopes"] == 1
        assert await redis.exists(rm_scope(SCOPE, "config"))

        counts = await w.svc.pool_jobs.reconcile_once()

        assert counts == {
            "purged": 0,
            "released": 0,
            "adopted": 1,
            "deleted": 0,
            "expired": 0,
            "foreign": 0,
        }
        assert w.k8s.deleted == []
        assert await w.warm() == {pod}
        assert await redis.exists(rm_pod(SCOPE, pod, "idle_since"))
        info = await redis.hgetall(rm_pod(SCOPE, pod, "info"))
        assert info["phase"] == "idle" and info["pod_sse_url"] == url
        assert info["deploy_ver"] == w.k8s.pods[pod].labels["agent-runtime/deploy-ver"]
        assert await rm_pod_known(redis, pod)
        assert (await w.svc.pool_jobs.reconcile_once())["adopted"] == 0, "adopted once"

        # the adopted pod serves the next session that needs a pod
        s2 = await w.routed("s2")
        assert s2["pod_id"] == pod and s2["pod_sse_url"] == url and w.k8s.deploy_calls == 1
        await w.assert_consistent()


async def test_l_an_unused_in_use_pod_is_released_after_two_passes(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=1)
        unused = (await w.routed("s1"))["pod_id"]
        busy = (await w.routed("s2"))["pod_id"]
        assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
        await w.age_pod(unused)

        # the empty-pod notice is lost on its way to the resource manager
        notices: list[str] = []

        async def lost(pod_id: str, scope_id: str) -> dict[str, bool]:
            notices.append(pod_id)
            raise ConnectionError("lost")

        monkeypatch.setattr(w.svc.resources, "idle_consider", lost)
        assert (await w.sweep())["idle"] == 1
        assert notices == [unused]
        assert await w.candidates() == [busy]
        assert await redis.hget(rm_pod(SCOPE, unused, "info"), "phase") == "in_use"
        assert await w.warm() == set()

        first = await w.svc.pool_jobs.reconcile_once()
        assert first["released"] == 0, "one pass is not enough"
        second = await w.svc.pool_jobs.reconcile_once()
        assert second["released"] == 1

        assert await w.warm() == {unused}
        assert await redis.hget(rm_pod(SCOPE, unused, "info"), "phase") == "idle"
        assert await redis.hget(rm_pod(SCOPE, busy, "info"), "phase") == "in_use"
        assert unused in w.k8s.pods and w.k8s.deleted == []
        await w.assert_live("s2", busy)
        s3 = await w.routed("s3")
        assert s3["pod_id"] == unused and w.k8s.deploy_calls == 2
        await w.assert_consistent()


# ================================================================================================
# M — config hot update
# ================================================================================================


async def test_m_policy_and_deploy_changes_take_effect_on_the_next_route(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db, scope_full_timeout=0.3) as w:
        await w.configure(scope_concurrency=1, pod_concurrency=1)
        old = (await w.routed("s1"))["pod_id"]
        assert_failure(await w.route("s2"), 504, "SCOPE_FULL_TIMEOUT")

        # policy: room for more sessions, on the pod that exists
        change = await w.sync(
            "template",
            "update",
            {"template_id": TEMPLATE_ID, "scope_concurrency": 4, "pod_concurrency": 2},
        )
        assert change["change_class"] == "policy" and change["affected_scopes"] == 1
        s2 = await w.routed("s2")
        assert s2["placement"] == "placed" and s2["pod_id"] == old
        assert await redis.hget(sm_scope(SCOPE, "config"), "scope_concurrency") == "4"
        assert await redis.hget(rm_scope(SCOPE, "config"), "max_pods") == "2"
        assert w.k8s.deploy_calls == 1
        old_ver = await redis.hget(rm_pod(SCOPE, old, "info"), "deploy_ver")

        # deploy: a new image; the old pod leaves the candidates, its sessions stay on it
        change = await w.sync(
            "template", "update", {"template_id": TEMPLATE_ID, "image": "agentserver:2"}
        )
        assert change["change_class"] == "deploy" and change["affected_scopes"] == 1
        assert await w.candidates() == []
        new_ver = await redis.hget(sm_scope(SCOPE, "config"), "deploy_ver")
        assert new_ver and new_ver != old_ver
        assert await redis.hget(rm_scope(SCOPE, "config"), "deploy_ver") == new_ver
        assert (await w.routed("s1")) == {**s2, "placement": "refresh"}
        s3 = await w.routed("s3")
        new = s3["pod_id"]
        assert s3["placement"] == "placed" and new != old and w.k8s.deploy_calls == 2
        assert w.k8s.pods[new].labels["agent-runtime/deploy-ver"] == new_ver
        assert await redis.hget(rm_pod(SCOPE, new, "info"), "deploy_ver") == new_ver
        assert await redis.hget(sm_pod(SCOPE, new, "info"), "deploy_ver") == new_ver
        assert (await w.routed("s4"))["pod_id"] == new
        assert await w.candidates() == [new]
        await w.assert_live("s1", old)
        await w.assert_live("s2", old)

        # a second deploy change while the old pod still serves: refused, nothing changed
        busy = await w.sync(
            "template", "update", {"template_id": TEMPLATE_ID, "image": "agentserver:3"}, status=409
        )
        assert busy["error_code"] == "CONFIG_SYNC_BUSY"
        assert await redis.hget(sm_scope(SCOPE, "config"), "deploy_ver") == new_ver
        assert await redis.hget(rm_scope(SCOPE, "config"), "deploy_ver") == new_ver

        # the old pod's sessions end; the jobs hand it back and reclaim the old version
        for session_id in ("s1", "s2"):
            assert await w.touch(session_id, eos=True) == {"touched": True, "released": True}
        await w.age_pod(old)
        assert (await w.sweep())["idle"] == 1
        assert await w.svc.pool_jobs.reclaim_once() == 1
        assert old in w.k8s.deleted and old not in w.k8s.pods
        await w.assert_pod_forgotten(old)
        await w.assert_pod_known(new)

        change = await w.sync(
            "template", "update", {"template_id": TEMPLATE_ID, "image": "agentserver:3"}
        )
        assert change["change_class"] == "deploy"
        assert await w.candidates() == [], "now the version-2 pod is the sunset one"
        assert (await w.routed("s3"))["placement"] == "refresh"
        s5 = await w.routed("s5")
        assert s5["pod_id"] not in (old, new) and w.k8s.deploy_calls == 3
        await w.assert_consistent()


async def test_m_a_deploy_change_replaces_the_warm_pool(redis: Redis, db: Database) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=2, min_idle_pods=1)
        pod = (await w.routed("s1"))["pod_id"]
        assert await w.autoscale() == 1
        (old_warm,) = await w.warm()

        change = await w.sync(
            "template", "update", {"template_id": TEMPLATE_ID, "image": "agentserver:2"}
        )
        assert change["change_class"] == "deploy"
        new_ver = await redis.hget(rm_scope(SCOPE, "config"), "deploy_ver")
        # the old warm pod is never handed out: a new session gets a pod of the new version
        # (max_pods 2 = the in-use pod and the old warm one: the old one goes first)
        assert await w.svc.pool_jobs.reclaim_once() == 1
        assert old_warm in w.k8s.deleted
        await w.assert_pod_forgotten(old_warm)
        assert await w.autoscale() == 1, "the floor is refilled with the new version"
        (new_warm,) = await w.warm()
        assert w.k8s.pods[new_warm].labels["agent-runtime/deploy-ver"] == new_ver
        s2 = await w.routed("s2")
        assert s2["pod_id"] == new_warm, "the new-version warm pod, not the sunset pod"
        assert (await w.routed("s1"))["pod_id"] == pod, "the old pod keeps its session"
        assert w.k8s.deploy_calls == 3
        await w.assert_consistent()


async def test_m_a_disabled_template_refuses_new_sessions_and_a_rule_change_applies(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db, scope_full_timeout=0.3) as w:
        await w.configure()
        await w.routed("s1")
        change = await w.sync("template", "update", {"template_id": TEMPLATE_ID, "enabled": False})
        assert change["change_class"] == "policy"

        resp = await w.route("s2")

        body = assert_failure(resp, 503, "CONFIG_NOT_FOUND")
        assert "retry_after" not in body
        assert not await redis.exists(sm_session(SCOPE, "s2"))
        await w.sync("template", "update", {"template_id": TEMPLATE_ID, "enabled": True})
        assert (await w.routed("s2"))["placement"] == "placed"

        # a routing-rule change drops every cached resolution; the exact rule still wins
        other = {**BASE_TEMPLATE, "template_id": "other", "scope_concurrency": 2}
        await w.sync("template", "sync", other)
        rule = {"group_id": GROUP, "bot_id": "*", "template_id": "other"}
        assert (await w.sync("routing_rule", "create", rule))["affected_scopes"] == 0
        assert not await redis.exists(sm_scope(SCOPE, "config"))
        assert (await w.routed("s3"))["placement"] == "placed"
        assert await redis.hget(sm_scope(SCOPE, "config"), "template_id") == TEMPLATE_ID
        # the scope moves to the other template: its scope_concurrency (2 < 3 live) applies
        exact = {"group_id": GROUP, "bot_id": BOT, "template_id": "other"}
        change = await w.sync("routing_rule", "update", exact)
        assert change["affected_scopes"] == 1 and change["change_class"] == "policy"
        assert_failure(await w.route("s4"), 504, "SCOPE_FULL_TIMEOUT")
        assert await redis.hget(sm_scope(SCOPE, "config"), "template_id") == "other"
        assert (await w.routed("s1"))["placement"] == "refresh"
        assert await w.live_sessions() == {"s1", "s2", "s3"}


async def test_m_sunset_pods_holding_max_pods_give_no_pod_available(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=2)  # max_pods 1
        old = (await w.routed("s1"))["pod_id"]
        await w.sync("template", "update", {"template_id": TEMPLATE_ID, "image": "agentserver:2"})

        resp = await w.route("s2")

        assert_failure(resp, 503, "NO_POD_AVAILABLE")
        assert_retry_after(resp)
        assert w.k8s.deploy_calls == 1 and not await redis.exists(sm_session(SCOPE, "s2"))
        assert await w.waiters() == 0
        # once the old pod is gone, the new version gets its pod
        assert await w.touch("s1", eos=True) == {"touched": True, "released": True}
        await w.age_pod(old)
        assert (await w.sweep())["idle"] == 1
        assert await w.svc.pool_jobs.reclaim_once() == 1
        s2 = await w.routed("s2")
        assert s2["pod_id"] != old and w.k8s.deploy_calls == 2
        await w.assert_consistent()


# ================================================================================================
# N — half-dead pod
# ================================================================================================


async def test_n_a_pod_failing_health_twice_is_cleaned_and_its_sessions_rebound(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=2)
        sick = (await w.routed("s1"))["pod_id"]
        assert (await w.routed("s2"))["pod_id"] == sick
        w.k8s.unhealthy.add(sick)  # Running, but GET /health fails

        assert await w.svc.pool_jobs.watch_once() == 0, "one failed probe is not enough"
        assert await redis.get(rm_pod(SCOPE, sick, "health_fails")) == "1"
        await w.assert_live("s1", sick)

        # a probe in between that passes starts the count again
        w.k8s.unhealthy.discard(sick)
        assert await w.svc.pool_jobs.watch_once() == 0
        assert not await redis.exists(rm_pod(SCOPE, sick, "health_fails"))
        w.k8s.unhealthy.add(sick)
        assert await w.svc.pool_jobs.watch_once() == 0

        assert await w.svc.pool_jobs.watch_once() == 1

        assert sick in w.k8s.deleted and sick not in w.k8s.pods
        await w.assert_pod_forgotten(sick)
        await w.assert_gone("s1", sick)
        await w.assert_gone("s2", sick)
        for session_id in ("s1", "s2"):
            data = await w.routed(session_id)
            assert data["placement"] == "rebound" and data["previous_pod_id"] == sick
            assert data["pod_id"] != sick
        await w.assert_consistent()


async def test_n_a_running_pod_that_is_not_ready_is_probed_too(redis: Redis, db: Database) -> None:
    async with world(redis, db) as w:
        await w.configure()
        sick = (await w.routed("s1"))["pod_id"]
        # its readiness probe fails: Kubernetes turns Ready false but it stays Running
        w.k8s.set_phase(sick, "Running", ready=False)
        w.k8s.unhealthy.add(sick)
        assert await w.svc.pool_jobs.watch_once() == 0
        assert await w.svc.pool_jobs.watch_once() == 1
        await w.assert_gone("s1", sick)
        await w.assert_pod_forgotten(sick)
        assert (await w.routed("s1"))["placement"] == "rebound"


async def test_n_a_probe_that_races_the_pods_purge_leaves_no_failure_count(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with world(redis, db) as w:
        await w.configure()
        pod = (await w.routed("s1"))["pod_id"]

        async def probe_while_purged(pod_ip: str, port: int) -> bool:
            # while watch probes the pod, it vanishes and reconcile forgets it
            w.k8s.remove(pod)
            assert (await w.svc.pool_jobs.reconcile_once())["purged"] == 1
            return False  # so the probe fails

        monkeypatch.setattr(w.k8s, "probe_health", probe_while_purged)
        assert await w.svc.pool_jobs.watch_once() == 0

        await w.assert_gone("s1", pod)
        await w.assert_pod_forgotten(pod)  # no health_fails counter of a forgotten pod


# ================================================================================================
# the whole life cycle with the jobs running by themselves
# ================================================================================================


async def test_with_the_jobs_running_an_abandoned_session_ends_and_its_pod_is_reclaimed(
    redis: Redis, db: Database
) -> None:
    fast = {
        f"{job}_interval": 0.1 for job in ("sweep", "autoscale", "reclaim", "watch", "reconcile")
    }
    async with world(redis, db, jobs_enabled=True, **fast) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=1, session_ttl=1, pod_ttl=1)
        pod = (await w.routed("s1"))["pod_id"]
        assert (await w.client.get("/healthz")).status_code == 200

        async def reclaimed() -> bool:  # deleted in Kubernetes, then forgotten in Redis
            return pod in w.k8s.deleted and not await redis.exists(
                sm_pod(SCOPE, pod, "info"), rm_pod(SCOPE, pod, "info")
            )

        # session_ttl 1 s → evicted; the 2 s grace → handed back; pod_ttl 1 s → deleted
        await eventually(reclaimed, "the abandoned pod is reclaimed", within=10)

        await w.assert_gone("s1", pod)
        await w.assert_pod_forgotten(pod)
        assert w.k8s.pods == {}
        data = await w.routed("s1")
        assert data["placement"] == "placed" and data["pod_id"] != pod


# ================================================================================================
# cleanup, replay, tokens
# ================================================================================================


async def post_cleanup(w: World, **rawdata: str) -> httpx.Response:
    return await w.client.post(CLEANUP, json=envelope(rawdata))


async def deploys_to(w: World, namespace: str) -> None:
    """A template naming ``namespace`` (one of AGENT_RUNTIME_NAMESPACES)."""
    item = {**BASE_TEMPLATE, "template_id": f"tpl-ns-{namespace}", "namespace": namespace}
    await w.sync("template", "sync", item)


async def test_cleanup_deletes_agentserver_pods_and_leaves_redis_to_watch(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db, namespaces=["team"]) as w:
        await w.configure(scope_concurrency=2, pod_concurrency=1)
        first = (await w.routed("s1"))["pod_id"]
        second = (await w.routed("s2"))["pod_id"]
        foreign = w.k8s.add_pod(
            scope_id=SCOPE, deploy_ver="x", labels={"jiuwenclaw-component": "other"}
        ).pod_id
        elsewhere = w.k8s.add_pod(scope_id=SCOPE, deploy_ver="x", namespace="team").pod_id

        resp = await post_cleanup(w, label_selector=f"app={first}")
        assert resp.status_code == 200, resp.text
        assert resp.json()["data"] == {"cleaned": 1}
        assert w.k8s.deleted == [first]

        resp = await post_cleanup(w)  # default namespace, every AgentServer pod
        assert resp.json()["data"] == {"cleaned": 1}
        assert w.k8s.deleted == [first, second]
        assert set(w.k8s.pods) == {foreign, elsewhere}, "not an AgentServer, or elsewhere"

        # Redis is not touched by cleanup ...
        for pod_id in (first, second):
            await w.assert_pod_known(pod_id)
        await w.assert_live("s1", first)
        # ... watch notices the deleted pods
        assert await w.svc.pool_jobs.watch_once() == 2
        for session_id, pod_id in (("s1", first), ("s2", second)):
            await w.assert_gone(session_id, pod_id)
            await w.assert_pod_forgotten(pod_id)

        await deploys_to(w, "team")
        resp = await post_cleanup(w, namespace="team")
        assert resp.json()["data"] == {"cleaned": 1}
        assert set(w.k8s.pods) == {foreign}


async def test_cleanup_of_a_missing_namespace_is_0_and_a_forbidden_one_is_502(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db, namespaces=["ghost", "locked"]) as w:
        w.k8s.add_pod(scope_id=SCOPE, deploy_ver="x", namespace="locked")
        w.k8s.missing_namespaces.add("ghost")
        w.k8s.forbidden_namespaces.add("locked")
        await deploys_to(w, "ghost")
        await deploys_to(w, "locked")

        resp = await post_cleanup(w, namespace="ghost")
        assert resp.status_code == 200 and resp.json()["data"] == {"cleaned": 0}

        resp = await post_cleanup(w, namespace="locked")
        body = assert_failure(resp, 502, "K8S_ERROR")
        assert "retry_after" not in body and "retry-after" not in resp.headers
        assert len(w.k8s.pods) == 1 and w.k8s.deleted == []


async def test_cleanup_never_reaches_a_namespace_off_the_allow_list(
    redis: Redis, db: Database
) -> None:
    """Only the default namespace and AGENT_RUNTIME_NAMESPACES: elsewhere nothing of ours can
    be, so nothing is listed or deleted there (cleaned 0), whatever the selector, and a
    template cannot make a namespace ours (400 at config_sync)."""
    async with world(redis, db) as w:
        theirs = w.k8s.add_pod(scope_id=SCOPE, deploy_ver="x", namespace="kube-system").pod_id
        calls: list[str] = []
        list_pods = w.k8s.list_pods

        async def counted(namespace: str, selector: str, *, cluster: str | None = None) -> Any:
            calls.append(namespace)
            return await list_pods(namespace, selector, cluster=cluster)

        w.k8s.list_pods = counted  # type: ignore[method-assign]
        resp = await post_cleanup(w, namespace="kube-system")
        assert resp.status_code == 200 and resp.json()["data"] == {"cleaned": 0}
        assert calls == [] and theirs in w.k8s.pods
        item = {**BASE_TEMPLATE, "template_id": "tpl-kube-system", "namespace": "kube-system"}
        resp = await w.client.post(SYNC, json=sync_body("template", "sync", item))
        body = assert_failure(resp, 400, "VALIDATION")
        assert body["error_message"].startswith("item.namespace:")
        resp = await post_cleanup(w, namespace="kube-system")
        assert resp.json()["data"] == {"cleaned": 0} and calls == [] and theirs in w.k8s.pods


async def test_route_replay_returns_the_first_answer_and_places_nothing(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=1)
        first = await w.routed("s1", request_id="r-1")
        expiry = await w.expiry("s1")
        await w.set_expiry("s1", expiry - 30)

        again = await w.routed("s1", request_id="r-1")

        assert again == first and again["placement"] == "placed", "the first answer, as it was"
        assert await w.expiry("s1") == pytest.approx(expiry - 30, abs=1e-3), "nothing done"
        # another session with the id is refused: the first answer is that request's only
        reused = await w.route("s2", request_id="r-1")
        assert reused.status_code == 409 and reused.json()["error_code"] == "REQUEST_ID_REUSED"
        assert first["pod_id"] not in reused.text
        assert not await redis.exists(sm_session(SCOPE, "s2"))
        assert w.k8s.deploy_calls == 1
        assert await redis.scard(sm_scope(SCOPE, "sessions")) == 1
        # a new request id does the work again
        assert (await w.routed("s1", request_id="r-2"))["placement"] == "refresh"


async def test_route_replay_of_a_request_still_running_waits_for_its_answer(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db) as w:
        await w.configure(scope_concurrency=4, pod_concurrency=1)
        w.k8s.ready_delay = 0.3  # the first call is deploying while the duplicate arrives
        first = asyncio.create_task(w.route("s1", request_id="r-dup"))

        async def deploying() -> bool:
            return w.k8s.deploy_calls == 1

        await eventually(deploying, "the first call deploys")
        duplicate = await w.route("s1", request_id="r-dup")
        original = await asyncio.wait_for(first, DEADLINE)

        assert original.status_code == duplicate.status_code == 200, duplicate.text
        assert duplicate.json() == original.json()
        assert w.k8s.deploy_calls == 1 and len(w.k8s.pods) == 1
        assert await redis.scard(sm_scope(SCOPE, "sessions")) == 1


async def test_route_replay_is_answered_by_another_replica(redis: Redis, db: Database) -> None:
    async with world(redis, db) as w, world(redis, db, instance_id="test-2") as other:
        await w.configure()
        first = await w.routed("s1", request_id="r-x")
        assert await other.routed("s1", request_id="r-x") == first
        assert other.k8s.deploy_calls == 0 and w.k8s.deploy_calls == 1
        # and the other replica refreshes the same binding with a new request id
        assert await other.routed("s1") == {**first, "placement": "refresh"}


async def test_route_and_touch_need_a_gateway_token_when_tokens_are_set(
    redis: Redis, db: Database
) -> None:
    async with world(redis, db, gateway_tokens=["gw-1", "gw-2"]) as w:
        await w.configure()  # admin endpoints stay open: only gateway tokens are set
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "gw-1"}):
            assert_failure(await w.route("s1", **headers), 401, "UNAUTHORIZED")
        assert w.k8s.deploy_calls == 0 and not await redis.exists(sm_session(SCOPE, "s1"))

        ok = await w.route("s1", Authorization="Bearer gw-2")
        assert ok.status_code == 200 and ok.json()["data"]["placement"] == "placed"

        body = envelope(session_id="s1")
        resp = await w.client.post(TOUCH, json=body)
        assert_failure(resp, 401, "UNAUTHORIZED")
        resp = await w.client.post(TOUCH, json=body, headers={"Authorization": "Bearer gw-1"})
        assert resp.status_code == 200 and resp.json()["data"] == {"touched": True}
