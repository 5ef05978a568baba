"""HTTP handlers of ``/api/session``. Thin: check the token, parse the envelope, delegate.

Bodies are read in a dependency after the token check (FastAPI would parse a declared body
before any dependency runs), so without a valid token every request is the same 401. The
OpenAPI schema still shows each body, token and answer (``openapi_extra``/``responses``: docs
only, nothing at run time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from http import HTTPStatus
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agent_runtime.api.answers import ok
from agent_runtime.api.openapi import documented_responses, inline_schema, json_request_body
from agent_runtime.api.request import AdminEnvelope, parse_rawdata, read_envelope
from agent_runtime.auth import check_bearer
from agent_runtime.errors import K8sError, ValidationFailed
from agent_runtime.resource_manager.facade import CleanupPreview, K8sApiError
from agent_runtime.session_manager.handler_deps import HandlerDeps, handler_deps
from agent_runtime.session_manager.models import (
    CleanupEnvelope,
    CleanupOk,
    CleanupRequest,
    ConfigSyncEnvelope,
    ConfigSyncOk,
    ConfigSyncRequest,
    RouteEnvelope,
    RouteOk,
    TouchEnvelope,
    TouchOk,
    check_fields,
)

log = logging.getLogger(__name__)

router = APIRouter(strict_content_type=False)  # JSON whatever the Content-Type

Deps = Annotated[HandlerDeps, Depends(handler_deps)]
E = TypeVar("E", bound=BaseModel)


def _body(model: type[E], *, admin: bool):  # type: ignore[no-untyped-def]
    async def dependency(request: Request, deps: Deps) -> E:
        tokens = deps.admin_tokens if admin else deps.gateway_tokens
        check_bearer(request.headers.get("authorization"), tokens)
        return await read_envelope(request, model)

    return Depends(dependency)


AdminBody = Annotated[AdminEnvelope, _body(AdminEnvelope, admin=True)]
RouteBody = Annotated[RouteEnvelope, _body(RouteEnvelope, admin=False)]
TouchBody = Annotated[TouchEnvelope, _body(TouchEnvelope, admin=False)]


@router.post(
    "/route",
    openapi_extra=json_request_body(inline_schema(RouteEnvelope), security="GatewayToken"),
    responses=documented_responses(RouteOk, 400, 401, 409, 500, 503, 504),
)
async def route(envelope: RouteBody, request: Request, deps: Deps) -> JSONResponse:
    """Which pod serves this session: refresh, placed or rebound (gateway)."""
    meta = envelope.metadata
    data = await deps.orchestrator.route(
        meta.request_id,
        meta.session_id,
        meta.extra.group_id,
        meta.bot_id,
        disconnected=request.is_disconnected,
        failed_pod_id=envelope.rawdata.failed_pod_id,
    )
    return ok(meta.request_id, data)


@router.post(
    "/touch",
    openapi_extra=json_request_body(inline_schema(TouchEnvelope), security="GatewayToken"),
    responses=documented_responses(TouchOk, 400, 401, 409, 500, 503),
)
async def touch(envelope: TouchBody, deps: Deps) -> JSONResponse:
    """Keep a session alive, or end it with ``rawdata.eos`` (gateway)."""
    meta = envelope.metadata
    data = await deps.orchestrator.touch(
        meta.session_id,
        eos=envelope.rawdata.eos,
        request_id=meta.request_id or "",
        scope_id=meta.scope_id(),
    )
    return ok(meta.request_id, data)


@router.post(
    "/config_sync",
    openapi_extra=json_request_body(inline_schema(ConfigSyncEnvelope), security="AdminToken"),
    responses=documented_responses(ConfigSyncOk, 400, 401, 404, 409, 500, 503),
)
async def config_sync(envelope: AdminBody, deps: Deps) -> JSONResponse:
    """Create, update, delete or sync one template or routing rule (admin)."""
    body = parse_rawdata(ConfigSyncRequest, envelope.rawdata)
    check_fields(body)
    return ok(envelope.metadata.request_id, await deps.config_store.config_sync(body))


@router.post(
    "/cleanup",
    openapi_extra=json_request_body(inline_schema(CleanupEnvelope), security="AdminToken"),
    responses=documented_responses(CleanupOk, 400, 401, 500, 502, 503),
)
async def cleanup(envelope: AdminBody, deps: Deps) -> JSONResponse:
    """Bulk-delete AgentServer pods in Kubernetes (admin); Redis is left to watch/reconcile.
    With ``rawdata.dry_run``: the pods the same call would delete, none deleted."""
    body = parse_rawdata(CleanupRequest, envelope.rawdata)
    request_id = envelope.metadata.request_id
    if body.dry_run:
        with _k8s_refusals(request_id):
            preview = await deps.resources.cleanup_preview(body.namespace, body.label_selector)
        return ok(request_id, _preview_data(preview))
    with _k8s_refusals(request_id):
        cleaned = await deps.resources.cleanup(body.namespace, body.label_selector)
    return ok(request_id, {"cleaned": cleaned})


def _preview_data(preview: CleanupPreview) -> dict[str, Any]:
    return {
        "cleaned": 0,
        "dry_run": True,
        "matched": preview.matched,
        "truncated": preview.truncated,
        "pods": [dataclasses.asdict(pod) for pod in preview.pods],
    }


@contextlib.contextmanager
def _k8s_refusals(request_id: str) -> Iterator[None]:
    """A selector the resource manager refuses is 400; a Kubernetes refusal is 502 with its
    status only (the API server's body — names, paths — goes to the log)."""
    try:
        yield
    except ValueError as exc:
        raise ValidationFailed(f"rawdata.label_selector: {exc}") from None
    except K8sApiError as exc:
        log.warning("cleanup %s: %s", request_id, exc)
        raise K8sError(_refusal(exc.status)) from None


def _refusal(status: int | None) -> str:
    """``kubernetes refused the cleanup: 403 Forbidden`` — the status and its reason only."""
    if status is None:
        return "kubernetes could not be reached for the cleanup"
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "error"
    return f"kubernetes refused the cleanup: {status} {reason}"
