"""The scope records in Redis: the resolve cache, the scope registry and its indexes, the config
generation, the scope expiry's marks and the config_sync lock.

What config_sync, resolve and the scope expiry need, apart from the sessions and pods the
routes use (``state.SessionState``). Key names come from ``state``'s builders (the only place
that spells them); the cache hash's layout from ``scope_cache``; a registry entry is JSON
``[group_id, bot_id, template_id, generation]`` (written by scope_put.lua, read here only).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager, suppress
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import LockError

from agent_runtime import lua
from agent_runtime.config import SM_KEY_PREFIX as P
from agent_runtime.session_manager.replies import IdleMarkPage
from agent_runtime.session_manager.scope_cache import ScopeConfig
from agent_runtime.session_manager.state import (
    CONFIG_GEN_KEY,
    CONFIG_SYNC_LOCK_KEY,
    KEYS_PRELUDE,
    SCOPE_CONFIG_PATTERN,
    SCOPE_IDLE_KEY,
    SCOPE_REGISTRY_KEY,
    bot_index_key,
    group_index_key,
    pod_info_key,
    registered_in,
    scope_config_key,
    scope_pod_seq_key,
    scope_pods_key,
    scope_reserved_key,
    scope_sessions_key,
    scope_waiters_key,
    template_index_key,
)

log = logging.getLogger(__name__)

CONFIG_SYNC_LOCK_TTL = 60  # seconds; a config_sync is a handful of DB and Redis calls
SCOPE_BATCH = 200  # registry entries per HMGET
# registry entries per scope_idle_mark call: ~3.5 µs each inside Redis (4 reads + a ZADD/ZREM),
# measured 0.7 ms mean / 1.4 ms max at 200 on the 2-core box: 100 keeps a call near 0.35 ms
MARK_PAGE = 100


def registry_ids(value: str | bytes) -> tuple[str, str]:
    """(group_id, bot_id) of a ``scope_registry`` entry."""
    entry = json.loads(value)
    return str(entry[0]), str(entry[1])


class ScopeState:
    """Typed operations on the scope records (client with decode_responses)."""

    def __init__(self, redis: Redis, *, observe: lua.ScriptObserver | None = None) -> None:
        self.redis = redis
        pkg = "agent_runtime.session_manager"

        def script(name: str) -> Any:
            return lua.register(redis, pkg, name, prelude=KEYS_PRELUDE, observe=observe)

        self._scope_put = script("scope_put")
        self._scope_idle_mark = script("scope_idle_mark")
        self._scope_expire = script("scope_expire")

    # --- resolve cache -----------------------------------------------------------------------

    async def get_scope_config(self, scope_id: str) -> ScopeConfig | None:
        """The scope's cached configuration; None when there is none, or none that reads
        (a malformed cache is logged: resolve reloads it from the DB)."""
        cached = cast(dict[str, str], await self.redis.hgetall(scope_config_key(scope_id)))
        if not cached:
            return None
        try:
            return ScopeConfig.from_hash(scope_id, cached)
        except (KeyError, ValueError):
            log.warning("resolve cache of scope %s is malformed; reloading", scope_id)
            return None

    async def config_generation(self) -> int:
        return int(await self.redis.get(CONFIG_GEN_KEY) or 0)

    async def fill_scope_config(
        self,
        scope_id: str,
        group_id: str,
        bot_id: str,
        fields: dict[str, str],
        generation: int,
        template_id: str | None = None,
    ) -> bool:
        """Write the cache and register the scope (with its index memberships), unless a
        config change came in between: ``config_gen`` must still be ``generation``, read
        before the DB query (scope_put.lua, one step)."""
        tid = fields.get("template_id", "") if template_id is None else template_id
        return await self._put(scope_id, group_id, bot_id, tid, generation, "fill", fields)

    async def apply_scope(
        self,
        scope_id: str,
        group_id: str,
        bot_id: str,
        template_id: str | None,
        generation: int,
        fields: dict[str, str] | None,
    ) -> bool:
        """config_sync's write of one scope: the cache written (``fields``) or dropped
        (None), the registry entry and indexes moved to ``template_id``; refused (False)
        when a later config_sync (a greater generation) already wrote the scope."""
        return await self._put(
            scope_id, group_id, bot_id, template_id or "", generation, "apply", fields
        )

    async def _put(
        self,
        scope_id: str,
        group_id: str,
        bot_id: str,
        template_id: str,
        generation: int,
        mode: str,
        fields: dict[str, str] | None,
    ) -> bool:
        flat = [x for kv in (fields or {}).items() for x in kv]
        written = await self._scope_put(
            keys=[CONFIG_GEN_KEY, SCOPE_REGISTRY_KEY, scope_config_key(scope_id)],
            args=[
                P, scope_id, group_id, bot_id, template_id, generation, mode,
                "write" if fields else "drop", *flat,
            ],
        )  # fmt: skip
        return bool(written)

    async def write_scope_config(
        self, scope_id: str, group_id: str, bot_id: str, fields: dict[str, str]
    ) -> None:
        """Unconditional write (tests, admin fixtures): as a config_sync of the current
        generation would write it."""
        await self.apply_scope(
            scope_id, group_id, bot_id, fields.get("template_id"),
            await self.config_generation(), fields,
        )  # fmt: skip

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

    # --- the registry and the scope indexes (config_sync's walk) ----------------------------

    async def index_members(self, key: str) -> set[str]:
        """The sids of one scope index (SSCAN pages)."""
        return {sid async for sid in self.redis.sscan_iter(key, count=500)}

    async def scopes_in_template(self, template_id: str) -> set[str]:
        return await self.index_members(template_index_key(template_id))

    async def scopes_in_group(self, group_id: str) -> set[str]:
        return await self.index_members(group_index_key(group_id))

    async def scopes_of_bot(self, bot_id: str) -> set[str]:
        return await self.index_members(bot_index_key(bot_id))

    async def registry_entries(self, scope_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
        """sid → (group_id, bot_id) of the given scopes that are registered (HMGET slices)."""
        ids = list(scope_ids)
        out: dict[str, tuple[str, str]] = {}
        for i in range(0, len(ids), SCOPE_BATCH):
            chunk = ids[i : i + SCOPE_BATCH]
            values = await self.redis.hmget(SCOPE_REGISTRY_KEY, chunk)
            for sid, value in zip(chunk, values, strict=True):
                if value is not None:
                    out[sid] = registry_ids(value)
        return out

    async def known_scopes(self) -> dict[str, tuple[str, str]]:
        """Every scope that ever resolved: sid → (group_id, bot_id)."""
        return {
            sid: registry_ids(value)
            async for sid, value in self.redis.hscan_iter(SCOPE_REGISTRY_KEY, count=500)
        }

    async def registry_page(self, cursor: str, count: int) -> tuple[str, list[str]]:
        """One HSCAN page of the registry: (next cursor, "0" at the end; scope ids)."""
        next_cursor, page = await self.redis.hscan(SCOPE_REGISTRY_KEY, int(cursor), count=count)
        return str(next_cursor), [str(sid) for sid in cast(dict[str, str], page)]

    async def scope_count(self) -> int:
        return int(await self.redis.hlen(SCOPE_REGISTRY_KEY))

    # --- pods, as config_sync sees them --------------------------------------------------------

    async def registered_pods_by_scope(self, scope_ids: set[str]) -> dict[str, list[str]]:
        """Registered pod ids of the given scopes that have any (a pipeline of each scope's
        ``pods:{sid}:registered``)."""
        ids = sorted(scope_ids)
        found = zip(ids, await registered_in(self.redis, ids), strict=True)
        return {sid: pods for sid, pods in found if pods}

    async def pod_versions(self, scope_id: str, pod_ids: list[str]) -> dict[str, str | None]:
        if not pod_ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pod_ids:
                pipe.hget(pod_info_key(scope_id, pod_id), "deploy_ver")
            versions = await pipe.execute()
        return dict(zip(pod_ids, versions, strict=True))

    # --- the scope expiry ----------------------------------------------------------------------

    async def mark_idle_scopes(self, cursor: str, page: int = MARK_PAGE) -> IdleMarkPage:
        """One HSCAN page of the registry: empty scopes join ``scope_idle``, used ones leave
        it (scope_idle_mark.lua)."""
        reply = await self._scope_idle_mark(
            keys=[SCOPE_REGISTRY_KEY, SCOPE_IDLE_KEY], args=[P, cursor, page]
        )
        return IdleMarkPage(str(reply[0]), int(reply[2]))

    async def idle_scopes_due(self, idle_ttl: float, limit: int) -> list[str]:
        """Scopes seen empty at least ``idle_ttl`` seconds ago (Redis clock), oldest first."""
        now = await self.now()
        return cast(
            list[str],
            await self.redis.zrangebyscore(
                SCOPE_IDLE_KEY, "-inf", now - idle_ttl, start=0, num=limit
            ),
        )

    async def expire_scope(self, scope_id: str, idle_ttl: float) -> bool:
        """The scope's session-side keys leave Redis if it is still empty and was so for
        ``idle_ttl`` (scope_expire.lua, one step)."""
        return bool(
            await self._scope_expire(
                keys=[
                    SCOPE_REGISTRY_KEY,
                    SCOPE_IDLE_KEY,
                    scope_config_key(scope_id),
                    scope_pod_seq_key(scope_id),
                    scope_sessions_key(scope_id),
                    scope_pods_key(scope_id),
                    scope_waiters_key(scope_id),
                    scope_reserved_key(scope_id),
                ],
                args=[P, scope_id, idle_ttl],
            )
        )

    async def forget_idle_mark(self, scope_id: str) -> None:
        await self.redis.zrem(SCOPE_IDLE_KEY, scope_id)

    async def now(self) -> float:
        seconds, micros = await self.redis.time()
        return seconds + micros / 1_000_000

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
