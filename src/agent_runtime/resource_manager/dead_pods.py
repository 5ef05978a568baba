"""``DeadPods``: the one judgement "this pod is dead: clean it", for every door that finds one.

The watch pass (``pool_jobs.watch_once``), the watch stream (``pod_watch.py``) and a gateway's
report (``pod_reports.py``) each learn something of a pod — Kubernetes' view of it (or that
it is missing), or failed health probes — and hand it here: ``settle`` classifies
Kubernetes' view (``why_dead``, the only place that does) and cleans a dead pod; ``clean``
cleans one found dead by its probes. Cleaning is idempotent, so two doors finding the same
death at once (the pass and the stream, two replicas for a moment) do no harm.

Cleaning: delete the pod (when it still exists; a failed delete is retried by reconcile),
purge its resource-manager keys, and tell the session side, which evicts its sessions with a
tombstone (their next route answers ``rebound`` with ``previous_pod_id``).
"""

from __future__ import annotations

import contextlib
import logging

from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import PodStatus
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.session_side import SessionSide

log = logging.getLogger(__name__)

HEALTH_FAILS_TO_DEAD = 2  # failed /health probes in a row that make a Running pod half-dead
CLEANED_BY = ("pass", "stream", "report")  # the doors (metrics label)


class DeadPods:
    def __init__(
        self,
        *,
        k8s: K8sPodClient,
        jobs_state: PoolJobsState,
        sessions: SessionSide,
        metrics: Metrics | None = None,
    ) -> None:
        self._k8s = k8s
        self._jobs_state = jobs_state
        self._sessions = sessions
        metrics = metrics or Metrics()
        self._cleaned = {by: metrics.dead_pods_cleaned.labels(by) for by in CLEANED_BY}

    @staticmethod
    def why_dead(status: PodStatus | None) -> str | None:
        """Why Kubernetes' view of a pod of ours makes it dead ("missing", its phase: Failed,
        Succeeded, Terminating, a dead waiting reason such as CrashLoopBackOff), or None.
        ``status`` None: Kubernetes does not have the pod (a LIST without it, a DELETED
        event)."""
        if status is None:
            return "missing"
        if status.dead:
            return status.phase
        return None

    async def settle(
        self, pod_id: str, namespace: str, cluster: str | None, status: PodStatus | None, *, by: str
    ) -> bool:
        """Clean the pod if Kubernetes' view says it is dead; whether it did."""
        why = self.why_dead(status)
        if why is None:
            return False
        await self.clean(pod_id, namespace, cluster, exists=status is not None, why=why, by=by)
        return True

    async def clean(
        self, pod_id: str, namespace: str, cluster: str | None, *, exists: bool, why: str, by: str
    ) -> None:
        """Delete (if it ``exists``), purge and tell the session side; ``by``: which door."""
        log.info("pod %s: %s; cleaning it (%s)", pod_id, why, by)
        if exists:
            with contextlib.suppress(Exception):  # reconcile retries a delete that failed
                await self._k8s.delete(pod_id, namespace, cluster=cluster)
        await self.forget(pod_id)
        self._cleaned[by].inc()

    async def forget(self, pod_id: str) -> None:
        """Purge the pod's RM keys and tell the session side (both idempotent)."""
        await self._jobs_state.purge(pod_id)
        try:
            await self._sessions.notify_pod_dead(pod_id)
        except Exception as exc:  # reconcile repeats it
            log.warning("pod %s: notify_pod_dead failed: %s", pod_id, exc)
