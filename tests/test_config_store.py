"""The config layer: resolve (cache, then DB) and config_sync, on every Redis × DB backend."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from redis.asyncio import Redis
from sqlalchemy.exc import OperationalError

from agent_runtime import spec_fields
from agent_runtime.db.engine import Database
from agent_runtime.errors import (
    ConfigNotFound,
    ConfigSyncBusy,
    Conflict,
    NotFound,
    ValidationFailed,
)
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager.facade import ResourceManagerFacade
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.orchestrator import ResourceOrchestrator
from agent_runtime.resource_manager.state import ResourceState
from agent_runtime.resource_manager.state import scope_config_key as rm_config_key
from agent_runtime.session_manager import config_repo
from agent_runtime.session_manager.config_store import ConfigStore
from agent_runtime.session_manager.items import TemplateItem
from agent_runtime.session_manager.models import ConfigSyncRequest
from agent_runtime.session_manager.scope_state import ScopeState
from agent_runtime.session_manager.state import (
    CONFIG_SYNC_LOCK_KEY,
    SessionState,
    pod_info_key,
    pods_registered_key,
    scope_config_key,
    scope_pods_key,
)
from agent_runtime.util import scope_id_of
from helpers import IDENTITY, running_app


class CountingDatabase:
    """Wraps a Database: counts calls, and can make writes fail like a dropped connection."""

    def __init__(self, inner: Database) -> None:
        self.inner = inner
        self.reads = 0
        self.writes = 0
        self.fail_writes = False

    async def read(self, fn: Callable[..., Any]) -> Any:
        self.reads += 1
        return await self.inner.read(fn)

    async def write(self, fn: Callable[..., Any]) -> Any:
        self.writes += 1
        if self.fail_writes:
            raise OperationalError("UPDATE …", {}, ConnectionError("server has gone away"))
        return await self.inner.write(fn)


@pytest.fixture
def counting_db(db: Database) -> CountingDatabase:
    return CountingDatabase(db)


@pytest.fixture
def store(redis: Redis, counting_db: CountingDatabase) -> ConfigStore:
    return ConfigStore(
        db=counting_db,  # type: ignore[arg-type]
        state=SessionState(redis),
        scopes=ScopeState(redis),
        resources=ResourceManagerFacade(
            orchestrator=ResourceOrchestrator(
                state=ResourceState(redis),
                k8s=FakeK8sPodClient(),
                notifier=Notifier(redis),
                default_namespace="default",
                identity=IDENTITY,
            )
        ),
    )


async def sync(store: ConfigStore, kind: str, op: str, **item: Any) -> dict[str, Any]:
    return await store.config_sync(ConfigSyncRequest(kind=kind, op=op, item=item))  # type: ignore[arg-type]


async def template(store: ConfigStore, template_id: str, **fields: Any) -> dict[str, Any]:
    fields.setdefault("image", f"img/{template_id}:1")
    return await sync(store, "template", "sync", template_id=template_id, **fields)


async def rule(store: ConfigStore, group_id: str, bot_id: str, template_id: str) -> None:
    await sync(
        store, "routing_rule", "sync", group_id=group_id, bot_id=bot_id, template_id=template_id
    )


async def resolve(store: ConfigStore, group_id: str, bot_id: str) -> Any:
    return await store.resolve(scope_id_of(group_id, bot_id), group_id, bot_id)


async def add_pod(redis: Redis, scope_id: str, pod_id: str, deploy_ver: str, order: int) -> None:
    """Register a pod on the session side, as register_pod will."""
    await redis.zadd(scope_pods_key(scope_id), {pod_id: order})
    await redis.hset(
        pod_info_key(scope_id, pod_id), mapping={"sse_url": "http://x", "deploy_ver": deploy_ver}
    )
    await redis.sadd(pods_registered_key(scope_id), pod_id)


# --- resolve -----------------------------------------------------------------------------------


async def test_resolve_priority_all_four_levels(store: ConfigStore) -> None:
    for tid in ("t-exact", "t-group", "t-bot", "t-all"):
        await template(store, tid)
    await rule(store, "g", "b", "t-exact")
    await rule(store, "g", "*", "t-group")
    await rule(store, "*", "b", "t-bot")
    await rule(store, "*", "*", "t-all")
    assert (await resolve(store, "g", "b")).template_id == "t-exact"
    assert (await resolve(store, "g", "other")).template_id == "t-group"
    assert (await resolve(store, "other", "b")).template_id == "t-bot"
    assert (await resolve(store, "other", "other")).template_id == "t-all"


async def test_resolve_disabled_template_and_no_match(store: ConfigStore) -> None:
    await template(store, "t-off", enabled=False)
    await template(store, "t-all")
    await rule(store, "g", "b", "t-off")
    await rule(store, "*", "*", "t-all")
    # the most specific rule decides: its template is disabled, so no fall-through to (*, *)
    with pytest.raises(ConfigNotFound):
        await resolve(store, "g", "b")
    assert (await resolve(store, "g", "x")).template_id == "t-all"
    await sync(store, "routing_rule", "delete", group_id="*", bot_id="*")
    with pytest.raises(ConfigNotFound):
        await resolve(store, "g", "x")


async def test_resolve_ids_are_case_sensitive(store: ConfigStore) -> None:
    await template(store, "lower")
    await template(store, "upper")
    await rule(store, "grp", "*", "lower")
    await rule(store, "GRP", "*", "upper")
    assert (await resolve(store, "grp", "b")).template_id == "lower"
    assert (await resolve(store, "GRP", "b")).template_id == "upper"


async def test_resolve_fills_the_cache_and_the_second_resolve_does_not_touch_the_db(
    store: ConfigStore, redis: Redis, counting_db: CountingDatabase
) -> None:
    await template(store, "t1", scope_concurrency=6, pod_concurrency=4, session_ttl=90)
    await rule(store, "*", "*", "t1")
    sid = scope_id_of("g", "b")
    first = await resolve(store, "g", "b")
    cached = await redis.hgetall(scope_config_key(sid))
    assert cached["template_id"] == "t1"
    assert cached["scope_concurrency"] == "6" and cached["max_pods"] == "2"
    assert cached["session_ttl"] == "90"
    assert json.loads(cached["pod_spec_json"])["image"] == "img/t1:1"
    assert cached["deploy_ver"] == spec_fields.deploy_ver(json.loads(cached["pod_spec_json"]))

    reads_before = counting_db.reads
    second = await resolve(store, "g", "b")
    assert counting_db.reads == reads_before, "a cached resolve must not read the DB"
    assert second == first


async def test_a_cold_burst_of_one_scope_reads_the_db_once(
    store: ConfigStore, counting_db: CountingDatabase
) -> None:
    """50 concurrent resolves of an uncached scope share one DB read; a caller that goes
    away does not cancel it for the others; a refusal reaches every waiter alike."""
    await template(store, "t1")
    await rule(store, "g", "b", "t1")
    reads_before = counting_db.reads
    calls = [asyncio.ensure_future(resolve(store, "g", "b")) for _ in range(50)]
    await asyncio.sleep(0)
    calls[0].cancel()
    results = await asyncio.gather(*calls[1:])
    assert counting_db.reads - reads_before == 1
    assert {r.template_id for r in results} == {"t1"}
    await asyncio.gather(calls[0], return_exceptions=True)  # cancelled, or done (fakeredis)

    reads_before = counting_db.reads
    misses = await asyncio.gather(
        *(resolve(store, "nobody", "here") for _ in range(5)), return_exceptions=True
    )
    assert {type(m) for m in misses} == {ConfigNotFound}
    assert counting_db.reads - reads_before == 1
    # the next one asks again (a refusal is not cached)
    with pytest.raises(ConfigNotFound):
        await resolve(store, "nobody", "here")
    assert counting_db.reads - reads_before == 2


async def test_a_resolve_that_raced_a_config_change_does_not_write_a_stale_cache(
    store: ConfigStore, redis: Redis
) -> None:
    state = ScopeState(redis)
    sid = scope_id_of("g", "b")
    generation = await state.config_generation()
    await state.bump_config_generation()  # a config_sync ran between the read and the fill
    assert not await state.fill_scope_config(sid, "g", "b", {"template_id": "stale"}, generation)
    assert not await redis.exists(scope_config_key(sid))


# --- config_sync: items ------------------------------------------------------------------------


async def test_template_create_update_delete_sync(store: ConfigStore, db: Database) -> None:
    created = await sync(store, "template", "create", template_id="t1", image="a:1")
    assert created == {
        "kind": "template",
        "op": "create",
        "id": "t1",
        "change_class": "none",
        "affected_scopes": 0,
    }
    with pytest.raises(Conflict):
        await sync(store, "template", "create", template_id="t1", image="a:1")

    updated = await sync(store, "template", "update", template_id="t1", pod_ttl=900)
    assert updated["change_class"] == "policy"
    stored = await db.read(lambda c: config_repo.get_template(c, "t1"))
    assert stored is not None and stored.pod_ttl == 900 and stored.image == "a:1"  # partial update

    assert (await sync(store, "template", "update", template_id="t1", image="a:2"))[
        "change_class"
    ] == "deploy"
    # sync replaces the whole item: fields not given go back to their defaults
    replaced = await sync(store, "template", "sync", template_id="t1", image="a:2")
    assert replaced["change_class"] == "policy"  # pod_ttl 900 → default
    assert (
        await db.read(lambda c: config_repo.get_template(c, "t1"))
    ).pod_ttl == TemplateItem.model_fields["pod_ttl"].default
    assert (await sync(store, "template", "sync", template_id="t1", image="a:2"))[
        "change_class"
    ] == "none"

    assert (await sync(store, "template", "delete", template_id="t1"))["op"] == "delete"
    assert await db.read(lambda c: config_repo.get_template(c, "t1")) is None
    with pytest.raises(NotFound):
        await sync(store, "template", "delete", template_id="t1")
    with pytest.raises(NotFound):
        await sync(store, "template", "update", template_id="t1", pod_ttl=5)


async def test_routing_rule_create_update_delete_sync(store: ConfigStore, db: Database) -> None:
    await template(store, "t1")
    await template(store, "t2")
    out = await sync(store, "routing_rule", "create", group_id="g", bot_id="*", template_id="t1")
    assert out["kind"] == "routing_rule" and out["id"] == "g/*"
    with pytest.raises(Conflict):
        await sync(store, "routing_rule", "create", group_id="g", bot_id="*", template_id="t2")
    await sync(store, "routing_rule", "update", group_id="g", bot_id="*", template_id="t2")
    assert (await db.read(lambda c: config_repo.get_rule(c, "g", "*"))).template_id == "t2"
    with pytest.raises(ValidationFailed, match=r"item\.template_id"):
        await sync(store, "routing_rule", "sync", group_id="g", bot_id="*", template_id="missing")
    with pytest.raises(Conflict):  # a template that rules still use cannot go
        await sync(store, "template", "delete", template_id="t2")
    await sync(store, "routing_rule", "delete", group_id="g", bot_id="*")
    assert await db.read(lambda c: config_repo.get_rule(c, "g", "*")) is None
    with pytest.raises(NotFound):
        await sync(store, "routing_rule", "update", group_id="g", bot_id="*", template_id="t1")
    with pytest.raises(NotFound):
        await sync(store, "routing_rule", "delete", group_id="g", bot_id="*")
    await sync(store, "template", "delete", template_id="t2")


async def test_delete_needs_only_the_id_fields_and_refuses_unknown_ones(store: ConfigStore) -> None:
    await template(store, "t1")
    with pytest.raises(ValidationFailed, match=r"item\.colour: unknown field"):
        await sync(store, "template", "delete", template_id="t1", colour="red")
    await sync(store, "template", "delete", template_id="t1", image="ignored")


async def test_invalid_item_is_refused_before_the_lock(store: ConfigStore, redis: Redis) -> None:
    await redis.set(CONFIG_SYNC_LOCK_KEY, "someone-else")
    with pytest.raises(ValidationFailed, match=r"item\.pod_concurrency"):
        await sync(store, "template", "create", template_id="t1", image="a", pod_concurrency=0)
    with pytest.raises(ConfigSyncBusy):
        await sync(store, "template", "create", template_id="t1", image="a")


async def test_the_lock_is_released_after_an_error(store: ConfigStore, redis: Redis) -> None:
    with pytest.raises(NotFound):
        await sync(store, "template", "update", template_id="nope", pod_ttl=5)
    assert not await redis.exists(CONFIG_SYNC_LOCK_KEY)
    await template(store, "t1")


# --- config_sync: propagation ------------------------------------------------------------------


async def _scope_on(store: ConfigStore, redis: Redis, template_id: str, group: str = "g") -> str:
    """A scope that has routed (resolved) and runs two pods of the template's version."""
    config = await resolve(store, group, "b")
    assert config.template_id == template_id
    sid = config.scope_id
    await add_pod(redis, sid, f"{group}-p1", config.deploy_ver, 1)
    await add_pod(redis, sid, f"{group}-p2", config.deploy_ver, 2)
    return sid


