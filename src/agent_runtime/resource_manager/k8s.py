"""The Kubernetes adapter: ``RealK8sPodClient`` (kubernetes_asyncio) and ``FakeK8sPodClient``.

Both implement ``K8sPodClient`` exactly; the resource manager never sees a kubernetes_asyncio
object. The pure pieces (``new_pod_name``, ``build_pod_body``, ``pod_status_from_json`` — the
one reading of a pod's phase, readiness and IP — ``read_pod_list``, ``label_selector_matches``)
are module functions so they can be tested without a cluster. A LIST is paged and parsed a
slice at a time: 10k pods through the generated models held the loop for 6–10 s.

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
import re
import secrets
import string
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp

from agent_runtime import label_selector
from agent_runtime.resource_manager.clusters import ClusterConfig
from agent_runtime.resource_manager.identity import IDENTITY_ANNOTATION, PodIdentity
from agent_runtime.resource_manager.models import (
    APP_LABEL,
    COMPONENT_LABEL,
    COMPONENT_VALUE,
    DEPLOY_VER_LABEL,
    SCOPE_LABEL,
    DeployFailed,
    K8sApiError,
    PodDeployInfo,
    PodGone,
    PodStatus,
    normalize_phase,
)

log = logging.getLogger(__name__)

CONTAINER_NAME = "agentserver"
NFS_VOLUME = "nfs"
HEALTH_PATH = "/health"
PROBE_TIMEOUT = 3.0  # seconds for one GET /health (contract §5 half-dead rule)
REQUEST_TIMEOUT = 30.0  # cap of one API call; a deploy's own deadline may cut it shorter
DISCARD_TIMEOUT = 5.0  # best-effort delete after a failed deploy
AWAIT_READY_MIN = 1.0  # seconds await_ready looks for at least (one GET)
CREATE_NAME_TRIES = 3  # 409 AlreadyExists → a new name, this many names in all
BACKOFF_BASE = 0.2
BACKOFF_CAP = 5.0
# A pod_spec normally comes complete from a template; these fill a partial one (tests, tools).
DEFAULT_POD_NAME = "agent"
DEFAULT_PORT = 8080
DEFAULT_SSE_PATH = "/sse"
DEFAULT_READY_TIMEOUT = 300.0
DEFAULT_READY_POLL_INTERVAL = 2.0
LIST_PAGE_SIZE = 500  # pods per LIST request (``limit``), as client-go's pager
LIST_PARSE_SLICE = 0.001  # seconds of parsing a LIST page before yielding to the loop
MERGE_PATCH = "application/merge-patch+json"

_NAME_ALPHABET = string.ascii_lowercase + string.digits
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
        self, pod_id: str, namespace: str, pod_spec: dict[str, Any], *, uid: str, within: float
    ) -> PodDeployInfo:
        """Wait for an existing pod (one a dead deploy leader created, incarnation ``uid``) to
        be Ready with an IP, polling as a deploy does, for at most ``within`` seconds. Gone or
        another incarnation under the name → ``PodGone``; dead or not Ready in time →
        ``DeployFailed`` (the pod is left for the caller to delete)."""

    async def sign(
        self,
        pod_id: str,
        namespace: str,
        pod_spec: dict[str, Any],
        *,
        uid: str,
        annotations: dict[str, str],
        within: float,
    ) -> None:
        """Merge-patch ``annotations`` onto the pod incarnation ``uid`` (named in the patch, so
        that another incarnation under the name is refused, never signed): how a taker
        completes the identity of a dead leader's pod. Lost replies, 429 and 5xx are tried
        again for up to ``within`` seconds. Gone or another incarnation → ``PodGone``; any
        other refusal → ``DeployFailed``."""

    async def delete(self, pod_id: str, namespace: str) -> bool:
        """Delete a pod; False if it did not exist (404)."""

    async def get_pod(self, pod_id: str, namespace: str) -> PodStatus | None: ...

    async def list_pods(self, namespace: str, label_selector: str) -> list[PodStatus]:
        """Every matching pod (the real client pages the LIST). A namespace that does not
        exist → []; 403 → ``K8sApiError``."""

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        """``GET http://{pod_ip}:{port}/health`` within 3 s; only a 200 is healthy."""


