"""The contract's Redis key names (docs/reference/redis-keys.md), spelled out literally.

Tests that look at Redis directly name keys through these, never through the service's own
``state`` modules: a renamed key in the code must fail a test, not follow it silently. One
argument order everywhere: the scope first, then the pod, then the part. A scope id in a key
name is the key's Redis Cluster hash tag: it is written in braces (``scope:{<sid>}:pods``).
"""

from __future__ import annotations

import zlib

from redis.asyncio import Redis

BUCKETS = 64  # cross-scope indexes: one key per bucket, tagged {b00} … {b63}


def bucket(member: str) -> str:
    """The bucket tag of a scope id or pod id in a cross-scope index: ``{b07}``
    (crc32 % 64, spelled here on purpose)."""
    return f"{{b{zlib.crc32(member.encode()) % BUCKETS:02d}}}"


def rm_pods_index(pod_id: str) -> str:
    """The bucket of the pod index (HASH pod id → scope id) that holds ``pod_id``."""
    return f"resource_manager:resource:pods:{bucket(pod_id)}"


async def rm_pod_scope(redis: Redis, pod_id: str) -> str | None:
    """The scope the pod index names for the pod (None: the resource manager does not know it)."""
    return await redis.hget(rm_pods_index(pod_id), pod_id)  # type: ignore[no-any-return,misc]


async def rm_pod_known(redis: Redis, pod_id: str) -> bool:
    """Whether the resource manager knows the pod (the pod index has it)."""
    return bool(await redis.hexists(rm_pods_index(pod_id), pod_id))  # type: ignore[misc]


def rm_scopes(scope_id: str) -> str:
    """The bucket of the scope index (SET of scopes with a pool config) that holds the scope."""
    return f"resource_manager:resource:scopes:{bucket(scope_id)}"


def rm_leased(scope_id: str) -> str:
    """The bucket of the leased scopes (ZSET scope → when the prune looks) that holds it."""
    return f"resource_manager:resource:leased_scopes:{bucket(scope_id)}"


def rm_draining(scope_id: str) -> str:
    """The bucket (the scope's) of the draining pods (ZSET pod → drain deadline)."""
    return f"resource_manager:resource:draining:{bucket(scope_id)}"


async def _every_bucket(redis: Redis, head: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for b in range(BUCKETS):
        found.update(await redis.zrange(f"{head}{{b{b:02d}}}", 0, -1, withscores=True))  # type: ignore[arg-type]
    return found


async def rm_leased_scopes(redis: Redis) -> dict[str, float]:
    """Every scope in the leased scopes' index → when the prune looks at it next."""
    return await _every_bucket(redis, "resource_manager:resource:leased_scopes:")


async def rm_draining_pods(redis: Redis) -> dict[str, float]:
    """Every pod under a drain → its deadline (every bucket)."""
    return await _every_bucket(redis, "resource_manager:resource:draining:")


async def rm_pods_known(redis: Redis) -> dict[str, str]:
    """Every pod the resource manager knows → its scope (the pod index, every bucket)."""
    pods: dict[str, str] = {}
    for b in range(BUCKETS):
        pods.update(await redis.hgetall(f"resource_manager:resource:pods:{{b{b:02d}}}"))  # type: ignore[misc]
    return pods


def sm_session(scope_id: str, session_id: str) -> str:
    """A session's hash, in its scope."""
    return f"session_manager:session:{{{scope_id}}}:{session_id}"


def sm_session_scope(session_id: str) -> str:
    """The session-scope index (a hint: session id → the scope it was last bound in)."""
    return f"session_manager:session_scope:{session_id}"


def sm_expiry(scope_id: str) -> str:
    """The scope's sessions by expiry."""
    return sm_scope(scope_id, "session_expiry")


def sm_pods_registered(scope_id: str) -> str:
    """The pods registered in the scope (pod ids)."""
    return f"session_manager:pods:{{{scope_id}}}:registered"


def sm_touch(scope_id: str, request_id: str) -> str:
    return f"session_manager:touch:{{{scope_id}}}:{request_id}"


def sm_bucket(index: str, bucket: int) -> str:
    """expiry_due | leased_scopes | scope_registry | scope_idle: a bucket of an index over
    scopes (``{b00}`` … ``{b63}``)."""
    return f"session_manager:{index}:{{b{bucket:02d}}}"


def sm_scope(scope_id: str, what: str) -> str:
    """sessions | session_expiry | pods | pod_seq | config | waiters | reserved | arrivals"""
    return f"session_manager:scope:{{{scope_id}}}:{what}"


def sm_pod(scope_id: str, pod_id: str, what: str) -> str:
    """sessions | info | idle_notified"""
    return f"session_manager:pod:{{{scope_id}}}:{pod_id}:{what}"


def route_marker(scope_id: str, request_id: str) -> str:
    return f"session_manager:route:{{{scope_id}}}:{request_id}"


def rm_scope(scope_id: str, what: str) -> str:
    """pods | idle | config | deploying | cold_deploys | deploy_followers:{deploy id} |
    deploy_pod:{deploy id}"""
    return f"resource_manager:resource:scope:{{{scope_id}}}:{what}"


def rm_pod(scope_id: str, pod_id: str, what: str) -> str:
    """info | idle_since | health_fails | drain | reported: a pod's keys carry its scope's tag"""
    return f"resource_manager:resource:pod:{{{scope_id}}}:{pod_id}:{what}"


def rm_deploy_lock(scope_id: str, deploy_id: str) -> str:
    """One cold deploy's lock (a scope runs many: helpers.deploy_locks reads them all)."""
    return f"resource_manager:lock:rm:deploy:{{{scope_id}}}:{deploy_id}"
