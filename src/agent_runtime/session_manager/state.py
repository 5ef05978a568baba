"""Session manager state in Redis: the only module that knows the ``session_manager:`` key names.

Key table: contract §4 (and ``docs/design/hld.md``). Keys of this module that are not in the
contract because nothing outside reads them: ``scope:{sid}:entry`` (the scope's record, [group_id,
bot_id, template_id, generation]), ``scope_registry:{bNN}`` (every scope known, per bucket, so a
config change finds the scopes it affects even when their cache was dropped), the scope indexes
``scope_index:template:{tid}``, ``scope_index:group:{group_id}`` and ``scope_index:bot:{bot_id}``
(SETs of sids, written before the scope's record and again after it: a config change walks only
the scopes its item can reach), ``scope_idle:{bNN}`` (sid → when first seen empty: the scope
expiry's candidates) and ``config_gen`` (bumped by every config change; a resolve's cache fill
is dropped again when the generation it read before its DB query moved meanwhile, so a resolve
racing a config_sync cannot leave a stale cache; a propagation writes a scope only if no later
config_sync bumped, nor wrote the scope's record already).

A session's keys carry its scope's tag (``session:{<sid>}:<id>``, ``scope:{<sid>}:session_expiry``,
``touch:{<sid>}:<rid>``, ``pods:{<sid>}:registered``): every script of ``SessionState`` touches one
slot. Three keys span scopes and are written by ``SessionState`` when a script's reply asks for
it: the session-scope index ``session_scope:<id>`` (a hint for callers that know only the
session id), and the bucketed DueIndexes ``expiry_due:{bNN}`` and ``leased_scopes:{bNN}``
(``scope_buckets``); those a route's or a touch's reply asks for (all but ``need_acquire``'s
``leased_scopes`` mark) after the reply, by ``index_writes`` (the hot path stays one round
trip); ``SessionState.safety_walk`` remakes a mark a crashed replica lost.

``SessionState`` is the door to sessions, pods and routes (the hot path's scripts, the
sweeper's passes, the facade's questions); ``scope_state.ScopeState`` the door to the scope
records (resolve cache, registry, indexes, scope expiry, the config_sync lock) and
``views.SessionViews`` the admin's and the gauges' reads. Both use the key builders below; each
script reply is decoded once, here or there, into ``replies``' typed values.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from agent_runtime import lua
from agent_runtime.config import SM_KEY_PREFIX as P
from agent_runtime.errors import BackendUnavailable
from agent_runtime.jobs import DetachedWrites
from agent_runtime.redis_client import is_cluster
from agent_runtime.resource_manager.session_side import ARRIVAL_FAST_WINDOW, ARRIVAL_SLOW_WINDOW
from agent_runtime.scope_buckets import BUCKETS, DueIndex, bucket_tag
from agent_runtime.session_manager.replies import (
    PLACING,
    Eviction,
    Placement,
    PodCleanup,
    PodRef,
    RoutePlacement,
    ScopeExpired,
    SeatsPruned,
    TouchOutcome,
)

log = logging.getLogger(__name__)

# --- key names -------------------------------------------------------------------------------
# Every key of one scope's state carries the scope id as its Redis Cluster hash tag, braces
# included ("scope:{<sid>}:sessions"): a script that touches one scope touches one slot. The
# scripts derive the same names with lua/_keys.lua.


def _scope(scope_id: str) -> str:
    """The head of a scope's keys: ``session_manager:scope:{<sid>}:``."""
    return f"{P}scope:{{{scope_id}}}:"


def _pod(scope_id: str, pod_id: str) -> str:
    """The head of a pod's keys in a scope: ``session_manager:pod:{<sid>}:<pod>:``."""
    return f"{P}pod:{{{scope_id}}}:{pod_id}:"


def scope_config_key(scope_id: str) -> str:
    return f"{_scope(scope_id)}config"


def scope_pods_key(scope_id: str) -> str:
    return f"{_scope(scope_id)}pods"


def pod_info_key(scope_id: str, pod_id: str) -> str:
    return f"{_pod(scope_id, pod_id)}info"


def pod_sessions_key(scope_id: str, pod_id: str) -> str:
    return f"{_pod(scope_id, pod_id)}sessions"


def pod_idle_notified_key(scope_id: str, pod_id: str) -> str:
    return f"{_pod(scope_id, pod_id)}idle_notified"


def session_key(scope_id: str, session_id: str) -> str:
    """The session's hash, in its scope: ``session:{<sid>}:<session_id>``."""
    return f"{P}session:{{{scope_id}}}:{session_id}"


