"""A route that reports the pod whose stream just failed (``rawdata.failed_pod_id``).

The gateway saw its SSE stream to the session's pod break. Before the route is placed, the
report is checked: only when the session is bound to that very pod (in that scope) is the
resource manager asked to probe it (``check_reported_pod``: bounded, shared, never harming a
pod that answers ``/health``); a dead pod is cleaned there, its sessions evicted with a
tombstone, so the ``route_place`` that follows answers ``rebound`` with ``previous_pod_id``
in this same call. A report of any other pod is ignored (a stale or a forged one costs one
read). Without the field a route never comes here: the hot path stays one EVALSHA.
"""

from __future__ import annotations

import logging

from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.facade import PodVerdict, ResourceManagerFacade
from agent_runtime.session_manager.state import SessionState

log = logging.getLogger(__name__)

IGNORED = "ignored"


class PodReport:
    def __init__(
        self,
        *,
        state: SessionState,
        resources: ResourceManagerFacade,
        metrics: Metrics | None = None,
    ) -> None:
        self._state = state
        self._resources = resources
        self._ignored = (metrics or Metrics()).pod_reports.labels(IGNORED)

    async def check(self, session_id: str, scope_id: str, pod_id: str) -> PodVerdict | None:
        """The reported pod's verdict, or None when the report was ignored (or could not be
        checked: a report is advice, and the route goes on without it)."""
        bound = await self._state.bound_pod(session_id, scope_id)
        if bound is None or bound.pod_id != pod_id:
            self._ignored.inc()
            return None
        try:
            verdict = await self._resources.check_reported_pod(pod_id)
        except Exception as exc:  # advisory: the route goes on as without it
            log.warning("session %s reported pod %s; not checked: %s", session_id, pod_id, exc)
            return None
        log.info("session %s reported pod %s: %s", session_id, pod_id, verdict.value)
        return verdict
