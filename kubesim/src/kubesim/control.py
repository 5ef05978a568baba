"""The control endpoint: how a test or a person steers the simulator (no auth; loopback only).

=====================================================  ==========================================
``GET /_sim/state``                                    pods, nodes, namespaces, watches, faults,
                                                       request counts
``GET /_sim/faults``                                   the fault rules
``POST /_sim/faults``                                  add one (JSON, see ``faults.py``) → 201
``DELETE /_sim/faults``                                remove all
``DELETE /_sim/faults/{id}``                           remove one (404 if unknown)
``POST /_sim/pods/{ns}/{name}/kill``                   ``{"mode": "vanish"|"fail"|"crash"}``
``POST /_sim/pods/{ns}/{name}/delete``                 a graceful delete waiting exactly
                                                       ``{"grace_seconds": N}`` (not capped by
                                                       ``grace_period``; default: the pod's)
``POST /_sim/nodes/{name}/cordon``, ``/uncordon``      ``spec.unschedulable`` true / removed
``POST /_sim/namespaces/{ns}``                         create a namespace
``DELETE /_sim/namespaces/{ns}``                       remove it and its pods
``POST /_sim/settings``                                ``ready_delay``, ``jitter``,
                                                       ``grace_period``, ``probe_period``
``POST /_sim/reset``                                   drop every pod, fault and counter
``POST /_sim/watches/drop``                            end every open watch stream now;
                                                       ``{"mode": "close"}`` (default: the stream
                                                       ends cleanly) or ``"reset"`` (the
                                                       connection is cut) → ``{"dropped": n}``
``POST /_sim/watches/compact``                         forget the event history: a watch resumed
                                                       from an older version gets 410
=====================================================  ==========================================

Refusals are ``{"error": "..."}`` with 400 (bad input) or 404 (no such fault, pod, node).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kubesim.errors import ApiError
from kubesim.labels import dns1123_label_errors
from kubesim.watch import DROP_MODES

if TYPE_CHECKING:
    from kubesim.sim import KubeSim

PREFIX = "/_sim"
MAX_GRACE_SECONDS = 3600  # a control delete's longest grace: bounded like every input


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


def _refuse(message: str, status: int = 400) -> web.Response:
    return _json({"error": message}, status)


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    text = await request.text()
    if not text.strip():
        return {}
    body = json.loads(text)  # ValueError → 400 in the handlers
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def add_control_routes(app: web.Application, sim: KubeSim) -> None:
    async def state(request: web.Request) -> web.Response:
        return _json(sim.state())

    async def list_faults(request: web.Request) -> web.Response:
        return _json(sim.faults.to_json())

    async def add_fault(request: web.Request) -> web.Response:
        try:
            fault = sim.faults.add_json(await _body(request))
        except (ValueError, TypeError) as exc:
            return _refuse(str(exc))
        return _json(fault.to_json(), 201)

    async def clear_faults(request: web.Request) -> web.Response:
        sim.faults.clear()
        return _json({"faults": []})

    async def remove_fault(request: web.Request) -> web.Response:
        raw = request.match_info["id"]
        if not raw.isdigit() or not sim.faults.remove(int(raw)):
            return _refuse(f"no fault {raw}", 404)
        return _json({"removed": int(raw)})

    async def kill(request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        try:
            mode = str((await _body(request)).get("mode") or "fail")
            pod = await sim.kill(namespace, name, mode)
        except ValueError as exc:
            return _refuse(str(exc))
        except ApiError as exc:
            return _refuse(exc.message, exc.code)
        return _json({"killed": name, "mode": mode, "pod": pod})

    async def delete_pod(request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        try:
            raw = (await _body(request)).get("grace_seconds")
            grace = None if raw is None else int(raw)
            if grace is not None and not 0 <= grace <= MAX_GRACE_SECONDS:
                raise ValueError(f"grace_seconds must be between 0 and {MAX_GRACE_SECONDS}")
            pod = await sim.delete_pod(namespace, name, grace, capped=False)
        except (ValueError, TypeError) as exc:
            return _refuse(str(exc))
        except ApiError as exc:
            return _refuse(exc.message, exc.code)
        return _json({"deleting": name, "grace_seconds": grace, "pod": pod})

    async def cordon(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        flag = request.match_info["action"] == "cordon"
        try:
            return _json(sim.nodes.cordon(name, flag))
        except ApiError as exc:
            return _refuse(exc.message, exc.code)

    async def add_namespace(request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        errors = dns1123_label_errors(namespace)
        if errors:
            return _refuse(f"namespace {namespace!r}: {errors[0]}")
        return _json(sim.store.add_namespace(namespace), 201)

    async def remove_namespace(request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        if namespace not in sim.store.namespaces:
            return _refuse(f"no namespace {namespace}", 404)
        await sim.remove_namespace(namespace)
        return _json({"removed": namespace})

    async def settings(request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            values = {key: float(value) for key, value in body.items()}
            sim.set_timing(**values)
        except (ValueError, TypeError) as exc:
            return _refuse(str(exc))
        return _json(sim.state()["settings"])

    async def reset(request: web.Request) -> web.Response:
        await sim.reset()
        return _json({"reset": True})

    async def drop_watches(request: web.Request) -> web.Response:
        try:
            mode = str((await _body(request)).get("mode") or "close")
        except ValueError as exc:
            return _refuse(str(exc))
        if mode not in DROP_MODES:
            return _refuse(f"drop mode must be one of {', '.join(DROP_MODES)}")
        return _json({"dropped": sim.watches.close_all("dropped" if mode == "close" else mode)})

    async def compact_watches(request: web.Request) -> web.Response:
        return _json({"oldest_resource_version": str(sim.watches.compact())})

    router = app.router
    router.add_get(f"{PREFIX}/state", state)
    router.add_get(f"{PREFIX}/faults", list_faults)
    router.add_post(f"{PREFIX}/faults", add_fault)
    router.add_delete(f"{PREFIX}/faults", clear_faults)
    router.add_delete(f"{PREFIX}/faults/{{id}}", remove_fault)
    router.add_post(f"{PREFIX}/pods/{{namespace}}/{{name}}/kill", kill)
    router.add_post(f"{PREFIX}/pods/{{namespace}}/{{name}}/delete", delete_pod)
    router.add_post(f"{PREFIX}/nodes/{{name}}/{{action:cordon|uncordon}}", cordon)
    router.add_post(f"{PREFIX}/namespaces/{{namespace}}", add_namespace)
    router.add_delete(f"{PREFIX}/namespaces/{{namespace}}", remove_namespace)
    router.add_post(f"{PREFIX}/settings", settings)
    router.add_post(f"{PREFIX}/reset", reset)
    router.add_post(f"{PREFIX}/watches/drop", drop_watches)
    router.add_post(f"{PREFIX}/watches/compact", compact_watches)
