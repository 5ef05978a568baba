"""The key layout (issue 17): a replica refuses keys of an earlier layout, and
``agent-runtime redis migrate`` moves them to the current names without stranding a session.

Layout 1 put the scope id bare in key names; layout 2 wraps it in braces (the Redis Cluster
hash tag). A live session written by this version, its keys given back their layout-1 names,
is served again after the migration exactly as before (same pod, ``refresh``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys

import pytest
from redis.asyncio import Redis

import contract_keys as K
from agent_runtime import key_layout
from agent_runtime.config import ConfigError
from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.scope_buckets import bucket_of
from helpers import envelope, real_redis_url, running_app, sync_body

SID = "0123456789abcdef0123456789abcdef"
LAYOUT_1 = {  # a layout-1 name → its layout-2 name
    f"session_manager:scope:{SID}:sessions": f"session_manager:scope:{{{SID}}}:sessions",
    f"session_manager:pod:{SID}:pod-1:info": f"session_manager:pod:{{{SID}}}:pod-1:info",
    f"resource_manager:resource:scope:{SID}:pods":
        f"resource_manager:resource:scope:{{{SID}}}:pods",
    f"resource_manager:resource:scope:{SID}:deploy_followers:r-1":
        f"resource_manager:resource:scope:{{{SID}}}:deploy_followers:r-1",
    f"resource_manager:lock:rm:deploy:{SID}:r-1": f"resource_manager:lock:rm:deploy:{{{SID}}}:r-1",
    "resource_manager:resource:foreign_pods": "resource_manager:resource:foreign_pods:{foreign}",
    "resource_manager:resource:foreign_pods:count":
        "resource_manager:resource:foreign_pods:{foreign}:count",
    "resource_manager:budget:pods": "resource_manager:budget:{budget}:pods",
    "resource_manager:budget:rule:r-1:pods": "resource_manager:budget:{budget}:rule:r-1:pods",
    "resource_manager:budget:rules": "resource_manager:budget:{budget}:rules",
    "resource_manager:budget:rule_limits": "resource_manager:budget:{budget}:rule_limits",
}  # fmt: skip
UNCHANGED = ["session_manager:config_gen", "session_manager:lock:config_sync"]
# retired names: the migration deletes them (the scopes that referenced a pod: the resource
# manager names a pod's one scope now; the global expiry set: each session hash carries its
# expiry; an eos's 60 s answer that names no scope)
RETIRED = ["session_manager:pods:pod-1:scopes", "session_manager:touch:r-9"]


async def write_layout_1(redis: Redis) -> None:
    for name in [*LAYOUT_1, *UNCHANGED]:
        await redis.set(name, f"value of {name}")
    for name in RETIRED:
        await redis.sadd(name, SID)
    await redis.expire(f"resource_manager:lock:rm:deploy:{SID}:r-1", 300)


async def test_a_redis_without_our_keys_is_recorded_as_the_current_layout(redis: Redis) -> None:
    await redis.set("someone_else:key", "1")
    await key_layout.check(redis)
    assert await redis.get(key_layout.LAYOUT_KEY) == str(key_layout.LAYOUT)
    await key_layout.check(redis)  # and accepted from then on


async def test_keys_of_an_earlier_layout_are_refused_with_the_way_out(redis: Redis) -> None:
    await write_layout_1(redis)
    with pytest.raises(ConfigError, match=r"agent-runtime redis migrate"):
        await key_layout.check(redis)
    assert await redis.get(key_layout.LAYOUT_KEY) is None
    await redis.set(key_layout.LAYOUT_KEY, "3")
    with pytest.raises(ConfigError, match="newer than this version"):
        await key_layout.check(redis)


async def test_migrate_renames_every_old_key_keeping_values_and_ttls(redis: Redis) -> None:
    await write_layout_1(redis)
    dry = await key_layout.migrate(redis, dry_run=True)
    assert (dry.renamed, dry.deleted, dry.clash_count) == (len(LAYOUT_1), len(RETIRED), 0)
    assert f"would delete {len(RETIRED)} retired" in dry.describe()
    assert all([await redis.exists(old) for old in [*LAYOUT_1, *RETIRED]]), "a dry run: nothing"

    done = await key_layout.migrate(redis)
    assert (done.renamed, done.deleted, done.clash_count) == (len(LAYOUT_1), len(RETIRED), 0)
    for name in RETIRED:
        assert not await redis.exists(name)
    for old, new in LAYOUT_1.items():
        assert not await redis.exists(old)
        assert await redis.get(new) == f"value of {old}"
    for name in UNCHANGED:
        assert await redis.get(name) == f"value of {name}"
    assert 0 < await redis.ttl(LAYOUT_1[f"resource_manager:lock:rm:deploy:{SID}:r-1"]) <= 300
    assert await redis.get(key_layout.LAYOUT_KEY) == str(key_layout.LAYOUT)
    await key_layout.check(redis)
    again = await key_layout.migrate(redis)
    assert (again.renamed, again.deleted, again.clash_count) == (0, 0, 0), "idempotent"


async def test_a_retired_key_alone_is_refused_and_migrate_deletes_it(redis: Redis) -> None:
    await redis.sadd(RETIRED[0], SID)
    with pytest.raises(ConfigError, match=r"agent-runtime redis migrate"):
        await key_layout.check(redis)
    done = await key_layout.migrate(redis)
    assert (done.renamed, done.deleted) == (0, 1)
    assert not await redis.exists(RETIRED[0])
    await key_layout.check(redis)


async def test_migrate_leaves_a_clash_under_the_old_name_and_says_so(redis: Redis) -> None:
    old, new = next(iter(LAYOUT_1.items()))
    await redis.set(old, "old")
    await redis.set(new, "new")
    done = await key_layout.migrate(redis)
    assert (done.renamed, done.clash_count, done.clashes) == (0, 1, [old])
    assert (await redis.get(old), await redis.get(new)) == ("old", "new")
    assert "1 left under their old name" in done.describe()


async def test_migrate_refuses_while_a_replica_holds_a_job_lock(redis: Redis) -> None:
    await write_layout_1(redis)
    await redis.set("agent_runtime:job:sm_sweep", "token", ex=10)
    with pytest.raises(ConfigError, match="replicas are running"):
        await key_layout.migrate(redis)
    assert await redis.exists(next(iter(LAYOUT_1)))
    done = await key_layout.migrate(redis, force=True)
    assert done.renamed == len(LAYOUT_1)


_TAG = re.compile(r"\{([^{}]+)\}")
# a resource-manager pod's key: resource:pod:{<sid>}:<pod>:<part>, layout 1 had no scope in it
_RM_POD = re.compile(r"^(resource_manager:resource:pod:)\{[^{}]+\}:(.+)$")
_SESSION = re.compile(r"^session_manager:session:\{([^{}]+)\}:(.*)$")
_EXPIRY = re.compile(r"^session_manager:scope:\{([^{}]+)\}:session_expiry$")
_REGISTERED = re.compile(r"^session_manager:pods:\{([^{}]+)\}:registered$")
_GONE = re.compile(r"^session_manager:(session_scope|expiry_due|leased_scopes|touch):")


async def back_to_layout_1(redis: Redis) -> int:
    """What an earlier version would have left: every scope key's braces taken off, a session
    hash named by its session id, one expiry set and one registered-pods set for all scopes,
    none of the indexes layout 2 keeps beside them."""
    moved = 0
    rm = "resource_manager:resource:"
    pods = await K.rm_pods_known(redis)
    for pod_id in pods:
        await redis.hdel(K.rm_pods_index(pod_id), pod_id)
        await redis.sadd(f"{rm}pods:all", pod_id)
    for scope_id in await K.rm_leased_scopes(redis):
        await redis.delete(K.rm_leased(scope_id))
        await redis.sadd(f"{rm}leased_scopes", scope_id)
    for pod_id, deadline in (await K.rm_draining_pods(redis)).items():
        await redis.zadd(f"{rm}draining", {pod_id: deadline})
    async for key in redis.scan_iter(match=f"{rm}scopes:*"):
        await redis.sadd(f"{rm}scopes", *await redis.smembers(key))
        await redis.delete(key)
    async for key in redis.scan_iter(match=f"{rm}draining:*"):
        await redis.delete(key)
    for pattern in ("session_manager:*", "resource_manager:*"):
        async for key in redis.scan_iter(match=pattern):
            if key.startswith(f"{rm}pods:"):
                continue  # the pod index: gone above
            elif pod_key := _RM_POD.match(key):
                await redis.rename(key, f"{pod_key[1]}{pod_key[2]}")
            elif "{budget}:" in key or ":{foreign}" in key:  # a literal tag, not a scope's
                await redis.rename(key, key.replace("{budget}:", "").replace(":{foreign}", ""))
            elif _GONE.match(key):
                await redis.delete(key)
            elif match := _SESSION.match(key):
                await redis.hdel(key, "index_until")
                await redis.rename(key, f"session_manager:session:{match[2]}")
            elif match := _EXPIRY.match(key):
                members = await redis.zrange(key, 0, -1, withscores=True)
                await redis.zadd("session_manager:session_expiry", dict(members))
                await redis.delete(key)
            elif match := _REGISTERED.match(key):
                pods = [f"{match[1]}:{pod}" for pod in await redis.smembers(key)]
                await redis.sadd("session_manager:pods:registered", *pods)
                await redis.delete(key)
            elif (old := _TAG.sub(r"\1", key, count=1)) != key:
                await redis.rename(key, old)
            else:
                continue
            moved += 1
    await redis.delete(key_layout.LAYOUT_KEY)
    return moved


async def test_a_live_session_is_served_again_after_the_migration(
    redis: Redis, db: Database
) -> None:
    cluster = FakeK8sPodClient()
    route = envelope(request_id="r-1", session_id="s1", bot_id="b1", extra={"group_id": "g1"})
    async with running_app(redis, db, k8s=cluster) as client:
        item = {"template_id": "tpl-a", "image": "agentserver:1", "ready_poll_interval": 0.02}
        assert (await client.post(
            "/api/session/config_sync", json=sync_body("template", "create", item)
        )).status_code == 200  # fmt: skip
        rule = {"group_id": "*", "bot_id": "*", "template_id": "tpl-a"}
        assert (await client.post(
            "/api/session/config_sync", json=sync_body("routing_rule", "create", rule)
        )).status_code == 200  # fmt: skip
        first = (await client.post("/api/session/route", json=route)).json()["data"]
        assert first["placement"] == "placed"
    assert await back_to_layout_1(redis) > 5
    with pytest.raises(Exception, match="agent-runtime redis migrate"):
        async with running_app(redis, db, k8s=cluster):
            pass
    assert (await key_layout.migrate(redis)).clash_count == 0
    async with running_app(redis, db, k8s=cluster) as client:
        again = envelope(request_id="r-2", session_id="s1", bot_id="b1", extra={"group_id": "g1"})
        answer = (await client.post("/api/session/route", json=again)).json()["data"]
        assert answer["placement"] == "refresh"
        assert answer["pod_id"] == first["pod_id"]
        scope = await redis.get(K.sm_session_scope("s1"))
        assert await redis.hget(K.sm_session(scope, "s1"), "scope_id") == scope
        assert await redis.sismember(K.sm_scope(scope, "sessions"), "s1")
        assert await K.rm_pod_scope(redis, first["pod_id"]) == scope
        assert await redis.sismember(K.rm_scopes(scope), scope)
        assert await redis.hget(K.rm_pod(scope, first["pod_id"], "info"), "phase") == "in_use"
        assert await redis.sismember(K.sm_pods_registered(scope), first["pod_id"])
        # the session still ends by its expiry: the conversion marked its scope (its time
        # brought forward here instead of waiting for it)
        due = K.sm_bucket("expiry_due", bucket_of(scope))
        assert await redis.zscore(due, scope) is not None
        await redis.zadd(K.sm_expiry(scope), {"s1": 1.0})
        await redis.zadd(due, {scope: 1.0})
        services = client.app.state.services  # type: ignore[attr-defined]
        assert await services.session_sweeper.expire_once() == 1
        assert not await redis.exists(K.sm_session(scope, "s1"))


async def test_a_session_and_the_indexes_over_scopes_move_under_the_scopes_tag(
    redis: Redis,
) -> None:
    """Layout 1's session hash (named by its session id), the global expiry set, the global
    registered pods, the leased scopes and the scope registry: each session goes under its
    scope's tag with its expiry, its session-scope index and its scope's expiry mark; the pods,
    leases and registry split by scope; the global expiry set and idle marks are deleted."""
    other = "f" * 32
    now = float((await redis.time())[0])
    for session_id, sid in (("s1", SID), ("s:2", SID), ("s3", other)):
        await redis.hset(
            f"session_manager:session:{session_id}",
            mapping={"scope_id": sid, "pod_id": "pod-1", "expiry": f"{now + 60:.6f}",
                     "session_ttl": "60"},
        )  # fmt: skip
        await redis.zadd("session_manager:session_expiry", {session_id: now + 60})
    await redis.hset("session_manager:session:half", "pod_id", "pod-1")  # no scope: dropped
    await redis.sadd("session_manager:pods:registered", f"{SID}:pod-1", f"{other}:pod-1")
    await redis.sadd("session_manager:leased_scopes", SID)
    await redis.hset("session_manager:scope_registry", SID, json.dumps(["g1", "b1", "tpl-a", 4]))
    await redis.zadd("session_manager:scope_idle", {SID: now})
    dry = await key_layout.migrate(redis, dry_run=True)
    assert (dry.converted, dry.deleted) == (7, 2)
    with pytest.raises(ConfigError, match="redis migrate"):
        await key_layout.check(redis)

    done = await key_layout.migrate(redis)
    assert (done.converted, done.deleted, done.clash_count) == (6, 2, 0)
    assert "converted 6" in done.describe()
    # the registry: each scope's record under its tag, its bucket entry
    record = await redis.get(f"session_manager:scope:{{{SID}}}:entry")
    assert json.loads(record) == ["g1", "b1", "tpl-a", 4]
    bucket = K.sm_bucket("scope_registry", bucket_of(SID))
    assert json.loads(await redis.hget(bucket, SID)) == ["g1", "b1"]
    for session_id, sid in (("s1", SID), ("s:2", SID), ("s3", other)):
        binding = await redis.hgetall(K.sm_session(sid, session_id))
        assert binding["pod_id"] == "pod-1" and binding["scope_id"] == sid
        assert await redis.zscore(K.sm_expiry(sid), session_id) == pytest.approx(now + 60)
        assert await redis.get(K.sm_session_scope(session_id)) == sid
        assert 0 < await redis.ttl(K.sm_session_scope(session_id)) <= 120
        due = K.sm_bucket("expiry_due", bucket_of(sid))
        assert await redis.zscore(due, sid) == pytest.approx(now + 60, abs=0.01)
    assert await redis.smembers(K.sm_pods_registered(SID)) == {"pod-1"}
    assert await redis.smembers(K.sm_pods_registered(other)) == {"pod-1"}
    assert await redis.zscore(K.sm_bucket("leased_scopes", bucket_of(SID)), SID) is not None
    for gone in (
        "session_expiry", "pods:registered", "leased_scopes", "session:half", "scope_registry",
        "scope_idle",
    ):  # fmt: skip
        assert not await redis.exists(f"session_manager:{gone}"), gone
    await key_layout.check(redis)
    again = await key_layout.migrate(redis)
    assert (again.renamed, again.converted, again.deleted) == (0, 0, 0), "idempotent"


@pytest.mark.parametrize("redis", ["real"], indirect=True)
async def test_the_cli_says_the_layout_and_migrates(redis: Redis) -> None:
    env = {**os.environ, "AGENT_RUNTIME_REDIS_URL": real_redis_url()}

    async def cli(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent_runtime.cli", "redis", *args,
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return int(proc.returncode or 0), out.decode()

    await write_layout_1(redis)
    code, out = await cli("status")
    assert code == 1 and "agent-runtime redis migrate" in out, out
    code, out = await cli("migrate", "--dry-run")
    assert code == 0 and f"would rename {len(LAYOUT_1)} keys" in out, out
    code, out = await cli("migrate")
    assert code == 0 and f"renamed {len(LAYOUT_1)} keys" in out, out
    code, out = await cli("status")
    assert code == 0 and "current" in out, out


async def test_a_pod_s_keys_and_the_indexes_over_scopes_move_to_their_buckets(
    redis: Redis,
) -> None:
    """Layout 1's resource-manager pod keys (named by the pod alone), the set of every pod and
    the one-key indexes over every scope: a pod's keys go under the scope its info names (its
    drain's when the info is gone), the pod into the pod index; the indexes split into their
    buckets; a pod key whose pod names no scope, and the set of every pod, are deleted."""
    rm = "resource_manager:resource:"
    await redis.sadd(f"{rm}pods:all", "pod-1", "ghost")
    await redis.hset(f"{rm}pod:pod-1:info", mapping={"scope_id": SID, "phase": "idle"})
    await redis.set(f"{rm}pod:pod-1:idle_since", "1000.5")
    await redis.hset(f"{rm}pod:pod-1:drain", mapping={"scope_id": SID, "state": "draining"})
    await redis.hset(f"{rm}pod:pod-2:drain", mapping={"scope_id": SID, "state": "draining"})
    await redis.set(f"{rm}pod:ghost:health_fails", "1")  # no info, no drain: names no scope
    await redis.sadd(f"{rm}scopes", SID)
    await redis.sadd(f"{rm}leased_scopes", SID)
    await redis.zadd(f"{rm}draining", {"pod-1": 1234.5})
    converted = 9  # 4 pod keys + ghost's + pods:all + the three indexes
    dry = await key_layout.migrate(redis, dry_run=True)
    assert (dry.converted, dry.deleted) == (converted, 0)
    with pytest.raises(ConfigError, match="redis migrate"):
        await key_layout.check(redis)
    assert await K.rm_pods_known(redis) == {}, "a dry run: nothing"

    done = await key_layout.migrate(redis)
    assert (done.converted, done.clash_count) == (converted, 0)
    assert await redis.hgetall(K.rm_pod(SID, "pod-1", "info")) == {
        "scope_id": SID, "phase": "idle"
    }  # fmt: skip
    assert await redis.get(K.rm_pod(SID, "pod-1", "idle_since")) == "1000.5"
    assert await redis.hget(K.rm_pod(SID, "pod-1", "drain"), "state") == "draining"
    assert await redis.hget(K.rm_pod(SID, "pod-2", "drain"), "state") == "draining"
    assert await K.rm_pods_known(redis) == {"pod-1": SID}, "the pod index has the pod"
    assert await redis.smembers(K.rm_scopes(SID)) == {SID}
    assert set(await K.rm_leased_scopes(redis)) == {SID}, "due: the prune looks at it"
    assert await K.rm_draining_pods(redis) == {"pod-1": 1234.5}
    left = [k async for k in redis.scan_iter(match=f"{rm}pod:*") if "{" not in k]
    assert left == [] and not await redis.exists(f"{rm}pods:all", f"{rm}scopes", f"{rm}draining")
    await key_layout.check(redis)
    again = await key_layout.migrate(redis)
    assert (again.renamed, again.converted, again.deleted) == (0, 0, 0), "idempotent"
