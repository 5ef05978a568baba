"""The Kubernetes API for core/v1 Events (what ``kubectl describe pod`` lists), over
``events.py``'s bounded store, behind the same gate as pods (RBAC, faults: only a rule that
names ``resource: events``).

=============================================  ================================================
``GET /api/v1/events``                          events of every namespace
``GET /api/v1/namespaces/{ns}/events``          EventList; ``labelSelector``, ``fieldSelector``
                                                (``involvedObject.name`` / ``.namespace`` /
                                                ``.uid`` / ``.kind`` …, ``reason``, ``type``),
                                                ``limit`` and ``continue`` (``paging.py``)
``POST /api/v1/namespaces/{ns}/events``         201 Event; 409 AlreadyExists, 422 Invalid,
                                                404 namespace
``GET .../events/{name}``                       Event; 404 NotFound
``PATCH .../events/{name}``                     200 Event: a merge or strategic merge patch
                                                (``count``, ``lastTimestamp``, ``message``…);
                                                422 immutable fields, 415 other patch types
``DELETE .../events/{name}``                    200 Event
=============================================  ================================================

No watch of events is served.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kubesim.errors import PATCH_TYPES, bad_request, not_found, unsupported_media_type
from kubesim.events import EVENT_FIELDS
from kubesim.labels import SelectorError, parse_field_selector, parse_selector
from kubesim.paging import parse_limit
from kubesim.store import Obj

if TYPE_CHECKING:
    from kubesim.sim import KubeSim


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


async def _body(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise bad_request("the body of the request was in an unknown format") from None


def add_event_routes(
    app: web.Application, sim: KubeSim, gate: Callable[..., Awaitable[None]]
) -> None:
    async def allowed(verb: str, namespace: str | None, name: str | None = None) -> None:
        await gate(verb, "events", namespace, name, None, exact=True)

    def existing(namespace: str, name: str) -> None:
        if not sim.namespace_exists(namespace):
            raise not_found("events", name)

    async def list_events(request: web.Request) -> web.Response:
        namespace = request.match_info.get("namespace")
        query = request.query
        await allowed("list", namespace)
        try:
            selector = parse_selector(query.get("labelSelector"))
            fields = parse_field_selector(query.get("fieldSelector"), EVENT_FIELDS)
        except SelectorError as exc:
            raise bad_request(str(exc)) from None

        def listing() -> Iterator[tuple[str, Obj]]:
            if namespace is not None and not sim.namespace_exists(namespace):
                return
            for (ns, name), event in sim.events.iter(namespace, selector, fields):
                if sim.faults.namespace_state(ns) is None:
                    key = name if namespace is not None else f"{ns}/{name}"
                    yield key, {k: v for k, v in event.items() if k not in ("kind", "apiVersion")}

        page = sim.event_pager.page(
            (namespace, query.get("labelSelector") or "", query.get("fieldSelector") or ""),
            limit=parse_limit(query.get("limit")),
            token=query.get("continue") or None,
            resource_version=int(sim.store.resource_version),
            listing=listing,
        )
        return web.Response(text=page.list_text("EventList"), content_type="application/json")

    async def create_event(request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        body = await _body(request)
        meta = body.get("metadata") if isinstance(body, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        await allowed("create", namespace, name if isinstance(name, str) else None)
        if not sim.namespace_exists(namespace):
            raise not_found("namespaces", namespace)
        return _json(sim.events.create(namespace, body), 201)

    async def get_event(request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        await allowed("get", namespace, name)
        existing(namespace, name)
        return _json(sim.events.get(namespace, name))

    async def patch_event(request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        await allowed("patch", namespace, name)
        if request.content_type not in PATCH_TYPES:
            raise unsupported_media_type(request.content_type)
        patch = await _body(request)
        existing(namespace, name)
        return _json(sim.events.patch(namespace, name, patch))

    async def delete_event(request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        await allowed("delete", namespace, name)
        existing(namespace, name)
        return _json(sim.events.delete(namespace, name))

    app.router.add_get("/api/v1/events", list_events)
    app.router.add_get("/api/v1/namespaces/{namespace}/events", list_events)
    app.router.add_post("/api/v1/namespaces/{namespace}/events", create_event)
    app.router.add_get("/api/v1/namespaces/{namespace}/events/{name}", get_event)
    app.router.add_patch("/api/v1/namespaces/{namespace}/events/{name}", patch_event)
    app.router.add_delete("/api/v1/namespaces/{namespace}/events/{name}", delete_event)
