"""The Kubernetes adapter: the ``K8sPodClient`` protocol, ``RealK8sPodClient``
(kubernetes_asyncio) and ``MeteredK8sPodClient``; ``FakeK8sPodClient`` lives in
``k8s_fake.py``, the pure pieces in ``pod_manifest.py`` (``new_pod_name``, ``build_pod_body``,
``sse_url``) and ``pod_reading.py`` (``pod_status_from_json`` — the one reading of a pod's
phase, readiness and IP — and ``read_pod_list``). All of them are
importable from here, as before.

Real and fake implement ``K8sPodClient`` exactly; the resource manager never sees a
kubernetes_asyncio object. A LIST is paged and parsed a slice at a time. A deploy goes to its
template's cluster (``clusters.template_cluster``); every call on an existing pod (``get_pod``,
``delete``, ``list_pods``, ``await_ready``, ``sign``) takes ``cluster=``, the cluster the pod
was recorded in (None: the process default).

Hazard: ``load_incluster_config`` is a plain function, ``load_kube_config`` a coroutine;
awaiting the first is a TypeError in-cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp

from agent_runtime.resource_manager.clusters import ClusterConfig, template_cluster
from agent_runtime.resource_manager.identity import IDENTITY_ANNOTATION, PodIdentity
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.models import (
    DeployFailed,
    K8sApiError,
    PodDeployInfo,
    PodGone,
    PodStatus,
)
from agent_runtime.resource_manager.pod_manifest import (
    CONTAINER_NAME,
    DEFAULT_POD_NAME,
    DEFAULT_PORT,
    DEFAULT_READY_POLL_INTERVAL,
    DEFAULT_READY_TIMEOUT,
    DEFAULT_SSE_PATH,
    HEALTH_PATH,
    NFS_VOLUME,
    PROBE_TIMEOUT,
    build_pod_body,
    deploy_timing,
    new_pod_name,
    pod_labels,
    sse_url,
)
from agent_runtime.resource_manager.pod_reading import (
    LIST_PAGE_SIZE,
    LIST_PARSE_SLICE,
    iter_json_object,
    pod_status,
    pod_status_from_json,
    read_pod_list,
)

# what callers and tests import from here (the split modules' names included)
__all__ = [
    "CONTAINER_NAME",
    "DEFAULT_POD_NAME",
    "DEFAULT_PORT",
    "DEFAULT_READY_POLL_INTERVAL",
    "DEFAULT_READY_TIMEOUT",
    "DEFAULT_SSE_PATH",
    "HEALTH_PATH",
    "LIST_PAGE_SIZE",
    "LIST_PARSE_SLICE",
    "NFS_VOLUME",
    "PROBE_TIMEOUT",
    "FakeK8sPodClient",
    "K8sPodClient",
    "MeteredK8sPodClient",
    "OnCreated",
    "PodDeployInfo",
    "RealK8sPodClient",
    "build_pod_body",
    "deploy_timing",
    "iter_json_object",
    "new_pod_name",
    "pod_labels",
    "pod_status",
    "pod_status_from_json",
    "read_pod_list",
    "sse_url",
]

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 30.0  # cap of one API call; a deploy's own deadline may cut it shorter
DISCARD_TIMEOUT = 5.0  # best-effort delete after a failed deploy
AWAIT_READY_MIN = 1.0  # seconds await_ready looks for at least (one GET)
CREATE_NAME_TRIES = 3  # 409 AlreadyExists → a new name, this many names in all
BACKOFF_BASE = 0.2
BACKOFF_CAP = 5.0
MERGE_PATCH = "application/merge-patch+json"

# Transport failures: the request may or may not have reached the API server.
_LOST_REPLY = (TimeoutError, aiohttp.ClientError)

T = TypeVar("T")

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

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        """``GET http://{pod_ip}:{port}/health`` within 3 s; only a 200 is healthy."""


# --- real client -----------------------------------------------------------------------------

# Opens a CoreV1Api-like object for a configured cluster name (None: the process default). It must
# carry ``api_client`` with an async ``close()``. Tests inject a fake here.
ApiFactory = Callable[[str | None], Awaitable[Any]]


# kubernetes_asyncio is imported where used: it costs ~0.6 s and local mode never needs it.


