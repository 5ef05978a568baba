"""The session side's job (``sm_sweep``, 1 s): expiry pass and empty-pod pass.

Expiry: sessions whose expiry passed (Redis clock) are evicted in slices of one script each
(read and evicted atomically: a session extended meanwhile stays) — the only way an abandoned
session leaves. Empty pods: ``sweep_idle_notify`` takes an empty pod out of the
candidates and, once per 60 s, the resource manager is told (``idle_consider``) so the pod
joins the warm pool. That notice is fire-and-forget: a failure is logged and the 60 s notice
expiry sends it again.
"""

from __future__ import annotations

import logging

from agent_runtime.jobs import BackgroundTasks
from agent_runtime.resource_manager.facade import ResourceManagerFacade
from agent_runtime.session_manager.state import SessionState

log = logging.getLogger(__name__)

EXPIRY_BATCH = 50  # evictions per script call (~10 µs each inside Redis: ~0.5 ms a call)
MAX_EXPIRY_BATCHES = 200  # per tick: a backlog is worked off over several ticks
IDLE_GRACE = 2.0  # seconds: a pod registered this recently is getting its first session


class SessionSweeper:
    def __init__(self, *, state: SessionState, resources: ResourceManagerFacade) -> None:
        self._state = state
        self._resources = resources
        self._notices = BackgroundTasks()

    async def sweep_once(self) -> dict[str, int]:
        return {"expired": await self.expire_once(), "idle": await self.notify_idle_once()}

    async def expire_once(self) -> int:
        evicted = 0
        for _ in range(MAX_EXPIRY_BATCHES):
            batch = len(await self._state.evict_expired(EXPIRY_BATCH))
            evicted += batch
            if batch < EXPIRY_BATCH:
                break
        return evicted

    async def notify_idle_once(self) -> int:
        """Every registered pod is looked at inside Redis, a page of them per script: Python
        only sees the few that were handed back."""
        notified = await self._state.sweep_idle(IDLE_GRACE)
        for scope_id, pod_id in notified:
            self._notice(scope_id, pod_id)
        return len(notified)

    def _notice(self, scope_id: str, pod_id: str) -> None:
        async def send() -> None:
            try:
                await self._resources.idle_consider(pod_id, scope_id)
            except Exception as exc:
                log.warning("pod %s: idle notice failed (%s); resent in 60 s", pod_id, exc)

        self._notices.spawn(send(), name=f"idle-notice:{pod_id}")

    async def wait_for_notices(self) -> None:
        await self._notices.wait()
