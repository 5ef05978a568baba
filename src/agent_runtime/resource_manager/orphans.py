"""Reconcile's orphans: pods Kubernetes has with our labels and Redis does not know.

Labels prove nothing (anyone who may create pods can copy them), so ownership comes first
(``identity.py``). A FOREIGN pod is never adopted, never routed to and never deleted: it is
logged once (WARNING, bounded memory of what was logged), counted, and listed in a report
the admin view reads (``foreign_report.lua``: the last pass's, replaced as a whole).

A pod that its scope's deploy record names (a leader created it and died before registering
it: this very incarnation, its uid) is settled only under that deploy's lease, so that a
route taking the deploy over never registers it too: left while it starts, then signed for
its incarnation if the leader died before that, and adopted warm (or deleted: no room). Any
other pod of ours is adopted in use (the session side still has sessions on it), adopted warm
(``adopt.lua``: within max_pods and the budgets when the scope has a pool config, as it is
when Redis lost that too), or deleted (dead, not Ready, an old version, no room). An
UNFINISHED one (our create, never signed for its incarnation, and no record of it) is
deleted: it is never routed to. Hazard: the LIST may be a whole pass old, so every decision
is taken on a fresh GET. Every call goes to the cluster the pod was listed in, and an adopted
pod is registered with it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from agent_runtime.metrics import Metrics
from agent_runtime.resource_manager.deploy_state import DeployState, lock_token
from agent_runtime.resource_manager.identity import Ownership, PodIdentity, Verdict
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import DeployFailed, PodGone, PodStatus
from agent_runtime.resource_manager.pod_events import (
    NoPodEvents,
    PodEventReason,
    PodEventSink,
    PodRef,
)
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.session_side import SessionSide
from agent_runtime.resource_manager.state import ResourceState

log = logging.getLogger(__name__)

REPORT_LIMIT = 100  # foreign pods the report holds (the count says how many were seen)
REPORTED_MEMORY = 4096  # foreign pods this replica remembers having logged


class Orphans:
    def __init__(
        self,
        *,
        state: ResourceState,
        deploys: DeployState,
        jobs_state: PoolJobsState,
        k8s: K8sPodClient,
        sessions: SessionSide,
        identity: PodIdentity,
        metrics: Metrics,
        deploy_lease: float,
        events: PodEventSink | None = None,
    ) -> None:
        self._state = state
        self._events = events or NoPodEvents()
        self._deploy_state = deploys
        self._jobs_state = jobs_state
        self._k8s = k8s
        self._sessions = sessions
        self._identity = identity
        self._metrics = metrics
        self._lease = deploy_lease
        self._seen: dict[str, dict[str, Any]] = {}  # this pass's foreign pods
        self._logged: OrderedDict[str, None] = OrderedDict()

    # --- one reconcile pass --------------------------------------------------------------------

    def begin_pass(self) -> None:
        self._seen = {}

    def foreign(self, status: PodStatus, cluster: str | None = None) -> bool:
        """Whether the listed pod (of ``cluster``: None is the process default) is not
        provably ours (then noted for the report)."""
        verdict = self._identity.verify(status)
        if verdict.ownership is not Ownership.FOREIGN:
            return False
        self._note(status, verdict, cluster)
        return True

    async def settle(self, status: PodStatus, cluster: str | None = None) -> str:
        """An orphan's fate on a fresh look (in ``cluster``, where it was listed): ``adopted``,
        ``deleted``, ``foreign`` (its fresh view no longer verifies: left alone), ``left`` (a
        dead deploy leader's, still starting or taken over meanwhile) or ``gone`` (deleted or
        being deleted)."""
        fresh = await self._recheck(status, cluster)
        if fresh is None:
            return "gone"
        verdict = self._identity.verify(fresh)
        if verdict.ownership is Ownership.FOREIGN:
            self._note(fresh, verdict, cluster)
            return "foreign"
        recorded = await self._dead_leaders_pod(fresh, verdict, cluster)
        if recorded is not None:
            return recorded
        # a dead one is deleted, never adopted: nobody else would (watch only sees pods Redis
        # knows, and retries a failed delete of its own through here); an unfinished one is
        # ours but unproven for this incarnation: never routed to
        if (
            verdict.ownership is Ownership.OURS
            and not fresh.dead
            and (
                await self._adopt_with_sessions(fresh, verdict, cluster)
                or await self._adopt(fresh, verdict, cluster)
            )
        ):
            return "adopted"
        if verdict.ownership is Ownership.UNFINISHED:
            log.warning("pod %s/%s: %s; deleting it", fresh.namespace, fresh.pod_id, verdict.reason)
        await self._delete(fresh, cluster, _why_not_adopted(fresh, verdict))
        return "deleted"

    async def _delete(self, status: PodStatus, cluster: str | None, why: str) -> None:
        """Delete an orphan of ours that is not adopted, and say so on the pod."""
        try:
            await self._k8s.delete(status.pod_id, status.namespace, cluster=cluster)
        except Exception:  # the next pass finds it again
            return
        self._events.record(
            PodRef(status.pod_id, status.namespace, status.uid, cluster),
            PodEventReason.DELETED_ORPHAN,
            f"deleted by reconcile: a pod of ours (scope {status.scope_id}) that Redis did not "
            f"hold, not adopted: {why}",
        )

    async def end_pass(self) -> int:
        """Write the pass's report; returns how many foreign pods it saw."""
        shown = dict(sorted(self._seen.items())[:REPORT_LIMIT])
        await self._jobs_state.report_foreign(len(self._seen), shown)
        return len(self._seen)

    async def _dead_leaders_pod(
        self, status: PodStatus, verdict: Verdict, cluster: str | None
    ) -> str | None:
        """A pod whose deploy leader died before registering it (a deploy record of its scope
        names this incarnation) is adopted or deleted only under that deploy's lease, so that
        a route taking the deploy over never registers it too; one still starting is left to
        such a takeover, or to a later pass once Ready (its record lapses with its
        ready_timeout, and then it is an orphan like any other). None: not such a pod (a dead
        one is deleted as any other)."""
        if status.dead or not status.scope_id:
            return None
        records = await self._deploy_state.deploy_records(status.scope_id)
        deploy_id = next(
            (d for d, r in records.items()
             if (r.pod_id, r.uid, r.cluster) == (status.pod_id, status.uid, cluster)),
            None,
        )  # fmt: skip
        if deploy_id is None:
            return None
        if not status.ready:
            return "left"
        token = lock_token("reconcile", await self._state.now())
        took = await self._deploy_state.take_deploy_lease(
            status.scope_id, deploy_id, token, self._lease
        )
        if not took.leader:
            return "left"  # a route took the deploy over: the pod is its leader's
        settled = "none"  # "left": the record stays, for a taker or a later pass
        try:
            orphan = took.orphan
            if orphan is None or (orphan.pod_id, orphan.uid, orphan.cluster) != (
                status.pod_id, status.uid, cluster
            ):  # fmt: skip
                return "left"
            if verdict.ownership is Ownership.UNFINISHED:
                # the leader died between its create and the incarnation patch; the record,
                # ours under this lease, proves the pod: finish what it began
                try:
                    await self._k8s.sign(
                        status.pod_id, status.namespace, {},
                        uid=status.uid, annotations=self._identity.completion(status),
                        within=self._lease / 2, cluster=cluster,
                    )  # fmt: skip
                except PodGone:
                    settled = "done"
                    return "gone"
                except DeployFailed as exc:  # a later pass tries again (or its record lapses)
                    log.warning("pod %s: not signed (%s); left", status.pod_id, exc)
                    return "left"
            # nobody renews our lease: taken again (extended, or re-taken after a lapse) before
            # we act on the pod; another holder (a route took it over meanwhile) has it now
            again = await self._deploy_state.take_deploy_lease(
                status.scope_id, deploy_id, token, self._lease
            )
            if not again.leader or again.orphan != orphan:
                return "left"
            adopted = await self._adopt(status, verdict, cluster)
            settled = "done"  # the record goes: the pod is registered, or deleted now
            if adopted:
                return "adopted"
            await self._delete(status, cluster, "its scope has no room for it")
            return "deleted"
        finally:
            await self._deploy_state.end_deploy_lease(
                status.scope_id, deploy_id, token, settled, self._lease
            )

    # --- foreign pods --------------------------------------------------------------------------

    def _note(self, status: PodStatus, verdict: Verdict, cluster: str | None) -> None:
        key = f"{status.namespace}/{status.pod_id}"
        if cluster is not None:
            key = f"{cluster}/{key}"
        self._seen[key] = {
            "cluster": cluster,
            "namespace": status.namespace,
            "pod_id": status.pod_id,
            "uid": status.uid,
            "scope_id": status.scope_id,
            "deploy_ver": status.deploy_ver,
            "image": status.image,
            "phase": status.phase,
            "reason": verdict.reason,
        }
        incarnation = f"{key}@{status.uid}"
        # on every pass: the same event, counted up (and rate-limited) by the recorder
        self._events.record(
            PodRef(status.pod_id, status.namespace, status.uid, cluster),
            PodEventReason.FOREIGN_POD_IGNORED,
            f"carries our labels (scope {status.scope_id}) but is not provably ours "
            f"({verdict.reason}): never adopted, routed to or deleted",
        )
        if incarnation in self._logged:
            self._logged.move_to_end(incarnation)
            return
        self._logged[incarnation] = None
        while len(self._logged) > REPORTED_MEMORY:
            self._logged.popitem(last=False)
        self._metrics.foreign_pods.inc()
        log.warning(
            "pod %s carries our labels (scope %s) but is not provably ours (%s; image %.200r): "
            "never adopted, routed to or deleted",
            key, status.scope_id, verdict.reason, status.image,
        )  # fmt: skip

    # --- ours ----------------------------------------------------------------------------------

    async def _recheck(self, status: PodStatus, cluster: str | None) -> PodStatus | None:
        """The pod as Kubernetes sees it now (the LIST may be stale by a whole pass); None when
        it is gone or terminating. A failed GET keeps the listed view."""
        try:
            fresh = await self._k8s.get_pod(status.pod_id, status.namespace, cluster=cluster)
        except Exception:
            return status
        if fresh is None or fresh.phase == "Terminating":
            return None
        return fresh

    async def _adopt(self, status: PodStatus, verdict: Verdict, cluster: str | None) -> bool:
        """A pod of ours that Redis forgot (Redis lost its data): a warm pod of its scope if it
        is Ready (adopt.lua decides the rest: version and room when the scope has a config)."""
        if not (status.ready and status.pod_ip and status.scope_id):
            return False
        outcome = await self._jobs_state.adopt(
            scope_id=status.scope_id,
            pod_id=status.pod_id,
            pod_sse_url=verdict.sse_url(status.pod_ip),
            pod_ip=status.pod_ip,
            namespace=status.namespace,
            deploy_ver=status.deploy_ver or "",
            cluster=cluster,
        )
        if outcome.kept:
            log.info(
                "pod %s adopted into scope %s's warm pool (%s)",
                status.pod_id, status.scope_id, outcome.detail or "already registered",
            )  # fmt: skip
            self._events.record(
                PodRef(status.pod_id, status.namespace, status.uid, cluster),
                PodEventReason.ADOPTED,
                f"adopted by reconcile into scope {status.scope_id}'s warm pool: Redis did not "
                f"hold it ({outcome.detail or 'already registered'})",
            )
        return outcome.kept

    async def _adopt_with_sessions(
        self, status: PodStatus, verdict: Verdict, cluster: str | None
    ) -> bool:
        """Redis lost only our keys but the session side still has sessions on the pod: keep
        it in use whatever its version or the cap (a pod with live sessions is never deleted
        for bookkeeping reasons); sunset and reclaim take their normal course afterwards."""
        if not (status.pod_ip and status.scope_id):
            return False
        usage = await self._sessions.reconcile_pods({status.pod_id: status.scope_id})
        use = usage.get(status.pod_id)
        if use is None or use.sessions == 0:
            return False
        await self._state.register(
            scope_id=status.scope_id,
            pod_id=status.pod_id,
            placeholder=None,
            pod_sse_url=verdict.sse_url(status.pod_ip),
            pod_ip=status.pod_ip,
            namespace=status.namespace,
            deploy_ver=status.deploy_ver or "",
            warm=False,
            cluster=cluster,
        )
        log.info("pod %s re-adopted in use: %d live sessions", status.pod_id, use.sessions)
        self._events.record(
            PodRef(status.pod_id, status.namespace, status.uid, cluster),
            PodEventReason.ADOPTED,
            f"adopted by reconcile in use for scope {status.scope_id}: Redis did not hold it, "
            f"the session side has {use.sessions} live sessions on it",
        )
        return True


def _why_not_adopted(status: PodStatus, verdict: Verdict) -> str:
    if verdict.ownership is Ownership.UNFINISHED:
        return f"never signed for its incarnation ({verdict.reason})"
    if status.dead:
        return f"dead ({status.phase})"
    if not status.ready:
        return "not Ready"
    return "an old version, or no room in its scope"
