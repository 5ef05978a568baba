"""Session manager state in Redis: the only module that knows the ``session_manager:`` key names.

Key table: contract §4 (and ``docs/design/hld.md``). Keys of this module that are not in the
contract because nothing outside reads them: ``scope_registry`` (every scope known, sid →
[group_id, bot_id, template_id, generation], so a config change finds the scopes it affects
even when their cache was dropped), the scope indexes ``scope_index:template:{tid}``,
``scope_index:group:{group_id}`` and ``scope_index:bot:{bot_id}`` (SETs of sids, kept in the
same script as the registry entry: a config change walks only the scopes its item can reach),
``scope_idle`` (ZSET sid → when first seen empty: the scope expiry's candidates),
``leased_scopes`` (scopes that took a queue seat or a reservation: the prune's index) and
``config_gen`` (bumped by every config change; a resolve fills the cache only if the
generation it read before its DB query is still current, so a resolve racing a config_sync
cannot write back a stale cache; a propagation writes a scope only if no later config_sync
wrote it already).
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager, suppress
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import LockError

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


def scope_waiters_key(scope_id: str) -> str:
    return f"{P}scope:{scope_id}:waiters"


def scope_reserved_key(scope_id: str) -> str:
    """Routes headed for a pod being acquired: request_id → lease deadline (route_place)."""
    return f"{P}scope:{scope_id}:reserved"


def scope_pod_seq_key(scope_id: str) -> str:
    return f"{P}scope:{scope_id}:pod_seq"


def route_key(request_id: str) -> str:
    """Replay of a route: its answer (JSON, with the request's ``request_hash``) for 60 s, or
    ``pending:{token}\n{request_hash}`` while running."""
    return f"{P}route:{request_id}"


def request_hash(first: str, second: str = "") -> str:
    """What binds a replay answer to its request: a digest of the request's own fields (route:
    scope and session; touch: session). A request_id reused by another request does not match
    it and is answered REQUEST_ID_REUSED instead of the first caller's answer. ~0.6 µs."""
    joined = f"{first}\x00{second}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(joined, digest_size=16).hexdigest()


def touch_key(request_id: str) -> str:
    """The answer of an eos that ended its session, for the same request re-sent (REPLAY_TTL)."""
    return f"{P}touch:{request_id}"


def previous_pod_key(session_id: str) -> str:
    """Tombstone: the pod that died under the session (for ``rebound``), for session_ttl."""
    return f"{P}previous_pod:{session_id}"  # not under session:{id}: ids may hold ":"


FREE_PATTERN = f"{P}scope:*:free"
REPLAY_TTL = 60
# seconds a running route's pending marker, reservation and seat live unless renewed: a route
# renews them every ROUTE_LEASE / 3 (route_lease.lua); one that died or lost Redis frees them
# within this, so a retry of its request_id runs instead of waiting for a call that is gone
ROUTE_LEASE = 3.0


PODS_REGISTERED_KEY = f"{P}pods:registered"
SESSION_EXPIRY_KEY = f"{P}session_expiry"
CONFIG_SYNC_LOCK_KEY = f"{P}lock:config_sync"
SCOPE_REGISTRY_KEY = f"{P}scope_registry"
CONFIG_GEN_KEY = f"{P}config_gen"
SCOPE_CONFIG_PATTERN = f"{P}scope:*:config"
SCOPE_IDLE_KEY = f"{P}scope_idle"
# scopes that took a queue seat or a reservation since the prune job last found them empty:
# where a dead replica's leftovers can be (seat_prune.lua), so the job never walks every scope
LEASED_SCOPES_KEY = f"{P}leased_scopes"
PRUNE_BATCH = 25  # scopes per seat_prune call: ~5 commands, 8–17 µs a scope in Redis (loaded box)
SCOPE_BATCH = 200  # registry entries per HMGET
# registry entries per scope_idle_mark call: ~3.5 µs each inside Redis (4 reads + a ZADD/ZREM),
# measured 0.7 ms mean / 1.4 ms max at 200 on the 2-core box: 100 keeps a call near 0.35 ms
MARK_PAGE = 100


