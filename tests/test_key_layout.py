"""The key layout (issue 17): a replica refuses keys of an earlier layout, and
``agent-runtime redis migrate`` moves them to the current names without stranding a session.

Layout 1 put the scope id bare in key names; layout 2 wraps it in braces (the Redis Cluster
hash tag). A live session written by this version, its keys given back their layout-1 names,
is served again after the migration exactly as before (same pod, ``refresh``).
"""

from __future__ import annotations

import asyncio
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
UNCHANGED = ["session_manager:session:s1", "session_manager:session_expiry"]
# a resource-manager pod's keys named only the pod: they move under its scope's tag, the
# scope read from its info, and the set of every pod becomes the pod index
POD_MOVES = {
    "resource_manager:resource:pod:pod-1:info": K.rm_pod(SID, "pod-1", "info"),
    "resource_manager:resource:pod:pod-1:idle_since": K.rm_pod(SID, "pod-1", "idle_since"),
}
# retired names: the migration deletes them (the scopes that referenced a pod: the resource
# manager names a pod's one scope now; the set of every pod, once its pods are indexed; a pod
# key of a pod in no index, which names no scope)
RETIRED = [
    "session_manager:pods:pod-1:scopes",
    "resource_manager:resource:pods:all",
    "resource_manager:resource:pod:ghost:health_fails",
    # the indexes over every scope: split into their buckets first
    "resource_manager:resource:scopes",
    "resource_manager:resource:leased_scopes",
    "resource_manager:resource:draining",
]
RENAMED = len(LAYOUT_1) + len(POD_MOVES)


async def write_layout_1(redis: Redis) -> None:
    for name in [*LAYOUT_1, *UNCHANGED]:
        await redis.set(name, f"value of {name}")
    await redis.sadd(RETIRED[0], SID)
    await redis.sadd("resource_manager:resource:pods:all", "pod-1")
    await redis.hset("resource_manager:resource:pod:pod-1:info", mapping={"scope_id": SID})
    await redis.set("resource_manager:resource:pod:pod-1:idle_since", "1000.5")
    await redis.set("resource_manager:resource:pod:ghost:health_fails", "1")
    await redis.sadd("resource_manager:resource:scopes", SID)
    await redis.sadd("resource_manager:resource:leased_scopes", SID)
    await redis.zadd("resource_manager:resource:draining", {"pod-1": 1234.5})
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
    assert (dry.renamed, dry.deleted, dry.clash_count) == (RENAMED, len(RETIRED), 0)
    assert f"would delete {len(RETIRED)} retired" in dry.describe()
    olds = [*LAYOUT_1, *POD_MOVES, *RETIRED]
    assert all([await redis.exists(old) for old in olds]), "a dry run: nothing"
    assert not await K.rm_pods_known(redis)

    done = await key_layout.migrate(redis)
    assert (done.renamed, done.deleted, done.clash_count) == (RENAMED, len(RETIRED), 0)
    for name in [*RETIRED, *POD_MOVES]:
        assert not await redis.exists(name)
    assert await redis.hgetall(POD_MOVES["resource_manager:resource:pod:pod-1:info"]) == {
        "scope_id": SID
    }
    assert await redis.get(K.rm_pod(SID, "pod-1", "idle_since")) == "1000.5"
    assert await K.rm_pods_known(redis) == {"pod-1": SID}, "the pod index has the pod"
    assert await redis.smembers(K.rm_scopes(SID)) == {SID}
    assert set(await K.rm_leased_scopes(redis)) == {SID}, "due: the prune looks at it"
    assert await K.rm_draining_pods(redis) == {"pod-1": 1234.5}
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


@pytest.mark.parametrize("retired", RETIRED)
async def test_a_retired_key_alone_is_refused_and_migrate_deletes_it(
    redis: Redis, retired: str
) -> None:
    if retired.endswith(":draining"):
        await redis.zadd(retired, {"pod-1": 1.0})  # a ZSET, pod -> deadline
    else:
        await redis.sadd(retired, SID)
    with pytest.raises(ConfigError, match=r"agent-runtime redis migrate"):
        await key_layout.check(redis)
    done = await key_layout.migrate(redis)
    assert (done.renamed, done.deleted) == (0, 1)
    assert not await redis.exists(retired)
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
    assert done.renamed == RENAMED


_TAG = re.compile(r"\{([^{}]+)\}")
# a resource-manager pod's key: resource:pod:{<sid>}:<pod>:<part>, layout 1 had no scope in it
_RM_POD = re.compile(r"^(resource_manager:resource:pod:)\{[^{}]+\}:(.+)$")


async def back_to_layout_1(redis: Redis) -> int:
    """What an earlier version would have left: every scope key's braces taken off, a pod's
    keys named by the pod alone, and each index over every scope or pod one key."""
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
            pod_key = _RM_POD.match(key)
            old = f"{pod_key[1]}{pod_key[2]}" if pod_key else _TAG.sub(r"\1", key, count=1)
            if old != key and not key.startswith(f"{rm}pods:"):
                await redis.rename(key, old)
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
        scope = await redis.hget(K.sm_session("s1"), "scope_id")
        assert await redis.sismember(K.sm_scope(scope, "sessions"), "s1")
        assert await K.rm_pod_scope(redis, first["pod_id"]) == scope
        assert await redis.sismember(K.rm_scopes(scope), scope)
        assert await redis.hget(K.rm_pod(scope, first["pod_id"], "info"), "phase") == "in_use"


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
    assert code == 0 and f"would rename {RENAMED} keys" in out, out
    code, out = await cli("migrate")
    assert code == 0 and f"renamed {RENAMED} keys" in out, out
    code, out = await cli("status")
    assert code == 0 and "current" in out, out