async def test_policy_change_drops_the_cache_and_pushes_pool_config(
    store: ConfigStore, redis: Redis
) -> None:
    await template(store, "t1", scope_concurrency=4, pod_concurrency=2)
    await rule(store, "*", "*", "t1")
    sid = await _scope_on(store, redis, "t1")
    out = await sync(
        store, "template", "update", template_id="t1", scope_concurrency=9, min_idle_pods=1
    )
    assert out["change_class"] == "policy" and out["affected_scopes"] == 1
    assert not await redis.exists(scope_config_key(sid))
    assert await redis.zrange(scope_pods_key(sid), 0, -1) == ["g-p1", "g-p2"]  # nothing sunset
    pool = await redis.hgetall(rm_config_key(sid))
    assert (
        pool["max_pods"] == "5" and pool["min_idle_pods"] == "1" and pool["pod_concurrency"] == "2"
    )
    assert (await resolve(store, "g", "b")).scope_concurrency == 9  # effective at the next route


async def test_deploy_change_sunsets_old_pods_and_writes_the_new_version(
    store: ConfigStore, redis: Redis
) -> None:
    await template(store, "t1")
    await template(store, "t-other")
    await rule(store, "g", "*", "t1")
    await rule(store, "*", "*", "t-other")
    sid = await _scope_on(store, redis, "t1")
    other = await _scope_on(store, redis, "t-other", group="h")
    old_ver = (await resolve(store, "g", "b")).deploy_ver

    out = await sync(store, "template", "update", template_id="t1", image="img/t1:2")
    assert out["change_class"] == "deploy" and out["affected_scopes"] == 1
    new_ver = (await resolve(store, "g", "b")).deploy_ver
    assert new_ver != old_ver
    assert await redis.zrange(scope_pods_key(sid), 0, -1) == []  # left the candidates at once
    assert await redis.sismember(pods_registered_key(sid), "g-p1")  # registered: sessions stay
    cached = await redis.hgetall(scope_config_key(sid))
    assert cached["deploy_ver"] == new_ver
    pool = await redis.hgetall(rm_config_key(sid))
    assert pool["deploy_ver"] == new_ver
    assert json.loads(pool["pod_spec_json"])["image"] == "img/t1:2"
    # another scope on another template is untouched
    assert await redis.zrange(scope_pods_key(other), 0, -1) == ["h-p1", "h-p2"]

    # a pod of the new version arrives and stays a candidate on a later policy change
    await add_pod(redis, sid, "g-p3", new_ver, 3)
    await sync(store, "template", "update", template_id="t1", pod_ttl=42)
    assert await redis.zrange(scope_pods_key(sid), 0, -1) == ["g-p3"]


