"""Bounded growth of per-scope state (issue 13 §3): idle scopes leave Redis and come back from
the DB; config_sync walks only the scopes its item reaches, outside its lock, and overlapping
propagations converge. Real Redis and fakeredis (the ``redis`` fixture), every DB backend."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager import state as rms
from agent_runtime.resource_manager.facade import PoolConfigUpdate, ResourceManagerFacade
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.orchestrator import ResourceOrchestrator
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.scope_buckets import BUCKETS, bucket_of
from agent_runtime.session_manager import state as sms
from agent_runtime.session_manager.config_store import ConfigStore
from agent_runtime.session_manager.models import ConfigSyncRequest
from agent_runtime.session_manager.scope_state import ScopeState
from agent_runtime.session_manager.state import SessionState
from agent_runtime.session_manager.sweeper import SessionSweeper
from agent_runtime.util import scope_id_of
from agent_runtime.wiring import Services
from helpers import IDENTITY, envelope, running_app, sync_body

TTL = 0.3  # the idle TTL of these tests (s)


class Env:
    def __init__(self, redis: Redis, db: Database) -> None:
        self.redis = redis
        self.state = ScopeState(redis)  # the scope records these tests look at
        self.rm_state = ResourceState(redis)
        self.resources = ResourceManagerFacade(
            orchestrator=ResourceOrchestrator(
                state=self.rm_state,
                k8s=FakeK8sPodClient(),
                notifier=Notifier(redis),
                default_namespace="default",
                identity=IDENTITY,
            )
        )
        sessions = SessionState(redis)
        self.store = ConfigStore(db=db, state=sessions, scopes=self.state, resources=self.resources)
        self.sweeper = SessionSweeper(
            state=sessions, scopes=self.state, resources=self.resources, scope_idle_ttl=TTL
        )

    async def sync(self, kind: str, op: str, **item: Any) -> dict[str, Any]:
        request = ConfigSyncRequest(kind=kind, op=op, item=item)  # type: ignore[arg-type]
        return await self.store.config_sync(request)

    async def template(self, template_id: str, **fields: Any) -> dict[str, Any]:
        fields.setdefault("image", f"img/{template_id}:1")
        return await self.sync("template", "sync", template_id=template_id, **fields)

    async def rule(self, group_id: str, bot_id: str, template_id: str) -> None:
        await self.sync(
            "routing_rule", "sync", group_id=group_id, bot_id=bot_id, template_id=template_id
        )

    async def resolve(self, group_id: str, bot_id: str) -> str:
        """Resolve the scope, and give it a pool config as its first acquire would."""
        sid = scope_id_of(group_id, bot_id)
        config = await self.store.resolve(sid, group_id, bot_id)
        await self.resources.update_pool_config(sid, config.pool_config(), config.pod_spec)
        return sid

    async def registered(self, sid: str) -> bool:
        return bool(await self.redis.hexists(sms.scope_registry_key(bucket_of(sid)), sid))

    async def expire_until(self, done: Callable[[], Awaitable[bool]], ticks: int = 40) -> bool:
        """Tick the expiry job by hand until ``done`` (generous: a loaded machine)."""
        for _ in range(ticks):
            await self.sweeper.expire_scopes_once()
            if await done():
                return True
            await asyncio.sleep(TTL / 2)
        return False


@pytest.fixture
async def env(redis: Redis, db: Database) -> Env:
    e = Env(redis, db)
    await e.template("t1")
    await e.rule("*", "*", "t1")
    return e


async def test_an_empty_scope_leaves_redis_after_the_ttl_and_comes_back_from_the_db(
    env: Env,
) -> None:
    sid = await env.resolve("g", "b")
    assert await env.registered(sid) and await env.redis.exists(sms.scope_config_key(sid))
    assert await env.redis.sismember(rms.scope_index_key(sid), sid)

    async def gone() -> bool:
        return not await env.registered(sid)

    assert await env.expire_until(gone)
    for key in (
        sms.scope_config_key(sid),
        sms.scope_pod_seq_key(sid),
        rms.scope_config_key(sid),
        rms.scope_config_gen_key(sid),
        sms.template_index_key("t1"),
        sms.group_index_key("g"),
        sms.bot_index_key("b"),
        sms.scope_idle_key(bucket_of(sid)),
        sms.scope_entry_key(sid),
    ):
        assert not await env.redis.exists(key), key
    assert not await env.redis.sismember(rms.scope_index_key(sid), sid)

    # the next route rebuilds it from the DB, and config_sync finds it again
    assert (await env.store.resolve(sid, "g", "b")).template_id == "t1"
    assert await env.registered(sid) and await env.redis.exists(sms.scope_config_key(sid))
    out = await env.sync("template", "update", template_id="t1", scope_concurrency=7)
    assert out["affected_scopes"] == 1


async def _session(r: Redis, sid: str) -> None:
    await r.sadd(sms.scope_sessions_key(sid), "s1")


async def _candidate(r: Redis, sid: str) -> None:
    await r.zadd(sms.scope_pods_key(sid), {"p1": 1})


async def _waiter(r: Redis, sid: str) -> None:
    seconds, _ = await r.time()
    await r.zadd(sms.scope_waiters_key(sid), {"rq": seconds + 3600})


async def _reservation(r: Redis, sid: str) -> None:
    seconds, _ = await r.time()
    await r.zadd(sms.scope_reserved_key(sid), {"rq": seconds + 3600})


async def _rm_pod(r: Redis, sid: str) -> None:
    await r.zadd(rms.scope_pods_key(sid), {"p1": 1})


async def _warm_pod(r: Redis, sid: str) -> None:
    await r.sadd(rms.scope_idle_key(sid), "p1")


async def _placeholder(r: Redis, sid: str) -> None:
    seconds, _ = await r.time()
    await r.sadd(rms.scope_deploying_key(sid), f"tok@{seconds + 3600}")


async def _follower(r: Redis, sid: str) -> None:
    seconds, _ = await r.time()
    await r.zadd(rms.scope_followers_key(sid, "rq"), {"rq": seconds + 3600})
    await r.zadd(rms.scope_cold_deploys_key(sid), {"rq": seconds})


async def _deploy_lock(r: Redis, sid: str) -> None:
    await r.set(rms.deploy_lock_key(sid, "rq"), "tok", ex=3600)
    await r.zadd(rms.scope_cold_deploys_key(sid), {"rq": 1})


USES = {
    "session": _session,
    "candidate": _candidate,
    "waiter": _waiter,
    "reservation": _reservation,
    "rm_pod": _rm_pod,
    "warm_pod": _warm_pod,
    "placeholder": _placeholder,
    "follower": _follower,
    "deploy_lock": _deploy_lock,
}


@pytest.mark.parametrize("use", sorted(USES))
async def test_a_scope_in_use_is_kept(env: Env, use: str) -> None:
    sid = await env.resolve("g", "b")
    other = await env.resolve("h", "b")  # an empty neighbour: proves the job ran
    await USES[use](env.redis, sid)

    async def other_gone() -> bool:
        return not await env.registered(other)

    assert await env.expire_until(other_gone)
    await asyncio.sleep(TTL * 2)
    for _ in range(3):
        await env.sweeper.expire_scopes_once()
    assert await env.registered(sid), use
    assert await env.redis.exists(sms.scope_config_key(sid)), use
    assert await env.redis.exists(rms.scope_config_key(sid)), use
    assert await env.redis.sismember(sms.template_index_key("t1"), sid)


async def test_an_expired_placeholder_does_not_keep_a_scope(env: Env) -> None:
    sid = await env.resolve("g", "b")
    seconds, _ = await env.redis.time()
    await env.redis.sadd(rms.scope_deploying_key(sid), f"tok@{seconds - 10}")

    async def gone() -> bool:
        return not await env.registered(sid)

    assert await env.expire_until(gone)
    assert not await env.redis.exists(rms.scope_deploying_key(sid))


async def test_the_scope_registry_stays_bounded_under_a_flood_of_scopes_that_end(
    env: Env,
) -> None:
    n = 2000
    gen = await env.state.config_generation()
    for i in range(n):  # what resolve's fill writes, 2,000 fresh (group, bot) pairs
        sid = scope_id_of(f"flood-{i}", "b")
        fields = {"template_id": "t1", "scope_concurrency": "1"}
        assert await env.state.fill_scope_config(sid, f"flood-{i}", "b", fields, gen, "t1")
    assert await env.state.scope_count() == n
    assert await env.redis.scard(sms.template_index_key("t1")) == n

    async def empty() -> bool:
        return await env.state.scope_count() == 0

    assert await env.expire_until(empty, ticks=80)
    for bucket in range(BUCKETS):
        assert await env.redis.hlen(sms.scope_registry_key(bucket)) == 0
        assert await env.redis.zcard(sms.scope_idle_key(bucket)) == 0
    assert not await env.redis.exists(sms.template_index_key("t1"))
    assert not await env.redis.exists(sms.bot_index_key("b"))


def _no_full_walk(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    async def walk() -> dict[str, tuple[str, str]]:
        raise AssertionError("config_sync walked every known scope")

    monkeypatch.setattr(env.state, "known_scopes", walk)


async def test_a_template_change_touches_only_the_scopes_of_that_template(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    await env.template("t2")
    await env.rule("g", "*", "t2")
    t1 = [await env.resolve(f"x{i}", "b") for i in range(5)]
    t2 = [await env.resolve("g", f"b{i}") for i in range(3)]
    _no_full_walk(env, monkeypatch)
    out = await env.sync(
        "template", "update", template_id="t2", scope_concurrency=9, pod_concurrency=1
    )
    assert out["change_class"] == "policy" and out["affected_scopes"] == 3
    for sid in t2:
        assert not await env.redis.exists(sms.scope_config_key(sid))  # dropped: re-resolve
        assert await env.redis.hget(rms.scope_config_key(sid), "max_pods") == "9"
    for sid in t1:
        assert await env.redis.exists(sms.scope_config_key(sid))  # untouched
        assert await env.redis.hget(rms.scope_config_key(sid), "max_pods") != "9"


async def test_a_rule_change_walks_only_the_scopes_it_can_match_and_moves_the_index(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    await env.template("t2", image="img/t2:1")
    others = [await env.resolve(f"x{i}", "b") for i in range(4)]
    mine = [await env.resolve("g", f"b{i}") for i in range(3)]
    _no_full_walk(env, monkeypatch)
    out = await env.sync("routing_rule", "create", group_id="g", bot_id="*", template_id="t2")
    assert out["affected_scopes"] == 3 and out["change_class"] == "deploy"
    # the contract: a routing-rule change drops every cached scope resolution
    for sid in others:
        assert not await env.redis.exists(sms.scope_config_key(sid))
    assert await env.state.scopes_in_template("t2") == set(mine)
    assert await env.state.scopes_in_template("t1") == set(others)
    for sid in mine:
        spec = json.loads(await env.redis.hget(rms.scope_config_key(sid), "pod_spec_json"))
        assert spec["image"] == "img/t2:1"
    # now a change of t2 reaches exactly the moved scopes
    out = await env.sync("template", "update", template_id="t2", scope_concurrency=5)
    assert out["affected_scopes"] == 3


async def test_a_config_sync_during_another_ones_propagation_is_served_and_both_converge(
    env: Env,
) -> None:
    await env.template("t2")
    await env.rule("g", "*", "t2")
    t1 = [await env.resolve(f"x{i}", "b") for i in range(4)]
    t2 = [await env.resolve("g", f"b{i}") for i in range(2)]
    gate, parked = asyncio.Event(), asyncio.Event()
    real = env.resources.update_pool_config
    slowed = set(t1)

    async def slow(sid: str, *args: Any, **kwargs: Any) -> PoolConfigUpdate:
        if sid in slowed:
            parked.set()
            await gate.wait()  # the first propagation is stuck mid-walk
        return await real(sid, *args, **kwargs)

    env.resources.update_pool_config = slow  # type: ignore[method-assign]
    first = asyncio.create_task(
        env.sync("template", "update", template_id="t1", scope_concurrency=3, pod_concurrency=1)
    )
    await asyncio.wait_for(parked.wait(), 30)
    # not 409: the lock is not held for the walk; another item and the same item both pass
    other = await env.sync(
        "template", "update", template_id="t2", scope_concurrency=6, pod_concurrency=1
    )
    assert other["affected_scopes"] == 2
    slowed.clear()
    second = await env.sync(
        "template", "update", template_id="t1", scope_concurrency=8, pod_concurrency=1
    )
    assert second["affected_scopes"] == 4
    gate.set()
    assert (await asyncio.wait_for(first, 30))["affected_scopes"] == 4
    for sid in t1:  # the later sync wins, whatever order the writes landed in
        assert await env.redis.hget(rms.scope_config_key(sid), "max_pods") == "8"
        assert (await env.store.resolve(sid, "", "")).scope_concurrency == 8
    for sid in t2:
        assert await env.redis.hget(rms.scope_config_key(sid), "max_pods") == "6"


async def test_a_stale_propagation_write_is_refused_by_both_sides(redis: Redis) -> None:
    state, rm = ScopeState(redis), ResourceState(redis)
    gen = await state.bump_config_generation()
    await state.bump_config_generation()  # a later config_sync planned meanwhile
    fields = {"template_id": "t1", "scope_concurrency": "1"}
    assert not await state.apply_scope("s1", "g", "b", "t1", gen, fields)
    assert not await redis.exists(sms.scope_config_key("s1"))
    pool = {"min_idle_pods": 0, "max_pods": 2, "pod_ttl": 1, "pod_concurrency": 1}
    assert await rm.write_pool_config("s1", pool, generation=gen + 1)
    assert not await rm.write_pool_config("s1", {**pool, "max_pods": 5}, generation=gen)
    assert await redis.hget(rms.scope_config_key("s1"), "max_pods") == "2"
    assert set(await redis.hkeys(rms.scope_config_key("s1"))) == set(pool)  # contract fields
    assert await rm.write_pool_config("s1", {**pool, "max_pods": 4})  # acquire's: no generation
    assert await redis.hget(rms.scope_config_key("s1"), "max_pods") == "4"


async def test_over_http_a_scope_whose_last_pod_is_reclaimed_expires_and_routes_again(
    redis: Redis, db: Database
) -> None:
    """The whole life: route, end the session, the pod goes warm and is reclaimed, the jobs
    expire the scope; the next route rebuilds it from the DB and deploys again."""
    api = "/api/session"
    async with running_app(redis, db, scope_idle_ttl=TTL) as client:
        svc: Services = client.app.state.services  # type: ignore[attr-defined]
        for kind, item in (
            ("template", {"template_id": "t1", "image": "img:1", "pod_ttl": 1}),
            ("routing_rule", {"group_id": "*", "bot_id": "*", "template_id": "t1"}),
        ):
            resp = await client.post(f"{api}/config_sync", json=sync_body(kind, "sync", item))
            assert resp.status_code == 200, resp.text
        sid = scope_id_of("g", "b")

        async def route(session_id: str) -> dict[str, Any]:
            body = envelope(session_id=session_id, bot_id="b", extra={"group_id": "g"})
            resp = await client.post(f"{api}/route", json=body)
            assert resp.status_code == 200, resp.text
            data: dict[str, Any] = resp.json()["data"]
            return data

        pod = (await route("s1"))["pod_id"]
        resp = await client.post(f"{api}/touch", json=envelope({"eos": True}, session_id="s1"))
        assert resp.json()["data"]["released"] is True
        info = sms.pod_info_key(sid, pod)  # past the sweeper's grace for a new pod
        registered_at = float(await redis.hget(info, "registered_at") or 0)
        await redis.hset(info, "registered_at", f"{registered_at - 60:.6f}")

        async def reclaimed() -> bool:
            await svc.session_sweeper.sweep_once()
            await svc.session_sweeper.wait_for_notices()
            await svc.pool_jobs.reclaim_once()
            return not await redis.exists(rms.scope_pods_key(sid))

        for _ in range(60):
            if await reclaimed():
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the warm pod was never reclaimed")
        assert await redis.hexists(sms.scope_registry_key(bucket_of(sid)), sid)

        for _ in range(60):
            assert await svc.jobs.run_once("scope_expiry")
            if not await redis.hexists(sms.scope_registry_key(bucket_of(sid)), sid):
                break
            await asyncio.sleep(TTL / 2)
        else:
            raise AssertionError("the empty scope never expired")
        assert not await redis.exists(sms.scope_config_key(sid), rms.scope_config_key(sid))

        again = await route("s2")
        assert again["placement"] == "placed" and again["pod_id"] != pod
        assert await redis.hexists(sms.scope_registry_key(bucket_of(sid)), sid)
        assert await redis.hget(rms.scope_config_key(sid), "pod_ttl") == "1"
