"""The Kubernetes API for nodes (core/v1), on the same gate and watch machinery as pods.

===========================================  ===================================================
``GET /api/v1/nodes``                         NodeList (``labelSelector``; ``fieldSelector``
                                              ``metadata.name``, ``spec.unschedulable``); one
                                              page; ``watch=1``: a node watch (``watch.py``)
``GET /api/v1/nodes/{name}``                  Node; 404 NotFound
``PATCH /api/v1/nodes/{name}``                200 Node: a merge (or strategic merge) patch of
                                              ``spec.unschedulable`` (``kubectl cordon``) and
                                              ``metadata.labels`` / ``annotations``; 409 stale
                                              resourceVersion, 422 anything else, 415
===========================================  ===================================================
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kubesim.errors import PATCH_TYPES, bad_request, unsupported_media_type
from kubesim.labels import NODE_FIELDS, SelectorError, parse_field_selector, parse_selector
from kubesim.watch import Filter, is_flag

if TYPE_CHECKING:
    from kubesim.sim import KubeSim

Gate = Callable[[str, str, str | None, str | None], Awaitable[None]]
Watch = Callable[[web.Request, Filter, str], Awaitable[web.StreamResponse]]


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


def add_node_routes(app: web.Application, sim: KubeSim, gate: Gate, watch: Watch) -> None:
    async def list_nodes(request: web.Request) -> web.StreamResponse:
        query = request.query
        watching = is_flag(query.get("watch"))
        await gate("watch" if watching else "list", "nodes", None, None)
        try:
            selector = parse_selector(query.get("labelSelector"))
            fields = parse_field_selector(query.get("fieldSelector"), NODE_FIELDS)
        except SelectorError as exc:
            raise bad_request(str(exc)) from None
        if watching:
            return await watch(request, Filter("nodes", None, selector, fields), "Node")
        items = [
            {k: v for k, v in node.items() if k not in ("kind", "apiVersion")}
            for node in sim.store.list_nodes(selector, fields)
        ]
        meta = {"resourceVersion": sim.store.resource_version}
        return _json({"kind": "NodeList", "apiVersion": "v1", "metadata": meta, "items": items})

    async def get_node(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await gate("get", "nodes", None, name)
        return _json(sim.store.require_node(name))

    async def patch_node(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        await gate("patch", "nodes", None, name)
        if request.content_type not in PATCH_TYPES:
            raise unsupported_media_type(request.content_type)
        try:
            patch = await request.json()
        except ValueError:
            raise bad_request("the body of the request was in an unknown format") from None
        return _json(sim.nodes.patch(name, patch))

    app.router.add_get("/api/v1/nodes", list_nodes)
    app.router.add_get("/api/v1/nodes/{name}", get_node)
    app.router.add_patch("/api/v1/nodes/{name}", patch_node)