# --- pure helpers ----------------------------------------------------------------------------


def _random_chars(n: int) -> str:
    return "".join(secrets.choice(_NAME_ALPHABET) for _ in range(n))


def new_pod_name(pod_name: str | None) -> str:
    """``{pod_name}-{10}-{5}``: random, so a pod name never leaks a business id."""
    return f"{pod_name or DEFAULT_POD_NAME}-{_random_chars(10)}-{_random_chars(5)}"


def pod_labels(pod_id: str, scope_id: str, deploy_ver: str) -> dict[str, str]:
    """The labels watch, reconcile and cleanup select on (contract §5)."""
    return {
        COMPONENT_LABEL: COMPONENT_VALUE,
        APP_LABEL: pod_id,
        SCOPE_LABEL: scope_id,
        DEPLOY_VER_LABEL: deploy_ver,
    }


def sse_url(pod_ip: str, pod_spec: dict[str, Any]) -> str:
    port = pod_spec.get("sse_port") or DEFAULT_PORT
    return f"http://{pod_ip}:{port}{pod_spec.get('sse_path') or DEFAULT_SSE_PATH}"


def _resources(pod_spec: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Requests and limits with only the quantities the template sets (K8s defaults the rest)."""
    out: dict[str, dict[str, str]] = {}
    for kind, field_kind in (("requests", "request"), ("limits", "limit")):
        quantities = {
            res: pod_spec[f"{res}_{field_kind}"]
            for res in ("cpu", "memory")
            if pod_spec.get(f"{res}_{field_kind}")
        }
        if quantities:
            out[kind] = quantities
    return out


def build_pod_body(
    pod_id: str,
    scope_id: str,
    deploy_ver: str,
    pod_spec: dict[str, Any],
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The Pod manifest (camelCase JSON) for ``create_namespaced_pod``; namespace is in the path.
    ``annotations``: the pod identity's (``PodIdentity.create_annotations``)."""
    if not pod_spec.get("image"):
        raise DeployFailed("pod_spec has no image")
    sse_port = int(pod_spec.get("sse_port") or DEFAULT_PORT)
    container_port = int(pod_spec.get("container_port") or sse_port)
    ports: list[dict[str, Any]] = [{"name": "sse", "containerPort": sse_port, "protocol": "TCP"}]
    if container_port != sse_port:
        ports.append({"name": "http", "containerPort": container_port, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": pod_spec["image"],
        "ports": ports,
        # a string is a value; an object is a ``{"valueFrom": {"secretKeyRef": …}}`` reference
        "env": [
            {"name": k, "value": v} if isinstance(v, str) else {"name": k, **v}
            for k, v in sorted((pod_spec.get("env") or {}).items())
        ],
        # A short period so Ready shows soon after start; the timeout matches our own probe.
        "readinessProbe": {
            "httpGet": {"path": HEALTH_PATH, "port": sse_port},
            "periodSeconds": 2,
            "timeoutSeconds": int(PROBE_TIMEOUT),
        },
    }
    resources = _resources(pod_spec)
    if resources:
        container["resources"] = resources
    spec: dict[str, Any] = {"restartPolicy": "Always", "containers": [container]}
    if pod_spec.get("nfs_server") and pod_spec.get("nfs_path") and pod_spec.get("nfs_mount_path"):
        container["volumeMounts"] = [{"name": NFS_VOLUME, "mountPath": pod_spec["nfs_mount_path"]}]
        spec["volumes"] = [
            {
                "name": NFS_VOLUME,
                "nfs": {"server": pod_spec["nfs_server"], "path": pod_spec["nfs_path"]},
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_id,
            "labels": pod_labels(pod_id, scope_id, deploy_ver),
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
    }


def pod_status_from_json(pod: dict[str, Any]) -> PodStatus:
    """A Pod as the API sends it (camelCase JSON) as a ``PodStatus``: the one place the phase,
    ready and IP rules are read (phase normalised per contract §5)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    containers = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    waiting = [((cs or {}).get("state") or {}).get("waiting") or {} for cs in containers]
    conditions = status.get("conditions") or []
    specs = (pod.get("spec") or {}).get("containers") or [{}]
    return PodStatus(
        pod_id=meta.get("name") or "",
        namespace=meta.get("namespace") or "",
        phase=normalize_phase(
            status.get("phase"),
            deleting=meta.get("deletionTimestamp") is not None,
            waiting_reasons=[w["reason"] for w in waiting if w.get("reason")],
        ),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
        pod_ip=status.get("podIP") or None,
        labels=dict(meta.get("labels") or {}),
        uid=meta.get("uid") or "",
        annotations=dict(meta.get("annotations") or {}),
        image=(specs[0] or {}).get("image") or "",
    )


def pod_status(v1pod: Any) -> PodStatus:
    """A kubernetes_asyncio ``V1Pod`` (get, deploy polling) as a ``PodStatus``: the fields the
    rules read, in their JSON shape, through ``pod_status_from_json`` (a projection, not
    ``to_dict``: ~10 µs a pod instead of ~150; tests check both read every case alike)."""
    meta, status, spec = v1pod.metadata, v1pod.status, v1pod.spec

    def container(cs: Any) -> dict[str, Any]:
        waiting = cs.state.waiting if cs.state is not None else None
        return {"state": {"waiting": {"reason": waiting.reason} if waiting is not None else None}}

    return pod_status_from_json(
        {
            "metadata": {
                "name": meta.name,
                "namespace": meta.namespace,
                "labels": meta.labels,
                "annotations": meta.annotations,
                "uid": meta.uid,
                "deletionTimestamp": meta.deletion_timestamp,
            },
            "spec": None
            if spec is None or not spec.containers
            else {"containers": [{"image": spec.containers[0].image}]},
            "status": None
            if status is None
            else {
                "phase": status.phase,
                "podIP": status.pod_ip,
                "conditions": [
                    {"type": c.type, "status": c.status} for c in status.conditions or []
                ],
                "initContainerStatuses": [
                    container(cs) for cs in status.init_container_statuses or []
                ],
                "containerStatuses": [container(cs) for cs in status.container_statuses or []],
            },
        }
    )


_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_JSON = json.JSONDecoder()


def iter_json_object(text: str, stream: str = "items") -> Iterator[tuple[str, Any]]:
    """The members of the JSON object ``text``, decoded one at a time: ``(key, value)``, and for
    the array member ``stream`` one ``(f"{stream}[]", element)`` per element instead.

    ``json.loads`` of a whole LIST page is one synchronous chunk (tens of ms for 500 pods); a
    caller walking it can yield to the loop between items. Malformed JSON → ``ValueError``.
    """

    def skip(i: int) -> int:
        match = _JSON_SPACE.match(text, i)
        return match.end() if match else i

    def expect(i: int, char: str) -> int:
        if text[i : i + 1] != char:
            raise ValueError(f"expected {char!r} at {i} of a JSON object")
        return skip(i + 1)

    i = expect(skip(0), "{")
    if text[i : i + 1] == "}":
        i = skip(i + 1)
    else:
        while True:
            key, i = _JSON.raw_decode(text, i)
            if not isinstance(key, str):
                raise ValueError(f"a JSON object key is a string, not {key!r}")
            i = expect(skip(i), ":")
            if key == stream and text[i : i + 1] == "[":
                i = skip(i + 1)
                if text[i : i + 1] == "]":
                    i += 1
                else:
                    while True:
                        element, i = _JSON.raw_decode(text, i)
                        yield f"{stream}[]", element
                        i = skip(i)
                        if text[i : i + 1] != ",":
                            break
                        i = skip(i + 1)
                    i = expect(i, "]")
            else:
                value, i = _JSON.raw_decode(text, i)
                yield key, value
            i = skip(i)
            if text[i : i + 1] != ",":
                break
            i = skip(i + 1)
        i = expect(i, "}")
    if i != len(text):
        raise ValueError(f"extra data at {i} after a JSON object")


async def read_pod_list(text: str, into: list[PodStatus]) -> str | None:
    """One PodList page (JSON text) into ``into``; returns its continue token (None: the last
    page). Yields to the loop every ``LIST_PARSE_SLICE`` s, so a page never blocks it for long."""
    token: str | None = None
    clock = time.perf_counter
    await asyncio.sleep(0)  # reading and decoding the page was a slice already
    slice_started = clock()
    for key, value in iter_json_object(text):
        if key == "items[]":
            if not isinstance(value, dict):
                raise ValueError(f"a PodList item is an object, not {type(value).__name__}")
            into.append(pod_status_from_json(value))
        elif key == "metadata" and isinstance(value, dict):
            token = value.get("continue") or None
        if clock() - slice_started >= LIST_PARSE_SLICE:
            await asyncio.sleep(0)
            slice_started = clock()
    return token


def parse_label_selector(selector: str) -> list[label_selector.Requirement]:
    """The requirements of a label selector (``agent_runtime.label_selector``: the grammar we
    accept; ``ValueError`` for anything else)."""
    return label_selector.parse(selector)


def label_selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Whether ``labels`` satisfy every term of ``selector`` (an empty selector matches all)."""
    return labels_match(parse_label_selector(selector), labels)


def labels_match(terms: list[label_selector.Requirement], labels: dict[str, str]) -> bool:
    """``label_selector_matches`` with the selector parsed once (a LIST of many pods)."""
    return label_selector.matches(terms, labels)


def _deploy_timing(pod_spec: dict[str, Any]) -> tuple[float, float]:
    timeout = float(pod_spec.get("ready_timeout") or DEFAULT_READY_TIMEOUT)
    poll = float(pod_spec.get("ready_poll_interval") or DEFAULT_READY_POLL_INTERVAL)
    return timeout, min(poll, timeout)


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
    at startup, opened in ``start``); that client serves new deploys only. A name that is not
    configured fails the deploy without opening anything. delete, get_pod, list_pods (and so
    watch, reconcile and cleanup) always use the default client: pods deployed into another
    cluster are not seen by them (a known limitation).
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

    # reads and deletes (default client)

    async def delete(self, pod_id: str, namespace: str) -> bool:
        api = await self._api(None)
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

    async def get_pod(self, pod_id: str, namespace: str) -> PodStatus | None:
        api = await self._api(None)
        try:
            v1pod = await self._call(
                f"get pod {namespace}/{pod_id}", lambda: api.read_namespaced_pod(pod_id, namespace)
            )
        except K8sApiError as exc:
            if exc.status == 404:
                return None
            raise
        return pod_status(v1pod)

    async def list_pods(self, namespace: str, label_selector: str) -> list[PodStatus]:
        """Paged as client-go's pager: ``limit`` ``LIST_PAGE_SIZE`` and each page's continue
        token, until a page has none. Each page is one ``_call`` (bounded, every failure a
        ``K8sApiError``), read as raw JSON (no V1Pod models) a slice at a time. A 404 (the
        namespace) → []; a 410 of a continued page (its token expired) → the list again from
        the start, once; any other refusal, or a second 410, is raised."""
        api = await self._api(None)
        what = f"list pods in {namespace} ({label_selector})"
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
        ready_timeout, poll = _deploy_timing(pod_spec)
        deadline = _Deadline(ready_timeout)  # create and readiness together
        api = await self._deploy_api(pod_spec)
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
        return PodDeployInfo(name, job.namespace, pod_ip, sse_url(pod_ip, pod_spec))

    async def await_ready(
        self, pod_id: str, namespace: str, pod_spec: dict[str, Any], *, uid: str, within: float
    ) -> PodDeployInfo:
        _, poll = _deploy_timing(pod_spec)
        api = await self._deploy_api(pod_spec)  # the pod's cluster: where its deploy went
        # one GET at least, however little of the pod's own deadline is left
        deadline = _Deadline(max(within, AWAIT_READY_MIN))
        job = _DeployJob(api, namespace, "", "", pod_spec, deadline, identity=None)
        pod_ip = await self._wait_ready(job, pod_id, uid, poll)
        return PodDeployInfo(pod_id, namespace, pod_ip, sse_url(pod_ip, pod_spec))

    async def _deploy_api(self, pod_spec: dict[str, Any]) -> Any:
        """The API of the template's cluster, or ``DeployFailed`` (an unknown or down one)."""
        cluster = pod_spec.get("kubeconfig")
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
    ) -> None:
        api = await self._deploy_api(pod_spec)  # the pod's cluster: where its deploy went
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


# --- fake client -----------------------------------------------------------------------------


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

    Pod IPs are loopback: 127.0.1.1 … 127.0.1.254, then 127.0.2.x and so on.
    """

    def __init__(self, *, default_namespace: str = "default", ready_delay: float = 0.0) -> None:
        self.default_namespace = default_namespace
        self.ready_delay = ready_delay
        self.never_ready = False
        self.fail_next_deploys = 0
        self.unhealthy: set[str] = set()
        self.missing_namespaces: set[str] = set()
        self.forbidden_namespaces: set[str] = set()
        self.pods: dict[str, PodStatus] = {}
        self.deleted: list[str] = []
        self.deploy_calls = 0
        self.started = False
        self._ips_given = 0
        self._pod_of_ip: dict[str, str] = {}  # probes find their pod in O(1) (10k-pod benches)
        self._starting: dict[str, float] = {}  # deployed pods not yet Running → created (loop)

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False

    # faults and test helpers

    def set_phase(
        self,
        pod_id: str,
        phase: str,
        waiting_reason: str | None = None,
        *,
        ready: bool | None = None,
    ) -> None:
        """Move a pod to ``phase`` (a waiting reason wins, as in ``pod_status``); Ready follows
        Running unless ``ready`` says otherwise."""
        pod = self.pods[pod_id]
        reasons = (waiting_reason,) if waiting_reason else ()
        phase = normalize_phase(phase, deleting=False, waiting_reasons=reasons)
        running = phase == "Running"
        self.pods[pod_id] = dataclasses.replace(
            pod,
            phase=phase,
            ready=running if ready is None else ready,
            pod_ip=pod.pod_ip or (self._next_ip(pod_id) if running else None),
        )

    def kill(self, pod_id: str) -> None:
        self.set_phase(pod_id, "Failed")

    def remove(self, pod_id: str) -> None:
        """The pod vanishes as if someone else deleted it (not recorded in ``deleted``)."""
        self.pods.pop(pod_id, None)

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
            pod_ip=None if phase == "Pending" else self._next_ip(pod_id),
            labels={**pod_labels(pod_id, scope_id, deploy_ver), **(labels or {})},
            uid=uid,
            annotations={**notes, **(annotations or {})},
            image=image,
        )
        self.pods[pod_id] = pod
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

    def _next_ip(self, pod_id: str) -> str:
        n, self._ips_given = self._ips_given, self._ips_given + 1
        ip = f"127.0.{1 + n // 254}.{1 + n % 254}"
        self._pod_of_ip[ip] = pod_id
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
        for pod_id, created in list(self._starting.items()):
            pod = self.pods.get(pod_id)
            if pod is None or pod.phase != "Pending":
                del self._starting[pod_id]
            elif now - created >= self.ready_delay:
                del self._starting[pod_id]
                self.set_phase(pod_id, "Running")

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
        if self.fail_next_deploys > 0:
            self.fail_next_deploys -= 1
            raise DeployFailed("fake: injected deploy failure")
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
        self.pods[pod_id] = PodStatus(
            pod_id, namespace, "Pending", False, None, body["metadata"]["labels"],
            uid=uid, annotations=notes, image=pod_spec["image"],
        )  # fmt: skip
        self._starting[pod_id] = asyncio.get_running_loop().time()
        try:
            if on_created is not None:
                await on_created(pod_id, namespace, uid)
            incarnation = identity.incarnation_annotations(
                uid=uid, identity=notes[IDENTITY_ANNOTATION]
            )
            await self.sign(
                pod_id, namespace, pod_spec, uid=uid, annotations=incarnation, within=0.0
            )
            pod_ip = await self._wait_ready(pod_id, uid, _deploy_timing(pod_spec))
        except BaseException:  # as the real client: a failed or cancelled deploy leaves no pod
            if self.pods.pop(pod_id, None) is not None:
                self.deleted.append(pod_id)
            raise
        return PodDeployInfo(pod_id, namespace, pod_ip, sse_url(pod_ip, pod_spec))

    async def await_ready(
        self, pod_id: str, namespace: str, pod_spec: dict[str, Any], *, uid: str, within: float
    ) -> PodDeployInfo:
        self._check_namespace(namespace)
        pod = self.pods.get(pod_id)
        if pod is None or pod.namespace != namespace:
            raise PodGone(f"pod {pod_id} disappeared")
        _, poll = _deploy_timing(pod_spec)
        pod_ip = await self._wait_ready(pod_id, uid, (max(within, 0.0), poll))
        return PodDeployInfo(pod_id, namespace, pod_ip, sse_url(pod_ip, pod_spec))

    async def sign(
        self,
        pod_id: str,
        namespace: str,
        pod_spec: dict[str, Any],
        *,
        uid: str,
        annotations: dict[str, str],
        within: float,
    ) -> None:
        if namespace in self.forbidden_namespaces:
            raise DeployFailed(f"sign pod {namespace}/{pod_id} refused: 403 Forbidden")
        pod = self.pods.get(pod_id)
        if pod is None or pod.namespace != namespace or pod.uid != uid:
            raise PodGone(f"pod {pod_id} disappeared")
        self.pods[pod_id] = dataclasses.replace(pod, annotations={**pod.annotations, **annotations})

    async def _wait_ready(self, pod_id: str, uid: str, timing: tuple[float, float]) -> str:
        """Like the real poll loop: a pod killed, removed or replaced meanwhile fails at the
        next poll."""
        timeout, poll = timing
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            self._kubelet()
            pod = self.pods.get(pod_id)
            if pod is None or pod.uid != uid:
                raise PodGone(f"pod {pod_id} disappeared")
            if pod.dead:
                raise DeployFailed(f"pod {pod_id} is {pod.phase}")
            if pod.ready and pod.pod_ip:
                return pod.pod_ip
            elapsed = loop.time() - started
            if elapsed >= timeout:
                raise DeployFailed(f"pod {pod_id} not Ready within {timeout:g}s (last: Pending)")
            created = self._starting.get(pod_id)
            due = math.inf if created is None or self.never_ready else self.ready_delay
            until_due = (created or 0.0) + due - loop.time()
            await asyncio.sleep(max(min(poll, timeout - elapsed, until_due), 0.0))

    async def delete(self, pod_id: str, namespace: str) -> bool:
        self._check_namespace(namespace)
        pod = self.pods.get(pod_id)
        if pod is None or pod.namespace != namespace:
            return False
        del self.pods[pod_id]
        self.deleted.append(pod_id)
        return True

    async def get_pod(self, pod_id: str, namespace: str) -> PodStatus | None:
        self._check_namespace(namespace)
        self._kubelet()
        pod = self.pods.get(pod_id)
        return pod if pod is not None and pod.namespace == namespace else None

    async def list_pods(self, namespace: str, label_selector: str) -> list[PodStatus]:
        self._check_namespace(namespace)
        if namespace in self.missing_namespaces:
            return []
        self._kubelet()
        terms = parse_label_selector(label_selector)
        pods = list(self.pods.values())
        found: list[PodStatus] = []
        for i in range(0, len(pods), LIST_PAGE_SIZE):  # pages, as the real client reads them
            if i:
                await asyncio.sleep(0)
            page = pods[i : i + LIST_PAGE_SIZE]
            found += [p for p in page if p.namespace == namespace and labels_match(terms, p.labels)]
        return found

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        pod = self.pods.get(self._pod_of_ip.get(pod_ip, ""))
        return (
            pod is not None
            and pod.pod_ip == pod_ip
            and pod.phase == "Running"
            and pod.pod_id not in self.unhealthy
        )


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
        self, pod_id: str, namespace: str, pod_spec: dict[str, Any], *, uid: str, within: float
    ) -> PodDeployInfo:
        call = self.inner.await_ready(pod_id, namespace, pod_spec, uid=uid, within=within)
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
    ) -> None:
        call = self.inner.sign(
            pod_id, namespace, pod_spec, uid=uid, annotations=annotations, within=within
        )
        await self._timed("sign", call)

    async def delete(self, pod_id: str, namespace: str) -> bool:
        return await self._timed("delete", self.inner.delete(pod_id, namespace))

    async def get_pod(self, pod_id: str, namespace: str) -> PodStatus | None:
        return await self._timed("get", self.inner.get_pod(pod_id, namespace))

    async def list_pods(self, namespace: str, label_selector: str) -> list[PodStatus]:
        return await self._timed("list", self.inner.list_pods(namespace, label_selector))

    async def probe_health(self, pod_ip: str, port: int) -> bool:
        return await self._timed("probe_health", self.inner.probe_health(pod_ip, port))
