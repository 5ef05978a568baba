"""The Kubernetes API over HTTP: the core/v1 subset kubernetes_asyncio uses for pods.

==========================================  ==================================================
``GET /version``, ``/api``, ``/api/v1``,     discovery (enough for kubectl)
``/apis``, ``/healthz``, ``/readyz``
``GET /api/v1/namespaces[/{ns}]``            Namespace(List); 404 missing, 403 forbidden
``GET /api/v1/pods``                         pods of every namespace
``GET /api/v1/namespaces/{ns}/pods``         PodList; ``labelSelector``, ``fieldSelector``,
                                             ``limit`` and ``continue`` (``paging.py``)
``GET .../pods?watch=1`` (both of the above)  a watch stream (``watch.py``):
                                             ``resourceVersion``, ``timeoutSeconds``,
                                             ``allowWatchBookmarks``, the selectors; 429
                                             over the cap, 410 in-stream when too old
``POST /api/v1/namespaces/{ns}/pods``        201 Pod; 409 AlreadyExists, 422 Invalid, 404 ns
``GET /api/v1/namespaces/{ns}/pods/{name}``  Pod; 404 NotFound
``PATCH .../pods/{name}``                    200 Pod: a merge (or strategic merge) patch of
                                             ``metadata.labels`` / ``annotations``; 409 stale
                                             resourceVersion, 422 immutable (``uid``), 415
``DELETE .../pods/{name}``                   200 Pod (``gracePeriodSeconds`` query or body)
``/api/v1/nodes[/{name}]``                   GET, PATCH, watch (``api_nodes.py``)
``/api/v1[/namespaces/{ns}]/events[/{name}]`` POST, GET (list, one), PATCH, DELETE
                                             (``api_events.py``, ``events.py``)
``/_sim/...``                                the control endpoint (``control.py``)
==========================================  ==================================================

Every failure is a ``Status`` (``errors.py``). Each request of the API passes the gate first:
fault latency, then injected errors (429 / 5xx), then the namespace's RBAC (403).
Not served: PUT, JSON patches and server-side apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kubesim import pods, watch
from kubesim.api_events import add_event_routes
from kubesim.api_nodes import add_node_routes
from kubesim.control import add_control_routes
from kubesim.errors import (
    PATCH_TYPES,
    ApiError,
    bad_request,
    forbidden,
    injected,
    method_not_allowed,
    not_found,
    path_not_found,
    server_error,
    too_many_requests,
    unauthorized,
    unsupported_media_type,
)
from kubesim.labels import SelectorError, parse_field_selector, parse_selector
from kubesim.paging import parse_limit
from kubesim.store import Obj
from kubesim.watch import (
    Event,
    Expired,
    Filter,
    TooManyWatches,
    Watcher,
    is_flag,
    resource_version_param,
    timeout_seconds,
)

if TYPE_CHECKING:
    from kubesim.sim import KubeSim

SIM: web.AppKey[KubeSim] = web.AppKey("kubesim")
VERSION = {
    "major": "1",
    "minor": "31",
    "gitVersion": "v1.31.0-kubesim",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2024-08-13T00:00:00Z",
    "goVersion": "go1.22.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        text=json.dumps(obj), status=status, headers=headers, content_type="application/json"
    )


def status_response(error: ApiError) -> web.Response:
    return _json(error.status(), error.code, error.headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    sim = request.app[SIM]
    if request.path.startswith("/_sim/"):
        return await handler(request)
    try:
        if sim.token is not None and request.headers.get("Authorization") != f"Bearer {sim.token}":
            raise unauthorized()
        return await handler(request)
    except ApiError as exc:
        return status_response(exc)
    except web.HTTPMethodNotAllowed:
        return status_response(method_not_allowed())
    except web.HTTPNotFound:
        return status_response(path_not_found())


def build_app(sim: KubeSim) -> web.Application:
    app = web.Application(middlewares=[_api_middleware], client_max_size=3 * 1024 * 1024)
    app[SIM] = sim
    api = _Api(sim)
    add_control_routes(app, sim)
    app.router.add_get("/version", api.version)
    for probe in ("/healthz", "/livez", "/readyz"):
        app.router.add_get(probe, api.healthz)
    app.router.add_get("/api", api.api_versions)
    app.router.add_get("/api/v1", api.api_resources)
    app.router.add_get("/apis", api.api_groups)
    app.router.add_get("/api/v1/namespaces", api.list_namespaces)
    app.router.add_get("/api/v1/namespaces/{namespace}", api.get_namespace)
    app.router.add_get("/api/v1/pods", api.list_pods)
    app.router.add_get("/api/v1/namespaces/{namespace}/pods", api.list_pods)
    app.router.add_post("/api/v1/namespaces/{namespace}/pods", api.create_pod)
    app.router.add_get("/api/v1/namespaces/{namespace}/pods/{name}", api.get_pod)
    app.router.add_patch("/api/v1/namespaces/{namespace}/pods/{name}", api.patch_pod)
    app.router.add_delete("/api/v1/namespaces/{namespace}/pods/{name}", api.delete_pod)
    add_node_routes(app, sim, api.gate, api.watch)
    add_event_routes(app, sim, api.gate)
    return app


class _Api:
    def __init__(self, sim: KubeSim) -> None:
        self.sim = sim

    # --- the gate every API request passes ---------------------------------------------------

    async def gate(
        self,
        verb: str,
        resource: str,
        namespace: str | None,
        name: str | None = None,
        labels: dict[str, str] | None = None,
        *,
        exact: bool = False,
    ) -> None:
        """Latency, injected errors and RBAC, in that order. ``exact``: a fault rule must name
        ``resource`` itself (events: a ``*`` rule is meant for the pods)."""
        sim = self.sim
        sim.requests[f"{verb} {resource}"] += 1
        match: dict[str, Any] = {
            "verb": verb,
            "resource": resource,
            "namespace": namespace,
            "name": name,
            "labels": labels,
            "exact": exact,
        }
        slow = sim.faults.take("latency", **match)
        if slow is not None:
            sim.injected["latency"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sim.stopping.wait(), float(slow.params["seconds"]))
            if sim.stopping.is_set():
                raise server_error(503, "kubesim is stopping")
        failure = sim.faults.take("api_error", **match)
        if failure is not None:
            code = int(failure.params["status"])
            sim.injected[f"api_error {code}"] += 1
            raise injected(code, int(failure.params["retry_after"]))
        if namespace is not None and sim.faults.namespace_state(namespace) == "forbidden":
            raise forbidden(sim.user, verb, resource, namespace, name or "")

    def _stored_labels(self, namespace: str, name: str) -> dict[str, str] | None:
        pod = self.sim.store.get_pod(namespace, name)
        return dict(pod["metadata"].get("labels") or {}) if pod is not None else None

    def _reply_lost(self, request: web.Request, verb: str, pod: Obj) -> web.Response | None:
        meta = pod["metadata"]
        lost = self.sim.faults.take(
            "reply_lost",
            verb=verb,
            namespace=meta["namespace"],
            name=meta["name"],
            labels=meta.get("labels") or {},
        )
        if lost is None:
            return None
        mode = str(lost.params["mode"])
        self.sim.injected[f"reply_lost {mode}"] += 1
        if mode == "500":
            raise server_error(500, f"the {verb} was applied but its reply was lost")
        # drop: close the connection without a byte of answer (the write below then fails,
        # which aiohttp takes as a client that went away)
        request.protocol.force_close()
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=500)

    # --- discovery ----------------------------------------------------------------------------

    async def version(self, request: web.Request) -> web.Response:
        return _json(VERSION)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def api_versions(self, request: web.Request) -> web.Response:
        return _json(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.sim.host}:{self.sim.port}"}
                ],
            }
        )

    async def api_groups(self, request: web.Request) -> web.Response:
        return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": []})

    async def api_resources(self, request: web.Request) -> web.Response:
        def resource(name: str, kind: str, namespaced: bool, verbs: list[str]) -> dict[str, Any]:
            return {
                "name": name,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": verbs,
            }

        return _json(
            {
                "kind": "APIResourceList",
                "groupVersion": "v1",
                "resources": [
                    resource("namespaces", "Namespace", False, ["get", "list"]),
                    resource("nodes", "Node", False, ["get", "list", "patch", "watch"]),
                    resource(
                        "pods", "Pod", True, ["create", "delete", "get", "list", "patch", "watch"]
                    ),
                    resource("events", "Event", True, ["create", "delete", "get", "list", "patch"]),
                ],
            }
        )

    # --- namespaces -----------------------------------------------------------------------------

    async def list_namespaces(self, request: web.Request) -> web.Response:
        await self.gate("list", "namespaces", None)
        items = [
            ns
            for name, ns in sorted(self.sim.store.namespaces.items())
            if self.sim.namespace_exists(name)
        ]
        return _json(
            {
                "kind": "NamespaceList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": self.sim.store.resource_version},
                "items": [_item(ns) for ns in items],
            }
        )

    async def get_namespace(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        await self.gate("get", "namespaces", namespace, namespace)
        if not self.sim.namespace_exists(namespace):
            raise not_found("namespaces", namespace)
        return _json(self.sim.store.namespaces[namespace])

    # --- pods -------------------------------------------------------------------------------------

    async def list_pods(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info.get("namespace")
        query = request.query
        watching = is_flag(query.get("watch"))
        await self.gate("watch" if watching else "list", "pods", namespace)
        try:
            selector = parse_selector(query.get("labelSelector"))
            fields = parse_field_selector(query.get("fieldSelector"))
        except SelectorError as exc:
            raise bad_request(str(exc)) from None
        if watching:
            return await self.watch(request, Filter("pods", namespace, selector, fields), "Pod")
        limit = parse_limit(query.get("limit"))
        sim = self.sim

        def listing() -> Iterator[tuple[str, Obj]]:
            """(key relative to the list's prefix, item) of the pods the list shows."""
            if namespace is not None and not sim.namespace_exists(namespace):
                return  # a missing namespace lists empty
            for (ns, name), pod in sim.store.iter_pods(namespace, selector, fields):
                if sim.faults.namespace_state(ns) is None:
                    yield (name if namespace is not None else f"{ns}/{name}"), _item(pod)

        def expire() -> bool:
            if sim.faults.take("continue_expired", namespace=namespace) is None:
                return False
            sim.injected["continue_expired"] += 1
            return True

        page = sim.pager.page(
            (namespace, query.get("labelSelector") or "", query.get("fieldSelector") or ""),
            limit=limit,
            token=query.get("continue") or None,
            resource_version=int(sim.store.resource_version),
            listing=listing,
            expire=expire,
        )
        return web.Response(text=page.list_text("PodList"), content_type="application/json")

    async def watch(self, request: web.Request, what: Filter, kind: str) -> web.StreamResponse:
        """A watch (``watch.py``): parameters checked, the watcher opened (429 over the cap),
        then the stream; a version older than the history is the in-stream 410."""
        sim, query = self.sim, request.query
        since = resource_version_param(query.get("resourceVersion"))
        timeout = timeout_seconds(query.get("timeoutSeconds"), sim.watch_timeout, sim.rng)
        bookmarks = sim.bookmark_interval if is_flag(query.get("allowWatchBookmarks")) else None
        opened: tuple[Watcher, list[Event]] | Expired
        current: list[Obj] = []
        if since is None and what.resource == "nodes":
            current = sim.store.list_nodes(what.selector, what.fields)
        elif since is None:
            current = [
                pod
                for pod in sim.store.list_pods(what.namespace, what.selector, what.fields)
                if sim.namespace_exists(pod["metadata"]["namespace"])
            ]
        try:
            opened = sim.watches.open(what, since, current)
        except TooManyWatches:
            sim.injected["watch refused"] += 1
            raise too_many_requests(1) from None
        except Expired as exc:
            opened = exc

        def visible(event: Event) -> bool:
            namespace = event.namespace
            return namespace is None or sim.namespace_exists(namespace)

        return await watch.stream(
            request,
            kind=kind,
            opened=opened,
            seconds=timeout,
            bookmarks=bookmarks,
            visible=visible,
            stopping=sim.stopping,
        )

    async def create_pod(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        try:
            body = await request.json()
        except ValueError:
            raise bad_request("the body of the request was in an unknown format") from None
        meta = body.get("metadata") if isinstance(body, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        labels = meta.get("labels") if isinstance(meta, dict) else None
        await self.gate(
            "create",
            "pods",
            namespace,
            name if isinstance(name, str) else None,
            labels if isinstance(labels, dict) else None,
        )
        if not self.sim.namespace_exists(namespace):
            raise not_found("namespaces", namespace)
        pod = self.sim.create_pod(pods.admit(namespace, body, self.sim.rng))
        dropped = self._reply_lost(request, "create", pod)
        return dropped or _json(pod, 201)

    async def get_pod(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        await self.gate("get", "pods", namespace, name, self._stored_labels(namespace, name))
        if not self.sim.namespace_exists(namespace):
            raise not_found("pods", name)
        return _json(self.sim.store.require_pod(namespace, name))

    async def patch_pod(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        await self.gate("patch", "pods", namespace, name, self._stored_labels(namespace, name))
        if request.content_type not in PATCH_TYPES:
            raise unsupported_media_type(request.content_type)
        try:
            patch = await request.json()
        except ValueError:
            raise bad_request("the body of the request was in an unknown format") from None
        if not self.sim.namespace_exists(namespace):
            raise not_found("pods", name)
        pod = self.sim.patch_pod(namespace, name, patch)
        dropped = self._reply_lost(request, "patch", pod)
        return dropped or _json(pod)

    async def delete_pod(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        await self.gate("delete", "pods", namespace, name, self._stored_labels(namespace, name))
        grace = await _grace_seconds(request)
        if not self.sim.namespace_exists(namespace):
            raise not_found("pods", name)
        pod = await self.sim.delete_pod(namespace, name, grace)
        dropped = self._reply_lost(request, "delete", pod)
        return dropped or _json(pod)


def _item(obj: Obj) -> Obj:
    """A list item: the API server leaves out ``kind`` and ``apiVersion``."""
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


async def _grace_seconds(request: web.Request) -> int | None:
    """``gracePeriodSeconds`` from the query, else from a ``DeleteOptions`` body."""
    raw: Any = request.query.get("gracePeriodSeconds")
    if raw is None and request.can_read_body:
        text = await request.text()
        if text.strip() and text.strip() != "null":
            try:
                options = json.loads(text)
            except ValueError:
                raise bad_request("the body of the request was in an unknown format") from None
            if isinstance(options, dict):
                raw = options.get("gracePeriodSeconds")
    if raw is None:
        return None
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise bad_request(f'invalid value for gracePeriodSeconds: "{raw}"') from None