def _api_status(exc: BaseException) -> int | None:
    from kubernetes_asyncio.client.exceptions import ApiException

    return exc.status if isinstance(exc, ApiException) else None


def _api_error_text(exc: BaseException) -> str:
    """``403 Forbidden: pods is forbidden: …`` — status, reason and the API server's message."""
    from kubernetes_asyncio.client.exceptions import ApiException

    if not isinstance(exc, ApiException):
        return f"{type(exc).__name__}: {exc}".rstrip(": ")
    text = f"{exc.status} {exc.reason or ''}".rstrip()
    with contextlib.suppress(Exception):
        message = json.loads(exc.body or "{}").get("message")
        if message:
            text += f": {str(message)[:300]}"
    return text


def _retry_after(exc: BaseException) -> float | None:
    """The ``Retry-After`` header in seconds (the delta form; an HTTP date is ignored)."""
    headers = getattr(exc, "headers", None)
    if not headers:
        return None
    with contextlib.suppress(TypeError, ValueError):
        seconds = float(headers.get("Retry-After"))
        if math.isfinite(seconds):
            return max(seconds, 0.0)
    return None


def _retryable(exc: BaseException) -> bool:
    """429, 5xx and lost replies are worth another try; any other refusal is final."""
    status = _api_status(exc)
    if status is None:
        return isinstance(exc, _LOST_REPLY)
    return status == 429 or status >= 500


