"""The resource manager's keys as an earlier version named them: what ``agent-runtime redis
migrate`` renames (``key_layout.py`` runs it). The only place that spells a retired key name;
the current names are ``state.py``'s.

Layout 1 (before Redis Cluster, issue 17) put the scope id bare in a key name; layout 2 wraps
it in braces, the Redis Cluster hash tag, so that every key of one scope lives in one slot.

A pod's keys named only the pod (``resource:pod:<pod_id>:info``); layout 2 puts them under
their scope's tag (``resource:pod:{<sid>}:<pod_id>:info``), and the set of every pod
(``resource:pods:all``) became the pod index, a HASH pod id → scope id per bucket. The scope
is not in the old name: ``prepare`` reads it from the pod's info (or its drain) for every pod
of ``resource:pods:all``, moves the pod's keys and indexes it, before the walk over the names;
the walk then deletes what is left under the old names (a pod key whose pod was in no index,
``resource:pods:all`` itself). The indexes over every scope (``resource:scopes``,
``resource:leased_scopes``, ``resource:draining``) are split into their buckets the same way.
"""

from __future__ import annotations

import re
from typing import cast

from redis.asyncio import Redis

from agent_runtime.config import RM_KEY_PREFIX as P
from agent_runtime.resource_manager.state import (
    leased_scopes_key,
    pod_index_key,
    pod_key_head,
    scope_draining_key,
    scope_index_key,
)
from agent_runtime.scope_buckets import bucket_of, bucket_tag

SCAN_PATTERN = f"{P}*"

# resource:scope:{sid}:… and lock:rm:deploy:{sid}:{deploy_id} with a bare scope id
_SCOPE_BARE = re.compile(rf"^({re.escape(P)}(?:resource:scope|lock:rm:deploy):)([^:{{}}]+)(:.+)$")

POD_PARTS = ("info", "idle_since", "health_fails", "drain", "reported")
PODS_ALL_KEY = f"{P}resource:pods:all"  # SET of every pod id
# resource:pod:<pod_id>:<part>, untagged (a pod id holds no ':' and no braces)
_POD_BARE = re.compile(rf"^{re.escape(P)}resource:pod:[^:{{}}]+:(?:{'|'.join(POD_PARTS)})$")
SCAN_COUNT = 500
# the indexes over every scope, one key each: now one key per bucket (``{b07}``)
SCOPES_KEY = f"{P}resource:scopes"  # SET scope ids -> resource:scopes:{bNN}
LEASED_KEY = f"{P}resource:leased_scopes"  # SET scope ids -> the DueIndex, due at once
DRAINING_KEY = f"{P}resource:draining"  # ZSET pod -> deadline -> resource:draining:{bNN}
_INDEXES = (SCOPES_KEY, LEASED_KEY, DRAINING_KEY)


def _old_pod_key(pod_id: str, part: str) -> str:
    return f"{P}resource:pod:{pod_id}:{part}"


# reconcile's report of foreign pods, untagged: its two keys go under the tag {foreign}
_FOREIGN = {
    f"{P}resource:foreign_pods": f"{P}resource:foreign_pods:{{foreign}}",
    f"{P}resource:foreign_pods:count": f"{P}resource:foreign_pods:{{foreign}}:count",
}
# the pod budgets, untagged: budget:pods, budget:rules, budget:rule_limits and
# budget:rule:{rule_id}:pods go under the tag {budget} (budget:{budget}:…)
_BUDGET_BARE = re.compile(rf"^({re.escape(P)}budget:)((?:pods|rules|rule_limits|rule:.+:pods))$")


def current_name(key: str) -> str | None:
    """The layout-2 name of a layout-1 key, or None when ``key`` is not one."""
    if key in _FOREIGN:
        return _FOREIGN[key]
    if budget := _BUDGET_BARE.match(key):
        return f"{budget[1]}{{budget}}:{budget[2]}"
    match = _SCOPE_BARE.match(key)
    if match is None:
        return None
    head, scope_id, rest = match.groups()
    return f"{head}{{{scope_id}}}{rest}"


def retired(key: str) -> bool:
    """Whether ``key`` is of a name no current version uses (the migration deletes it, after
    ``prepare`` moved what it could): the set of every pod, and untagged pod keys."""
    return key in (PODS_ALL_KEY, *_INDEXES) or _POD_BARE.match(key) is not None


async def prepare(redis: Redis, *, dry_run: bool) -> set[str]:
    """Move each pod of ``resource:pods:all`` to layout 2: its keys renamed under its scope's
    tag (RENAMENX: values and TTLs kept; one whose new name exists stays, and goes with the
    retired ones), and the pod into the pod index. Returns the old names it renamed (with
    ``dry_run``: would rename). Idempotent: a moved pod has no old keys left."""
    renamed: set[str] = set()
    async for pod_id in redis.sscan_iter(PODS_ALL_KEY, count=SCAN_COUNT):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hget(_old_pod_key(pod_id, "info"), "scope_id")
            pipe.hget(_old_pod_key(pod_id, "drain"), "scope_id")
            for part in POD_PARTS:
                pipe.exists(_old_pod_key(pod_id, part))
            info_scope, drain_scope, *present = await pipe.execute()
        scope_id = cast(str | None, info_scope or drain_scope)
        if not scope_id:
            continue  # no record of its scope: nothing to move (its keys are retired)
        parts = [part for part, there in zip(POD_PARTS, present, strict=True) if there]
        if dry_run:
            renamed.update(_old_pod_key(pod_id, part) for part in parts)
            continue
        await redis.hset(pod_index_key(pod_id), pod_id, scope_id)
        for part in parts:
            old, new = _old_pod_key(pod_id, part), f"{pod_key_head(scope_id, pod_id)}{part}"
            if await redis.renamenx(old, new):
                renamed.add(old)
    if not dry_run:
        await _split_indexes(redis)
    return renamed


async def _split_indexes(redis: Redis) -> None:
    """The scope index, the leased scopes and the draining pods, each one key, into their
    buckets (the old keys then go with the retired ones). A draining pod's bucket is its
    scope's: the pod index (just written) names it; one it does not name is left out (its
    drain, if one is left, is put back by reconcile)."""
    async for scope_id in redis.sscan_iter(SCOPES_KEY, count=SCAN_COUNT):
        await redis.sadd(scope_index_key(scope_id), scope_id)
    async for scope_id in redis.sscan_iter(LEASED_KEY, count=SCAN_COUNT):
        # due at once: the prune looks at it and says when next
        await redis.zadd(leased_scopes_key(bucket_tag(bucket_of(scope_id))), {scope_id: 0})
    async for pod_id, deadline in redis.zscan_iter(DRAINING_KEY, count=SCAN_COUNT):
        scope_id = cast(str | None, await redis.hget(pod_index_key(pod_id), pod_id))
        if scope_id:
            await redis.zadd(scope_draining_key(scope_id), {pod_id: deadline})
