"""Session manager state in Redis: the only module that knows the ``session_manager:`` key names.

Key table: contract §4 (and ``docs/design/hld.md``). Two keys of this module are not in the
contract because nothing outside reads them: ``scope_registry`` (every scope that ever
resolved, sid → [group_id, bot_id], so a config change finds the scopes it affects even when
their cache was dropped) and ``config_gen`` (bumped by every config change; a resolve fills
the cache only if the generation it read before its DB query is still current, so a resolve
racing a config_sync cannot write back a stale cache).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager, suppress
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import LockError, WatchError

from agent_runtime import lua
from agent_runtime.config import SM_KEY_PREFIX as P

CONFIG_SYNC_LOCK_TTL = 60  # seconds; a config_sync is a handful of DB and Redis calls


# --- key names -------------------------------------------------------------------------------


def scope_config_key(scope_id: str) -> str:
    return f"{P}scope:{scope_id}:config"


def scope_pods_key(scope_id: str) -> str:
    return f"{P}scope:{scope_id}:pods"


def pod_info_key(scope_id: str, pod_id: str) -> str:
    return f"{P}pod:{scope_id}:{pod_id}:info"


def pod_sessions_key(scope_id: str, pod_id: str) -> str:
    return f"{P}pod:{scope_id}:{pod_id}:sessions"


def pod_idle_notified_key(scope_id: str, pod_id: str) -> str:
    return f"{P}pod:{scope_id}:{pod_id}:idle_notified"


def pod_scopes_key(pod_id: str) -> str:
    return f"{P}pods:{pod_id}:scopes"


def session_key(session_id: str) -> str:
    return f"{P}session:{session_id}"


def scope_sessions_key(scope_id: str) -> str:
    return f"{P}scope:{scope_id}:sessions"


def scope_free_channel(scope_id: str) -> str:
    return f"{P}scope:{scope_id}:free"


PODS_REGISTERED_KEY = f"{P}pods:registered"
SESSION_EXPIRY_KEY = f"{P}session_expiry"
CONFIG_SYNC_LOCK_KEY = f"{P}lock:config_sync"
SCOPE_REGISTRY_KEY = f"{P}scope_registry"
CONFIG_GEN_KEY = f"{P}config_gen"
SCOPE_CONFIG_PATTERN = f"{P}scope:*:config"


def _mapping(fields: dict[str, str]) -> dict[Any, Any]:
    return fields  # redis-py's hset typing wants a wider key type than str


class SessionState:
    """Typed operations on the session manager's Redis keys (client with decode_responses)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        pkg = "agent_runtime.session_manager"
        self._evict = lua.register(redis, pkg, "evict")
        self._cleanup_pod = lua.register(redis, pkg, "cleanup_pod")

    # --- sessions and pods (scripts) -----------------------------------------------------------

    async def evict(self, session_id: str) -> tuple[str, str, int] | None:
        """Remove a session from its four places; (scope, pod, sessions left) or None."""
        reply = await self._evict(
            keys=[session_key(session_id), SESSION_EXPIRY_KEY], args=[P, session_id]
        )
        if not reply:
            return None
        return str(reply[0]), str(reply[1]), int(reply[2])

    async def cleanup_pod(self, scope_id: str, pod_id: str) -> int:
        """-1: sessions remain (evict them, call again); 1: cleaned; 0: was not registered."""
        return int(
            await self._cleanup_pod(
                keys=[
                    scope_pods_key(scope_id),
                    pod_info_key(scope_id, pod_id),
                    pod_sessions_key(scope_id, pod_id),
                    pod_idle_notified_key(scope_id, pod_id),
                    PODS_REGISTERED_KEY,
                    pod_scopes_key(pod_id),
                ],
                args=[scope_id, pod_id],
            )
        )

    async def pod_scopes(self, pod_id: str) -> list[str]:
        return cast(list[str], list(await self.redis.smembers(pod_scopes_key(pod_id))))

    async def pod_sessions(self, scope_id: str, pod_id: str) -> list[str]:
        return cast(list[str], list(await self.redis.smembers(pod_sessions_key(scope_id, pod_id))))

    async def pod_usage(self, pods: list[tuple[str, str]]) -> list[tuple[bool, int]]:
        """For each (scope, pod): (is a placement candidate, live sessions on it)."""
        if not pods:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id, pod_id in pods:
                pipe.zscore(scope_pods_key(scope_id), pod_id)
                pipe.scard(pod_sessions_key(scope_id, pod_id))
            replies = await pipe.execute()
        return [(replies[i] is not None, int(replies[i + 1])) for i in range(0, len(replies), 2)]

    # --- resolve cache -----------------------------------------------------------------------

    async def get_scope_config(self, scope_id: str) -> dict[str, str]:
        return cast(dict[str, str], await self.redis.hgetall(scope_config_key(scope_id)))

    async def config_generation(self) -> int:
        return int(await self.redis.get(CONFIG_GEN_KEY) or 0)

    async def fill_scope_config(
        self, scope_id: str, group_id: str, bot_id: str, fields: dict[str, str], generation: int
    ) -> bool:
        """Write the cache and register the scope, unless a config change came in between.

        Optimistic: WATCH the generation; a config_sync bumps it before touching caches, so an
        EXEC after that fails and the stale value is never written.
        """
        key = scope_config_key(scope_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(CONFIG_GEN_KEY)
                if int(await pipe.get(CONFIG_GEN_KEY) or 0) != generation:
                    return False
                pipe.multi()
                pipe.delete(key)
                pipe.hset(key, mapping=_mapping(fields))
                pipe.hset(SCOPE_REGISTRY_KEY, scope_id, json.dumps([group_id, bot_id]))
                await pipe.execute()
                return True
            except WatchError:
                return False

    async def write_scope_config(
        self, scope_id: str, group_id: str, bot_id: str, fields: dict[str, str]
    ) -> None:
        """Unconditional write, for config_sync itself (it holds the config lock)."""
        key = scope_config_key(scope_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=_mapping(fields))
            pipe.hset(SCOPE_REGISTRY_KEY, scope_id, json.dumps([group_id, bot_id]))
            await pipe.execute()

    async def bump_config_generation(self) -> int:
        return int(await self.redis.incr(CONFIG_GEN_KEY))

    async def drop_scope_configs(self, scope_ids: Iterable[str]) -> int:
        keys = [scope_config_key(sid) for sid in scope_ids]
        return int(await self.redis.delete(*keys)) if keys else 0

    async def drop_all_scope_configs(self, batch: int = 500) -> int:
        """SCAN (never KEYS) every resolve cache and delete it, in batches."""
        dropped = 0
        pending: list[str] = []
        async for key in self.redis.scan_iter(match=SCOPE_CONFIG_PATTERN, count=batch):
            pending.append(key)
            if len(pending) >= batch:
                dropped += int(await self.redis.delete(*pending))
                pending.clear()
        if pending:
            dropped += int(await self.redis.delete(*pending))
        return dropped

    async def known_scopes(self) -> dict[str, tuple[str, str]]:
        """Every scope that ever resolved: sid → (group_id, bot_id)."""
        scopes: dict[str, tuple[str, str]] = {}
        async for sid, value in self.redis.hscan_iter(SCOPE_REGISTRY_KEY, count=500):
            group_id, bot_id = json.loads(value)
            scopes[sid] = (group_id, bot_id)
        return scopes

    # --- pods, as config_sync sees them --------------------------------------------------------

    async def registered_pods_by_scope(self, scope_ids: set[str]) -> dict[str, list[str]]:
        """Registered pod ids of the given scopes (one SSCAN over ``pods:registered``)."""
        found: dict[str, list[str]] = defaultdict(list)
        if not scope_ids:
            return found
        async for member in self.redis.sscan_iter(PODS_REGISTERED_KEY, count=500):
            sid, _, pod_id = member.partition(":")
            if sid in scope_ids:
                found[sid].append(pod_id)
        return found

    async def pod_versions(self, scope_id: str, pod_ids: list[str]) -> dict[str, str | None]:
        if not pod_ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pod_ids:
                pipe.hget(pod_info_key(scope_id, pod_id), "deploy_ver")
            versions = await pipe.execute()
        return dict(zip(pod_ids, versions, strict=True))

    async def candidate_pods(self, scope_id: str) -> list[str]:
        return cast(list[str], await self.redis.zrange(scope_pods_key(scope_id), 0, -1))

    async def remove_candidates(self, scope_id: str, pod_ids: list[str]) -> int:
        """Sunset: the pods leave first-fit at once; their sessions stay where they are."""
        if not pod_ids:
            return 0
        return int(await self.redis.zrem(scope_pods_key(scope_id), *pod_ids))

    # --- the config_sync lock ------------------------------------------------------------------

    @asynccontextmanager
    async def config_sync_lock(self) -> AsyncIterator[bool]:
        """Token-owned ``SET NX EX 60``; yields whether it was taken.

        Released by compare-and-delete (redis-py's Lock script), never by a bare DEL.
        """
        lock = self.redis.lock(CONFIG_SYNC_LOCK_KEY, timeout=CONFIG_SYNC_LOCK_TTL, blocking=False)
        taken = await lock.acquire()
        try:
            yield bool(taken)
        finally:
            if taken:
                with suppress(LockError):  # expired, maybe re-taken by another: not ours
                    await lock.release()
