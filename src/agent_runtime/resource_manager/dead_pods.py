"""``DeadPods``: the one judgement "this pod is dead: clean it" (or "being retired: drain it"),
for every door that finds one.

The watch pass (``pool_jobs.watch_once``), the watch stream (``pod_watch.py``) and a gateway's
report (``pod_reports.py``) each learn something of a pod — Kubernetes' view of it (or that
it is missing), or failed health probes — and hand it here: ``settle`` reads Kubernetes' view
through ``pod_reading.pod_condition`` (alive / draining / dead: the one classification) and
cleans a dead pod or hands a draining one (a graceful deletion with time left, a cordoned
node) to ``Drains``; ``clean`` cleans one found dead by its probes. ``why_dead`` is the quick
pre-filter of the stream (anything it lets through is settled here). Cleaning is
idempotent, so two doors finding the same death at once (the pass and the stream, two
replicas for a moment) do no harm.

Cleaning: delete the pod (when it still exists; a failed delete is retried by reconcile),
purge its resource-manager keys, and tell the session side, which evicts its sessions with a
tombstone (their next route answers ``rebound`` with ``previous_pod_id``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection

from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.drains import Drains
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import PodStatus
from agent_runtime.resource_manager.pod_events import (
    NoPodEvents,
    PodEventReason,
    PodEventSink,
    PodRef,
)
from agent_runtime.resource_manager.pod_reading import pod_condition
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.session_side import SessionSide

log = logging.getLogger(__name__)

HEALTH_FAILS_TO_DEAD = 2  # failed /health probes in a row that make a Running pod half-dead
CLEANED_BY = ("pass", "stream", "report")  # the doors (metrics label)
_DOORS = {"pass": "the watch pass", "stream": "the watch stream", "report": "a gateway's report"}


class DeadPods:
    def __init__(
        self,
        *,
        k8s: K8sPodClient,
        jobs_state: PoolJobsState,
        sessions: SessionSide,
        drains: Drains,
        clock: Callable[[], Awaitable[float]],
        metrics: Metrics | None = None,
        events: PodEventSink | None = None,
    ) -> None:
        """``clock``: Redis seconds (the clock drain deadlines are kept in), read only for a
        pod being deleted; ``events``: where a deletion is recorded (DeletedDead,
        DeletedHalfDead)."""
        self._events = events or NoPodEvents()
        self._k8s = k8s
        self._drains = drains
        self._clock = clock
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
        self,
        pod_id: str,
        namespace: str,
        cluster: str | None,
        status: PodStatus | None,
        *,
        by: str,
        cordoned_nodes: Collection[str] = (),
        now: float | None = None,
        scope_id: str | None = None,
    ) -> bool:
        """Clean the pod if Kubernetes' view says it is dead, drain it if it is being retired
        (``cordoned_nodes``: its cluster's cordoned nodes, as far as the caller knows them);
        whether it cleaned it. A gateway's report (``by="report"``) comes after a failed
        probe: a pod being deleted is then dead whatever its grace (nothing to drain to).
        ``scope_id``: the pod's scope as the caller read it from the pod's record, if it did
        (see ``forget``)."""
        if by == "report" or (self.why_dead(status) is None and not cordoned_nodes):
            why = self.why_dead(status)
            if why is None:
                return False
            await self.clean(
                pod_id, namespace, cluster, exists=status is not None, why=why, by=by,
                scope_id=scope_id, uid=status.uid if status is not None else "",
            )  # fmt: skip
            return True
        if now is None and status is not None and status.phase == "Terminating":
            now = await self._clock()
        condition = pod_condition(
            status, now or 0.0, margin=self._drains.margin, cordoned_nodes=cordoned_nodes
        )
        if condition.state == "draining":
            await self._drains.drain_seen(pod_id, condition)
            return False
        if condition.state == "dead":
            why = "missing" if status is None else status.phase
            await self.clean(
                pod_id, namespace, cluster, exists=status is not None, why=why, by=by,
                scope_id=scope_id, uid=status.uid if status is not None else "",
            )  # fmt: skip
            return True
        return False

    async def clean(
        self,
        pod_id: str,
        namespace: str,
        cluster: str | None,
        *,
        exists: bool,
        why: str,
        by: str,
        scope_id: str | None = None,
        uid: str = "",
    ) -> None:
        """Delete (if it ``exists``: recorded on the pod, ``uid`` its incarnation when the
        caller knows it), purge and tell the session side; ``by``: which door."""
        log.info("pod %s: %s; cleaning it (%s)", pod_id, why, by)
        if exists:
            deleted = "deleted"
            try:
                await self._k8s.delete(pod_id, namespace, cluster=cluster)
            except Exception:  # reconcile retries a delete that failed
                deleted = "forgotten (its delete failed: reconcile deletes it)"
            half_dead = why == "half-dead"
            self._events.record(
                PodRef(pod_id, namespace, uid, cluster),
                PodEventReason.DELETED_HALF_DEAD if half_dead else PodEventReason.DELETED_DEAD,
                f"{deleted}: {_DOORS.get(by, by)} found it "
                + ("failing its health checks" if half_dead else f"dead ({why})")
                + "; its sessions are evicted (their next route is rebound)",
            )
        await self.forget(pod_id, scope_id)
        self._cleaned[by].inc()

    async def forget(self, pod_id: str, scope_id: str | None = None) -> None:
        """Purge the pod's RM keys and tell the session side (both idempotent). The session
        side is told the pod's scope: the one the purged record named, else ``scope_id`` (what
        the caller read of it; a door that comes after another's purge). Neither: the record
        was gone and the caller knew none; the door that purged it told the session side."""
        scope = await self._jobs_state.purge(pod_id, scope_id) or scope_id
        if scope is None:
            log.info("pod %s: no record left; the session side was told by its purger", pod_id)
            return
        try:
            await self._sessions.notify_pod_dead(scope, pod_id)
        except Exception as exc:  # a door that read the record before the purge repeats it
            log.warning("pod %s: notify_pod_dead failed: %s", pod_id, exc)
