"""The Kubernetes adapter's door: the ``K8sPodClient`` protocol and ``OnCreated``.

Three clients implement it exactly: ``RealK8sPodClient`` (``k8s_real.py``, kubernetes_asyncio;
a deploy's steps in ``k8s_deploy.py``), ``FakeK8sPodClient`` (``k8s_fake.py``, in memory: local
mode and the tests) and ``MeteredK8sPodClient`` (``k8s_metered.py``, any client counted and
timed). The pure pieces are ``pod_manifest.py`` (``new_pod_name``, ``build_pod_body``,
``sse_url``) and ``pod_reading.py`` (``pod_status_from_json`` — the one reading of a pod's
phase, readiness and IP — and ``read_pod_list``).

The resource manager never sees a kubernetes_asyncio object. A LIST is paged and parsed a
slice at a time. A deploy goes to its template's cluster (``clusters.template_cluster``);
every call on an existing pod (``get_pod``, ``delete``, ``list_pods``, ``await_ready``,
``sign``) takes ``cluster=``, the cluster the pod was recorded in (None: the process default),
and so do ``list_nodes`` and the Event calls (an Event goes where its pod runs).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

from agent_runtime.resource_manager.identity import PodIdentity
from agent_runtime.resource_manager.models import (
    NodeStatus,
    PodDeployInfo,
    PodEvent,
    PodListing,
    PodStatus,
)

# called by a deploy once its create landed, with the pod's name, namespace and uid
OnCreated = Callable[[str, str, str], Awaitable[None]]


class K8sPodClient(Protocol):
    """What the resource manager needs from Kubernetes. Real and fake share it exactly."""

    async def start(self) -> None:
        """Load credentials and open the shared API client. May raise: the caller degrades."""

    async def close(self) -> None: ...

    async def deploy(
        self,
        *,
        scope_id: str,
        deploy_ver: str,
        pod_spec: dict[str, Any],
        identity: PodIdentity,
        on_created: OnCreated | None = None,
    ) -> PodDeployInfo:
        """Create one AgentServer pod, sign it and wait until it is Ready with an IP.

        Labels per contract §5; name ``{pod_name}-{10}-{5}`` (409 → a new name, 3 tries); the
        identity annotations of ``identity`` in the manifest. ``on_created(name, namespace,
        uid)`` runs once the create landed: if it raises, the pod is deleted and its error
        raised. Then the incarnation annotation is patched on with the uid the create
        answered; polls every ``ready_poll_interval`` up to ``ready_timeout``. Timeout, a
        terminal phase, a dead waiting reason, disappearance or another incarnation under the
        name → the pod is deleted, ``DeployFailed``.
        """

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
        """Wait for an existing pod of ``cluster`` (one a dead deploy leader created,
        incarnation ``uid``) to be Ready with an IP, polling as a deploy does, for at most
        ``within`` seconds; ``pod_spec`` gives the poll interval and the SSE URL only. Gone or
        another incarnation under the name → ``PodGone``; dead or not Ready in time, or a
        cluster that is not configured or down → ``DeployFailed`` (the pod is left for the
        caller to delete)."""

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
        """Merge-patch ``annotations`` onto the pod incarnation ``uid`` of ``cluster`` (named
        in the patch, so that another incarnation under the name is refused, never signed):
        how a taker completes the identity of a dead leader's pod. Lost replies, 429 and 5xx
        are tried again for up to ``within`` seconds. Gone or another incarnation →
        ``PodGone``; any other refusal (a cluster not configured or down too) →
        ``DeployFailed``."""

    async def delete(self, pod_id: str, namespace: str, *, cluster: str | None = None) -> bool:
        """Delete a pod of ``cluster``; False if it did not exist (404). A cluster that is not
        configured (or whose client cannot be opened) → ``K8sApiError``, as every read."""

    async def get_pod(
        self, pod_id: str, namespace: str, *, cluster: str | None = None
    ) -> PodStatus | None: ...

    async def list_pods(
        self, namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> list[PodStatus]:
        """Every matching pod of ``cluster`` (the real client pages the LIST). A namespace
        that does not exist → []; 403, or a cluster not configured or down → ``K8sApiError``."""

    async def list_nodes(self, *, cluster: str | None = None) -> list[NodeStatus]:
        """Every node of ``cluster`` with whether it is cordoned (``spec.unschedulable``): how
        the watch tells a pod on a node being drained. Paged as ``list_pods``; 403 (the
        service may not read nodes), or a cluster not configured or down → ``K8sApiError``."""
        ...

    async def list_pods_versioned(
        self, namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> PodListing:
        """``list_pods`` with the ``resourceVersion`` of the LIST's snapshot (a watch's start)."""

    def watch_pods(
        self,
        namespace: str,
        label_selector: str,
        *,
        resource_version: str,
        timeout_seconds: int,
        cluster: str | None = None,
    ) -> AsyncGenerator[PodEvent, None]:
        """The changes to matching pods of ``cluster`` after ``resource_version``, as they
        happen, until the server ends the stream (``timeout_seconds``, or the connection
        dropped): the stream simply ends, and the caller resumes from the last event's
        ``resource_version``. A version too old to resume from (compacted) → ``K8sApiError``
        with status 410 (the caller lists again); any other refusal or failure →
        ``K8sApiError``. Bookmarks come as ``BOOKMARK`` events without a pod. Close it with
        ``aclose`` (``contextlib.aclosing``)."""
        ...

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        """``GET http://{pod_ip}:{port}/health`` within 3 s; only a 200 is healthy."""

    async def create_event(
        self, namespace: str, body: dict[str, Any], *, cluster: str | None = None
    ) -> None:
        """Create the core/v1 Event ``body`` (its JSON, ``pod_events.py`` builds it) in
        ``namespace`` of ``cluster``, bounded as every call. Any refusal (403: RBAC; 404: the
        namespace; 409: the name is taken) or failure → ``K8sApiError`` with its status."""

    async def patch_event(
        self, namespace: str, name: str, patch: dict[str, Any], *, cluster: str | None = None
    ) -> None:
        """Strategic-merge-patch the Event ``name`` (``count``, ``lastTimestamp``, ``message``:
        an occurrence more of one already recorded). Gone (expired) → ``K8sApiError`` 404."""