async def test_second_deploy_change_while_sunset_pods_remain_is_refused_and_changes_nothing(
    store: ConfigStore, redis: Redis, db: Database
) -> None:
    await template(store, "t1")
    await rule(store, "*", "*", "t1")
    sid = await _scope_on(store, redis, "t1")
    await sync(store, "template", "update", template_id="t1", image="img/t1:2")
    cache_before = await redis.hgetall(scope_config_key(sid))
    pool_before = await redis.hgetall(rm_config_key(sid))

    with pytest.raises(ConfigSyncBusy, match="sunset"):
        await sync(store, "template", "update", template_id="t1", image="img/t1:3")
    assert (await db.read(lambda c: config_repo.get_template(c, "t1"))).image == "img/t1:2"
    assert await redis.hgetall(scope_config_key(sid)) == cache_before
    assert await redis.hgetall(rm_config_key(sid)) == pool_before
    assert not await redis.exists(CONFIG_SYNC_LOCK_KEY)

    # a policy change is still allowed while pods are sunsetting
    assert (await sync(store, "template", "update", template_id="t1", pod_ttl=5))[
        "change_class"
    ] == "policy"
    # once the old pods are reclaimed (unregistered) the next deploy change goes through
    await redis.srem(pods_registered_key(sid), "g-p1", "g-p2")
    assert (await sync(store, "template", "update", template_id="t1", image="img/t1:3"))[
        "change_class"
    ] == "deploy"


