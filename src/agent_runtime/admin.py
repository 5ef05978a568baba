"""Admin views and drains (admin token): what the control plane holds, for an operator, and
the one thing an operator does to it here — drain a pod or a node.

``GET /api/session/admin/scopes`` — scopes with live sessions, waiters, reservations, pods
by state and their cached policy, one page at a time (``cursor``, ``limit`` ≤ 200: HSCAN
over the scope registry, never KEYS); ``/scopes/{scope_id}`` — one scope in detail (both
modules' view of it); ``/pods/{pod_id}`` — one pod, ``owned`` false for a foreign one;
``/foreign_pods`` — pods with our labels that are not provably ours (reconcile's last pass);
``/sessions/{session_id}`` — one binding; ``/drains`` — pods under a drain, their deadlines
and remaining sessions. The views are read only; each answer costs a bounded number of
pipelined reads.

``POST /pods/{pod_id}/drain`` and ``POST /nodes/{node}/drain`` (body optional:
``{"deadline_seconds": N}``) drain through the resource manager's facade
(``ResourceManagerFacade.drain_pod``/``drain_node``; docs/spec/resource-manager.md
"Drains"). They sit here, next to the wiring, because they read both modules' state,
through their read-only views (the session side's ``SessionViews``, the resource side's
``ResourceViews``: key names stay in each module's ``state.py``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.convertors import PathConvertor, register_url_convertor

from agent_runtime.api.answers import ok
from agent_runtime.api.ids import ID_MAX, PRINTABLE_PATTERN, is_id
from agent_runtime.api.json_body import parse_body
from agent_runtime.api.openapi import documented_responses, inline_schema
from agent_runtime.api.request import validate_as
from agent_runtime.auth import check_bearer
from agent_runtime.errors import BackendUnavailable, Conflict, K8sError, NotFound, ValidationFailed
from agent_runtime.resource_manager.facade import (
    MAX_DRAIN_SECONDS,
    DrainStatus,
    K8sApiError,
    ResourceManagerFacade,
)
from agent_runtime.resource_manager.views import ResourceViews
from agent_runtime.session_manager.views import SessionViews
from agent_runtime.spec_fields import REDACTED, redacted_spec

MAX_PAGE = 200
_DECIMAL = re.compile(r"[0-9]{1,20}")  # ASCII digits only (``\d`` would take other scripts' too)
MAX_CURSOR = 2**63 - 1  # SCAN cursors are 64-bit; beyond signed range some servers refuse them


class _AnyIdConvertor(PathConvertor):
    """``{name:anyid}``: the rest of the path, newlines included (``path`` stops at one), so
    an id route would refuse is answered 400 by ``_checked``, not 404 by the router."""

    regex = r"[\s\S]*"


register_url_convertor("anyid", _AnyIdConvertor())


def _path_id(description: str) -> Any:
    """An id in the path: exactly what route accepts (contract §2.1: 1–256 characters, no
    control or format characters; ``/`` and newlines reach it too: ``:anyid``). The pattern is the
    documented one; ``is_id`` is what runs. Ids only ever name exact keys (never a SCAN
    MATCH), so ``*`` or ``:`` in one reads nothing but that key."""
    return Path(
        description=description,
        min_length=1,
        max_length=ID_MAX,
        json_schema_extra={"pattern": PRINTABLE_PATTERN},
    )


ScopeId = Annotated[str, _path_id("a scope id (md5 of group_id and bot_id, hex)")]
PodId = Annotated[str, _path_id("a pod id")]
SessionId = Annotated[str, _path_id("a session id, as route takes it")]

router = APIRouter(prefix="/admin")


@dataclass(frozen=True, slots=True)
class AdminDeps:
    """What the admin views read (each module's state, read only), the resource manager's
    facade for the drains, and the admin tokens."""

    sessions: SessionViews
    resources: ResourceViews
    control: ResourceManagerFacade  # the drains
    admin_tokens: Sequence[str]
    serving: Callable[[], bool]  # False while the process starts or stops: 503


_APP_STATE_SLOT = "admin_deps"


def install(app: FastAPI, deps: AdminDeps | None) -> None:
    """The wiring's side: from now on (None: no longer) the admin views read through ``deps``."""
    setattr(app.state, _APP_STATE_SLOT, deps)


async def _admin(request: Request) -> AdminDeps:
    deps: AdminDeps | None = getattr(request.app.state, _APP_STATE_SLOT, None)
    if deps is None or not deps.serving():
        raise BackendUnavailable("service is starting or stopping")
    check_bearer(request.headers.get("authorization"), deps.admin_tokens)
    return deps


Admin = Annotated[AdminDeps, Depends(_admin)]


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if is_id(given) else f"admin-{uuid.uuid4().hex[:12]}"


def _only_query(request: Request, *names: str, ids: tuple[str, ...] = ()) -> None:
    """Only the named parameters, each at most once (a repeated one would silently lose all
    but its last value), and every value a plain decimal integer: pydantic's lax parsing would
    take ``0.0``, `` 1`` or ``1_0`` for one, which the OpenAPI's ``integer`` does not. The
    ``ids`` parameters hold an id (the id rule) instead."""
    unknown = sorted(set(request.query_params) - set(names) - set(ids))
    if unknown:
        raise ValidationFailed(f"unknown query parameter {unknown[0][:64]!r}")
    for name in (*names, *ids):
        values = request.query_params.getlist(name)
        if len(values) > 1:
            raise ValidationFailed(f"query parameter {name!r} given more than once")
        if values and name in ids:
            _checked(name, values[0])
        elif values and not _DECIMAL.fullmatch(values[0]):
            raise ValidationFailed(f"query parameter {name!r}: a decimal integer, digits only")


def _redacted(config: dict[str, str] | None) -> dict[str, str] | None:
    """A cached config hash with its pod spec's plain env values shown as ``<redacted>``
    (API keys live there; names and ``valueFrom`` Secret references stay)."""
    if not config or "pod_spec_json" not in config:
        return config
    try:
        spec = json.loads(config["pod_spec_json"])
        shown = json.dumps(redacted_spec(spec), sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError, AttributeError):
        shown = REDACTED
    return {**config, "pod_spec_json": shown}


def _checked(kind: str, value: str) -> str:
    if not is_id(value):
        raise ValidationFailed(
            f"{kind}: an id is 1-{ID_MAX} characters without control or format characters"
        )
    return value


@router.get("/scopes")
async def list_scopes(
    request: Request,
    deps: Admin,
    cursor: Annotated[int, Query(ge=0, le=MAX_CURSOR)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
) -> JSONResponse:
    _only_query(request, "cursor", "limit")
    next_cursor, page = await deps.sessions.scopes_page(cursor, limit)
    sids = [sid for sid, _, _ in page]
    summaries = {s["scope_id"]: s for s in await deps.sessions.scope_summaries(sids)}
    registered = await deps.sessions.registered_pods_by_scope(set(sids))
    scopes: list[dict[str, Any]] = []
    for sid, group_id, bot_id in page:
        pool = await deps.resources.scope_pool(sid)
        phases = [p["phase"] for p in pool["pods"]]
        summary = summaries[sid]
        scopes.append(
            {
                **summary,
                "config": _redacted(summary["config"]),
                "group_id": group_id,
                "bot_id": bot_id,
                "pods": {
                    "in_use": phases.count("in_use"),
                    "idle": phases.count("idle"),
                    "deploying": pool["deploys_in_flight"],
                    # registered here but no longer a candidate: old version, or handed back
                    "retiring": len(registered.get(sid, [])) - summary["candidate_pods"],
                },
            }
        )
    return ok(_request_id(request), {"scopes": scopes, "next_cursor": next_cursor})


@router.get("/scopes/{scope_id:anyid}")
async def get_scope(request: Request, deps: Admin, scope_id: ScopeId) -> JSONResponse:
    _only_query(request)
    sid = _checked("scope_id", scope_id)
    (summary,) = await deps.sessions.scope_summaries([sid])
    detail = await deps.sessions.scope_detail(sid)
    pool = await deps.resources.scope_pool(sid)
    known = summary["config"] or pool["pool_config"] or detail["pods"] or pool["pods"]
    if not known and not detail["live_sessions"]:
        raise NotFound(f"scope {sid} is not known")
    summary["config"] = _redacted(summary["config"])
    pool["pool_config"] = _redacted(pool["pool_config"])
    return ok(_request_id(request), {**summary, **detail, "pool": pool})


@router.get("/pods/{pod_id:anyid}")
async def get_pod(request: Request, deps: Admin, pod_id: PodId) -> JSONResponse:
    _only_query(request)
    pid = _checked("pod_id", pod_id)
    info = await deps.resources.pod_info(pid)
    registrations = await deps.sessions.pod_registrations(pid, info.get("scope_id", ""))
    _, reported = await deps.resources.foreign_pods()
    foreign = [p for p in reported if p.get("pod_id") == pid]
    if not info and not registrations and not foreign:
        raise NotFound(f"pod {pid} is not known")
    view: dict[str, Any] = {"pod_id": pid, "info": info, "scopes": registrations}
    # ours: registered by us (a foreign pod never is); a foreign one is only ever reported
    view["owned"] = bool(info) or not foreign
    if foreign:
        view["foreign"] = foreign
    drain = await deps.resources.drain(pid)
    if drain is not None:
        view["drain"] = {**drain, "deadline_in": await _seconds_left(deps, drain["deadline"])}
    return ok(_request_id(request), view)


@router.get("/foreign_pods")
async def foreign_pods(request: Request, deps: Admin) -> JSONResponse:
    """What the last reconcile pass saw: pods with our component and scope labels whose
    identity does not verify (never adopted, routed to or deleted), at most 100 of them."""
    _only_query(request)
    count, pods = await deps.resources.foreign_pods()
    return ok(_request_id(request), {"count": count, "pods": pods})


@router.get("/sessions/{session_id:anyid}")
async def get_session(
    request: Request,
    deps: Admin,
    session_id: SessionId,
    scope_id: Annotated[
        str,
        Query(
            description="the scope whose tombstone to read (default: the binding's scope)",
            min_length=1,
            max_length=ID_MAX,
            json_schema_extra={"pattern": PRINTABLE_PATTERN},
        ),
    ] = "",
) -> JSONResponse:
    _only_query(request, ids=("scope_id",))
    sid = _checked("session_id", session_id)
    view = await deps.sessions.session_view(sid, scope_id)
    if view is None:
        raise NotFound(f"session {sid} is not known")
    return ok(_request_id(request), {"session_id": sid, **view})


# --- drains ---------------------------------------------------------------------------------

_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain, as Kubernetes'
NodeName = Annotated[
    str,
    Path(
        description="a node name (a DNS subdomain, as Kubernetes names nodes)",
        min_length=1,
        max_length=253,
        json_schema_extra={"pattern": _NODE_NAME.pattern},
    ),
]


class DrainRequest(BaseModel):
    """The optional body of a drain call."""

    model_config = ConfigDict(extra="forbid", strict=True)
    deadline_seconds: int | None = Field(
        None,
        ge=0,
        le=MAX_DRAIN_SECONDS,
        description="seconds from now until the sessions left are rebound and the pod is "
        "deleted (default AGENT_RUNTIME_DRAIN_TIMEOUT; 0: at once)",
    )


class DrainView(BaseModel):
    pod_id: str
    state: str = Field(description="pending (a replacement is warmed first), draining, deleted")
    trigger: str = Field(description="admin, graceful_delete or cordon")
    deadline: float = Field(description="Unix seconds: sessions left then are rebound")
    deadline_in: float = Field(description="seconds until the deadline (0 once past)")
    started: bool = Field(description="this call began the drain (false: one was under way)")
    sessions: int = Field(description="live sessions the pod still carries")


class DrainPodOk(BaseModel):
    ok: bool = True
    request_id: str
    data: DrainView


class DrainNodeData(BaseModel):
    node: str
    pods: list[DrainView]


class DrainNodeOk(BaseModel):
    ok: bool = True
    request_id: str
    data: DrainNodeData


_DRAIN_BODY = {
    "requestBody": {
        "required": False,
        "content": {"application/json": {"schema": inline_schema(DrainRequest)}},
    },
    "security": [{"AdminToken": []}],
}


async def _drain_seconds(request: Request) -> int | None:
    """The body's ``deadline_seconds`` (no body, or none given: the default)."""
    _only_query(request)
    raw = await request.body()
    if not raw.strip():
        return None
    return validate_as(DrainRequest, parse_body(raw), prefix=None).deadline_seconds


async def _seconds_left(deps: AdminDeps, deadline: float) -> float:
    return round(max(deadline - await deps.resources.now(), 0.0), 3)


async def _drain_view(deps: AdminDeps, status: DrainStatus) -> dict[str, Any]:
    return {
        "pod_id": status.pod_id,
        "state": status.state,
        "trigger": status.trigger,
        "deadline": status.deadline,
        "deadline_in": await _seconds_left(deps, status.deadline),
        "started": status.started,
        "sessions": status.sessions,
    }


@router.post(
    "/pods/{pod_id:anyid}/drain",
    openapi_extra=_DRAIN_BODY,
    responses=documented_responses(DrainPodOk, 404, 409),
)
async def drain_pod(request: Request, deps: Admin, pod_id: PodId) -> JSONResponse:
    """Drain a pod of ours: it takes no new session at once, its sessions stay until they
    end or until the deadline, then are rebound; then it is deleted (at once when empty; a
    delete Kubernetes refused is left to the drain job, which tries again)."""
    pid = _checked("pod_id", pod_id)
    seconds = await _drain_seconds(request)
    status = await deps.control.drain_pod(pid, seconds)
    if status is None:
        _, reported = await deps.resources.foreign_pods()
        if any(p.get("pod_id") == pid for p in reported):
            raise Conflict(f"pod {pid} is not ours (its identity does not verify): not drained")
        raise NotFound(f"pod {pid} is not known")
    return ok(_request_id(request), await _drain_view(deps, status))


@router.post(
    "/nodes/{node:anyid}/drain",
    openapi_extra=_DRAIN_BODY,
    responses=documented_responses(DrainNodeOk, 502),
)
async def drain_node(request: Request, deps: Admin, node: NodeName) -> JSONResponse:
    """Drain every pod of ours on a node, in every cluster and namespace that holds pods of
    ours (none: an empty list). Cordons nothing: ``kubectl cordon`` first keeps new pods off
    the node (and drains ours by itself)."""
    if not _NODE_NAME.fullmatch(node) or len(node) > 253:
        raise ValidationFailed("node: a node name is a DNS subdomain of at most 253 characters")
    seconds = await _drain_seconds(request)
    try:
        drained = await deps.control.drain_node(node, seconds)
    except K8sApiError as exc:
        why = exc.status or "unreachable"
        raise K8sError(f"kubernetes could not list the node's pods: {why}") from None
    pods = [await _drain_view(deps, status) for status in drained]
    return ok(_request_id(request), {"node": node, "pods": pods})


@router.get("/drains")
async def list_drains(
    request: Request,
    deps: Admin,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
) -> JSONResponse:
    """Pods under a drain (soonest deadline first, at most ``limit``), each with its
    state, trigger, deadline, seconds left and the sessions it still carries."""
    _only_query(request, "limit")
    count, drains = await deps.resources.drains(limit)
    pods = []
    for drain in drains:
        registrations = await deps.sessions.pod_registrations(drain["pod_id"], drain["scope_id"])
        pods.append(
            {
                **drain,
                "deadline_in": await _seconds_left(deps, drain["deadline"]),
                "sessions": sum(r["sessions"] for r in registrations),
            }
        )
    return ok(_request_id(request), {"count": count, "pods": pods})
