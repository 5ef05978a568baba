"""Indexes over many scopes that a Redis Cluster can hold: one key per bucket, each its own
hash tag, so no script ever needs two slots.

Every key of one scope carries the scope's tag (``{sid}``) and so lives in one slot; an index
over all scopes ("which scopes have sessions due", "which took a lease") cannot live in any
one scope's slot. It is split into ``BUCKETS`` keys tagged ``{b00}`` … ``{b63}``: a scope
belongs to bucket ``crc32(scope id) % BUCKETS``, and a job walks the index bucket by bucket
(each bucket on one node). The bucket count is part of the key layout (``key_layout``).

A ``DueIndex`` is such an index as a ZSET per bucket, scope id → when to look at the scope
(Redis clock). It is a hint, written in a step of its own beside the scope's scripts (which
cannot reach it): ``mark`` only ever brings a time forward and always changes the score
(``bucket_mark.lua``), and ``settle``, the job's "looked at it, next time is T (or never)",
changes nothing when a mark came in between (``bucket_settle.lua`` compares the score it
read): a mark is never lost to a job that looked before it. A mark lost with a crashed
replica delays a look until a slow walk over every scope finds it (the module's job).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis

from agent_runtime import lua

BUCKETS = 64


def bucket_of(scope_id: str) -> int:
    """The bucket of a scope: stable across processes and versions (not Python's hash)."""
    return zlib.crc32(scope_id.encode("utf-8", "surrogatepass")) % BUCKETS


def bucket_tag(bucket: int) -> str:
    """The hash tag of a bucket's keys: ``{b07}``."""
    if not 0 <= bucket < BUCKETS:
        raise ValueError(f"bucket {bucket} outside 0..{BUCKETS - 1}")
    return f"{{b{bucket:02d}}}"


class DueIndex:
    """Scope id → when to look at it, in ``BUCKETS`` ZSETs; ``key_of(bucket)`` names them
    (the module's ``state.py`` builds the names, with ``bucket_tag``)."""

    def __init__(
        self,
        redis: Redis,
        key_of: Callable[[int], str],
        *,
        name: str,
        observe: lua.ScriptObserver | None = None,
    ) -> None:
        self._redis = redis
        self._key_of = key_of
        self._due: Any = lua.register(
            redis, lua.SHARED, "bucket_due", observe=observe, label=f"{name}_due"
        )
        self._mark: Any = lua.register(
            redis, lua.SHARED, "bucket_mark", observe=observe, label=f"{name}_mark"
        )
        self._settle: Any = lua.register(
            redis, lua.SHARED, "bucket_settle", observe=observe, label=f"{name}_settle"
        )

    def key(self, scope_id: str) -> str:
        return self._key_of(bucket_of(scope_id))

    async def mark(self, scope_id: str, when: float) -> None:
        """Look at the scope at ``when`` at the latest (never later than already marked)."""
        await self._mark(keys=[self.key(scope_id)], args=[scope_id, repr(float(when))])

    async def due(self, bucket: int, limit: int) -> list[tuple[str, str]]:
        """Up to ``limit`` scopes of the bucket whose time has come: (scope id, the score as
        read, for ``settle``)."""
        flat = await self._due(keys=[self._key_of(bucket)], args=[limit])
        return [(str(flat[i]), str(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def settle(self, scope_id: str, seen: str, next_when: float | None) -> bool:
        """After a look: next time ``next_when`` (None: drop the scope from the index), unless
        a mark came since the score ``seen`` was read. True when settled."""
        args = [scope_id, seen, "" if next_when is None else repr(float(next_when))]
        return bool(await self._settle(keys=[self.key(scope_id)], args=args))
