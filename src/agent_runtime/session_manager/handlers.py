"""HTTP handlers of ``/api/session``. Thin: parse the envelope, check the token, delegate."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from agent_runtime.auth import check_bearer
from agent_runtime.envelope import AdminEnvelope, ok, parse_rawdata, read_envelope
from agent_runtime.session_manager.config_store import ConfigStore
from agent_runtime.session_manager.models import ConfigSyncRequest
from agent_runtime.wiring import Services, services

router = APIRouter(strict_content_type=False)  # JSON whatever the Content-Type

ServicesDep = Annotated[Services, Depends(services)]


async def _admin_envelope(request: Request, svc: ServicesDep) -> AdminEnvelope:
    """The token first, then the body: without a valid token every request is the same 401.

    The body is read here rather than declared as a parameter, because FastAPI parses a
    declared body before any dependency runs."""
    check_bearer(request.headers.get("authorization"), svc.settings.admin_tokens)
    return await read_envelope(request, AdminEnvelope)


AdminBody = Annotated[AdminEnvelope, Depends(_admin_envelope)]


@router.post("/config_sync")
async def config_sync(envelope: AdminBody, svc: ServicesDep) -> JSONResponse:
    """Create, update, delete or sync one template or routing rule (admin)."""
    body = parse_rawdata(ConfigSyncRequest, envelope.rawdata)
    store: ConfigStore = svc.config_store
    return ok(envelope.metadata.request_id, await store.config_sync(body))