class _Deadline:
    """A monotonic deadline shared by every step of one deploy."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = asyncio.get_running_loop().time() + seconds

    def remaining(self) -> float:
        return self._at - asyncio.get_running_loop().time()

    def call_timeout(self) -> float:
        return max(min(self.remaining(), REQUEST_TIMEOUT), 0.0)


@dataclasses.dataclass
class _DeployJob:
    """One deploy's inputs, and ``sent``: the names whose create may have landed (so a failed
    or cancelled deploy deletes them)."""

    api: Any
    namespace: str
    scope_id: str
    deploy_ver: str
    pod_spec: dict[str, Any]
    deadline: _Deadline
    identity: PodIdentity | None  # None: a wait for an existing pod, which creates none
    sent: set[str] = dataclasses.field(default_factory=set)

    def body(self) -> dict[str, Any]:
        """A new name's manifest, signed for that name."""
        assert self.identity is not None
        name = new_pod_name(self.pod_spec.get("pod_name"))
        notes = self.identity.create_annotations(
            pod_id=name, namespace=self.namespace, scope_id=self.scope_id,
            deploy_ver=self.deploy_ver, pod_spec=self.pod_spec,
        )  # fmt: skip
        return build_pod_body(name, self.scope_id, self.deploy_ver, self.pod_spec, notes)


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
                            f"kubernetes client unavailable: {_api_error_text(exc)}"
                        ) from exc
                    self._apis[cluster] = api
        return api

    async def _call(self, what: str, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """One API call outside a deploy: bounded, and every failure a ``K8sApiError``."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                return await coro_fn()
        except Exception as exc:
            raise K8sApiError(f"{what}: {_api_error_text(exc)}", status=_api_status(exc)) from exc

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
        """Paged as client-go's pager: ``limit`` ``LIST_PAGE_SIZE`` and each page's continue
        token, until a page has none. Each page is one ``_call`` (bounded, every failure a
        ``K8sApiError``), read as raw JSON (no V1Pod models) a slice at a time. A 404 (the
        namespace) → []; a 410 of a continued page (its token expired) → the list again from
        the start, once; any other refusal, or a second 410, is raised."""
        api = await self._pod_api(cluster)
        where = namespace if cluster is None else f"{cluster}/{namespace}"
        what = f"list pods in {where} ({label_selector})"
        found: list[PodStatus] = []
        token: str | None = None
        restarted = False
        while True:
            try:
                text = await self._call(
                    what, functools.partial(self._list_page, api, namespace, label_selector, token)
                )
            except K8sApiError as exc:
                if exc.status == 404:
                    return []
                if exc.status == 410 and token is not None and not restarted:
                    log.info("%s: continue token expired; listing again from the start", what)
                    found, token, restarted = [], None, True
                    continue
                raise
            try:
                token = await read_pod_list(text, found)
            except (ValueError, TypeError, AttributeError) as exc:
                raise K8sApiError(f"{what}: a reply that is not a PodList: {exc}") from exc
            if token is None:
                return found

    @staticmethod
    async def _list_page(api: Any, namespace: str, label_selector: str, token: str | None) -> str:
        """One LIST page as JSON text. ``_preload_content=False`` hands back the aiohttp
        response unread and unchecked: a refusal is raised here as kubernetes_asyncio raises
        it (``ApiException`` with status, reason, headers and body)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        resp = await api.list_namespaced_pod(
            namespace,
            label_selector=label_selector,
            limit=LIST_PAGE_SIZE,
            _continue=token,
            _preload_content=False,
        )
        try:
            body: bytes = await resp.read()
        finally:
            resp.release()
        if not 200 <= resp.status <= 299:
            refused = ApiException(status=resp.status, reason=resp.reason)
            refused.body, refused.headers = body, resp.headers
            raise refused
        return body.decode("utf-8")

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT))
        try:
            async with self._http.get(f"http://{pod_ip}:{port}{HEALTH_PATH}") as resp:
                return resp.status == 200
        except Exception:
            return False

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
        deadline = _Deadline(ready_timeout)  # create and readiness together
        cluster = template_cluster(pod_spec)
        api = await self._deploy_api(cluster)
        job = _DeployJob(
            api=api,
            namespace=pod_spec.get("namespace") or self._default_namespace,
            scope_id=scope_id,
            deploy_ver=deploy_ver,
            pod_spec=pod_spec,
            deadline=deadline,
            identity=identity,
        )
        try:
            name, uid, signature = await self._create(job)
            if on_created is not None:
                await on_created(name, job.namespace, uid)
            await self._sign(job, name, uid, signature)
            pod_ip = await self._wait_ready(job, name, uid, poll)
        except BaseException:  # DeployFailed, and also cancellation: never leave a pod behind
            for maybe_created in job.sent:
                await self._discard(api, maybe_created, job.namespace)
            raise
        return PodDeployInfo(name, job.namespace, pod_ip, sse_url(pod_ip, pod_spec), cluster)

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
        deadline = _Deadline(max(within, AWAIT_READY_MIN))
        job = _DeployJob(api, namespace, "", "", pod_spec, deadline, identity=None)
        pod_ip = await self._wait_ready(job, pod_id, uid, poll)
        return PodDeployInfo(pod_id, namespace, pod_ip, sse_url(pod_ip, pod_spec), cluster)

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

    async def _create(self, job: _DeployJob) -> tuple[str, str, str]:
        """Create the pod; its name, the uid the API server gave it and its identity MAC.

        409 → a new name (3 names in all). 429 / 5xx / a lost reply → the same name again
        after a backoff, so a create that did land shows up as our own pod (GET, or the next
        create's 409) instead of an orphan. A 409 for a name whose earlier create may have
        landed, while the GET cannot tell whose pod it is, keeps the name and asks again
        (moving on would leave our own pod behind). Any other refusal is final.
        """
        names_tried = attempt = 0
        body: dict[str, Any] | None = None
        maybe_landed = False  # an earlier create of this name may have been applied
        while True:  # ends by return, by raise, or at the deadline
            if body is None:
                names_tried += 1
                if names_tried > CREATE_NAME_TRIES:
                    raise DeployFailed(
                        f"pod name taken {CREATE_NAME_TRIES} times in {job.namespace}"
                    )
                body = job.body()
                maybe_landed = False
            name = body["metadata"]["name"]
            signature = body["metadata"]["annotations"][IDENTITY_ANNOTATION]
            what = f"create pod {job.namespace}/{name}"
            if job.deadline.remaining() <= 0:
                raise DeployFailed(f"{what}: no time left")
            job.sent.add(name)
            try:
                async with asyncio.timeout(job.deadline.call_timeout()):
                    created = await job.api.create_namespaced_pod(job.namespace, body)
                return name, self._uid_of(created, what), signature
            except DeployFailed:
                raise
            except Exception as exc:
                error = exc
            status = _api_status(error)
            if status == 409:
                owner, uid = await self._is_ours(job, name, signature)
                if owner is True:
                    return name, uid, signature
                if owner is None and maybe_landed:  # likely ours: keep it, ask again
                    await self._backoff(attempt, error, job.deadline, what)
                    attempt += 1
                    continue
                job.sent.discard(name)  # another pod's name: never ours to delete
                body = None
                continue
            if not _retryable(error):
                job.sent.discard(name)
                raise DeployFailed(f"{what} refused: {_api_error_text(error)}") from error
            if status != 429:  # a 429 is refused before anything is applied
                maybe_landed = True
                owner, uid = await self._is_ours(job, name, signature)
                if owner:
                    return name, uid, signature
            await self._backoff(attempt, error, job.deadline, what)
            attempt += 1

    @staticmethod
    def _uid_of(created: Any, what: str) -> str:
        uid = pod_status(created).uid
        if not uid:  # nothing to bind the signature to; the name is deleted by the caller
            raise DeployFailed(f"{what}: the reply carries no metadata.uid")
        return uid

    @staticmethod
    async def _is_ours(job: _DeployJob, name: str, signature: str) -> tuple[bool | None, str]:
        """Whether ``name`` exists with our labels and the identity MAC we sent (a create that
        landed), and its uid: True, False (another pod, or none: 404), or None when the GET
        failed too (unknown).

        Unknown never counts as ours; the name stays in ``job.sent``, so a failed deploy
        still deletes it.
        """
        if job.deadline.remaining() <= 0:
            return None, ""
        try:
            async with asyncio.timeout(job.deadline.call_timeout()):
                found = pod_status(await job.api.read_namespaced_pod(name, job.namespace))
        except Exception as exc:
            log.debug("get pod %s/%s after a failed create: %s", job.namespace, name, exc)
            return (False if _api_status(exc) == 404 else None), ""
        ours = (
            found.scope_id == job.scope_id
            and found.deploy_ver == job.deploy_ver
            and hmac.compare_digest(
                found.annotations.get(IDENTITY_ANNOTATION, "").encode(), signature.encode()
            )
            and bool(found.uid)
        )
        return ours, found.uid

    async def _sign(self, job: _DeployJob, name: str, uid: str, signature: str) -> None:
        """Patch the incarnation MAC onto the pod we just created."""
        assert job.identity is not None
        notes = job.identity.incarnation_annotations(uid=uid, identity=signature)
        await self._patch_incarnation(job.api, job.namespace, name, uid, notes, job.deadline)

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
        deadline = _Deadline(max(within, AWAIT_READY_MIN))
        await self._patch_incarnation(api, namespace, pod_id, uid, annotations, deadline)

    async def _patch_incarnation(
        self,
        api: Any,
        namespace: str,
        name: str,
        uid: str,
        notes: dict[str, str],
        deadline: _Deadline,
    ) -> None:
        """A JSON merge patch of ``notes`` (re-sent as is after a lost reply). The patch names
        the uid: should the name hold another incarnation by now, the API server refuses (the
        uid is immutable) instead of us signing that one."""
        patch = {"metadata": {"uid": uid, "annotations": notes}}
        what = f"sign pod {namespace}/{name}"
        attempt = 0
        while True:
            if deadline.remaining() <= 0:
                raise DeployFailed(f"{what}: no time left")
            try:
                async with asyncio.timeout(deadline.call_timeout()):
                    await api.patch_namespaced_pod(
                        name, namespace, patch, _content_type=MERGE_PATCH
                    )
                return
            except Exception as exc:
                error = exc
            status = _api_status(error)
            if status == 404:
                raise PodGone(f"pod {namespace}/{name} disappeared") from error
            if status in (409, 422):  # the uid named is not the name's: another incarnation
                raise PodGone(f"{what}: another pod holds the name now") from error
            if not _retryable(error):
                hint = " (the service account needs `patch` on pods)" if status == 403 else ""
                raise DeployFailed(f"{what} refused: {_api_error_text(error)}{hint}") from error
            await self._backoff(attempt, error, deadline, what)
            attempt += 1

    @staticmethod
    async def _backoff(attempt: int, error: BaseException, deadline: _Deadline, what: str) -> None:
        """Sleep ``Retry-After`` or a capped exponential delay; fail now if it would pass the
        deadline (no point sleeping into a certain timeout)."""
        delay = _retry_after(error)
        if delay is None:
            delay = min(BACKOFF_BASE * 2**attempt, BACKOFF_CAP) * random.uniform(0.5, 1.0)
        if delay >= deadline.remaining():
            raise DeployFailed(f"{what}: {_api_error_text(error)} (no time left to retry)")
        log.warning("%s: %s; retry in %.2fs", what, _api_error_text(error), delay)
        await asyncio.sleep(delay)

    @staticmethod
    async def _wait_ready(job: _DeployJob, name: str, uid: str, poll: float) -> str:
        """Poll until Ready with an IP; dead, gone or replaced (another uid under the name)
        fails at once, a GET hiccup waits."""
        where = f"pod {job.namespace}/{name}"
        last = "unknown"
        while True:
            try:
                async with asyncio.timeout(job.deadline.call_timeout()):
                    found = pod_status(await job.api.read_namespaced_pod(name, job.namespace))
            except Exception as exc:
                if _api_status(exc) == 404:
                    raise PodGone(f"{where} disappeared") from exc
                if not _retryable(exc):
                    raise DeployFailed(f"{where}: get refused: {_api_error_text(exc)}") from exc
                last = f"get failed: {_api_error_text(exc)}"
            else:
                if found.uid != uid:
                    raise DeployFailed(f"{where} was replaced by another pod of that name")
                if found.dead:
                    raise DeployFailed(f"{where} is {found.phase}")
                if found.ready and found.pod_ip:
                    return found.pod_ip
                last = found.phase
            remaining = job.deadline.remaining()
            if remaining <= 0:
                raise DeployFailed(
                    f"{where} not Ready within {job.deadline.seconds:g}s (last: {last})"
                )
            await asyncio.sleep(min(poll, remaining))

    @staticmethod
    async def _discard(api: Any, name: str, namespace: str) -> None:
        """Delete a failed deploy's pod at once (grace 0). Best effort: reconcile catches a miss."""
        try:
            async with asyncio.timeout(DISCARD_TIMEOUT):
                await api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except Exception as exc:
            if _api_status(exc) != 404:
                log.warning("delete of failed pod %s/%s: %s", namespace, name, exc)


