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

``SessionState`` is the door to sessions, pods and routes (the hot path's scripts, the
sweeper's passes, the facade's questions); ``scope_state.ScopeState`` the door to the scope
records (resolve cache, registry, indexes, scope expiry, the config_sync lock) and
``views.SessionViews`` the admin's and the gauges' reads. Both use the key builders below; each
script reply is decoded once, here or there, into ``replies``' typed values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, cast

from redis.asyncio import Redis

from agent_runtime import lua
from agent_runtime.config import SM_KEY_PREFIX as P
from agent_runtime.errors import BackendUnavailable
from agent_runtime.resource_manager.session_side import ARRIVAL_FAST_WINDOW, ARRIVAL_SLOW_WINDOW
from agent_runtime.session_manager.replies import (
    PLACING,
    Eviction,
    Placement,
    PodCleanup,
    PodRef,
    RoutePlacement,
    SeatsPruned,
    TouchOutcome,
)

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


def session_key(session_id: str) -> str:
    return f"{P}session:{session_id}"


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


def touch_key(request_id: str) -> str:
    """The answer of an eos that ended its session, for the same request re-sent (REPLAY_TTL)."""
    return f"{P}touch:{request_id}"


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


PODS_REGISTERED_KEY = f"{P}pods:registered"
SESSION_EXPIRY_KEY = f"{P}session_expiry"
CONFIG_SYNC_LOCK_KEY = f"{P}lock:config_sync"
SCOPE_REGISTRY_KEY = f"{P}scope_registry"
CONFIG_GEN_KEY = f"{P}config_gen"
SCOPE_CONFIG_PATTERN = f"{_scope('*')}config"
SCOPE_IDLE_KEY = f"{P}scope_idle"
# scopes that took a queue seat or a reservation since the prune job last found them empty:
# where a dead replica's leftovers can be (seat_prune.lua), so the job never walks every scope
LEASED_SCOPES_KEY = f"{P}leased_scopes"
PRUNE_BATCH = 25  # scopes per seat_prune call: ~5 commands, 8–17 µs a scope in Redis (loaded box)


def template_index_key(template_id: str) -> str:
    """Scopes whose best rule names the template (scope_put.lua derives the same name)."""
    return f"{P}scope_index:template:{template_id}"


def group_index_key(group_id: str) -> str:
    """Scopes of the group: those a ``(group_id, *)`` rule can reach."""
    return f"{P}scope_index:group:{group_id}"


def bot_index_key(bot_id: str) -> str:
    """Scopes of the bot: those a ``(*, bot_id)`` rule can reach."""
    return f"{P}scope_index:bot:{bot_id}"


def pod_ref(member: str) -> PodRef:
    """A ``pods:registered`` member ``{sid}:{pod}`` (scope ids are hex: the first colon)."""
    scope_id, _, pod_id = member.partition(":")
    return PodRef(scope_id, pod_id)


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
        return RoutePlacement(action, pod_id=pod_id, pod_sse_url=url, previous_pod_id=previous)
    if action is Placement.SCOPE_FULL:
        return RoutePlacement(action, reserved=reply[1] == "1")
    return RoutePlacement(action)


