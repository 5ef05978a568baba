"""Cleanup: an operator's bulk delete of AgentServer pods in Kubernetes, and its dry run.

Both select with one function (``_targets``), so the dry run lists exactly what the same call
would delete: the namespace (default: the process's), the operator's selector in its
canonical form, and our own labels always ANDed in — the component label and the existence of
the scope label — so another tool's AgentServer is never ours to delete. Only the process's
own cluster: pods of a named cluster are never listed or deleted here. Redis is not touched:
watch and reconcile notice the deleted pods.

Hazard: a dry run is a snapshot. Pods created between it and the real call are deleted too
when they match, and pods gone meanwhile are not counted.
"""

from __future__ import annotations

import asyncio
import heapq

from agent_runtime import label_selector as selectors
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import (
    OWN_PODS_SELECTOR,
    CleanupCandidate,
    CleanupPreview,
    PodStatus,
)

CLEANUP_CONCURRENCY = 10  # DELETE calls in flight at once
PREVIEW_MAX = 500  # pods a dry run names; ``matched`` counts them all


class BulkCleanup:
    def __init__(
        self, *, k8s: K8sPodClient, default_namespace: str, namespaces: frozenset[str] | None
    ) -> None:
        """``namespaces``: the operator's allow-list (None: any, for tests that build the
        orchestrator by hand); none of our pods can be elsewhere, so a call there selects none
        and asks Kubernetes nothing."""
        self._k8s = k8s
        self._default_namespace = default_namespace
        self._namespaces = namespaces

    async def delete(self, namespace: str | None, label_selector: str | None) -> int:
        """Delete the selected pods; how many were deleted (one already gone is not counted).
        ``ValueError``: a selector we do not accept; ``K8sApiError``: Kubernetes refused the
        LIST or a DELETE (e.g. 403)."""
        ns, pods = await self._targets(namespace, label_selector)
        gate = asyncio.Semaphore(CLEANUP_CONCURRENCY)

        async def delete(pod_id: str) -> bool:
            async with gate:
                return await self._k8s.delete(pod_id, ns)

        deleted = await asyncio.gather(*(delete(p.pod_id) for p in pods))
        return sum(1 for d in deleted if d)

    async def preview(self, namespace: str | None, label_selector: str | None) -> CleanupPreview:
        """What ``delete`` with the same arguments would delete now, deleting nothing: the
        count, and the first ``PREVIEW_MAX`` pods by name. The same errors as ``delete``'s LIST."""
        _, pods = await self._targets(namespace, label_selector)
        first = heapq.nsmallest(PREVIEW_MAX, pods, key=lambda p: p.pod_id)
        return CleanupPreview(len(pods), tuple(_candidate(p) for p in first))

    async def _targets(
        self, namespace: str | None, label_selector: str | None
    ) -> tuple[str, list[PodStatus]]:
        ns = namespace or self._default_namespace
        if self._namespaces is not None and ns not in self._namespaces:
            return ns, []  # before the selector is read: no call there fails
        # ValueError for a selector we do not accept; what Kubernetes gets is its canonical
        # form, so the API server never refuses (502) what we validated (400)
        terms = selectors.parse(label_selector or "")
        selector = ",".join([OWN_PODS_SELECTOR, *(term.render() for term in terms)])
        return ns, await self._k8s.list_pods(ns, selector)


def _candidate(pod: PodStatus) -> CleanupCandidate:
    return CleanupCandidate(
        pod_id=pod.pod_id,
        namespace=pod.namespace,
        scope_id=pod.scope_id or "",
        deploy_ver=pod.deploy_ver or "",
        phase=pod.phase,
        ready=pod.ready,
        node=pod.node,
        created=pod.created,
    )
