"""``SessionManagerFacade``: the session side's answers to what the resource manager asks.

The resource manager declares the questions (``resource_manager.session_side.SessionSide``)
and never reads session keys; this class answers them. Keep it small: three questions, all
idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from agent_runtime.resource_manager.session_side import PodUsage, ScopeDemand
from agent_runtime.session_manager.demand_state import DemandState
from agent_runtime.session_manager.replies import PodCleanup
from agent_runtime.session_manager.state import SessionState

log = logging.getLogger(__name__)

MAX_CLEANUP_ROUNDS = 5


class SessionManagerFacade:
    """The session side as the resource manager sees it (``SessionSide``)."""

    def __init__(self, *, state: SessionState) -> None:
        self._state = state
        self._demand = DemandState(state.redis, observe=state.observe)

    async def notify_pod_dead(self, scope_id: str, pod_id: str) -> int:
        """The pod of ``scope_id`` is gone (deleted, dead, half-dead, reclaimed): evict its
        sessions (each frees its slot and wakes a waiter; the next route re-places the
        session) and drop its registration. Idempotent; returns the sessions evicted."""
        evicted = 0
        for _ in range(MAX_CLEANUP_ROUNDS):
            if await self._state.cleanup_pod(scope_id, pod_id) is not PodCleanup.SESSIONS_REMAIN:
                break
            for session_id in await self._state.pod_sessions(scope_id, pod_id):
                evicted_here = await self._state.evict(session_id, scope_id=scope_id, pod_died=True)
                if evicted_here is not None:
                    evicted += 1
        else:
            log.warning("pod %s in scope %s: sessions keep arriving", pod_id, scope_id)
        return evicted

    async def retire_pod(self, scope_id: str, pod_id: str) -> int:
        """The pod of ``scope_id`` is being drained: it leaves the scope's placement
        candidates (as a sunset pod: its sessions stay); returns the live sessions it still
        carries."""
        return await self._state.retire_pod(scope_id, pod_id)

    async def reconcile_pods(self, view: Mapping[str, str]) -> dict[str, PodUsage]:
        """For each ``pod_id → scope_id``: is it a placement candidate, how many sessions."""
        pairs = [(scope_id, pod_id) for pod_id, scope_id in view.items()]
        usage = await self._state.pod_usage(pairs)
        return {
            pod_id: PodUsage(candidate=candidate, sessions=sessions)
            for (_, pod_id), (candidate, sessions) in zip(pairs, usage, strict=True)
        }

    async def scope_demand(self, scope_ids: Sequence[str]) -> dict[str, ScopeDemand]:
        """Each scope's arrival rates (decayed to now), live sessions and waiting routes:
        what a predictive warm pool is sized by (read only, in slices)."""
        return await self._demand.scope_demand(scope_ids)