class MeteredK8sPodClient:
    """Any ``K8sPodClient``, each call counted by verb and outcome and timed (metrics).

    Outcomes: ``ok``, the HTTP status of a refusal (``K8sApiError``), ``deploy_failed``,
    ``timeout``, ``error``: a small fixed set, whatever the error text.
    """

    def __init__(self, inner: K8sPodClient, observe: Callable[[str, str, float], None]) -> None:
        self.inner = inner
        self._observe = observe

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def _timed(self, verb: str, call: Awaitable[T]) -> T:
        started = time.perf_counter()
        status = "error"
        try:
            result = await call
            status = "ok"
            return result
        except K8sApiError as exc:
            status = str(exc.status) if exc.status else "error"
            raise
        except DeployFailed:
            status = "deploy_failed"
            raise
        except TimeoutError:
            status = "timeout"
            raise
        finally:
            self._observe(verb, status, time.perf_counter() - started)

    async def deploy(
        self,
        *,
        scope_id: str,
        deploy_ver: str,
        pod_spec: dict[str, Any],
        identity: PodIdentity,
        on_created: OnCreated | None = None,
    ) -> PodDeployInfo:
        call = self.inner.deploy(
            scope_id=scope_id, deploy_ver=deploy_ver, pod_spec=pod_spec, identity=identity,
            on_created=on_created,
        )  # fmt: skip
        return await self._timed("deploy", call)

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
        call = self.inner.await_ready(
            pod_id, namespace, pod_spec, uid=uid, within=within, cluster=cluster
        )
        return await self._timed("await_ready", call)

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
        call = self.inner.sign(
            pod_id, namespace, pod_spec, uid=uid, annotations=annotations, within=within,
            cluster=cluster,
        )  # fmt: skip
        await self._timed("sign", call)

    async def delete(self, pod_id: str, namespace: str, *, cluster: str | None = None) -> bool:
        return await self._timed("delete", self.inner.delete(pod_id, namespace, cluster=cluster))

    async def get_pod(
        self, pod_id: str, namespace: str, *, cluster: str | None = None
    ) -> PodStatus | None:
        return await self._timed("get", self.inner.get_pod(pod_id, namespace, cluster=cluster))

    async def list_pods(
        self, namespace: str, label_selector: str, *, cluster: str | None = None
    ) -> list[PodStatus]:
        call = self.inner.list_pods(namespace, label_selector, cluster=cluster)
        return await self._timed("list", call)

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        return await self._timed("probe_health", self.inner.probe_health(pod_ip, port))
