"""Bring one pod and register it: a new deploy, or the adoption of a pod that a leader whose
lease lapsed had created. Shared by a route's deploy (the orchestrator's leader) and the warm
pool's (autoscale). Hazard: the claim (placeholder, lease) is given back on every path, and a
pod that is Ready in Kubernetes but not registered is deleted — except one whose lease another
leader took over: that pod is the other leader's, never deleted here. An inherited pod is ours
only as the incarnation its leader recorded (its uid), and is registered only once signed for
it (identity.py): a dead leader may have died between its create and that signature. A pod
is registered and recorded with the cluster it runs in, and an inherited one is looked for,
signed, awaited and deleted in the cluster its record names (the template's may have changed
since: ``kubeconfig`` moves no running pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from agent_runtime import admission, logs, spec_fields
from agent_runtime.metrics import Metrics
from agent_runtime.notify import Notifier
from agent_runtime.resource_manager.clusters import template_cluster
from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.identity import Ownership, PodIdentity
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.lease import DeployLease
from agent_runtime.resource_manager.models import (
    AcquiredPod,
    DeployBounds,
    DeployFailed,
    LeaseLost,
    PodDeployInfo,
    PodGone,
)
from agent_runtime.resource_manager.pod_events import (
    NoPodEvents,
    PodEventReason,
    PodEventSink,
    PodRef,
)
from agent_runtime.resource_manager.state import ResourceState, registered_channel
from agent_runtime.resource_manager.state_values import OrphanPod
from agent_runtime.tracing import SCOPE_ID, Tracing

log = logging.getLogger(__name__)
# the deploy span's attributes
DEPLOY_KIND = "agent_runtime.deploy.kind"  # cold (a route's) or warm (the pool's)
DEPLOY_ADOPTS = "agent_runtime.deploy.adopts"  # a lapsed leader's pod taken over
POD_ID = "agent_runtime.pod_id"


@dataclass(slots=True)
class _CreatedPod:
    """The pod a deploy's create made (set by ``on_created``): what its failure's event
    names, since the client deletes that pod before the failure reaches the deployer."""

    pod: PodRef | None = None


@dataclass
class Requester:
    """Whether the caller is still there when its deploy finishes."""

    gone: bool = False


class Deployer:
    def __init__(
        self,
        *,
        state: ResourceState,
        deploys: DeployState,
        k8s: K8sPodClient,
        notifier: Notifier,
        default_namespace: str,
        bounds: DeployBounds | None,
        metrics: Metrics,
        lease: float,
        identity: PodIdentity,
        tracing: Tracing | None = None,
        events: PodEventSink | None = None,
    ) -> None:
        self._state = state
        self._tracing = tracing or Tracing()
        self._events = events or NoPodEvents()
        self._deploy_state = deploys
        self._k8s = k8s
        self._notifier = notifier
        self._default_namespace = default_namespace
        self._bounds = bounds
        self._deploys = metrics.deploys
        self._seconds = metrics.deploy_seconds
        self._takeovers = metrics.takeovers
        self._lease = lease
        self._identity = identity

    async def deploy_and_register(
        self,
        scope_id: str,
        pod_spec: dict[str, Any],
        placeholder: str | DeployLease,
        *,
        warm: bool,
        requester: Requester | None = None,
        orphan: OrphanPod | None = None,
    ) -> AcquiredPod:
        """Deploy one pod (or adopt ``orphan``: the pod a leader whose lease lapsed created)
        and register it; the claim (a placeholder member, or a cold deploy's lease) is renewed
        meanwhile and given back on every path. ``LeaseLost``: another leader took the claim
        over, and the pod with it: nothing is registered and nothing deleted."""
        lease = (
            placeholder
            if isinstance(placeholder, DeployLease)
            else DeployLease(self._deploy_state, scope_id, placeholder, seconds=self._lease)
        )
        version = spec_fields.deploy_ver(pod_spec)
        logs.add_secret_values(spec_fields.clear_env_values(pod_spec))  # an error may echo them
        kind = "warm" if warm else "cold"
        started = time.perf_counter()
        created = _CreatedPod()
        try:
            refusal = self._bounds and self._bounds.refusal(pod_spec, self._default_namespace)
            if refusal:
                log.warning(
                    "scope %s: no deploy: %s (namespace %.80r, cluster %.80r)",
                    scope_id, refusal, pod_spec.get("namespace"), pod_spec.get("kubeconfig"),
                )  # fmt: skip
                raise DeployFailed(refusal)
            # create to Ready (and the signature): the Kubernetes calls' spans under it
            attributes = {SCOPE_ID: scope_id, DEPLOY_KIND: kind, DEPLOY_ADOPTS: orphan is not None}
            with self._tracing.span("deploy", attributes=attributes) as span:
                async with lease.kept():
                    with admission.parked():  # a cold route waits on Kubernetes, not on Redis
                        info = await self._bring_pod(
                            scope_id, version, pod_spec, lease, orphan, created
                        )
                span.set_attribute(POD_ID, info.pod_id)
        except LeaseLost:
            self._deploys.labels(kind, "lost").inc()
            raise
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            self._deploys.labels(kind, "cancelled" if cancelled else "failed").inc()
            if created.pod is not None and not cancelled:  # the client deleted the pod it made
                self._events.record(
                    created.pod, PodEventReason.DEPLOY_FAILED,
                    logs.redact(f"deploy for scope {scope_id} failed, pod deleted: {exc}"),
                )  # fmt: skip
            with contextlib.suppress(Exception):
                await lease.give_back()
            if isinstance(exc, DeployFailed | asyncio.CancelledError):
                raise
            raise DeployFailed(f"scope {scope_id}: deploy failed: {exc}") from exc
        took = time.perf_counter() - started
        self._seconds.labels(kind).observe(took)
        if requester is not None and requester.gone and not warm:
            # its caller left: the pod goes warm, unless followers wait in the deploy's room
            # (it is theirs then: warm, each would have to find it again, and those that did
            # not would lead deploys of their own)
            warm = not await self._followers_waiting(lease)
        try:
            await lease.confirm()  # a lease lost while Redis was away
        except LeaseLost as exc:
            self._deploys.labels(kind, "lost").inc()
            if not exc.taken:
                # nobody took it, but the scope has no room for our slot again: the pod is
                # nobody's — neither registered (beyond max_pods) nor deleted: its record,
                # ours, stays (the caller gives back only the lock), so the next claim with a
                # slot takes it over Ready, or reconcile adopts or deletes it
                log.warning("scope %s: pod %s left to a taker: %s", scope_id, info.pod_id, exc)
            raise
        except Exception as exc:
            # Redis away for a whole lease: whether another leader took the pod over cannot be
            # told, so it is neither registered nor deleted — its record (ours or the new
            # leader's) hands it to the next leader, or reconcile adopts or deletes it
            self._deploys.labels(kind, "unconfirmed").inc()
            with contextlib.suppress(Exception):
                await lease.give_back()
            raise DeployFailed(f"scope {scope_id}: pod {info.pod_id} unconfirmed: {exc}") from exc
        try:
            await self._state.register(
                scope_id=scope_id,
                pod_id=info.pod_id,
                placeholder=lease.member,
                pod_sse_url=info.pod_sse_url,
                pod_ip=info.pod_ip,
                namespace=info.namespace,
                deploy_ver=version,
                warm=warm,
                cluster=info.cluster,
            )
        except BaseException as exc:
            # Ready in Kubernetes but not in Redis: delete it rather than leak it
            self._deploys.labels(kind, "unregistered").inc()
            await self._discard_pod(info, lease)
            self._events.record(
                PodRef(info.pod_id, info.namespace, info.uid, info.cluster),
                PodEventReason.DEPLOY_FAILED,
                f"Ready, but its registration for scope {scope_id} failed "
                f"({type(exc).__name__}): deleted",
            )  # fmt: skip
            raise
        self._deploys.labels(kind, "ok").inc()
        if orphan is None:  # a deploy of ours, create to Ready: what a predictive pool plans by
            with contextlib.suppress(Exception):  # a measurement: never fails the deploy
                await self._state.record_deploy_time(scope_id, took)
        with contextlib.suppress(Exception):  # followers also poll; the signal only speeds up
            await self._notifier.publish(registered_channel(scope_id), info.pod_id)
        log.info(
            "scope %s: pod %s registered (%s)", scope_id, info.pod_id, "warm" if warm else "in use"
        )
        self._record_registered(scope_id, info, version, warm=warm, orphan=orphan, took=took)
        return AcquiredPod(info.pod_id, info.pod_sse_url, version)

    def _record_registered(
        self,
        scope_id: str,
        info: PodDeployInfo,
        version: str,
        *,
        warm: bool,
        orphan: OrphanPod | None,
        took: float,
    ) -> None:
        pod = PodRef(info.pod_id, info.namespace, info.uid, info.cluster)
        use = "warm pool" if warm else "in use"
        if orphan is not None and orphan.pod_id == info.pod_id:
            self._events.record(
                pod, PodEventReason.ADOPTED,
                f"adopted for scope {scope_id} ({use}, version {version}): its deploy leader's "
                "lease lapsed before it registered the pod",
            )  # fmt: skip
            return
        self._events.record(
            pod, PodEventReason.DEPLOYED,
            f"deployed for scope {scope_id} ({use}, version {version}), Ready in {took:.1f}s",
        )  # fmt: skip

    async def _followers_waiting(self, lease: DeployLease) -> bool:
        try:
            return lease.cold and await self._deploy_state.followers_waiting(
                lease.scope_id, lease.deploy_id
            )
        except Exception:  # Redis away: warm, as a deploy nobody waits for
            return False

    async def _bring_pod(
        self,
        scope_id: str,
        version: str,
        pod_spec: dict[str, Any],
        lease: DeployLease,
        orphan: OrphanPod | None,
        created: _CreatedPod,
    ) -> PodDeployInfo:
        """The inherited pod once Ready, else a new one (recorded under the lease once
        created, for whoever takes over should this replica die; noted in ``created`` for
        the event of its failure)."""
        if orphan is not None:
            adopted = await self._adopt_orphan(scope_id, version, pod_spec, orphan)
            if adopted is not None:
                return adopted
        # recorded with the cluster the deploy goes to: a taker looks for the pod there
        cluster = template_cluster(pod_spec)

        async def on_created(pod_id: str, namespace: str, uid: str) -> None:
            created.pod = PodRef(pod_id, namespace, uid, cluster)
            if lease.cold:
                await lease.record_pod(pod_id, namespace, uid, cluster=cluster)

        return await self._k8s.deploy(
            scope_id=scope_id,
            deploy_ver=version,
            pod_spec=pod_spec,
            identity=self._identity,
            on_created=on_created,
        )

    async def _adopt_orphan(
        self, scope_id: str, version: str, pod_spec: dict[str, Any], orphan: OrphanPod
    ) -> PodDeployInfo | None:
        """Wait for the pod a dead leader created until its own deadline. It is ours as the
        incarnation our own replica recorded under the lease we now hold (its uid), carrying
        our identity MAC; signed for that incarnation first if the leader died before it did
        (registered unsigned, a later Redis data loss would make reconcile delete it in use).
        None when it is gone, another incarnation or not ours (left alone), or of an old
        version (deleted): a new one is deployed. Dead, not Ready in time or its signature
        refused: deleted, DeployFailed."""
        cluster = orphan.cluster
        where = f"pod {orphan.namespace}/{orphan.pod_id}"
        if cluster is not None:
            where = f"pod {cluster}/{orphan.namespace}/{orphan.pod_id}"
        status = await self._k8s.get_pod(orphan.pod_id, orphan.namespace, cluster=cluster)
        if status is None or status.phase == "Terminating":
            log.info("scope %s: inherited %s is gone; deploying anew", scope_id, where)
            self._takeovers.labels("deployed").inc()
            return None
        verdict = self._identity.verify(status)
        if status.uid != orphan.uid or verdict.ownership is Ownership.FOREIGN:
            log.warning(
                "scope %s: %s is not the pod its leader created (%s); left alone, deploying anew",
                scope_id, where, verdict.reason or "another incarnation",
            )  # fmt: skip
            self._takeovers.labels("deployed").inc()
            return None
        if status.deploy_ver != version:
            with contextlib.suppress(Exception):
                await self._k8s.delete(orphan.pod_id, orphan.namespace, cluster=cluster)
            log.info("scope %s: inherited %s is of an old version; deploying anew", scope_id, where)
            self._takeovers.labels("deployed").inc()
            return None
        ready_timeout = float(pod_spec.get("ready_timeout") or 300)
        left = orphan.created + ready_timeout - await self._state.now()
        try:
            if verdict.ownership is Ownership.UNFINISHED:
                await self._k8s.sign(
                    orphan.pod_id, orphan.namespace, pod_spec,
                    uid=status.uid, annotations=self._identity.completion(status), within=left,
                    cluster=cluster,
                )  # fmt: skip
                log.info("scope %s: inherited %s signed for its incarnation", scope_id, where)
            info = await self._k8s.await_ready(
                orphan.pod_id, orphan.namespace, pod_spec, uid=status.uid, within=left,
                cluster=cluster,
            )  # fmt: skip
        except PodGone:
            self._takeovers.labels("deployed").inc()
            return None
        except DeployFailed:
            now = await self._k8s.get_pod(orphan.pod_id, orphan.namespace, cluster=cluster)
            if now is None or now.phase == "Terminating" or now.uid != status.uid:
                # deleted (or replaced) by someone else meanwhile: no failure of its image
                self._takeovers.labels("deployed").inc()
                return None
            self._takeovers.labels("failed").inc()
            with contextlib.suppress(Exception):
                await self._k8s.delete(orphan.pod_id, orphan.namespace, cluster=cluster)
            raise
        self._takeovers.labels("adopted").inc()
        log.info("scope %s: %s of a leader whose lease lapsed adopted", scope_id, where)
        return info

    async def _discard_pod(self, info: PodDeployInfo, lease: DeployLease) -> None:
        with contextlib.suppress(Exception):
            await self._k8s.delete(info.pod_id, info.namespace, cluster=info.cluster)
        with contextlib.suppress(Exception):
            await lease.give_back()
