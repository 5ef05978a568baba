"""``FakeK8sPodClient``: the in-memory Kubernetes of local mode and the tests. It implements
``k8s.K8sPodClient`` exactly; faults are plain public knobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import time
import uuid
from collections.abc import AsyncGenerator, Collection
from typing import Any

from agent_runtime import label_selector as selectors
from agent_runtime.resource_manager.clusters import template_cluster
from agent_runtime.resource_manager.identity import IDENTITY_ANNOTATION, PodIdentity
from agent_runtime.resource_manager.k8s import OnCreated
from agent_runtime.resource_manager.k8s_fake_watch import EventLog, PodSet
from agent_runtime.resource_manager.models import (
    DeployFailed,
    K8sApiError,
    NodeStatus,
    PodDeployInfo,
    PodEvent,
    PodGone,
    PodListing,
    PodStatus,
    normalize_phase,
)
from agent_runtime.resource_manager.pod_manifest import (
    build_pod_body,
    deploy_timing,
    new_pod_name,
    pod_labels,
    sse_url,
)
from agent_runtime.resource_manager.pod_reading import LIST_PAGE_SIZE


class FakeK8sPodClient:
    """In-memory Kubernetes for local mode and tests; faults are plain public knobs.

    Knobs: ``fail_next_deploys`` (that many deploys raise ``DeployFailed``), ``never_ready``
    (deploy waits its ``ready_timeout``, deletes the pod, raises), ``ready_delay`` (seconds from
    create to Ready: a deployed pod comes up by itself, as a kubelet brings it up, whether its
    deployer still waits or not), ``unhealthy`` (pod ids whose health probe fails),
    ``missing_namespaces`` (list → [], deploy refused) and ``forbidden_namespaces`` (every
    call → 403). Actions: ``set_phase``, ``kill``, ``remove`` (vanishes behind our back),
    ``add_pod`` (a pod this client did not deploy: signed with ``identity`` when one is given,
    as a lost one of ours; else foreign). Records: ``deploy_calls``, ``deleted`` (pod ids, in
    order), ``pods``. A deploy signs its pod as the real client does: the identity MAC at the
    create, ``on_created``, then the incarnation MAC (a deployer that dies in ``on_created``
    leaves a pod with the first only).

    Clusters: every cluster has a pod set of its own (``pods_in(name)``; ``pods`` is the
    process default's, None). A deploy goes to its template's ``kubeconfig`` cluster, every
    other call to its ``cluster=``; the test helpers take ``cluster=`` too. ``clusters``: the
    names configured (None: any name is a cluster, empty until used); a name not configured,
    or one in ``unreachable_clusters`` (None: the default), is refused as the real client
    refuses it: ``DeployFailed`` for deploy, await_ready and sign, ``K8sApiError`` for get,
    delete and list. ``deleted`` holds the pod ids of every cluster, ``deleted_in`` (cluster,
    pod id) pairs.

    Nodes: each cluster has ``nodes`` of them, ``fake-node-0`` …; a pod is put on the next one
    in turn (``add_pod(node=…)`` names one). ``cordon`` / ``uncordon`` set a node's
    ``spec.unschedulable``; ``nodes_forbidden`` refuses ``list_nodes`` (403, as a service
    account without the ClusterRole). ``begin_graceful_delete`` is Kubernetes' graceful
    deletion (phase Terminating, not Ready, ``deletion_at`` = now + grace): the pod is gone
    once its grace ran out (seen at the next read). ``delete`` (ours) removes at once.

    Pod IPs are loopback: 127.0.1.1 … 127.0.1.254, then 127.0.2.x and so on (one sequence over
    every cluster: no two pods share an IP).

    Watch (``k8s_fake_watch.py``): every change to a pod set, the tests' own included, is an
    event with a resourceVersion; ``drop_watches()`` ends every open stream (a dropped
    connection), ``compact_watches()`` makes every older version 410 (``watches_refused``:
    every new watch is refused, 503). ``health_probes`` counts ``probe_health`` calls.
    """

    def __init__(
        self,
        *,
        default_namespace: str = "default",
        ready_delay: float = 0.0,
        clusters: Collection[str] | None = None,
        nodes: int = 1,
    ) -> None:
        self.default_namespace = default_namespace
        self._node_count = max(nodes, 1)
        self._nodes: dict[str | None, dict[str, bool]] = {}  # cluster → node → unschedulable
        self._next_node = itertools.count()
        self.nodes_forbidden = False
        self.ready_delay = ready_delay
        self.never_ready = False
        self.fail_next_deploys = 0
        self.unhealthy: set[str] = set()
        self.missing_namespaces: set[str] = set()
        self.forbidden_namespaces: set[str] = set()
        self.clusters: set[str] | None = None if clusters is None else set(clusters)
        self.unreachable_clusters: set[str | None] = set()
        self.events = EventLog()
        self.pods: dict[str, PodStatus] = PodSet(self.events, None)
        self._named: dict[str, dict[str, PodStatus]] = {}  # the named clusters' pod sets
        self.watches_refused = False
        self.health_probes = 0
        self.deleted: list[str] = []
        self.deleted_in: list[tuple[str | None, str]] = []
        self.deploy_calls = 0
        self.started = False
        self._ips_given = 0
        # probes find their pod in O(1) (10k-pod benches): ip → (cluster, pod id)
        self._pod_of_ip: dict[str, tuple[str | None, str]] = {}
        # deployed pods not yet Running: (cluster, pod id) → created (loop time)
        self._starting: dict[tuple[str | None, str], float] = {}

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False

    # clusters

    def pods_in(self, cluster: str | None) -> dict[str, PodStatus]:
        """The pod set of ``cluster`` (None: the default), live: a test may read or change it."""
        if cluster is None:
            return self.pods
        pods = self._named.get(cluster)
        if pods is None:
            pods = self._named[cluster] = PodSet(self.events, cluster)
        return pods

    def _refusal(self, cluster: str | None) -> str | None:
        if cluster in self.unreachable_clusters:
            return f"fake: cluster {cluster or '(default)'} is unreachable"
        if cluster is not None and self.clusters is not None and cluster not in self.clusters:
            return f"fake: cluster {cluster!r} is not configured"
        return None

    def _reached(self, cluster: str | None) -> dict[str, PodStatus]:
        """The cluster's pods for a read or delete; ``K8sApiError`` when it cannot be asked."""
        refusal = self._refusal(cluster)
        if refusal is not None:
            raise K8sApiError(refusal)
        return self.pods_in(cluster)

    def _deployable(self, cluster: str | None) -> dict[str, PodStatus]:
        """The cluster's pods for a deploy's step; ``DeployFailed`` when it cannot be asked."""
        refusal = self._refusal(cluster)
        if refusal is not None:
            raise DeployFailed(refusal)
        return self.pods_in(cluster)

    # nodes and graceful deletion

    def nodes_of(self, cluster: str | None = None) -> dict[str, bool]:
        """The nodes of ``cluster`` → whether cordoned (live: a test may change it)."""
        if cluster not in self._nodes:
            self._nodes[cluster] = {f"fake-node-{i}": False for i in range(self._node_count)}
        return self._nodes[cluster]

    def _place(self, cluster: str | None) -> str:
        names = sorted(self.nodes_of(cluster))
        return names[next(self._next_node) % len(names)]

    def cordon(self, node: str, *, cluster: str | None = None) -> None:
        self.nodes_of(cluster)[node] = True

    def uncordon(self, node: str, *, cluster: str | None = None) -> None:
        self.nodes_of(cluster)[node] = False

    def begin_graceful_delete(
        self, pod_id: str, grace_seconds: float, *, cluster: str | None = None
    ) -> None:
        """Kubernetes begins a graceful deletion (a ``kubectl delete``, a node drain's
        eviction): Terminating, not Ready, gone ``grace_seconds`` from now."""
        pods = self.pods_in(cluster)
        pods[pod_id] = dataclasses.replace(
            pods[pod_id], phase="Terminating", ready=False, deletion_at=time.time() + grace_seconds
        )

    def _reap(self, cluster: str | None) -> None:
        """Pods whose graceful deletion's time is up are gone (Kubernetes killed them)."""
        pods = self.pods_in(cluster)
        now = time.time()
        for pod_id in [p for p, pod in pods.items() if pod.deletion_at and pod.deletion_at <= now]:
            del pods[pod_id]

    # faults and test helpers

    def set_phase(
        self,
        pod_id: str,
        phase: str,
        waiting_reason: str | None = None,
        *,
        ready: bool | None = None,
        cluster: str | None = None,
    ) -> None:
        """Move a pod to ``phase`` (a waiting reason wins, as in ``pod_status``); Ready follows
        Running unless ``ready`` says otherwise."""
        pods = self.pods_in(cluster)
        pod = pods[pod_id]
        reasons = (waiting_reason,) if waiting_reason else ()
        phase = normalize_phase(phase, deleting=False, waiting_reasons=reasons)
        running = phase == "Running"
        pods[pod_id] = dataclasses.replace(
            pod,
            phase=phase,
            ready=running if ready is None else ready,
            pod_ip=pod.pod_ip or (self._next_ip(pod_id, cluster) if running else None),
        )

    def kill(self, pod_id: str, *, cluster: str | None = None) -> None:
        self.set_phase(pod_id, "Failed", cluster=cluster)

    def remove(self, pod_id: str, *, cluster: str | None = None) -> None:
        """The pod vanishes as if someone else deleted it (not recorded in ``deleted``)."""
        self.pods_in(cluster).pop(pod_id, None)

    def add_pod(
        self,
        *,
        scope_id: str,
        deploy_ver: str,
        pod_id: str | None = None,
        namespace: str | None = None,
        phase: str = "Running",
        ready: bool | None = None,
        labels: dict[str, str] | None = None,
        identity: PodIdentity | None = None,
        pod_spec: dict[str, Any] | None = None,
        annotations: dict[str, str] | None = None,
        image: str = "agentserver:found",
        cluster: str | None = None,
        node: str | None = None,
    ) -> PodStatus:
        """A pod we did not deploy (e.g. found after a Redis wipe); ``labels`` override ours.
        With ``identity`` it carries both signatures (its SSE port and path from ``pod_spec``),
        as a pod of ours would; ``annotations`` are added last (a test's tampering)."""
        pod_id = pod_id or new_pod_name(None)
        namespace = namespace or self.default_namespace
        uid = str(uuid.uuid4())
        notes = {} if identity is None else self._signed(
            identity, pod_id, namespace, scope_id, deploy_ver, pod_spec or {}, uid
        )  # fmt: skip
        pod = PodStatus(
            pod_id=pod_id,
            namespace=namespace,
            phase=phase,
            ready=phase == "Running" if ready is None else ready,
            pod_ip=None if phase == "Pending" else self._next_ip(pod_id, cluster),
            labels={**pod_labels(pod_id, scope_id, deploy_ver), **(labels or {})},
            uid=uid,
            annotations={**notes, **(annotations or {})},
            image=image,
            node=node or self._place(cluster),
            created=time.time(),
        )
        self.pods_in(cluster)[pod_id] = pod
        return pod

    @staticmethod
    def _signed(
        identity: PodIdentity,
        pod_id: str,
        namespace: str,
        scope_id: str,
        deploy_ver: str,
        pod_spec: dict[str, Any],
        uid: str,
    ) -> dict[str, str]:
        notes = identity.create_annotations(
            pod_id=pod_id, namespace=namespace, scope_id=scope_id, deploy_ver=deploy_ver,
            pod_spec=pod_spec,
        )  # fmt: skip
        notes.update(identity.incarnation_annotations(uid=uid, identity=notes[IDENTITY_ANNOTATION]))
        return notes

    def _next_ip(self, pod_id: str, cluster: str | None) -> str:
        n, self._ips_given = self._ips_given, self._ips_given + 1
        ip = f"127.0.{1 + n // 254}.{1 + n % 254}"
        self._pod_of_ip[ip] = (cluster, pod_id)
        return ip

    def _check_namespace(self, namespace: str) -> None:
        if namespace in self.forbidden_namespaces:
            raise K8sApiError(f"fake: namespace {namespace} is forbidden", status=403)

    # K8sPodClient

    def _kubelet(self) -> None:
        """Deployed pods whose ready_delay has passed are Running and Ready (never with
        ``never_ready``); one killed or set meanwhile keeps what it was set to."""
        if not self._starting or self.never_ready:
            return
        now = asyncio.get_running_loop().time()
        for (cluster, pod_id), created in list(self._starting.items()):
            pod = self.pods_in(cluster).get(pod_id)
            if pod is None or pod.phase != "Pending":
                del self._starting[cluster, pod_id]
            elif now - created >= self.ready_delay:
                del self._starting[cluster, pod_id]
                self.set_phase(pod_id, "Running", cluster=cluster)

    async def deploy(
        self,
        *,
        scope_id: str,
        deploy_ver: str,
        pod_spec: dict[str, Any],
        identity: PodIdentity,
        on_created: OnCreated | None = None,
    ) -> PodDeployInfo:
        self.deploy_calls += 1
        namespace = pod_spec.get("namespace") or self.default_namespace
        cluster = template_cluster(pod_spec)
        if self.fail_next_deploys > 0:
            self.fail_next_deploys -= 1
            raise DeployFailed("fake: injected deploy failure")
        pods = self._deployable(cluster)
        if namespace in self.forbidden_namespaces:
            raise DeployFailed(f"create pod in {namespace} refused: 403 Forbidden")
        if namespace in self.missing_namespaces:
            raise DeployFailed(f"create pod in {namespace} refused: 404 namespace not found")
        pod_id = new_pod_name(pod_spec.get("pod_name"))
        uid = str(uuid.uuid4())
        notes = identity.create_annotations(
            pod_id=pod_id, namespace=namespace, scope_id=scope_id, deploy_ver=deploy_ver,
            pod_spec=pod_spec,
        )  # fmt: skip
        body = build_pod_body(pod_id, scope_id, deploy_ver, pod_spec, notes)
        pods[pod_id] = PodStatus(
            pod_id, namespace, "Pending", False, None, body["metadata"]["labels"],
            uid=uid, annotations=notes, image=pod_spec["image"], node=self._place(cluster),
            created=time.time(),
        )  # fmt: skip
        self._starting[cluster, pod_id] = asyncio.get_running_loop().time()
        try:
            if on_created is not None:
                await on_created(pod_id, namespace, uid)
            incarnation = identity.incarnation_annotations(
                uid=uid, identity=notes[IDENTITY_ANNOTATION]
            )
            await self.sign(
                pod_id, namespace, pod_spec, uid=uid, annotations=incarnation, within=0.0,
                cluster=cluster,
            )  # fmt: skip
            pod_ip = await self._wait_ready(pod_id, uid, deploy_timing(pod_spec), cluster)
        except BaseException:  # as the real client: a failed or cancelled deploy leaves no pod
            if pods.pop(pod_id, None) is not None:
                self._note_deleted(cluster, pod_id)
            raise
        return PodDeployInfo(pod_id, namespace, pod_ip, sse_url(pod_ip, pod_spec), cluster)

    def _note_deleted(self, cluster: str | None, pod_id: str) -> None:
        self.deleted.append(pod_id)
        self.deleted_in.append((cluster, pod_id))

    async def await_ready(
        self,
        pod_id: str,
        namespace: str,
        pod_spec: dict[str, Any],
        *,
        uid: str,
        within: float,
        cluster: str | None = None,
    ) -> PodDeployInfo:
        pods = self._deployable(cluster)
        self._check_namespace(namespace)
        pod = pods.get(pod_id)
        if pod is None or pod.namespace != namespace:
            raise PodGone(f"pod {pod_id} disappeared")
        _, poll = deploy_timing(pod_spec)
        pod_ip = await self._wait_ready(pod_id, uid, (max(within, 0.0), poll), cluster)
        return PodDeployInfo(pod_id, namespace, pod_ip, sse_url(pod_ip, pod_spec), cluster)

    async def sign(
        self,
        pod_id: str,
        namespace: str,
        pod_spec: dict[str, Any],
        *,
        uid: str,
        annotations: dict[str, str],
        within: float,
        cluster: str | None = None,
    ) -> None:
        pods = self._deployable(cluster)
        if namespace in self.forbidden_namespaces:
            raise DeployFailed(f"sign pod {namespace}/{pod_id} refused: 403 Forbidden")
        pod = pods.get(pod_id)
        if pod is None or pod.namespace != namespace or pod.uid != uid:
            raise PodGone(f"pod {pod_id} disappeared")
        pods[pod_id] = dataclasses.replace(pod, annotations={**pod.annotations, **annotations})

    async def _wait_ready(
        self, pod_id: str, uid: str, timing: tuple[float, float], cluster: str | None
    ) -> str:
        """Like the real poll loop: a pod killed, removed or replaced meanwhile fails at the
        next poll."""
        timeout, poll = timing
        loop = asyncio.get_running_loop()
        started = loop.time()
        pods = self.pods_in(cluster)
        while True:
            self._kubelet()
            pod = pods.get(pod_id)
            if pod is None or pod.uid != uid:
                raise PodGone(f"pod {pod_id} disappeared")
            if pod.dead:
                raise DeployFailed(f"pod {pod_id} is {pod.phase}")
            if pod.ready and pod.pod_ip:
                return pod.pod_ip
            elapsed = loop.time() - started
            if elapsed >= timeout:
                raise DeployFailed(f"pod {pod_id} not Ready within {timeout:g}s (last: Pending)")
            created = self._starting.get((cluster, pod_id))
            due = math.inf if created is None or self.never_ready else self.ready_delay
            until_due = (created or 0.0) + due - loop.time()
            await asyncio.sleep(max(min(poll, timeout - elapsed, until_due), 0.0))

    async def delete(self, pod_id: str, namespace: str, *, cluster: str | None = None) -> bool:
        pods = self._reached(cluster)
        self._check_namespace(namespace)
        pod = pods.get(pod_id)
        if pod is None or pod.namespace != namespace:
            return False
        del pods[pod_id]
        self._note_deleted(cluster, pod_id)
        return True

    async def get_pod(
        self, pod_id: str, namespace: str, *, cluster: str | None = None
    ) -> PodStatus | None:
        pods = self._reached(cluster)
        self._check_namespace(namespace)
        self._kubelet()
        self._reap(cluster)
        pod = pods.get(pod_id)
        return pod if pod is not None and pod.namespace == namespace else None

    async def list_pods(
        self, namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> list[PodStatus]:
        in_cluster = self._reached(cluster)
        self._check_namespace(namespace)
        if namespace in self.missing_namespaces:
            return []
        self._kubelet()
        self._reap(cluster)
        terms = selectors.parse(label_selector)
        pods = list(in_cluster.values())
        found: list[PodStatus] = []
        for i in range(0, len(pods), LIST_PAGE_SIZE):  # pages, as the real client reads them
            if i:
                await asyncio.sleep(0)
            page = pods[i : i + LIST_PAGE_SIZE]
            found += [
                p for p in page if p.namespace == namespace and selectors.matches(terms, p.labels)
            ]
        return found

    async def list_nodes(self, *, cluster: str | None = None) -> list[NodeStatus]:
        self._reached(cluster)
        if self.nodes_forbidden:
            raise K8sApiError("fake: nodes is forbidden", status=403)
        return [NodeStatus(name, cordoned) for name, cordoned in self.nodes_of(cluster).items()]

    async def list_pods_versioned(
        self, namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> PodListing:
        version = str(self.events.version)  # before the LIST: a watch from it misses nothing
        return PodListing(await self.list_pods(namespace, label_selector, cluster=cluster), version)

    async def watch_pods(
        self,
        namespace: str,
        label_selector: str,
        *,
        resource_version: str,
        timeout_seconds: int,
        cluster: str | None = None,
    ) -> AsyncGenerator[PodEvent, None]:
        self._reached(cluster)
        self._check_namespace(namespace)
        if self.watches_refused:
            raise K8sApiError("fake: watch refused", status=503)
        terms = selectors.parse(label_selector)

        def wanted(pod: PodStatus) -> bool:
            return pod.namespace == namespace and selectors.matches(terms, pod.labels)

        stream = self.events.stream(cluster, resource_version, timeout_seconds, wanted)
        async with contextlib.aclosing(stream) as events:
            async for event in events:
                yield event

    def drop_watches(self) -> None:
        """Every open watch ends, as if its connection dropped."""
        self.events.drop()

    def compact_watches(self) -> None:
        """Every version before now is compacted: a watch resuming from one gets 410."""
        self.events.compact()

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        self.health_probes += 1
        cluster, pod_id = self._pod_of_ip.get(pod_ip, (None, ""))
        pod = self.pods_in(cluster).get(pod_id)
        return (
            pod is not None
            and pod.pod_ip == pod_ip
            and pod.phase == "Running"
            and pod.pod_id not in self.unhealthy
        )
