"""The resource manager's keys as an earlier version named them: what ``agent-runtime redis
migrate`` renames (``key_layout.py`` runs it). The only place that spells a retired key name;
the current names are ``state.py``'s.

Layout 1 (before Redis Cluster, issue 17) put the scope id bare in a key name; layout 2 wraps
it in braces, the Redis Cluster hash tag, so that every key of one scope lives in one slot.

A pod's keys named only the pod (``resource:pod:<pod_id>:info``); layout 2 puts them under
their scope's tag (``resource:pod:{<sid>}:<pod_id>:info``), and the set of every pod
(``resource:pods:all``) became the pod index, a HASH pod id → scope id per bucket. The scope
is not in the old name: ``convert`` reads it from the pod's info (or the pod index, once the
info moved and indexed the pod; or its drain) and moves each pod key. The indexes over every
scope (``resource:scopes``, ``resource:leased_scopes``, ``resource:draining``) are split into
their buckets; the foreign-pod report's keys and the budgets' are renamed by name.
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

PREFIX = P  # every key of this module
# resource:scope:{sid}:… and lock:rm:deploy:{sid}:{deploy_id} with a bare scope id: key_layout
# puts the tag around it
SCOPE_HEADS: tuple[str, ...] = ("resource:scope", "lock:rm:deploy")

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


def renamed(key: str) -> str | None:
    """The layout-2 name of an untagged foreign-pod report or budget key, or None."""
    if key in _FOREIGN:
        return _FOREIGN[key]
    if budget := _BUDGET_BARE.match(key):
        return f"{budget[1]}{{budget}}:{budget[2]}"
    return None


def retired(key: str) -> bool:
    """Whether ``key`` is of a name no current version uses (the migration deletes it): none
    of this module's (its old indexes and pod keys are ``convertible``)."""
    return False


def convertible(key: str) -> bool:
    """Whether ``key`` is a layout-1 key whose content moves (``convert``): an untagged pod
    key, the set of every pod, a one-key index over every scope."""
    return key in (PODS_ALL_KEY, *_INDEXES) or _POD_BARE.match(key) is not None


async def convert(redis: Redis, key: str) -> bool:
    """Move a ``convertible`` key to layout 2 and delete it (after the renames, one at a time).
    A pod key goes under the scope its info names (the old info, or the pod index once the
    info moved; a drain names its own), the info indexing the pod; one whose pod names no
    scope any more is deleted (it describes nothing). ``resource:pods:all`` goes (the infos
    index their pods); the indexes over every scope are split into their buckets. False: a
    pod key whose new name exists (a clash, left)."""
    if key == PODS_ALL_KEY:
        await redis.delete(key)
        return True
    if key in _INDEXES:
        await _split_index(redis, key)
        await redis.delete(key)
        return True
    pod_id, part = key.removeprefix(f"{P}resource:pod:").rsplit(":", 1)
    scope_id = await _scope_of(redis, pod_id, key if part == "drain" else None)
    if not scope_id:
        await redis.delete(key)
        return True
    if part == "info":
        await redis.hset(pod_index_key(pod_id), pod_id, scope_id)
    return bool(await redis.renamenx(key, f"{pod_key_head(scope_id, pod_id)}{part}"))


async def _scope_of(redis: Redis, pod_id: str, drain: str | None) -> str | None:
    scope_id = await redis.hget(_old_pod_key(pod_id, "info"), "scope_id")
    if not scope_id:
        scope_id = await redis.hget(pod_index_key(pod_id), pod_id)
    if not scope_id and drain is not None:
        scope_id = await redis.hget(drain, "scope_id")
    return cast(str | None, scope_id or None)


async def _split_index(redis: Redis, key: str) -> None:
    """The scope index, the leased scopes or the draining pods into their buckets. A
    draining pod's bucket is its scope's (its old info's, or the pod index's); one that names
    no scope is left out (reconcile puts a drain still there back)."""
    if key == SCOPES_KEY:
        async for scope_id in redis.sscan_iter(key, count=SCAN_COUNT):
            await redis.sadd(scope_index_key(scope_id), scope_id)
    elif key == LEASED_KEY:
        async for scope_id in redis.sscan_iter(key, count=SCAN_COUNT):
            # due at once: the prune looks at it and says when next
            await redis.zadd(leased_scopes_key(bucket_tag(bucket_of(scope_id))), {scope_id: 0})
    else:
        async for pod_id, deadline in redis.zscan_iter(key, count=SCAN_COUNT):
            if scope_id := await _scope_of(redis, pod_id, None):
                await redis.zadd(scope_draining_key(scope_id), {pod_id: deadline})
