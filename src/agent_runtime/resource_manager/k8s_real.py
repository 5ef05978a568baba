"""``RealK8sPodClient``: the ``K8sPodClient`` of a real cluster, over kubernetes_asyncio.

One shared ``ApiClient`` per cluster; reads, deletes and the paged LIST here, a deploy's steps
(create, sign, wait for Ready, discard) in ``k8s_deploy.py``. A deploy goes to its template's
cluster (``clusters.template_cluster``); every call on an existing pod takes ``cluster=``,
the cluster the pod was recorded in (None: the process default). The resource manager never
sees a kubernetes_asyncio object.

Hazard: ``load_incluster_config`` is a plain function, ``load_kube_config`` a coroutine;
awaiting the first is a TypeError in-cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from agent_runtime.resource_manager.clusters import ClusterConfig, template_cluster
from agent_runtime.resource_manager.identity import PodIdentity
from agent_runtime.resource_manager.k8s import OnCreated
from agent_runtime.resource_manager.k8s_deploy import (
    REQUEST_TIMEOUT,
    Deadline,
    DeployJob,
    api_error_text,
    api_status,
    create,
    discard,
    patch_incarnation,
    sign_created,
    wait_ready,
)
from agent_runtime.resource_manager.models import (
    DeployFailed,
    K8sApiError,
    NodeStatus,
    PodDeployInfo,
    PodEvent,
    PodListing,
    PodStatus,
)
from agent_runtime.resource_manager.pod_manifest import (
    HEALTH_PATH,
    PROBE_TIMEOUT,
    deploy_timing,
    sse_url,
)
from agent_runtime.resource_manager.pod_reading import (
    LIST_PAGE_SIZE,
    PageEnd,
    pod_status,
    pod_status_from_json,
    read_node_page,
    read_pod_page,
)

log = logging.getLogger(__name__)

AWAIT_READY_MIN = 1.0  # seconds await_ready looks for at least (one GET)
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"  # client-go's event patch
WATCH_SLACK = 10  # seconds a watch's client waits past its timeoutSeconds (a silent connection)

# Opens a CoreV1Api-like object for a configured cluster name (None: the process default). It must
# carry ``api_client`` with an async ``close()``. Tests inject a fake here.
ApiFactory = Callable[[str | None], Awaitable[Any]]

# kubernetes_asyncio is imported where used: it costs ~0.6 s and local mode never needs it.


class RealK8sPodClient:
    """kubernetes_asyncio with one shared ``ApiClient`` per cluster.

    The process default is the in-cluster service account, else ``kubeconfig``. A template
    may name one of the operator's ``clusters`` (``clusters.read_clusters``: parsed and checked
    at startup, opened in ``start``); its new deploys go there. Every call on an existing pod
    takes the pod's ``cluster`` (None: the default), so watch, reconcile, reclaim and
    takeovers reach each pod where it runs; cleanup stays on the default. A name that is not
    configured (a template row from before names, or a cluster since removed) opens and reads
    nothing: a deploy fails, a read or delete raises ``K8sApiError``.
    """

    def __init__(
        self,
        *,
        kubeconfig: str | None = None,
        default_namespace: str = "default",
        api_factory: ApiFactory | None = None,
        clusters: Mapping[str, ClusterConfig] | None = None,
    ) -> None:
        self._kubeconfig = kubeconfig
        self._default_namespace = default_namespace
        self._open_api = api_factory or self._open_real_api
        self._clusters = dict(clusters or {})
        self._apis: dict[str | None, Any] = {}
        self._apis_lock = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None
        self._closed = False
        self.source: str | None = None

    # lifecycle

    async def start(self) -> None:
        self._closed = False
        for name in self._clusters:
            try:
                await self._api(name)
            except K8sApiError as exc:  # its deploys fail (and retry the open) until it heals
                log.error("cluster %s: %s", name, exc)
        await self._api(None)

    async def close(self) -> None:
        self._closed = True
        apis, self._apis = self._apis, {}
        for api in apis.values():
            with contextlib.suppress(Exception):
                await api.api_client.close()
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _open_real_api(self, cluster: str | None) -> Any:
        """A CoreV1Api for a configured cluster (its kubeconfig parsed at startup: the file is
        not read again), or for the process default (read here, once, in ``start``)."""
        from kubernetes_asyncio import client, config
        from kubernetes_asyncio.config import ConfigException
        from kubernetes_asyncio.config.kube_config import KubeConfigLoader

        configuration = client.Configuration()
        if cluster is not None:
            known = self._clusters[cluster]
            loader = KubeConfigLoader(
                config_dict=known.loader_input(), config_base_path=str(Path(known.path).parent)
            )
            await loader.load_and_set(configuration)
            source = f"cluster {cluster} ({known.path})"
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
                source = "in-cluster"
            except ConfigException:
                await config.load_kube_config(
                    config_file=self._kubeconfig, client_configuration=configuration
                )
                source = f"kubeconfig {self._kubeconfig or '~/.kube/config'}"
            self.source = source
        log.info("kubernetes client ready (%s)", source)
        return client.CoreV1Api(api_client=client.ApiClient(configuration=configuration))

    async def _api(self, cluster: str | None) -> Any:
        """The cached API of a cluster (None: the default); opened on first use, so a failed
        start heals. Only configured names get here."""
        if self._closed:
            raise K8sApiError("kubernetes client is closed")
        api = self._apis.get(cluster)
        if api is None:
            async with self._apis_lock:
                api = self._apis.get(cluster)
                if api is None:
                    try:
                        api = await self._open_api(cluster)
                    except Exception as exc:
                        raise K8sApiError(
                            f"kubernetes client unavailable: {api_error_text(exc)}"
                        ) from exc
                    self._apis[cluster] = api
        return api

    async def _call(self, what: str, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """One API call outside a deploy: bounded, and every failure a ``K8sApiError``."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                return await coro_fn()
        except Exception as exc:
            raise K8sApiError(f"{what}: {api_error_text(exc)}", status=api_status(exc)) from exc

    # reads and deletes (the pod's cluster)

    async def _pod_api(self, cluster: str | None) -> Any:
        """The API of an existing pod's cluster; ``K8sApiError`` for a name not configured
        (removed since the pod was recorded: nothing is opened)."""
        if cluster is not None and cluster not in self._clusters:
            raise K8sApiError(f"cluster {cluster[:80]!r} is not configured")
        return await self._api(cluster)

    async def delete(self, pod_id: str, namespace: str, *, cluster: str | None = None) -> bool:
        api = await self._pod_api(cluster)
        try:
            await self._call(
                f"delete pod {namespace}/{pod_id}",
                lambda: api.delete_namespaced_pod(pod_id, namespace),
            )
        except K8sApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def get_pod(
        self, pod_id: str, namespace: str, *, cluster: str | None = None
    ) -> PodStatus | None:
        api = await self._pod_api(cluster)
        try:
            v1pod = await self._call(
                f"get pod {namespace}/{pod_id}", lambda: api.read_namespaced_pod(pod_id, namespace)
            )
        except K8sApiError as exc:
            if exc.status == 404:
                return None
            raise
        return pod_status(v1pod)

    async def list_pods(
        self, namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> list[PodStatus]:
        return (await self.list_pods_versioned(namespace, label_selector, cluster=cluster)).pods

    async def list_pods_versioned(
        self, namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> PodListing:
        """Paged as client-go's pager: ``limit`` ``LIST_PAGE_SIZE`` and each page's continue
        token, until a page has none. Each page is one ``_call`` (bounded, every failure a
        ``K8sApiError``), read as raw JSON (no V1Pod models) a slice at a time. A 404 (the
        namespace) → [] (resourceVersion ""); a 410 of a continued page (its token expired) →
        the list again from the start, once; any other refusal, or a second 410, is raised.
        The resourceVersion is the first page's (every page is that one snapshot)."""
        api = await self._pod_api(cluster)
        where = namespace if cluster is None else f"{cluster}/{namespace}"

        def page(token: str | None) -> Awaitable[Any]:
            return api.list_namespaced_pod(
                namespace, label_selector=label_selector, limit=LIST_PAGE_SIZE,
                _continue=token, _preload_content=False,
            )  # fmt: skip

        found: list[PodStatus] = []
        what = f"list pods in {where} ({label_selector})"
        version = await self._paged(
            what, page, lambda text: read_pod_page(text, found), found, "PodList"
        )
        if version is None:
            return PodListing([], "")
        return PodListing(found, version)

    async def list_nodes(self, *, cluster: str | None = None) -> list[NodeStatus]:
        """Paged as ``list_pods``, read as raw JSON: a node object carries its images and
        conditions, and only its name and ``spec.unschedulable`` are kept."""
        api = await self._pod_api(cluster)

        def page(token: str | None) -> Awaitable[Any]:
            return api.list_node(limit=LIST_PAGE_SIZE, _continue=token, _preload_content=False)

        found: list[NodeStatus] = []
        what = "list nodes" if cluster is None else f"list nodes of {cluster}"
        await self._paged(what, page, lambda text: read_node_page(text, found), found, "NodeList")
        return found

    async def _paged(
        self,
        what: str,
        page: Callable[[str | None], Awaitable[Any]],
        read: Callable[[str], Awaitable[PageEnd]],
        found: list[Any],
        kind: str,
    ) -> str | None:
        """Every page of a LIST into ``found`` (``read`` parses one: its continue token and
        resourceVersion); the first page's resourceVersion, or None for a 404 (a namespace
        that does not exist: nothing found)."""
        token: str | None = None
        version = ""
        restarted = False
        while True:
            try:
                text = await self._call(what, functools.partial(_page_text, page, token))
            except K8sApiError as exc:
                if exc.status == 404:
                    return None
                if exc.status == 410 and token is not None and not restarted:
                    log.info("%s: continue token expired; listing again from the start", what)
                    found.clear()
                    token, restarted = None, True
                    continue
                raise
            first = token is None
            try:
                end = await read(text)
            except (ValueError, TypeError, AttributeError) as exc:
                raise K8sApiError(f"{what}: a reply that is not a {kind}: {exc}") from exc
            if first:
                version = end.resource_version
            token = end.token
            if token is None:
                return version

    async def watch_pods(
        self,
        namespace: str,
        label_selector: str,
        *,
        resource_version: str,
        timeout_seconds: int,
        cluster: str | None = None,
    ) -> AsyncGenerator[PodEvent, None]:
        """kubernetes_asyncio's ``watch.Watch`` over ``list_namespaced_pod``, with
        ``timeoutSeconds`` (so the stream ends instead of reconnecting by itself: the caller
        resumes, and a 410 is raised, never retried behind our back) and bookmarks. Events
        are read from their raw JSON (``return_type="object"``: no V1Pod models) through
        ``pod_status_from_json``. The client side gives up ``WATCH_SLACK`` s after the
        server should have ended it (a connection that went silent)."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        api = await self._pod_api(cluster)
        where = namespace if cluster is None else f"{cluster}/{namespace}"
        watcher = watch.Watch(return_type="object")
        stream = watcher.stream(
            api.list_namespaced_pod,
            namespace,
            label_selector=label_selector,
            resource_version=resource_version,
            timeout_seconds=timeout_seconds,
            allow_watch_bookmarks=True,
            _request_timeout=timeout_seconds + WATCH_SLACK,
        )
        try:
            async with stream:
                async for event in stream:
                    kind = str(event.get("type") or "")
                    raw = event.get("raw_object")
                    version = str(watcher.resource_version or resource_version)
                    if kind == "BOOKMARK" or not isinstance(raw, dict):
                        yield PodEvent("BOOKMARK", None, version)
                    else:
                        yield PodEvent(kind, pod_status_from_json(raw), version)
        except ApiException as exc:
            raise K8sApiError(
                f"watch pods in {where}: {api_error_text(exc)}", status=exc.status
            ) from exc
        except Exception as exc:  # a dropped connection, a silent one, a malformed line
            raise K8sApiError(f"watch pods in {where}: {api_error_text(exc)}") from exc

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT))
        try:
            async with self._http.get(f"http://{pod_ip}:{port}{HEALTH_PATH}") as resp:
                return resp.status == 200
        except Exception:
            return False

    # events (pod_events.py's sender; the pod's cluster)

    async def create_event(
        self, namespace: str, body: dict[str, Any], *, cluster: str | None = None
    ) -> None:
        api = await self._pod_api(cluster)
        await self._call(
            f"create event in {namespace}", lambda: api.create_namespaced_event(namespace, body)
        )

    async def patch_event(
        self, namespace: str, name: str, patch: dict[str, Any], *, cluster: str | None = None
    ) -> None:
        api = await self._pod_api(cluster)
        await self._call(
            f"patch event {namespace}/{name}",
            lambda: api.patch_namespaced_event(
                name, namespace, patch, _content_type=STRATEGIC_MERGE_PATCH
            ),
        )

    # deploy

    async def deploy(
        self,
        *,
        scope_id: str,
        deploy_ver: str,
        pod_spec: dict[str, Any],
        identity: PodIdentity,
        on_created: OnCreated | None = None,
    ) -> PodDeployInfo:
        ready_timeout, poll = deploy_timing(pod_spec)
        deadline = Deadline(ready_timeout)  # create and readiness together
        cluster = template_cluster(pod_spec)
        api = await self._deploy_api(cluster)
        job = DeployJob(
            api=api,
            namespace=pod_spec.get("namespace") or self._default_namespace,
            scope_id=scope_id,
            deploy_ver=deploy_ver,
            pod_spec=pod_spec,
            deadline=deadline,
            identity=identity,
        )
        try:
            name, uid, signature = await create(job)
            if on_created is not None:
                await on_created(name, job.namespace, uid)
            await sign_created(job, name, uid, signature)
            pod_ip = await wait_ready(job, name, uid, poll)
        except BaseException:  # DeployFailed, and also cancellation: never leave a pod behind
            for maybe_created in job.sent:
                await discard(api, maybe_created, job.namespace)
            raise
        return PodDeployInfo(name, job.namespace, pod_ip, sse_url(pod_ip, pod_spec), cluster, uid)

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
        _, poll = deploy_timing(pod_spec)
        api = await self._deploy_api(cluster)  # the pod's cluster: where its deploy went
        # one GET at least, however little of the pod's own deadline is left
        deadline = Deadline(max(within, AWAIT_READY_MIN))
        job = DeployJob(api, namespace, "", "", pod_spec, deadline, identity=None)
        pod_ip = await wait_ready(job, pod_id, uid, poll)
        return PodDeployInfo(pod_id, namespace, pod_ip, sse_url(pod_ip, pod_spec), cluster, uid)

    async def _deploy_api(self, cluster: str | None) -> Any:
        """The API of a deploy's cluster, or ``DeployFailed`` (an unknown or down one)."""
        if cluster is not None and cluster not in self._clusters:
            # a row written before clusters were names (a path), or a cluster since removed:
            # nothing is opened or read, and the answer does not echo the template's value
            log.warning("deploy refused: the template names an unknown cluster %.80r", cluster)
            raise DeployFailed("the template names a cluster this service does not configure")
        try:
            return await self._api(cluster)
        except K8sApiError as exc:
            log.warning("deploy to cluster %s: %s", cluster or "(default)", exc)
            raise DeployFailed("the kubernetes client of the template's cluster is down") from exc

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
        api = await self._deploy_api(cluster)  # the pod's cluster: where its deploy went
        deadline = Deadline(max(within, AWAIT_READY_MIN))
        await patch_incarnation(api, namespace, pod_id, uid, annotations, deadline)


async def _page_text(page: Callable[[str | None], Awaitable[Any]], token: str | None) -> str:
    """One LIST page as JSON text. ``_preload_content=False`` hands back the aiohttp response
    unread and unchecked: a refusal is raised here as kubernetes_asyncio raises it
    (``ApiException`` with status, reason, headers and body)."""
    from kubernetes_asyncio.client.exceptions import ApiException

    resp = await page(token)
    try:
        body: bytes = await resp.read()
    finally:
        resp.release()
    if not 200 <= resp.status <= 299:
        refused = ApiException(status=resp.status, reason=resp.reason)
        refused.body, refused.headers = body, resp.headers
        raise refused
    return body.decode("utf-8")
