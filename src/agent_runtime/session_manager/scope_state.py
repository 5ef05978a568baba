"""The scope records in Redis: the resolve cache, the scope registry and its indexes, the config
generation, the scope expiry's marks and the config_sync lock.

What config_sync, resolve and the scope expiry need, apart from the sessions and pods the
routes use (``state.SessionState``). Key names come from ``state``'s builders (the only place
that spells them); the cache hash's layout from ``scope_cache``. A scope's record
(``scope:{sid}:entry``, JSON ``[group_id, bot_id, template_id, generation]``) and its cache
are written by scope_put.lua, one slot; what spans scopes — the registry's bucket
(``scope_registry:{bNN}``: sid → ``[group_id, bot_id]``), the scope indexes, ``config_gen``,
``scope_idle:{bNN}`` — is written here beside the scripts. The order keeps them a superset:
a scope is registered and indexed before its record is written and again after it (a scope
expiry racing a resolve cannot leave a recorded scope out of the registry); an expiry takes
it out after the record went, and puts it back if a resolve wrote the record again meanwhile.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager, suppress
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import LockError

from agent_runtime import lua
from agent_runtime.scope_buckets import BUCKETS, bucket_of
from agent_runtime.session_manager.replies import IdleMarkPage
from agent_runtime.session_manager.scope_cache import ScopeConfig
from agent_runtime.session_manager.state import (
    CONFIG_GEN_KEY,
    CONFIG_SYNC_LOCK_KEY,
    KEYS_PRELUDE,
    SCOPE_CONFIG_PATTERN,
    ScriptCall,
    bot_index_key,
    group_index_key,
    pipelined,
    pod_info_key,
    pods_registered_key,
    registered_in,
    registry_page,
    scope_config_key,
    scope_entry_key,
    scope_idle_key,
    scope_pod_seq_key,
    scope_pods_key,
    scope_registry_key,
    scope_reserved_key,
    scope_sessions_key,
    scope_waiters_key,
    template_index_key,
)

log = logging.getLogger(__name__)

CONFIG_SYNC_LOCK_TTL = 60  # seconds; a config_sync is a handful of DB and Redis calls
SCOPE_BATCH = 200  # registry entries per HMGET
# registry entries per mark page: one scope_empty call each (pipelined), then one ZADD and
# one ZREM for the page's bucket
MARK_PAGE = 100


def registry_ids(value: str | bytes) -> tuple[str, str]:
    """(group_id, bot_id) of a registry entry (a bucket's value, or a scope's record)."""
    entry = json.loads(value)
    return str(entry[0]), str(entry[1])


class ScopeState:
    """Typed operations on the scope records (client with decode_responses)."""

    def __init__(self, redis: Redis, *, observe: lua.ScriptObserver | None = None) -> None:
        self.redis = redis
        pkg = "agent_runtime.session_manager"

        def script(name: str, *preludes: str) -> Any:
            return lua.register(
                redis, pkg, name, prelude=(KEYS_PRELUDE, *preludes), observe=observe
            )

        self._scope_put = script("scope_put")
        self._scope_empty = script("scope_empty", "_scope")
        self._scope_expire = script("scope_expire", "_scope")

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
        if mode == "apply" and await self.config_generation() > generation:
            return False  # a later config_sync bumped: it re-resolves this scope itself
        await self._register(scope_id, group_id, bot_id, template_id)
        flat = [x for kv in (fields or {}).items() for x in kv]
        written, before = await self._scope_put(
            keys=[scope_entry_key(scope_id), scope_config_key(scope_id)],
            args=[group_id, bot_id, template_id, generation, "write" if fields else "drop", *flat],
        )
        if not int(written):
            return False
        await self._register(scope_id, group_id, bot_id, template_id, str(before))
        if mode == "fill" and await self.config_generation() != generation:
            # a config_sync came between the DB read and this write: what was read may be
            # stale; dropped (the next route resolves again at the new generation)
            await self.redis.delete(scope_config_key(scope_id))
            return False
        return True

    async def _register(
        self, scope_id: str, group_id: str, bot_id: str, template_id: str, old_template: str = ""
    ) -> None:
        """The scope in its registry bucket and its indexes (one pipeline; idempotent); a
        template it left, out of that index."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(
                scope_registry_key(bucket_of(scope_id)), scope_id, json.dumps([group_id, bot_id])
            )
            if template_id:
                pipe.sadd(template_index_key(template_id), scope_id)
            pipe.sadd(group_index_key(group_id), scope_id)
            pipe.sadd(bot_index_key(bot_id), scope_id)
            if old_template and old_template != template_id:
                pipe.srem(template_index_key(old_template), scope_id)
            await pipe.execute()

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
        by_bucket: dict[int, list[str]] = defaultdict(list)
        for sid in scope_ids:
            by_bucket[bucket_of(sid)].append(sid)
        out: dict[str, tuple[str, str]] = {}
        for bucket, ids in sorted(by_bucket.items()):
            for i in range(0, len(ids), SCOPE_BATCH):
                chunk = ids[i : i + SCOPE_BATCH]
                values = await self.redis.hmget(scope_registry_key(bucket), chunk)
                for sid, value in zip(chunk, values, strict=True):
                    if value is not None:
                        out[sid] = registry_ids(value)
        return out

    async def known_scopes(self) -> dict[str, tuple[str, str]]:
        """Every scope that ever resolved: sid → (group_id, bot_id)."""
        known: dict[str, tuple[str, str]] = {}
        for bucket in range(BUCKETS):
            async for sid, value in self.redis.hscan_iter(scope_registry_key(bucket), count=500):
                known[sid] = registry_ids(value)
        return known

    async def registry_page(self, cursor: str, count: int) -> tuple[str, list[str]]:
        """One HSCAN page of the registry's buckets: (next cursor, "0" at the end; scope ids)."""
        following, page = await registry_page(self.redis, cursor, count)
        return following, list(page)

    async def scope_count(self) -> int:
        async with self.redis.pipeline(transaction=False) as pipe:
            for bucket in range(BUCKETS):
                pipe.hlen(scope_registry_key(bucket))
            return sum(int(n) for n in await pipe.execute())

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
        """One HSCAN page of a registry bucket: each scope asked whether it is empty
        (scope_empty.lua, one slot a call, pipelined); empty ones join the bucket's
        ``scope_idle`` (first time seen empty: NX), used ones leave it."""
        following, entries = await registry_page(self.redis, cursor, page)
        scopes = list(entries)
        calls: list[ScriptCall] = [
            (
                self._scope_empty,
                [
                    scope_sessions_key(sid),
                    scope_pods_key(sid),
                    pods_registered_key(sid),
                    scope_waiters_key(sid),
                    scope_reserved_key(sid),
                ],
                [],
            )
            for sid in scopes
        ]
        replies = await pipelined(self.redis, calls)
        empty = [sid for sid, is_empty in zip(scopes, replies, strict=True) if int(is_empty)]
        used = [sid for sid in scopes if sid not in set(empty)]
        if scopes:
            key = scope_idle_key(bucket_of(scopes[0]))  # a page is of one bucket
            now = await self.now()
            async with self.redis.pipeline(transaction=False) as pipe:
                if empty:
                    pipe.zadd(key, dict.fromkeys(empty, now), nx=True)
                if used:
                    pipe.zrem(key, *used)
                await pipe.execute()
        return IdleMarkPage(following, len(empty))

    async def idle_scopes_due(self, idle_ttl: float, limit: int) -> list[str]:
        """Scopes seen empty at least ``idle_ttl`` seconds ago (Redis clock), oldest first in
        each bucket, up to ``limit`` over the buckets."""
        now = await self.now()
        due: list[str] = []
        for bucket in range(BUCKETS):
            if len(due) >= limit:
                break
            found = await self.redis.zrangebyscore(
                scope_idle_key(bucket), "-inf", now - idle_ttl, start=0, num=limit - len(due)
            )
            due += [str(sid) for sid in found]
        return due

    async def expire_scope(self, scope_id: str, idle_ttl: float) -> bool:
        """The scope's session-side keys leave Redis if it is still marked idle for
        ``idle_ttl`` and still empty (scope_expire.lua: checked and deleted in one step);
        then it leaves the registry and the indexes, and comes back to them at once if a
        resolve wrote its record again meanwhile."""
        idle = scope_idle_key(bucket_of(scope_id))
        since = await self.redis.zscore(idle, scope_id)
        if since is None or float(since) + idle_ttl > await self.now():
            return False
        gone, entry = await self._scope_expire(
            keys=[
                scope_entry_key(scope_id),
                scope_config_key(scope_id),
                scope_pod_seq_key(scope_id),
                scope_sessions_key(scope_id),
                scope_pods_key(scope_id),
                scope_waiters_key(scope_id),
                scope_reserved_key(scope_id),
                pods_registered_key(scope_id),
            ],
            args=[],
        )
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(idle, scope_id)
            if int(gone):
                pipe.hdel(scope_registry_key(bucket_of(scope_id)), scope_id)
                if entry:
                    group_id, bot_id, template_id = json.loads(entry)[:3]
                    if template_id:
                        pipe.srem(template_index_key(template_id), scope_id)
                    pipe.srem(group_index_key(group_id), scope_id)
                    pipe.srem(bot_index_key(bot_id), scope_id)
            await pipe.execute()
        if not int(gone):
            return False
        again = await self.redis.get(scope_entry_key(scope_id))
        if again:  # a resolve recorded the scope again between the script and the removal
            group_id, bot_id, template_id = json.loads(again)[:3]
            await self._register(scope_id, group_id, bot_id, template_id)
        return True

    async def forget_idle_mark(self, scope_id: str) -> None:
        await self.redis.zrem(scope_idle_key(bucket_of(scope_id)), scope_id)

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
