"""The session side's job (``sm_sweep``, 1 s): expiry pass, empty-pod pass, seat prune and
the indexes' safety walk.

Expiry: sessions whose expiry passed (Redis clock) are evicted in slices of one script each
(read and evicted atomically: a session extended meanwhile stays) — the only way an abandoned
session leaves. Each scope keeps its own expiry set (one slot on a Redis Cluster); the pass
walks ``expiry_due`` (scope_buckets.DueIndex) bucket by bucket: each scope due is evicted and
settled with its next expiry. Empty pods: ``sweep_idle_notify`` takes an empty pod out of the
candidates and, once per 60 s, the resource manager is told (``idle_consider``) so the pod
joins the warm pool. That notice is fire-and-forget: a failure is logged and the 60 s notice
expiry sends it again. Seat prune: queue seats and reservations whose lease ran out (their
replica died) leave the scopes that took them (``seat_prune``), so nothing of a dead replica
stays in Redis where no route of its scope comes again; it walks ``leased_scopes`` as the
expiry walks ``expiry_due``. Safety walk: the scripts cannot reach those two indexes, so the
caller marks them after the script; a replica that dies in between loses the mark. One
registry page per tick (SAFETY_PAGE scopes) is looked at and any missing mark made again: a
lost mark is found within (scopes / SAFETY_PAGE) ticks.
"""

from __future__ import annotations

import asyncio
import logging

from agent_runtime.jobs import BackgroundTasks
from agent_runtime.resource_manager.facade import ResourceManagerFacade
from agent_runtime.scope_buckets import BUCKETS
from agent_runtime.session_manager.scope_state import ScopeState
from agent_runtime.session_manager.state import SessionState

log = logging.getLogger(__name__)

EXPIRY_BATCH = 50  # evictions per script call (~10 µs each inside Redis: ~0.5 ms a call)
MAX_EXPIRY_BATCHES = 200  # per tick: a backlog is worked off over several ticks
DUE_PER_BUCKET = 100  # scopes due read per bucket and tick (expiry and prune alike)
SAFETY_PAGE = 100  # registry entries the safety walk looks at per tick (one pipeline)
IDLE_GRACE = 2.0  # seconds: a pod registered this recently is getting its first session
SCOPE_MARK_PAGES = 200  # registry pages (~100 scopes) marked per tick: ~20k scopes a tick
SCOPE_EXPIRE_BATCH = 500  # scopes expired per tick at most (two script calls each)
YIELD_EVERY = 50  # scope expiries between loop yields


class SessionSweeper:
    def __init__(
        self,
        *,
        state: SessionState,
        scopes: ScopeState,
        resources: ResourceManagerFacade,
        scope_idle_ttl: float = 600.0,
    ) -> None:
        self._state = state
        self._scopes = scopes
        self._resources = resources
        self._notices = BackgroundTasks()
        self._scope_idle_ttl = scope_idle_ttl
        self._mark_cursor = "0"
        self._safety_cursor = "0"

    async def sweep_once(self) -> dict[str, int]:
        return {
            "remarked": await self.safety_once(),
            "expired": await self.expire_once(),
            "idle": await self.notify_idle_once(),
            "pruned": await self.prune_once(),
        }

    async def prune_once(self) -> int:
        """Seats and reservations a dead replica left behind; how many were dropped."""
        seats = reservations = 0
        for bucket in range(BUCKETS):
            pruned = await self._state.prune_seats(bucket, DUE_PER_BUCKET)
            seats, reservations = seats + pruned.seats, reservations + pruned.reservations
        if seats or reservations:
            log.info(
                "pruned %d queue seats and %d reservations past their lease", seats, reservations
            )
        return seats + reservations

    async def expire_once(self) -> int:
        """Each bucket of ``expiry_due``: every scope due has its expired sessions evicted (a
        slice per script call, at most MAX_EXPIRY_BATCHES slices a tick in all) and is settled
        with its next expiry (a scope left with a backlog is due again at once)."""
        evicted = batches = 0
        for bucket in range(BUCKETS):
            for scope_id, seen in await self._state.expiry_due.due(bucket, DUE_PER_BUCKET):
                while True:
                    done = await self._state.expire_scope_sessions(scope_id, EXPIRY_BATCH)
                    evicted, batches = evicted + len(done.evicted), batches + 1
                    if len(done.evicted) < EXPIRY_BATCH or batches >= MAX_EXPIRY_BATCHES:
                        break
                await self._state.expiry_due.settle(scope_id, seen, done.next_due)
                if batches >= MAX_EXPIRY_BATCHES:
                    return evicted
        return evicted

    async def safety_once(self) -> int:
        """One registry page of the safety walk (resumed where the last tick stopped): marks
        lost with a crashed replica made again; how many."""
        self._safety_cursor, page = await self._scopes.registry_page(
            self._safety_cursor, SAFETY_PAGE
        )
        return await self._state.safety_walk(page) if page else 0

    async def notify_idle_once(self) -> int:
        """Every registered pod is looked at inside Redis, a page of them per script: Python
        only sees the few that were handed back."""
        notified = await self._state.sweep_idle(IDLE_GRACE)
        for pod in notified:
            self._notice(pod.scope_id, pod.pod_id)
        return len(notified)

    async def expire_scopes_once(self) -> dict[str, int]:
        """The ``scope_expiry`` job. Marks: the registry walked an HSCAN page per script call
        (empty scopes join ``scope_idle``, used ones leave it), resumed where the last tick
        stopped. Expires: each scope empty for the idle TTL, the resource side first (its
        facade: nothing of the pool left → its config and index entry go), then the session
        side (scope_expire.lua: still empty → cache, pod_seq, registry entry, index entries
        go). A resource side still in use (a warm pod, a deploy) keeps both: the session
        side's registry entry is how config_sync finds the pool config."""
        marked = 0
        for _ in range(SCOPE_MARK_PAGES):
            page = await self._scopes.mark_idle_scopes(self._mark_cursor)
            self._mark_cursor, marked = page.cursor, marked + page.marked
            if self._mark_cursor == "0":
                break
        expired = kept = 0
        due = await self._scopes.idle_scopes_due(self._scope_idle_ttl, SCOPE_EXPIRE_BATCH)
        for i, scope_id in enumerate(due):
            if i and i % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            if not await self._resources.expire_scope(scope_id):
                await self._scopes.forget_idle_mark(scope_id)  # in use there: look again later
                kept += 1
            elif await self._scopes.expire_scope(scope_id, self._scope_idle_ttl):
                expired += 1
            else:
                kept += 1
        return {"marked": marked, "expired": expired, "kept": kept}

    def _notice(self, scope_id: str, pod_id: str) -> None:
        async def send() -> None:
            try:
                await self._resources.idle_consider(pod_id, scope_id)
            except Exception as exc:
                log.warning("pod %s: idle notice failed (%s); resent in 60 s", pod_id, exc)

        self._notices.spawn(send(), name=f"idle-notice:{pod_id}")

    async def wait_for_notices(self) -> None:
        await self._notices.wait()