def session_scope_key(session_id: str) -> str:
    """The session-scope index: STRING → the scope the session was last bound in, for the
    callers that know only the session id (touch without ids, evict, the admin view). A hint
    with a TTL of 2 × session_ttl, refreshed when a script says so: the session's own hash
    under the scope's tag is the truth. A key of no scope (any slot)."""
    return f"{P}session_scope:{session_id}"


def scope_expiry_key(scope_id: str) -> str:
    """The scope's sessions by expiry (Redis seconds): what the expiry pass reads."""
    return f"{_scope(scope_id)}session_expiry"


def pods_registered_key(scope_id: str) -> str:
    """The pods registered in the scope (candidates or not): SET of pod ids."""
    return f"{P}pods:{{{scope_id}}}:registered"


def expiry_due_key(bucket: int) -> str:
    """A bucket of the expiry index: scope id → when its earliest session expires
    (scope_buckets.DueIndex; marked beside route_place, settled by the expiry pass)."""
    return f"{P}expiry_due:{bucket_tag(bucket)}"


def leased_scopes_key(bucket: int) -> str:
    """A bucket of the seat prune's index: scope id → the earliest deadline of a queue seat or
    reservation it took (scope_buckets.DueIndex; marked beside waiter_gate and route_place)."""
    return f"{P}leased_scopes:{bucket_tag(bucket)}"


def scope_sessions_key(scope_id: str) -> str:
    return f"{_scope(scope_id)}sessions"


def scope_free_channel(scope_id: str) -> str:
    return f"{_scope(scope_id)}free"


def scope_waiters_key(scope_id: str) -> str:
    return f"{_scope(scope_id)}waiters"


def scope_reserved_key(scope_id: str) -> str:
    """Routes headed for a pod being acquired: request_id → lease deadline (route_place)."""
    return f"{_scope(scope_id)}reserved"


def scope_arrivals_key(scope_id: str) -> str:
    """The scope's arrival rate of new sessions: EWMAs ``fast``, ``slow`` and ``at``
    (route_place.lua counts each placement; the warm pool's demand, read by demand_state)."""
    return f"{_scope(scope_id)}arrivals"


def scope_pod_seq_key(scope_id: str) -> str:
    return f"{_scope(scope_id)}pod_seq"


def route_key(scope_id: str, request_id: str) -> str:
    """Replay of a route in its scope: its answer (JSON, with the request's ``request_hash``)
    for 60 s, or ``pending:{token}\n{request_hash}`` while running."""
    return f"{P}route:{{{scope_id}}}:{request_id}"


def request_hash(first: str, second: str = "") -> str:
    """What binds a replay answer to its request: a digest of the request's own fields (route:
    scope and session; touch: session). A request_id reused by another request does not match
    it and is answered REQUEST_ID_REUSED instead of the first caller's answer. ~0.6 µs."""
    joined = f"{first}\x00{second}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(joined, digest_size=16).hexdigest()


def touch_key(scope_id: str, request_id: str) -> str:
    """The answer of an eos that ended its session, for the same request re-sent (REPLAY_TTL),
    in the session's scope."""
    return f"{P}touch:{{{scope_id}}}:{request_id}"


def previous_pod_key(scope_id: str, session_id: str) -> str:
    """Tombstone in the session's scope: the pod that died under the session (for
    ``rebound``), for session_ttl (_keys.lua derives the same name)."""
    return f"{P}previous_pod:{{{scope_id}}}:{session_id}"  # not under session:{id}: ids hold ":"


# the prelude that derives the scope's key names in Lua (lua/_keys.lua), before any other
KEYS_PRELUDE = "_keys"
FREE_PATTERN = f"{_scope('*')}free"
REPLAY_TTL = 60
# seconds a running route's pending marker, reservation and seat live unless renewed: a route
# renews them every ROUTE_LEASE / 3 (route_lease.lua); one that died or lost Redis frees them
# within this, so a retry of its request_id runs instead of waiting for a call that is gone
ROUTE_LEASE = 3.0
# a scope's arrival rates (scope:{sid}:arrivals): the EWMAs' windows are the resource manager's
# question (session_side), the hash goes 10 slow windows after its last arrival (rate ~ 0)
ARRIVALS_TTL = int(10 * ARRIVAL_SLOW_WINDOW)


CONFIG_SYNC_LOCK_KEY = f"{P}lock:config_sync"
CONFIG_GEN_KEY = f"{P}config_gen"
SCOPE_CONFIG_PATTERN = f"{_scope('*')}config"