async def test_routing_rule_change_drops_every_cache(store: ConfigStore, redis: Redis) -> None:
    await template(store, "t1")
    await template(store, "t2", image="img/t1:1", pod_ttl=1000)  # same version, other policy
    await rule(store, "*", "*", "t1")
    await rule(store, "x", "*", "t2")
    scopes = [(await resolve(store, f"g{i}", "b")).scope_id for i in range(5)]
    x_scope = (await resolve(store, "x", "b")).scope_id
    assert all([await redis.exists(scope_config_key(s)) for s in [*scopes, x_scope]])

    out = await sync(store, "routing_rule", "create", group_id="g0", bot_id="b", template_id="t2")
    assert out["change_class"] == "policy" and out["affected_scopes"] == 1
    for sid in [*scopes, x_scope]:
        assert not await redis.exists(scope_config_key(sid)), "every scope cache is dropped"
    assert (await resolve(store, "g0", "b")).template_id == "t2"
    assert (await resolve(store, "g1", "b")).template_id == "t1"


async def test_rule_change_to_another_version_sunsets_the_scopes_pods(
    store: ConfigStore, redis: Redis
) -> None:
    await template(store, "t1")
    await template(store, "t2", image="img/other:1")
    await rule(store, "*", "*", "t1")
    sid = await _scope_on(store, redis, "t1")
    out = await sync(store, "routing_rule", "sync", group_id="g", bot_id="b", template_id="t2")
    assert out["change_class"] == "deploy"
    assert await redis.zrange(scope_pods_key(sid), 0, -1) == []
    assert (await redis.hgetall(rm_config_key(sid)))["deploy_ver"] == (
        await resolve(store, "g", "b")
    ).deploy_ver