class SessionState:
    """Typed operations on sessions, pods and routes (client with decode_responses)."""

    def __init__(
        self,
        redis: Redis,
        *,
        observe: lua.ScriptObserver | None = None,
        wait: lua.ReplicaWait | None = None,
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

    # --- route and touch (scripts) -------------------------------------------------------------

    async def route_place(
        self, *, request_id: str, session_id: str, scope_id: str, token: str, slow: bool = False
    ) -> RoutePlacement:
        """One EVALSHA: replay, refresh, or first-fit placement (see route_place.lua).
        ``slow``: the caller may hold a seat or a reservation; placing gives them back."""
        keys, args = _route_call(request_id, session_id, scope_id, token, slow)
        reply = await lua.run_acked(
            self.redis, self._route_place, keys=keys, args=args, wait=self.wait,
            use="route_place", binds=_binds,
        )  # fmt: skip
        return _placement(reply)

    async def place_many(
        self, requests: Sequence[tuple[str, str, str]], token: str
    ) -> list[RoutePlacement]:
        """``route_place`` for each (request_id, session_id, scope_id), pipelined in one round
        trip (set-ups of benches and fixtures: many sessions at once)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id, session_id, scope_id in requests:
                keys, args = _route_call(request_id, session_id, scope_id, token, False)
                await self._route_place(keys=keys, args=args, client=pipe)
            return [_placement(reply) for reply in await pipe.execute()]

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

    async def touch(
        self, session_id: str, *, eos: bool, request_id: str = "", scope_id: str | None = None
    ) -> TouchOutcome | None:
        """See touch.lua. Without a request_id no eos answer is kept. With ``scope_id`` a
        session of another scope is unknown here. None: an eos whose request_id ended another
        session within REPLAY_TTL (nothing done)."""
        touched, released = await self._touch(
            keys=[session_key(session_id), SESSION_EXPIRY_KEY, touch_key(request_id)],
            args=[
                P,
                session_id,
                "1" if eos else "0",
                REPLAY_TTL if request_id else 0,
                request_hash(session_id),
                scope_id or "",
            ],
        )
        if int(touched) < 0:
            return None
        return TouchOutcome(bool(touched), bool(released))

    async def take_waiter_seat(
        self, scope_id: str, request_id: str, hold_seconds: float, limit: int
    ) -> bool:
        """A seat in the scope's wait queue (the shared seat gate), held ``hold_seconds``
        unless renewed; False: the queue is full and no seat was kept."""
        return bool(
            await self._waiter_gate(
                keys=[scope_waiters_key(scope_id), LEASED_SCOPES_KEY],
                args=[request_id, hold_seconds, limit, scope_id],
            )
        )

    # --- sessions and pods (scripts) -----------------------------------------------------------

    async def register_pod(self, scope_id: str, pod_id: str, sse_url: str, deploy_ver: str) -> bool:
        """Make the pod a candidate; False if it is not of the scope's current version."""
        return bool(
            await self._register_pod(
                keys=[
                    scope_pods_key(scope_id),
                    scope_pod_seq_key(scope_id),
                    pod_info_key(scope_id, pod_id),
                    PODS_REGISTERED_KEY,
                    pod_idle_notified_key(scope_id, pod_id),
                    scope_config_key(scope_id),
                ],
                args=[P, scope_id, pod_id, sse_url, deploy_ver],
            )
        )

    async def evict(self, session_id: str, *, pod_died: bool = False) -> Eviction | None:
        """Remove a session from its four places; where it was, or None.
        ``pod_died`` leaves a tombstone so the session's next route answers ``rebound``."""
        reply = await self._evict(
            keys=[session_key(session_id), SESSION_EXPIRY_KEY],
            args=[P, session_id, "1" if pod_died else "0"],
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
                        PODS_REGISTERED_KEY,
                    ],
                    args=[scope_id, pod_id],
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

    async def sweep_idle(self, grace: float, page: int = 200) -> list[PodRef]:
        """Hand back every empty registered pod (see sweep_idle_notify.lua), one SSCAN page of
        ``pods:registered`` per script call: at 10k pods ~50 calls, each ~2.8 µs a pod inside
        Redis (a page of 200 holds it ~0.6 ms: a route waits behind it at most that). Returns
        the pods taken out of the candidates, to be told to the resource side."""
        notified: list[PodRef] = []
        cursor = "0"
        while True:
            reply = await self._sweep_idle_notify(
                keys=[PODS_REGISTERED_KEY], args=[P, grace, cursor, page]
            )
            cursor = str(reply[0])
            notified += [pod_ref(m) for m in reply[1:]]
            if cursor == "0":
                return notified

    async def prune_seats(self) -> SeatsPruned:
        """Drop the queue seats and reservations whose lease ran out (a replica that died left
        them) in every scope that took one, PRUNE_BATCH scopes a script call (seat_prune.lua).
        O(scopes that had seats), not O(scopes)."""
        scopes = [s async for s in self.redis.sscan_iter(LEASED_SCOPES_KEY, count=500)]
        seats = reserved = 0
        for i in range(0, len(scopes), PRUNE_BATCH):
            dropped = await self._seat_prune(
                keys=[LEASED_SCOPES_KEY], args=[P, *scopes[i : i + PRUNE_BATCH]]
            )
            seats, reserved = seats + int(dropped[0]), reserved + int(dropped[1])
        return SeatsPruned(seats, reserved)

    async def evict_expired(self, limit: int) -> list[str]:
        """Evict up to ``limit`` sessions whose expiry passed (Redis clock), oldest first, in
        one script (see evict_expired.lua); the ids evicted."""
        return cast(
            list[str], await self._evict_expired(keys=[SESSION_EXPIRY_KEY], args=[P, limit])
        )

    # --- pods: reads (the facade's, config_sync's sunset, the admin views) ----------------------

    async def registered_pods(self) -> list[PodRef]:
        """Every registered (scope, pod), by SSCAN."""
        return [pod_ref(m) async for m in self.redis.sscan_iter(PODS_REGISTERED_KEY, count=500)]

    async def bound_pod(self, session_id: str) -> PodRef | None:
        """The (scope, pod) the session is bound to, None when unbound (a read: the slow
        path's, for a route that reports a failed pod)."""
        scope_id, pod_id = await self.redis.hmget(session_key(session_id), "scope_id", "pod_id")
        if not scope_id or not pod_id:
            return None
        return PodRef(str(scope_id), str(pod_id))

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
    """route_place.lua's KEYS and ARGV (its header)."""
    keys = [
        session_key(session_id),
        SESSION_EXPIRY_KEY,
        scope_sessions_key(scope_id),
        scope_pods_key(scope_id),
        scope_config_key(scope_id),
        PODS_REGISTERED_KEY,
        route_key(scope_id, request_id),
        previous_pod_key(scope_id, session_id),
        scope_reserved_key(scope_id),
        scope_waiters_key(scope_id),
        LEASED_SCOPES_KEY,
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