def scope_entry_key(scope_id: str) -> str:
    """The scope's record: JSON ``[group_id, bot_id, template_id, generation]`` (scope_put.lua;
    the generation is what a config_sync's apply compares)."""
    return f"{_scope(scope_id)}entry"


def scope_registry_key(bucket: int) -> str:
    """A bucket of the scope registry: sid → JSON ``[group_id, bot_id]``, every scope Redis
    knows (written beside scope_put, before and after it; what the walks over scopes read)."""
    return f"{P}scope_registry:{bucket_tag(bucket)}"


def scope_idle_key(bucket: int) -> str:
    """A bucket of the scope expiry's candidates: sid → when first seen empty."""
    return f"{P}scope_idle:{bucket_tag(bucket)}"


def template_index_key(template_id: str) -> str:
    """Scopes whose best rule names the template (scope_put.lua derives the same name)."""
    return f"{P}scope_index:template:{template_id}"


def group_index_key(group_id: str) -> str:
    """Scopes of the group: those a ``(group_id, *)`` rule can reach."""
    return f"{P}scope_index:group:{group_id}"


def bot_index_key(bot_id: str) -> str:
    """Scopes of the bot: those a ``(*, bot_id)`` rule can reach."""
    return f"{P}scope_index:bot:{bot_id}"


def _binds(reply: list[Any]) -> bool:
    """route_place made a new binding (what a WAIT after it is for)."""
    return reply[0] in (Placement.PLACED, Placement.REBOUND)


def _placement(reply: list[Any]) -> RoutePlacement:
    """route_place.lua's reply (its header): the action first, then what that action says."""
    try:
        action = Placement(reply[0])
    except ValueError:
        raise BackendUnavailable(f"unexpected route outcome {reply[0]!r}") from None
    if action is Placement.REPLAY:
        stored: dict[str, Any] = json.loads(reply[1])
        stored.pop("request_hash", None)  # the binding, not part of the answer
        return RoutePlacement(action, replayed=stored)
    if action in PLACING:
        pod_id, url, previous = (str(x) for x in reply[1:4])
        return RoutePlacement(
            action,
            pod_id=pod_id,
            pod_sse_url=url,
            previous_pod_id=previous,
            index_ttl=int(reply[4]),
            due=float(reply[5]) if reply[5] else None,
        )
    if action is Placement.SCOPE_FULL:
        return RoutePlacement(action, reserved=reply[1] == "1")
    if action is Placement.NEED_ACQUIRE:
        return RoutePlacement(action, due=float(reply[1]))
    return RoutePlacement(action)


def _index_write(session_id: str, scope_id: str, placement: RoutePlacement) -> IndexWrite | None:
    """What a refresh's or a placement's reply asks of the keys of other slots (None: nothing).
    A new binding (``placed``, ``rebound``) always rewrites the index and looks at what it
    named before."""
    if placement.action not in PLACING or not (placement.index_ttl or placement.due is not None):
        return None
    moved = placement.action is not Placement.REFRESH and bool(placement.index_ttl)
    return IndexWrite(session_id, scope_id, placement.index_ttl, moved, placement.due)


async def registry_page(redis: Redis, cursor: str, count: int) -> tuple[str, dict[str, str]]:
    """One HSCAN page of the registry's buckets, from ``cursor`` (``"<bucket>:<hscan cursor>"``,
    "0" to start): (the next cursor, "0" when every bucket was walked; sid → entry)."""
    bucket, _, inner = cursor.partition(":")
    at, inner_cursor = int(bucket), int(inner or 0)
    next_inner, page = await redis.hscan(scope_registry_key(at), inner_cursor, count=count)
    if int(next_inner):
        following = f"{at}:{next_inner}"
    else:
        following = f"{at + 1}:0" if at + 1 < BUCKETS else "0"
    return following, {str(k): str(v) for k, v in cast(dict[str, str], page).items()}


async def registry_pages(redis: Redis, count: int = 500) -> AsyncIterator[list[str]]:
    """Every registered scope id, ``count`` at most a page: the walks over every scope (empty
    pods, registered pods, the live-session gauge). The registry's buckets are read together,
    one pipelined HSCAN per bucket a round (on a cluster the pipeline splits by node), so a
    walk costs round trips by the size of the largest bucket, not by the number of buckets."""
    cursors = dict.fromkeys(range(BUCKETS), 0)
    while cursors:
        async with redis.pipeline(transaction=False) as pipe:
            for bucket, cursor in cursors.items():
                pipe.hscan(scope_registry_key(bucket), cursor, count=count)
            replies = await pipe.execute()
        found: list[str] = []
        following: dict[int, int] = {}
        for bucket, (cursor, entries) in zip(cursors, replies, strict=True):
            found += [str(sid) for sid in entries]
            if int(cursor):
                following[bucket] = int(cursor)
        cursors = following
        for i in range(0, len(found), count):
            yield found[i : i + count]