async def test_disabling_a_template_drops_its_scopes_caches(
    store: ConfigStore, redis: Redis
) -> None:
    await template(store, "t1")
    await rule(store, "*", "*", "t1")
    sid = await _scope_on(store, redis, "t1")
    assert (await sync(store, "template", "update", template_id="t1", enabled=False))[
        "affected_scopes"
    ] == 1
    assert not await redis.exists(scope_config_key(sid))
    with pytest.raises(ConfigNotFound):
        await resolve(store, "g", "b")


async def test_db_write_failure_leaves_cache_and_pools_untouched(
    store: ConfigStore, redis: Redis, counting_db: CountingDatabase, db: Database
) -> None:
    await template(store, "t1")
    await rule(store, "*", "*", "t1")
    sid = await _scope_on(store, redis, "t1")
    await sync(
        store, "template", "update", template_id="t1", min_idle_pods=1
    )  # fills the pool config
    await resolve(store, "g", "b")
    cache_before = await redis.hgetall(scope_config_key(sid))
    pool_before = await redis.hgetall(rm_config_key(sid))
    candidates_before = await redis.zrange(scope_pods_key(sid), 0, -1)

    counting_db.fail_writes = True
    for change in ({"image": "img/t1:9"}, {"pod_ttl": 7}):
        with pytest.raises(OperationalError):
            await sync(store, "template", "update", template_id="t1", **change)
    with pytest.raises(OperationalError):
        await sync(store, "routing_rule", "create", group_id="g", bot_id="b", template_id="t1")
    assert await redis.hgetall(scope_config_key(sid)) == cache_before
    assert await redis.hgetall(rm_config_key(sid)) == pool_before
    assert await redis.zrange(scope_pods_key(sid), 0, -1) == candidates_before
    assert not await redis.exists(CONFIG_SYNC_LOCK_KEY)
    assert (await db.read(lambda c: config_repo.get_template(c, "t1"))).image == "img/t1:1"


