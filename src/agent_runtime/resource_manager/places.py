"""Where the pool jobs look for pods: places, (cluster, namespace) pairs — cluster None is the
process default. Redis' pods by the place they were recorded in, the places the pool configs'
templates deploy to, and the places' LISTs, all at once (a slow cluster delays no other).

A cluster that cannot be asked (down, or a name since removed from the settings) is left out
of a pass like any failed LIST: its pods are neither forgotten nor deleted. A LIST that failed
is never taken to mean "no pods".
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from agent_runtime.resource_manager.clusters import template_cluster
from agent_runtime.resource_manager.k8s import K8sPodClient
from agent_runtime.resource_manager.models import OWN_PODS_SELECTOR, K8sApiError, PodStatus
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState

log = logging.getLogger(__name__)

Place = tuple[str | None, str]


class Places:
    def __init__(
        self,
        *,
        jobs_state: PoolJobsState,
        k8s: K8sPodClient,
        default_namespace: str,
        namespaces: frozenset[str] | None,
    ) -> None:
        """``namespaces``: the allow-list reconcile may look for orphans in besides where our
        pods are (None: wherever pool configs say)."""
        self._jobs_state = jobs_state
        self._k8s = k8s
        self._default_namespace = default_namespace
        self._namespaces = namespaces

    async def pods_by_place(self) -> dict[Place, dict[str, str]]:
        """Redis' pods (pod id → scope id) by the place they were recorded in (no cluster
        field: the default)."""
        grouped: dict[Place, dict[str, str]] = defaultdict(dict)
        pods = await self._jobs_state.all_pods()
        for pod_id, place in (await self._jobs_state.pod_places(pods)).items():
            grouped[place.cluster, place.namespace or self._default_namespace][pod_id] = pods[
                pod_id
            ]
        return grouped

    async def config_places(self) -> set[Place]:
        """Where the pool configs' templates deploy (and the default namespace of the default
        cluster), in allowed namespaces only."""
        places: set[Place] = {(None, self._default_namespace)}
        scopes = await self._jobs_state.scopes_with_config()
        for config in (await self._jobs_state.pool_configs(scopes)).values():
            if config.pod_spec is not None:
                namespace = config.pod_spec.get("namespace") or self._default_namespace
                places.add((template_cluster(config.pod_spec), namespace))
        # a pool config from before the allow-list must not send reconcile where we may not go
        if self._namespaces is None:
            return places
        return {place for place in places if place[1] in self._namespaces}

    async def list_all(self, places: list[Place]) -> dict[Place, dict[str, PodStatus]]:
        """The places' LISTs at once; a place whose LIST failed is left out."""
        listed = await asyncio.gather(
            *(self._list(namespace, cluster) for cluster, namespace in places)
        )
        return {place: pods for place, pods in zip(places, listed, strict=True) if pods is not None}

    async def _list(self, namespace: str, cluster: str | None) -> dict[str, PodStatus] | None:
        """Our pods in a namespace of a cluster, or None when Kubernetes could not say (never
        "none"): the cluster is down, not configured (any more), or refused."""
        try:
            pods = await self._k8s.list_pods(namespace, OWN_PODS_SELECTOR, cluster=cluster)
        except (K8sApiError, OSError, TimeoutError) as exc:
            where = f"namespace {namespace}"
            if cluster is not None:
                where = f"cluster {cluster}, {where}"
            log.warning("%s: list failed (%s); skipped this tick", where, exc)
            return None
        return {p.pod_id: p for p in pods}