def template_index_key(template_id: str) -> str:
    """Scopes whose best rule names the template (scope_put.lua derives the same name)."""
    return f"{P}scope_index:template:{template_id}"


def group_index_key(group_id: str) -> str:
    """Scopes of the group: those a ``(group_id, *)`` rule can reach."""
    return f"{P}scope_index:group:{group_id}"


def bot_index_key(bot_id: str) -> str:
    """Scopes of the bot: those a ``(*, bot_id)`` rule can reach."""
    return f"{P}scope_index:bot:{bot_id}"


def _pod_pair(member: str) -> tuple[str, str]:
    """A ``pods:registered`` member ``{sid}:{pod}`` (scope ids are hex: the first colon)."""
    scope_id, _, pod_id = member.partition(":")
    return scope_id, pod_id


def _mapping(fields: dict[str, str]) -> dict[Any, Any]:
    return fields  # redis-py's hset typing wants a wider key type than str


class SessionState:
    """Typed operations on the session manager's Redis keys (client with decode_responses)."""

    def __init__(self, redis: Redis, *, observe: lua.ScriptObserver | None = None) -> None:
        self.redis = redis
        pkg = "agent_runtime.session_manager"

        def script(name: str, prelude: str | None = None) -> Any:
            return lua.register(redis, pkg, name, prelude=prelude, observe=observe)

        self._route_place = script("route_place", "_session")
        self._evict = script("evict", "_session")
        self._evict_expired = script("evict_expired", "_session")
        self._touch = script("touch", "_session")
        self._sweep_idle_notify = script("sweep_idle_notify")
        self._register_pod = script("register_pod")
        self._cleanup_pod = script("cleanup_pod")
        self._waiter_gate = script("waiter_gate")
        self._route_lease = script("route_lease")
        self._pod_usage = script("pod_usage")
        self._scope_put = script("scope_put")
        self._scope_idle_mark = script("scope_idle_mark")
        self._scope_expire = script("scope_expire")
        self._seat_prune = script("seat_prune")

    # --- route and touch (scripts) -------------------------------------------------------------

    async def route_place(
        self, *, request_id: str, session_id: str, scope_id: str, token: str, slow: bool = False
    ) -> list[str]:
        """One EVALSHA: replay, refresh, or first-fit placement (see route_place.lua).
        ``slow``: the caller may hold a seat or a reservation; placing gives them back."""
        return cast(
            list[str],
            await self._route_place(
                keys=[
                    session_key(session_id),
                    SESSION_EXPIRY_KEY,
                    scope_sessions_key(scope_id),
                    scope_pods_key(scope_id),
                    scope_config_key(scope_id),
                    PODS_REGISTERED_KEY,
                    route_key(request_id),
                    previous_pod_key(session_id),
                    scope_reserved_key(scope_id),
                    scope_waiters_key(scope_id),
                    LEASED_SCOPES_KEY,
                ],
                args=[
                    P,
                    session_id,
                    scope_id,
                    token,
                    REPLAY_TTL,
                    ROUTE_LEASE,
                    request_id,
                    "1" if slow else "0",
                    request_hash(scope_id, session_id),
                ],
            ),
        )

    async def renew_route(self, scope_id: str, request_id: str, token: str) -> bool:
        """Keep a running route's marker, reservation and seat for ROUTE_LEASE more seconds;
        False when the call no longer owns its request_id."""
        return await self._lease(scope_id, request_id, token, ROUTE_LEASE)

    async def release_route(self, scope_id: str, request_id: str, token: str) -> bool:
        """A failed route gives back its marker (so a retry runs), reservation and seat."""
        return await self._lease(scope_id, request_id, token, 0)

    async def _lease(self, scope_id: str, request_id: str, token: str, seconds: float) -> bool:
        keys = [route_key(request_id), scope_reserved_key(scope_id), scope_waiters_key(scope_id)]
        return bool(await self._route_lease(keys=keys, args=[token, request_id, seconds]))

    async def touch(
        self, session_id: str, *, eos: bool, request_id: str = ""
    ) -> tuple[bool, bool] | None:
        """(touched, released) — see touch.lua. Without a request_id no eos answer is kept.
        None: an eos whose request_id ended another session within REPLAY_TTL (nothing done)."""
        touched, released = await self._touch(
            keys=[session_key(session_id), SESSION_EXPIRY_KEY, touch_key(request_id)],
            args=[
                P,
                session_id,
                "1" if eos else "0",
                REPLAY_TTL if request_id else 0,
                request_hash(session_id),
            ],
        )
        if int(touched) < 0:
            return None
        return bool(touched), bool(released)

    async def register_pod(self, scope_id: str, pod_id: str, sse_url: str, deploy_ver: str) -> bool:
        """Make the pod a candidate; False if it is not of the scope's current version."""
        return bool(
            await self._register_pod(
                keys=[
                    scope_pods_key(scope_id),
                    scope_pod_seq_key(scope_id),
                    pod_info_key(scope_id, pod_id),
                    PODS_REGISTERED_KEY,
                    pod_scopes_key(pod_id),
                    pod_idle_notified_key(scope_id, pod_id),
                    scope_config_key(scope_id),
                ],
                args=[P, scope_id, pod_id, sse_url, deploy_ver],
            )
        )

    async def sweep_idle(self, grace: float, page: int = 200) -> list[tuple[str, str]]:
        """Hand back every empty registered pod (see sweep_idle_notify.lua), one SSCAN page of
        ``pods:registered`` per script call: at 10k pods ~50 calls, each ~2.8 µs a pod inside
        Redis (a page of 200 holds it ~0.6 ms: a route waits behind it at most that). Returns
        the (scope, pod) pairs taken out of the candidates, to be told to the resource side."""
        notified: list[tuple[str, str]] = []
        cursor = "0"
        while True:
            reply = await self._sweep_idle_notify(
                keys=[PODS_REGISTERED_KEY], args=[P, grace, cursor, page]
            )
            cursor = str(reply[0])
            notified += [_pod_pair(m) for m in reply[1:]]
            if cursor == "0":
                return notified

    async def take_waiter_seat(
        self, scope_id: str, request_id: str, hold_seconds: float, limit: int
    ) -> bool:
        return bool(
            await self._waiter_gate(
                keys=[scope_waiters_key(scope_id), LEASED_SCOPES_KEY],
                args=[request_id, hold_seconds, limit, scope_id],
            )
        )

    async def prune_seats(self) -> tuple[int, int]:
        """Drop the queue seats and reservations whose lease ran out (a replica that died left
        them) in every scope that took one, PRUNE_BATCH scopes a script call (seat_prune.lua);
        returns (seats, reservations) dropped. O(scopes that had seats), not O(scopes)."""
        scopes = [s async for s in self.redis.sscan_iter(LEASED_SCOPES_KEY, count=500)]
        seats = reserved = 0
        for i in range(0, len(scopes), PRUNE_BATCH):
            dropped = await self._seat_prune(
                keys=[LEASED_SCOPES_KEY], args=[P, *scopes[i : i + PRUNE_BATCH]]
            )
            seats, reserved = seats + int(dropped[0]), reserved + int(dropped[1])
        return seats, reserved

    async def evict_expired(self, limit: int) -> list[str]:
        """Evict up to ``limit`` sessions whose expiry passed (Redis clock), oldest first, in
        one script (see evict_expired.lua); the ids evicted."""
        return cast(
            list[str], await self._evict_expired(keys=[SESSION_EXPIRY_KEY], args=[P, limit])
        )

    async def registered_pods(self) -> list[tuple[str, str]]:
        """Every registered (scope, pod), by SSCAN."""
        pairs = []
        async for member in self.redis.sscan_iter(PODS_REGISTERED_KEY, count=500):
            pairs.append(_pod_pair(member))
        return pairs

    # --- sessions and pods (scripts) -----------------------------------------------------------

    async def evict(
        self, session_id: str, *, pod_died: bool = False
    ) -> tuple[str, str, int] | None:
        """Remove a session from its four places; (scope, pod, sessions left) or None.
        ``pod_died`` leaves a tombstone so the session's next route answers ``rebound``."""
        reply = await self._evict(
            keys=[session_key(session_id), SESSION_EXPIRY_KEY],
            args=[P, session_id, "1" if pod_died else "0"],
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

    async def live_sessions(self) -> int:
        return int(await self.redis.zcard(SESSION_EXPIRY_KEY))

    async def scope_session_counts(self, scope_ids: list[str]) -> list[int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id in scope_ids:
                pipe.scard(scope_sessions_key(scope_id))
            return [int(n) for n in await pipe.execute()]

    async def sunset_pods(self) -> int:
        """Registered pods that are no longer placement candidates (old version, or being
        handed back): they keep their sessions, take no new ones."""
        pairs = await self.registered_pods()
        if not pairs:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id, pod_id in pairs:
                pipe.zscore(scope_pods_key(scope_id), pod_id)
            return sum(1 for score in await pipe.execute() if score is None)

    # --- admin views (read only, bounded: HSCAN pages, per-scope pipelines) ----------------------

    async def scopes_page(self, cursor: int, limit: int) -> tuple[int, list[tuple[str, str, str]]]:
        """One page of the scope registry: (next cursor, 0 at the end; [(sid, group, bot)]).
        HSCAN's COUNT is a hint, so a page may hold a little more or less than ``limit``."""
        next_cursor, page = await self.redis.hscan(SCOPE_REGISTRY_KEY, cursor, count=limit)
        scopes = []
        for sid, value in cast(dict[str, str], page).items():
            entry = json.loads(value)
            scopes.append((sid, str(entry[0]), str(entry[1])))
        return int(next_cursor), scopes

    async def scope_summaries(self, scope_ids: list[str]) -> list[dict[str, Any]]:
        """Per scope: live sessions, queue seats and reservations (live ones: their deadline
        not passed), candidate pods, whether the resolve cache holds its policy."""
        if not scope_ids:
            return []
        seconds, micros = await self.redis.time()
        now = seconds + micros / 1_000_000
        async with self.redis.pipeline(transaction=False) as pipe:
            for sid in scope_ids:
                pipe.scard(scope_sessions_key(sid))
                pipe.zcount(scope_waiters_key(sid), now, "+inf")
                pipe.zcount(scope_reserved_key(sid), now, "+inf")
                pipe.zcard(scope_pods_key(sid))
                pipe.hgetall(scope_config_key(sid))
            replies = await pipe.execute()
        out = []
        for i, sid in enumerate(scope_ids):
            sessions, waiters, reserved, candidates, config = replies[5 * i : 5 * i + 5]
            out.append(
                {
                    "scope_id": sid,
                    "live_sessions": int(sessions),
                    "waiters": int(waiters),
                    "reserved": int(reserved),
                    "candidate_pods": int(candidates),
                    "config": config or None,
                }
            )
        return out

    async def scope_detail(self, scope_id: str) -> dict[str, Any]:
        """Candidates in arrival order with their sessions, the registered pods that are not
        candidates (sunset / being handed back), the queue and the reservations."""
        candidates = await self.candidate_pods(scope_id)
        registered = (await self.registered_pods_by_scope({scope_id})).get(scope_id, [])
        pods = sorted(set(registered) | set(candidates), key=lambda p: (p not in candidates, p))
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod_id in pods:
                pipe.scard(pod_sessions_key(scope_id, pod_id))
            pipe.zrange(scope_waiters_key(scope_id), 0, 99, withscores=True)
            pipe.zrange(scope_reserved_key(scope_id), 0, 99, withscores=True)
            pipe.scard(scope_sessions_key(scope_id))
            replies = await pipe.execute()
        counts, (waiters, reserved, sessions) = replies[: len(pods)], replies[len(pods) :]
        return {
            "live_sessions": int(sessions),
            "pods": [
                {"pod_id": p, "candidate": p in candidates, "sessions": int(n)}
                for p, n in zip(pods, counts, strict=True)
            ],
            "waiters": [{"request_id": m, "deadline": d} for m, d in waiters],
            "reserved": [{"request_id": m, "deadline": d} for m, d in reserved],
        }

    async def session_view(self, session_id: str) -> dict[str, Any] | None:
        binding = await self.redis.hgetall(session_key(session_id))
        tombstone = await self.redis.get(previous_pod_key(session_id))
        if not binding and tombstone is None:
            return None
        return {"binding": binding or None, "previous_pod_id": tombstone}

    async def pod_registrations(self, pod_id: str) -> list[dict[str, Any]]:
        """Every scope that references the pod, with its sessions there and whether it is a
        candidate."""
        scopes = sorted(await self.pod_scopes(pod_id))
        async with self.redis.pipeline(transaction=False) as pipe:
            for sid in scopes:
                pipe.scard(pod_sessions_key(sid, pod_id))
                pipe.zscore(scope_pods_key(sid), pod_id)
                pipe.hgetall(pod_info_key(sid, pod_id))
            replies = await pipe.execute()
        return [
            {
                "scope_id": sid,
                "sessions": int(replies[3 * i]),
                "candidate": replies[3 * i + 1] is not None,
                "info": replies[3 * i + 2],
            }
            for i, sid in enumerate(scopes)
        ]

    async def pod_scopes(self, pod_id: str) -> list[str]:
        return cast(list[str], list(await self.redis.smembers(pod_scopes_key(pod_id))))

    async def pod_sessions(self, scope_id: str, pod_id: str) -> list[str]:
        return cast(list[str], list(await self.redis.smembers(pod_sessions_key(scope_id, pod_id))))

    async def pod_usage(self, pods: list[tuple[str, str]]) -> list[tuple[bool, int]]:
        """For each (scope, pod): (is a placement candidate, live sessions on it). One
        ``pod_usage`` script per 100 pods: reconcile asks about every pod, and a command per
        pod (pipelined) costs the loop ~90 µs each."""
        usage: list[tuple[bool, int]] = []
        for i in range(0, len(pods), 100):  # ~4.8 µs a pod inside Redis: ~0.5 ms a call
            members = [f"{scope_id}:{pod_id}" for scope_id, pod_id in pods[i : i + 100]]
            flat = await self._pod_usage(keys=[], args=[P, *members])
            usage += [(flat[j] == 1, int(flat[j + 1])) for j in range(0, len(flat), 2)]
        return usage

    # --- resolve cache -----------------------------------------------------------------------

    async def get_scope_config(self, scope_id: str) -> dict[str, str]:
        return cast(dict[str, str], await self.redis.hgetall(scope_config_key(scope_id)))

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

    # --- the scope indexes (config_sync's walk) and the scope expiry ------------------------

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
                    entry = json.loads(value)
                    out[sid] = (str(entry[0]), str(entry[1]))
        return out

    async def scope_count(self) -> int:
        return int(await self.redis.hlen(SCOPE_REGISTRY_KEY))

    async def mark_idle_scopes(self, cursor: str, page: int = MARK_PAGE) -> tuple[str, int]:
        """One HSCAN page of the registry: empty scopes join ``scope_idle``, used ones leave
        it (scope_idle_mark.lua). (next cursor, "0" at the end; scopes marked empty)."""
        reply = await self._scope_idle_mark(
            keys=[SCOPE_REGISTRY_KEY, SCOPE_IDLE_KEY], args=[P, cursor, page]
        )
        return str(reply[0]), int(reply[2])

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

    async def known_scopes(self) -> dict[str, tuple[str, str]]:
        """Every scope that ever resolved: sid → (group_id, bot_id)."""
        scopes: dict[str, tuple[str, str]] = {}
        async for sid, value in self.redis.hscan_iter(SCOPE_REGISTRY_KEY, count=500):
            entry = json.loads(value)
            scopes[sid] = (str(entry[0]), str(entry[1]))
        return scopes

    # --- pods, as config_sync sees them --------------------------------------------------------

    async def registered_pods_by_scope(self, scope_ids: set[str]) -> dict[str, list[str]]:
        """Registered pod ids of the given scopes (one SSCAN over ``pods:registered``)."""
        found: dict[str, list[str]] = defaultdict(list)
        if not scope_ids:
            return found
        async for member in self.redis.sscan_iter(PODS_REGISTERED_KEY, count=500):
            sid, pod_id = _pod_pair(member)
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