async def test_a_retry_after_a_failed_propagation_heals_the_scope(
    store: ConfigStore, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    await template(store, "t1")
    await rule(store, "*", "*", "t1")
    sid = await _scope_on(store, redis, "t1")

    async def redis_gone(*_: Any, **__: Any) -> None:
        raise ConnectionError("redis went away mid-propagation")

    resources = store._resources
    monkeypatch.setattr(resources, "update_pool_config", redis_gone)
    with pytest.raises(ConnectionError):
        await sync(store, "template", "sync", template_id="t1", image="img/t1:2")
    monkeypatch.undo()

    # the DB holds the new item; the retry sees no change but still converges Redis
    out = await sync(store, "template", "sync", template_id="t1", image="img/t1:2")
    assert out["change_class"] == "none"
    new_ver = (await resolve(store, "g", "b")).deploy_ver
    assert (await redis.hgetall(rm_config_key(sid)))["deploy_ver"] == new_ver
    assert await redis.zrange(scope_pods_key(sid), 0, -1) == []


async def test_a_template_without_session_ttl_gets_the_default_session_ttl_setting(
    redis: Redis, db: Database
) -> None:
    """AGENT_RUNTIME_DEFAULT_SESSION_TTL: the session_ttl of a template created or synced
    without one (a fractional value rounds up to whole seconds); one given wins; an update
    without it keeps the stored one."""
    async with running_app(redis, db, default_session_ttl=7.5) as client:
        store: ConfigStore = client.app.state.services.config_store  # type: ignore[attr-defined]

        async def stored_ttl(template_id: str) -> int:
            row = await db.read(lambda c: config_repo.get_template(c, template_id))
            assert row is not None
            return row.session_ttl

        await sync(store, "template", "create", template_id="t-default", image="a:1")
        assert await stored_ttl("t-default") == 8
        await sync(store, "template", "create", template_id="t-given", image="a:1", session_ttl=90)
        assert await stored_ttl("t-given") == 90
        await sync(store, "template", "update", template_id="t-given", pod_ttl=900)
        assert await stored_ttl("t-given") == 90  # a partial update keeps it
        await sync(store, "template", "sync", template_id="t-given", image="a:1")
        assert await stored_ttl("t-given") == 8  # a sync replaces the whole item
