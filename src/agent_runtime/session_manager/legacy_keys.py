"""The session manager's keys as an earlier version named them: what ``agent-runtime redis
migrate`` renames, converts or deletes (``key_layout.py`` runs it). The only place that spells
a retired key name; the current names are ``state.py``'s.

Layout 1 (before Redis Cluster, issue 17) put the scope id bare in a key name and kept a
session and the indexes over scopes in keys of no scope; layout 2 wraps the scope id in braces,
the Redis Cluster hash tag, so that every key of one scope — a session's too — lives in one
slot:

- ``scope:<sid>:…``, ``pod:<sid>:<pod>:…`` → the same with ``{<sid>}`` (a rename);
- ``session:<session_id>`` → ``session:{<sid>}:<session_id>`` (the hash's ``scope_id``), its
  expiry into ``scope:{<sid>}:session_expiry``, the session-scope index and the scope's
  ``expiry_due`` mark written beside it (a conversion);
- ``pods:registered`` (members ``<sid>:<pod>``) → ``pods:{<sid>}:registered`` (a conversion);
- ``leased_scopes`` (a SET) → each scope marked due now in ``leased_scopes:{bNN}``;
- ``scope_registry`` (sid → ``[group, bot, template, generation]``) → each scope's record
  ``scope:{<sid>}:entry`` and its bucket ``scope_registry:{bNN}``;
- ``session_expiry``, ``scope_idle`` (the expiry's marks: the next walk marks again),
  ``touch:<request_id>`` (a 60 s replay answer that names no scope) and ``pods:<pod_id>:scopes``
  are deleted: each session's hash carries its expiry.
"""

from __future__ import annotations

import json
import math
import re
from typing import cast

from redis.asyncio import Redis

from agent_runtime.config import SM_KEY_PREFIX as P
from agent_runtime.scope_buckets import bucket_of
from agent_runtime.session_manager.state import (
    SessionState,
    pods_registered_key,
    scope_entry_key,
    scope_expiry_key,
    scope_registry_key,
    session_key,
    session_scope_key,
)

PREFIX = P  # every key of this module
# scope:{sid}:… and pod:{sid}:{pod_id}:… with a bare scope id (a scope id is hex, or any id
# without ':' and braces in tests): key_layout puts the tag around it, the rest stays as it was
SCOPE_HEADS: tuple[str, ...] = ("scope", "pod")

# retired: pods:{pod_id}:scopes (a pod belongs to one scope, the resource manager names it);
# the global session_expiry (each hash carries its expiry); touch:{request_id} without a scope
_RETIRED = re.compile(
    rf"^{re.escape(P)}(?:pods:[^{{}}]+:scopes|session_expiry|scope_idle|touch:(?!\{{[^{{}}]*\}}:).*)$"
)

_SESSION = f"{P}session:"
_CURRENT_SESSION = re.compile(rf"^{re.escape(_SESSION)}\{{([^{{}}]*)\}}:(.*)$", re.DOTALL)
_PODS_REGISTERED = f"{P}pods:registered"
_LEASED_SCOPES = f"{P}leased_scopes"
_SCOPE_REGISTRY = f"{P}scope_registry"


def renamed(key: str) -> str | None:
    """None: no key of this module is renamed other than by its scope's tag."""
    return None


def retired(key: str) -> bool:
    """Whether ``key`` is of a name no current version uses: the migration deletes it."""
    return _RETIRED.match(key) is not None


def convertible(key: str) -> bool:
    """Whether ``key`` is a layout-1 key whose content moves (``convert``): a session hash named
    by its session id alone, ``pods:registered``, the ``leased_scopes`` SET. (A layout-1 session
    id that itself looks like ``{…}:…`` is taken for a current name and left.)"""
    if key in (_PODS_REGISTERED, _LEASED_SCOPES, _SCOPE_REGISTRY):
        return True
    if not key.startswith(_SESSION):
        return False
    return _CURRENT_SESSION.match(key) is None


async def convert(redis: Redis, key: str) -> bool:
    """Move a ``convertible`` key's content to its layout-2 keys and delete it. False: nothing
    moved (gone since the SCAN, or a session hash whose current name exists: a clash, left)."""
    if key == _PODS_REGISTERED:
        members = [str(m) for m in await redis.smembers(key)]
        async with redis.pipeline(transaction=False) as pipe:
            for member in members:
                scope_id, _, pod_id = member.partition(":")
                pipe.sadd(pods_registered_key(scope_id), pod_id)
            pipe.delete(key)
            await pipe.execute()
        return bool(members)
    if key == _SCOPE_REGISTRY:
        entries = cast(dict[str, str], await redis.hgetall(key))
        async with redis.pipeline(transaction=False) as pipe:
            for scope_id, value in entries.items():
                group_id, bot_id = json.loads(value)[:2]
                pipe.set(scope_entry_key(scope_id), value, nx=True)
                pipe.hset(
                    scope_registry_key(bucket_of(scope_id)),
                    scope_id,
                    json.dumps([group_id, bot_id]),
                )
            pipe.delete(key)
            await pipe.execute()
        return bool(entries)
    state = SessionState(redis)
    if key == _LEASED_SCOPES:
        scopes = [str(m) for m in await redis.smembers(key)]
        for scope_id in scopes:  # the prune looks at each at once
            await state.leased.mark(scope_id, 0.0)
        await redis.delete(key)
        return bool(scopes)
    return await _convert_session(redis, state, key)


async def _convert_session(redis: Redis, state: SessionState, key: str) -> bool:
    binding = cast(dict[str, str], await redis.hgetall(key))
    scope_id, session_id = binding.get("scope_id"), key.removeprefix(_SESSION)
    if not binding:
        return False
    if not scope_id:  # no scope to move it to: half a session, nothing can serve it
        await redis.delete(key)
        return False
    new = session_key(scope_id, session_id)
    if not await redis.renamenx(key, new):
        return False
    expiry, ttl = float(binding.get("expiry") or 0), float(binding.get("session_ttl") or 0)
    index_ttl = max(1, math.ceil(2 * ttl))
    seconds, micros = await redis.time()
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zadd(scope_expiry_key(scope_id), {session_id: expiry})
        pipe.set(session_scope_key(session_id), scope_id, ex=index_ttl)
        pipe.hset(new, "index_until", f"{seconds + micros / 1e6 + index_ttl:.6f}")
        await pipe.execute()
    await state.expiry_due.mark(scope_id, expiry)
    return True