ScriptCall = tuple[Any, list[str], list[Any]]  # (registered script, KEYS, ARGV)
CLUSTER_FANOUT = 32  # script calls in flight at once on a cluster (a pipeline's stand-in)


async def pipelined(redis: Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Script calls in one pipeline. A call a node answered NOSCRIPT (the script not loaded
    there yet, or flushed) is sent again on its own, which loads it; any other error is raised.
    On a Redis Cluster (whose client pipelines no EVALSHA) the calls go out concurrently,
    CLUSTER_FANOUT at a time, each to the node of its slot."""
    if not calls:
        return []
    if is_cluster(redis):
        fanned: list[Any] = []
        for i in range(0, len(calls), CLUSTER_FANOUT):
            chunk = calls[i : i + CLUSTER_FANOUT]
            fanned += await asyncio.gather(*(s(keys=k, args=a) for s, k, a in chunk))
        return fanned
    async with redis.pipeline(transaction=False) as pipe:
        for script, keys, args in calls:
            await script(keys=keys, args=args, client=pipe)
        replies = await pipe.execute(raise_on_error=False)
    out: list[Any] = []
    for (script, keys, args), reply in zip(calls, replies, strict=True):
        if isinstance(reply, NoScriptError):
            reply = await script(keys=keys, args=args)
        elif isinstance(reply, Exception):
            raise reply
        out.append(reply)
    return out


async def registered_in(redis: Redis, scope_ids: list[str]) -> list[list[str]]:
    """The registered pod ids of each scope, in order (one pipeline)."""
    if not scope_ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for scope_id in scope_ids:
            pipe.smembers(pods_registered_key(scope_id))
        return [sorted(str(m) for m in members) for members in await pipe.execute()]


# The writes a placement's reply asks for outside its script's slot, done after the reply
# (docs/spec/session-manager.md, "Index writes after the reply"): at most INDEX_WRITES_PENDING
# wait (a route beyond it waits for room), INDEX_WRITE_BATCH per pipeline, each batch within
# INDEX_WRITE_TIMEOUT seconds.
INDEX_WRITES_PENDING = 4096
INDEX_WRITE_BATCH = 256
INDEX_WRITE_TIMEOUT = 10.0
# a session-scope index write the server refused (a node failing over, a slot moving) is tried
# again after these pauses, within INDEX_WRITE_TIMEOUT: a failover's window is seconds, and
# an index lost means a touch without ids answers "not touched" until the next refresh
INDEX_WRITE_RETRIES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.4, 3.2)


@dataclass(frozen=True, slots=True)
class IndexWrite:
    """What a refresh, a placement or a touch asks of the keys of other slots."""

    session_id: str
    scope_id: str
    ttl: int = 0  # the session-scope index's new TTL (0: not due)
    moved: bool = False  # a new binding: SET … GET, and a binding of another scope is evicted
    due: float | None = None  # the scope's new earliest expiry (mark expiry_due)


class SessionState:
    """Typed operations on sessions, pods and routes (client with decode_responses).

    Every script works on one scope (its keys carry the scope's tag: one slot on a Redis
    Cluster). The indexes that span scopes — the session-scope index, ``expiry_due`` and
    ``leased_scopes`` — are written here when the script's reply asks for them: a route's and a
    touch's after the reply (``index_writes``, in order, bounded, drained at stop); a mark lost
    with a crashed replica is found again by ``safety_walk``."""

    def __init__(
        self,
        redis: Redis,
        *,
        observe: lua.ScriptObserver | None = None,
        wait: lua.ReplicaWait | None = None,
        index_writes_counted: Callable[[str, int], None] | None = None,
    ) -> None:
        self.redis = redis
        self.observe = observe  # the script observer, for the session side's other readers
        self.wait = wait  # WAIT after a placement that binds (AGENT_RUNTIME_REDIS_WAIT_*)
        pkg = "agent_runtime.session_manager"

        def script(name: str, *preludes: str) -> Any:
            return lua.register(
                redis, pkg, name, prelude=(KEYS_PRELUDE, *preludes), observe=observe
            )

        self._route_place = script("route_place", "_session")
        self._evict = script("evict", "_session")
        self._evict_expired = script("evict_expired", "_session")
        self._touch = script("touch", "_session")
        self._sweep_idle_notify = script("sweep_idle_notify")
        self._register_pod = script("register_pod")
        self._cleanup_pod = script("cleanup_pod")
        self._retire_pod = script("retire_pod")
        # the shared seat gate (lua_shared/seat_gate.lua), timed as the wait queue's
        self._waiter_gate = lua.register(
            redis, lua.SHARED, "seat_gate", label="waiter_gate", observe=observe
        )
        self._route_lease = script("route_lease")
        self._pod_usage = script("pod_usage")
        self._seat_prune = script("seat_prune")
        self.expiry_due = DueIndex(redis, expiry_due_key, name="expiry_due", observe=observe)
        self.leased = DueIndex(redis, leased_scopes_key, name="leased_scopes", observe=observe)
        # the index writes after the reply (the hot path stays one round trip); drained at stop
        self.index_writes = DetachedWrites[IndexWrite](
            self.write_indexes,
            name="session index writes",
            pending=INDEX_WRITES_PENDING,
            batch=INDEX_WRITE_BATCH,
            timeout=INDEX_WRITE_TIMEOUT,
            counted=index_writes_counted,
        )

    # --- route and touch (scripts) -------------------------------------------------------------

    async def route_place(
        self, *, request_id: str, session_id: str, scope_id: str, token: str, slow: bool = False
    ) -> RoutePlacement:
        """One EVALSHA: replay, refresh, or first-fit placement (see route_place.lua). What its
        reply asks of keys of other slots — the session-scope index (a new binding: a binding
        in another scope is evicted there), the scope's expiry mark — is written after the
        reply (``index_writes``); a reservation's prune mark (``need_acquire``, the slow path)
        before it. ``slow``: the caller may hold a seat or a reservation; placing gives them
        back."""
        keys, args = _route_call(request_id, session_id, scope_id, token, slow)
        reply = await lua.run_acked(
            self.redis, self._route_place, keys=keys, args=args, wait=self.wait,
            use="route_place", binds=_binds,
        )  # fmt: skip
        placement = _placement(reply)
        if placement.action is Placement.NEED_ACQUIRE and placement.due is not None:
            await self.leased.mark(scope_id, placement.due)
        write = _index_write(session_id, scope_id, placement)
        if write is not None:
            await self.index_writes.put(write)
        return placement

    async def place_many(
        self, requests: Sequence[tuple[str, str, str]], token: str
    ) -> list[RoutePlacement]:
        """``route_place`` for each (request_id, session_id, scope_id), pipelined in one round
        trip (set-ups of benches and fixtures: many sessions at once), the indexes after, before
        it returns."""
        calls = [
            (self._route_place, *_route_call(request_id, session_id, scope_id, token, False))
            for request_id, session_id, scope_id in requests
        ]
        placements = [_placement(reply) for reply in await pipelined(self.redis, calls)]
        writes = [
            write
            for (_, session_id, scope_id), placement in zip(requests, placements, strict=True)
            if (write := _index_write(session_id, scope_id, placement)) is not None
        ]
        for i in range(0, len(writes), INDEX_WRITE_BATCH):
            await self.write_indexes(writes[i : i + INDEX_WRITE_BATCH])
        return placements

    async def write_indexes(self, writes: Sequence[IndexWrite]) -> None:
        """The index writes of many placements, in order: every session-scope index in one
        pipeline (``SET … GET`` for a new binding), then the expiry marks (the earliest per
        scope), then the evictions of sessions whose index named another scope (moved: that
        binding must not keep holding a seat there; rare)."""
        indexed = [w for w in writes if w.ttl]
        before = await self._set_indexes(indexed)
        marks: dict[str, float] = {}
        for w in writes:
            if w.due is not None:
                marks[w.scope_id] = min(w.due, marks.get(w.scope_id, w.due))
        for scope_id, due in marks.items():
            await self.expiry_due.mark(scope_id, due)
        for w, was in zip(indexed, before, strict=True):
            if w.moved and was and was != w.scope_id:
                moved = await self.evict(w.session_id, scope_id=str(was))
                if moved is not None:
                    log.info("session %s moved from scope %s to %s", w.session_id, was, w.scope_id)

    async def _set_indexes(self, writes: list[IndexWrite]) -> list[Any]:
        """Each write's ``SET … GET`` (its reply: the scope the index named before), in one
        pipeline; the commands the server refused (a slot moving, a node failing over) are
        sent again after a pause (INDEX_WRITE_RETRIES), so a failover's window loses none.
        Raises the last refusal when they run out."""
        replies: list[Any] = [None] * len(writes)
        todo = list(range(len(writes)))
        for pause in (*INDEX_WRITE_RETRIES, None):
            async with self.redis.pipeline(transaction=False) as pipe:
                for i in todo:
                    w = writes[i]
                    pipe.set(session_scope_key(w.session_id), w.scope_id, ex=w.ttl, get=w.moved)
                try:
                    results = await pipe.execute(raise_on_error=False)
                except (RedisConnectionError, RedisTimeoutError, RedisClusterException) as exc:
                    results = [exc] * len(todo)
            failed = []
            for i, result in zip(todo, results, strict=True):
                if isinstance(result, Exception):
                    failed.append(i)
                else:
                    replies[i] = result
            if not failed:
                return replies
            if pause is None:
                raise cast(Exception, results[todo.index(failed[0])])
            todo = failed
            await asyncio.sleep(pause)
        return replies  # (not reached)

    async def renew_route(self, scope_id: str, request_id: str, token: str) -> bool:
        """Keep a running route's marker, reservation and seat for ROUTE_LEASE more seconds;
        False when the call no longer owns its request_id."""
        return await self._lease(scope_id, request_id, token, ROUTE_LEASE)

    async def release_route(self, scope_id: str, request_id: str, token: str) -> bool:
        """A failed route gives back its marker (so a retry runs), reservation and seat."""
        return await self._lease(scope_id, request_id, token, 0)

    async def _lease(self, scope_id: str, request_id: str, token: str, seconds: float) -> bool:
        keys = [
            route_key(scope_id, request_id),
            scope_reserved_key(scope_id),
            scope_waiters_key(scope_id),
        ]
        return bool(await self._route_lease(keys=keys, args=[token, request_id, seconds]))

    async def session_scope(self, session_id: str) -> str | None:
        """The scope the session-scope index names (a hint: the scope's hash is the truth)."""
        scope = await self.redis.get(session_scope_key(session_id))
        return str(scope) if scope else None

    async def touch(
        self, session_id: str, *, eos: bool, request_id: str = "", scope_id: str | None = None
    ) -> TouchOutcome | None:
        """See touch.lua. Without a request_id no eos answer is kept. With ``scope_id`` the
        session is looked for in that scope only; without, in the one the session-scope index
        names (one GET first). None: an eos whose request_id ended another session of the
        scope within REPLAY_TTL (nothing done)."""
        scope = scope_id or await self.session_scope(session_id)
        if not scope:
            return TouchOutcome(False, False)
        touched, released, index_ttl = await self._touch(
            keys=[
                session_key(scope, session_id),
                scope_expiry_key(scope),
                touch_key(scope, request_id),
            ],
            args=[
                P,
                session_id,
                "1" if eos else "0",
                REPLAY_TTL if request_id else 0,
                request_hash(session_id),
                scope,
            ],
        )
        if int(touched) < 0:
            return None
        if int(index_ttl):  # after the reply, like a route's
            await self.index_writes.put(IndexWrite(session_id, scope, int(index_ttl)))
        return TouchOutcome(bool(touched), bool(released))

    async def take_waiter_seat(
        self, scope_id: str, request_id: str, hold_seconds: float, limit: int
    ) -> bool:
        """A seat in the scope's wait queue (the shared seat gate), held ``hold_seconds``
        unless renewed; False: the queue is full and no seat was kept. A new seat marks the
        scope for the seat prune (``leased_scopes``)."""
        seated = await self._waiter_gate(
            keys=[scope_waiters_key(scope_id)], args=[request_id, hold_seconds, limit]
        )
        if isinstance(seated, str) and "." in seated:  # a new seat: its deadline
            await self.leased.mark(scope_id, float(seated))
        return seated not in (0, "0")

    # --- sessions and pods (scripts) -----------------------------------------------------------

    async def register_pod(self, scope_id: str, pod_id: str, sse_url: str, deploy_ver: str) -> bool:
        """Make the pod a candidate; False if it is not of the scope's current version."""
        return bool(
            await self._register_pod(
                keys=[
                    scope_pods_key(scope_id),
                    scope_pod_seq_key(scope_id),
                    pod_info_key(scope_id, pod_id),
                    pods_registered_key(scope_id),
                    pod_idle_notified_key(scope_id, pod_id),
                    scope_config_key(scope_id),
                ],
                args=[P, scope_id, pod_id, sse_url, deploy_ver],
            )
        )

    async def evict(
        self, session_id: str, *, scope_id: str | None = None, pod_died: bool = False
    ) -> Eviction | None:
        """Remove a session from its four places; where it was, or None. Its scope: ``scope_id``
        or, without one, the session-scope index's. ``pod_died`` leaves a tombstone so the
        session's next route answers ``rebound``."""
        scope = scope_id or await self.session_scope(session_id)
        if not scope:
            return None
        reply = await self._evict(
            keys=[session_key(scope, session_id), scope_expiry_key(scope)],
            args=[P, session_id, "1" if pod_died else "0", scope],
        )
        if not reply:
            return None
        return Eviction(str(reply[0]), str(reply[1]), int(reply[2]))

    async def cleanup_pod(self, scope_id: str, pod_id: str) -> PodCleanup:
        """Drop one registration of the pod (cleanup_pod.lua)."""
        return PodCleanup(
            int(
                await self._cleanup_pod(
                    keys=[
                        scope_pods_key(scope_id),
                        pod_info_key(scope_id, pod_id),
                        pod_sessions_key(scope_id, pod_id),
                        pod_idle_notified_key(scope_id, pod_id),
                        pods_registered_key(scope_id),
                    ],
                    args=[pod_id],
                )
            )
        )

    async def retire_pod(self, scope_id: str, pod_id: str) -> int:
        """A drained pod leaves its scope's candidates (retire_pod.lua); its live sessions."""
        return int(
            await self._retire_pod(
                keys=[scope_pods_key(scope_id), pod_sessions_key(scope_id, pod_id)], args=[pod_id]
            )
        )

    # --- the sweeper's passes (scripts) --------------------------------------------------------

    async def sweep_idle(self, grace: float) -> list[PodRef]:
        """Hand back every empty registered pod (see sweep_idle_notify.lua): one script call
        per registered scope, pipelined a registry page at a time (on a cluster the pipeline
        goes to each node at once). Returns the pods taken out of the candidates, to be told
        to the resource side."""
        notified: list[PodRef] = []
        async for page in registry_pages(self.redis):
            calls: list[ScriptCall] = [
                (
                    self._sweep_idle_notify,
                    [pods_registered_key(scope_id), scope_pods_key(scope_id)],
                    [P, grace, scope_id],
                )
                for scope_id in page
            ]
            for scope_id, pods in zip(page, await pipelined(self.redis, calls), strict=True):
                notified += [PodRef(scope_id, str(pod)) for pod in pods]
        return notified

    async def prune_seats(self, bucket: int, limit: int) -> SeatsPruned:
        """Drop the queue seats and reservations whose lease ran out (a replica that died left
        them) in the scopes of one bucket of ``leased_scopes`` whose earliest deadline passed
        (seat_prune.lua per scope), each settled with its next deadline. O(scopes with seats
        due), not O(scopes)."""
        seats = reserved = 0
        for scope_id, seen in await self.leased.due(bucket, limit):
            dropped = await self._seat_prune(
                keys=[scope_waiters_key(scope_id), scope_reserved_key(scope_id)], args=[]
            )
            seats, reserved = seats + int(dropped[0]), reserved + int(dropped[1])
            await self.leased.settle(scope_id, seen, float(dropped[2]) if dropped[2] else None)
        return SeatsPruned(seats, reserved)

    async def expire_scope_sessions(self, scope_id: str, limit: int) -> ScopeExpired:
        """Evict up to ``limit`` of the scope's sessions whose expiry passed (Redis clock),
        oldest first, in one script (see evict_expired.lua)."""
        reply = await self._evict_expired(
            keys=[scope_expiry_key(scope_id)], args=[P, limit, scope_id]
        )
        return ScopeExpired([str(x) for x in reply[1:]], float(reply[0]) if reply[0] else None)

    async def safety_walk(self, page: list[str]) -> int:
        """The indexes' safety net for one registry page of scopes: a mark lost with a
        crashed replica (between a script and its mark) is made again — each scope's earliest
        expiry in ``expiry_due``, its earliest seat or reservation deadline in
        ``leased_scopes``, where the index holds nothing as early. One pipeline of reads for
        the page; returns the marks made."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for scope_id in page:
                pipe.zrange(scope_expiry_key(scope_id), 0, 0, withscores=True)
                pipe.zrange(scope_waiters_key(scope_id), 0, 0, withscores=True)
                pipe.zrange(scope_reserved_key(scope_id), 0, 0, withscores=True)
                pipe.zscore(self.expiry_due.key(scope_id), scope_id)
                pipe.zscore(self.leased.key(scope_id), scope_id)
            replies = await pipe.execute()
        marks = 0
        for i, scope_id in enumerate(page):
            expiry, waiters, reserved, expiry_mark, leased_mark = replies[5 * i : 5 * i + 5]
            wanted = [
                (self.expiry_due, [s for _, s in expiry], expiry_mark),
                (self.leased, [s for _, s in (*waiters, *reserved)], leased_mark),
            ]
            for index, times, held in wanted:
                if times and (held is None or float(held) > min(times)):
                    await index.mark(scope_id, min(times))
                    marks += 1
        return marks

    # --- pods: reads (the facade's, config_sync's sunset, the admin views) ----------------------

    async def registered_pods(self) -> list[PodRef]:
        """Every registered (scope, pod): the registry walked a page at a time, the scopes'
        sets read in one pipeline per page."""
        pods: list[PodRef] = []
        async for page in registry_pages(self.redis):
            for scope_id, members in zip(page, await registered_in(self.redis, page), strict=True):
                pods += [PodRef(scope_id, pod_id) for pod_id in members]
        return pods

    async def bound_pod(self, session_id: str, scope_id: str) -> PodRef | None:
        """The pod the session is bound to in the scope, None when unbound there (a read: the
        slow path's, for a route that reports a failed pod)."""
        pod_id = await self.redis.hget(session_key(scope_id, session_id), "pod_id")
        return PodRef(scope_id, str(pod_id)) if pod_id else None

    async def pod_sessions(self, scope_id: str, pod_id: str) -> list[str]:
        return cast(list[str], list(await self.redis.smembers(pod_sessions_key(scope_id, pod_id))))

    async def pod_usage(self, pods: list[tuple[str, str]]) -> list[tuple[bool, int]]:
        """For each (scope, pod): (is a placement candidate, live sessions on it). One
        ``pod_usage`` script per scope and 100 pods, pipelined: reconcile asks about every
        pod, and a command per pod (pipelined) costs the loop ~90 µs each."""
        by_scope: dict[str, list[str]] = defaultdict(list)
        for scope_id, pod_id in pods:
            by_scope[scope_id].append(pod_id)
        calls = [
            (scope_id, ids[i : i + 100])
            for scope_id, ids in by_scope.items()
            for i in range(0, len(ids), 100)
        ]
        found: dict[tuple[str, str], tuple[bool, int]] = {}
        for start in range(0, len(calls), 100):
            chunk = calls[start : start + 100]
            replies = await pipelined(
                self.redis,
                [(self._pod_usage, [scope_pods_key(sid)], [P, sid, *ids]) for sid, ids in chunk],
            )
            for (scope_id, ids), flat in zip(chunk, replies, strict=True):
                for j, pod_id in enumerate(ids):
                    found[(scope_id, pod_id)] = (flat[2 * j] == 1, int(flat[2 * j + 1]))
        return [found[pair] for pair in pods]

    async def candidate_pods(self, scope_id: str) -> list[str]:
        return cast(list[str], await self.redis.zrange(scope_pods_key(scope_id), 0, -1))

    async def remove_candidates(self, scope_id: str, pod_ids: list[str]) -> int:
        """Sunset: the pods leave first-fit at once; their sessions stay where they are."""
        if not pod_ids:
            return 0
        return int(await self.redis.zrem(scope_pods_key(scope_id), *pod_ids))


def _route_call(
    request_id: str, session_id: str, scope_id: str, token: str, slow: bool
) -> tuple[list[str], list[Any]]:
    """route_place.lua's KEYS and ARGV (its header): every key of the scope."""
    keys = [
        session_key(scope_id, session_id),
        scope_expiry_key(scope_id),
        scope_sessions_key(scope_id),
        scope_pods_key(scope_id),
        scope_config_key(scope_id),
        pods_registered_key(scope_id),
        route_key(scope_id, request_id),
        previous_pod_key(scope_id, session_id),
        scope_reserved_key(scope_id),
        scope_waiters_key(scope_id),
        scope_arrivals_key(scope_id),
    ]
    args: list[Any] = [
        P,
        session_id,
        scope_id,
        token,
        REPLAY_TTL,
        ROUTE_LEASE,
        request_id,
        "1" if slow else "0",
        request_hash(scope_id, session_id),
        ARRIVAL_FAST_WINDOW,
        ARRIVAL_SLOW_WINDOW,
        ARRIVALS_TTL,
    ]
    return keys, args
