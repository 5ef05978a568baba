"""HTTP handlers of ``/api/session``. Thin: parse the envelope, check the token, delegate."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from agent_runtime.auth import check_bearer
from agent_runtime.envelope import AdminEnvelope, ok, parse_rawdata, remember_request_id
from agent_runtime.session_manager.config_store import ConfigStore
from agent_runtime.session_manager.models import ConfigSyncRequest
from agent_runtime.wiring import Services, services

router = APIRouter(strict_content_type=False)  # JSON whatever the Content-Type

ServicesDep = Annotated[Services, Depends(services)]


def _admin(request: Request, svc: Services) -> None:
    check_bearer(request.headers.get("authorization"), svc.settings.admin_tokens)


@router.post("/config_sync")
async def config_sync(envelope: AdminEnvelope, request: Request, svc: ServicesDep) -> JSONResponse:
    """Create, update, delete or sync one template or routing rule (admin)."""
    remember_request_id(request, envelope.metadata.request_id)
    _admin(request, svc)
    body = parse_rawdata(ConfigSyncRequest, envelope.rawdata)
    store: ConfigStore = svc.config_store
    return ok(envelope.metadata.request_id, await store.config_sync(body))
