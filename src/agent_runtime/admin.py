"""Admin read views (admin token): what the control plane holds, for an operator.

``GET /api/session/admin/scopes`` — scopes with live sessions, waiters, reservations, pods
by state and their cached policy, one page at a time (``cursor``, ``limit`` ≤ 200: HSCAN
over the scope registry, never KEYS); ``/scopes/{scope_id}`` — one scope in detail (both
modules' view of it); ``/pods/{pod_id}`` — one pod, ``owned`` false for a foreign one;
``/foreign_pods`` — pods with our labels that are not provably ours (reconcile's last pass);
``/sessions/{session_id}`` — one binding.
Read only; each answer costs a bounded number of pipelined reads. They sit here, next to the
wiring, because they read both modules' state, through their read-only views (the session
side's ``SessionViews``, the resource side's ``ResourceViews``: key names stay in each
module's ``state.py``).
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
from starlette.convertors import PathConvertor, register_url_convertor

from agent_runtime.api.answers import ok
from agent_runtime.api.ids import ID_MAX, PRINTABLE_PATTERN, is_id
from agent_runtime.auth import check_bearer
from agent_runtime.errors import BackendUnavailable, NotFound, ValidationFailed
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
    """What the admin views read: each module's state, read only, and the admin tokens."""

    sessions: SessionViews
    resources: ResourceViews
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


def _only_query(request: Request, *names: str) -> None:
    """Only the named parameters, each at most once (a repeated one would silently lose all
    but its last value), and every value a plain decimal integer: pydantic's lax parsing would
    take ``0.0``, `` 1`` or ``1_0`` for one, which the OpenAPI's ``integer`` does not."""
    unknown = sorted(set(request.query_params) - set(names))
    if unknown:
        raise ValidationFailed(f"unknown query parameter {unknown[0][:64]!r}")
    for name in names:
        values = request.query_params.getlist(name)
        if len(values) > 1:
            raise ValidationFailed(f"query parameter {name!r} given more than once")
        if values and not _DECIMAL.fullmatch(values[0]):
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
    registrations = await deps.sessions.pod_registrations(pid)
    _, reported = await deps.resources.foreign_pods()
    foreign = [p for p in reported if p.get("pod_id") == pid]
    if not info and not registrations and not foreign:
        raise NotFound(f"pod {pid} is not known")
    view: dict[str, Any] = {"pod_id": pid, "info": info, "scopes": registrations}
    # ours: registered by us (a foreign pod never is); a foreign one is only ever reported
    view["owned"] = bool(info) or not foreign
    if foreign:
        view["foreign"] = foreign
    return ok(_request_id(request), view)


@router.get("/foreign_pods")
async def foreign_pods(request: Request, deps: Admin) -> JSONResponse:
    """What the last reconcile pass saw: pods with our component and scope labels whose
    identity does not verify (never adopted, routed to or deleted), at most 100 of them."""
    _only_query(request)
    count, pods = await deps.resources.foreign_pods()
    return ok(_request_id(request), {"count": count, "pods": pods})


@router.get("/sessions/{session_id:anyid}")
async def get_session(request: Request, deps: Admin, session_id: SessionId) -> JSONResponse:
    _only_query(request)
    sid = _checked("session_id", session_id)
    view = await deps.sessions.session_view(sid)
    if view is None:
        raise NotFound(f"session {sid} is not known")
    return ok(_request_id(request), {"session_id": sid, **view})
