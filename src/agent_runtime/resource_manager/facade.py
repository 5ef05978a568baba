"""``ResourceManagerFacade``: the only way the session manager reaches the resource manager.

Thin on purpose: the work is in ``orchestrator``. Every method gives a small typed value
(``AcquiredPod``, ``IdleTransition``, ``PoolConfigUpdate``, ``CleanupPreview``, a bool or a
count), never a dict. Those values and the resource manager's own failures are re-exported
here, so the session side imports nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent_runtime.resource_manager.cleanup import PREVIEW_MAX as CLEANUP_PREVIEW_MAX
from agent_runtime.resource_manager.drains import MAX_DRAIN_SECONDS, Drains, DrainStatus
from agent_runtime.resource_manager.followers import OnReady
from agent_runtime.resource_manager.models import (
    AcquiredPod,
    CleanupCandidate,
    CleanupPreview,
    DeployFailed,
    DeployInProgress,
    DeployTimedOut,
    IdleTransition,
    K8sApiError,
    MaxPodsReached,
    PodBudgetReached,
    PodVerdict,
    PoolConfigUpdate,
)
from agent_runtime.resource_manager.orchestrator import ResourceOrchestrator
from agent_runtime.resource_manager.pod_reports import PodReports

__all__ = [
    "CLEANUP_PREVIEW_MAX",
    "MAX_DRAIN_SECONDS",
    "AcquiredPod",
    "CleanupCandidate",
    "CleanupPreview",
    "DeployFailed",
    "DeployInProgress",
    "DeployTimedOut",
    "DrainStatus",
    "IdleTransition",
    "K8sApiError",
    "MaxPodsReached",
    "OnReady",
    "PodBudgetReached",
    "PodVerdict",
    "PoolConfigUpdate",
    "ResourceManagerFacade",
]


class ResourceManagerFacade:
    def __init__(
        self,
        *,
        orchestrator: ResourceOrchestrator,
        drains: Drains | None = None,
        reports: PodReports | None = None,
    ) -> None:
        """``drains``: the operator's drain calls (None: this facade serves routes only);
        ``reports``: the checks of reported pods (the wiring's; None in tests that build the
        resource manager by hand and report nothing: every pod is then ``UNKNOWN``)."""
        self._orchestrator = orchestrator
        self._drains = drains
        self._reports = reports

    def _drain_control(self) -> Drains:
        if self._drains is None:
            raise RuntimeError("this resource manager facade was built without drains")
        return self._drains

    async def acquire(
        self,
        scope_id: str,
        pod_spec: dict[str, Any],
        pool_config: Mapping[str, int | str],
        request_id: str,
        *,
        on_ready: OnReady | None = None,
        rule_id: str = "",
        rule_pod_budget: int = 0,
        asked_at: float | None = None,
        demand_id: str = "",
    ) -> AcquiredPod:
        """A warm pod, or a place in a cold deploy: one in flight with room for us (a
        follower), or one we lead (a deploy per pod the demand needs, in parallel).

        ``demand_id``: what the pod is for (the route's request id; default the request_id):
        the id of a deploy this call leads, so a duplicate of the demand joins that deploy
        instead of making another.

        ``on_ready(pod)``: called by a deploy leader with its new pod before it lets go of
        its deploy's lock, so the caller can publish the pod before another acquire
        could decide to deploy again (a failure there is logged, the pod is still returned).

        ``rule_id``: the routing rule the scope resolved through (its pods count against that
        rule's budget, ``rule_pod_budget``, 0 = unbounded; "" = no rule budget).

        Raises ``MaxPodsReached`` (the cap is held by pods that exist), its subclass
        ``DeployInProgress`` (the scope runs its deploy concurrency, or the cap is held by
        deploys in flight whose follower rooms are full: a pod registers soon),
        ``PodBudgetReached`` (a new pod would exceed the installation's or the rule's pod
        budget, and none is on its way), ``DeployFailed``, or
        ``DeployTimedOut``: the caller waits at most ``ready_timeout`` + 10 s from ``asked_at``
        (event-loop time it first asked; default now), once, however many calls it makes —
        a deploy of the scope may still be on its way and serve later routes.
        """
        return await self._orchestrator.acquire(
            scope_id,
            pod_spec,
            pool_config,
            request_id,
            on_ready=on_ready,
            rule_id=rule_id,
            rule_pod_budget=rule_pod_budget,
            asked_at=asked_at,
            demand_id=demand_id,
        )

    async def set_rule_pod_budget(self, rule_id: str, limit: int) -> None:
        """A routing rule's pod budget (0 = unbounded), from config_sync: autoscale of scopes
        that do not route meanwhile sees it at once (an acquire also refreshes it)."""
        await self._orchestrator.set_rule_pod_budget(rule_id, limit)

    async def idle_consider(self, pod_id: str, scope_id: str) -> IdleTransition:
        """The session side saw the pod empty: into the warm pool (idempotent)."""
        return await self._orchestrator.idle_consider(pod_id, scope_id)

    async def update_pool_config(
        self,
        scope_id: str,
        pool_config: Mapping[str, int | str],
        pod_spec: dict[str, Any] | None = None,
        *,
        generation: int | None = None,
    ) -> PoolConfigUpdate:
        """Set the scope's pool parameters; with a pod spec also its ``deploy_ver`` (computed
        here with ``spec_fields.deploy_ver``, so the two sides never disagree). With the
        config_sync's ``generation``: ``updated`` False when a later config_sync already
        wrote this scope's config (overlapping propagations converge to the later one)."""
        return await self._orchestrator.update_pool_config(
            scope_id, pool_config, pod_spec, generation=generation
        )

    async def expire_scope(self, scope_id: str) -> bool:
        """The scope's pool state leaves Redis if nothing of it is left (no pod, warm or in
        use, no deploy in flight, no follower): True when it is gone. Asked by the session
        side's scope expiry before it drops its own side of the scope."""
        return await self._orchestrator.expire_scope(scope_id)

    async def check_reported_pod(self, pod_id: str) -> PodVerdict:
        """A gateway saw the pod's stream fail: probe it at once (bounded: one probe per pod
        per second across every replica, its verdict shared) and, if it is dead, clean it —
        its sessions are evicted with a tombstone, so the caller's next ``route_place``
        answers ``rebound``. A pod that answers ``/health`` is never touched. The session
        side asks only for a pod its session is bound to."""
        if self._reports is None:
            return PodVerdict.UNKNOWN
        return await self._reports.check(pod_id)

    async def cleanup(self, namespace: str | None = None, label_selector: str | None = None) -> int:
        """Delete AgentServer pods that carry our scope label (never another tool's); raises
        ``K8sApiError`` when Kubernetes refuses (e.g. 403), ``ValueError`` for a selector
        we do not accept."""
        return await self._orchestrator.cleanup.delete(namespace, label_selector)

    async def cleanup_preview(
        self, namespace: str | None = None, label_selector: str | None = None
    ) -> CleanupPreview:
        """``cleanup``'s dry run: the pods the same call would delete now (selected by the
        same rules), deleting nothing: their count and the first ``CLEANUP_PREVIEW_MAX`` by
        name. The same errors as ``cleanup``'s."""
        return await self._orchestrator.cleanup.preview(namespace, label_selector)

    async def drain_pod(self, pod_id: str, seconds: float | None = None) -> DrainStatus | None:
        """Drain a pod of ours: out of the placement candidates at once, its sessions stay
        until they end or for ``seconds`` (None: the default drain timeout; bounded to
        ``MAX_DRAIN_SECONDS``), then are rebound and the pod deleted (at once when empty).
        A warm pod the scope's floor needs drains once a replacement is warm (``pending``).
        Idempotent (a drain under way is kept; a deadline only comes forward). None: the pod
        is not registered here."""
        return await self._drain_control().drain_pod(pod_id, seconds)

    async def drain_node(self, node: str, seconds: float | None = None) -> list[DrainStatus]:
        """``drain_pod`` for every pod of ours that Kubernetes places on ``node``, in every
        cluster and namespace that holds pods of ours; ``K8sApiError`` when a pod list
        failed (no pod is drained then)."""
        return await self._drain_control().drain_node(node, seconds)
