"""The OpenAPI schema, documentation only (bodies are read by hand, answers built by
``answers.ok``/``failure``): the failure envelopes per status, ``documented_responses`` and
``json_request_body`` for the route decorators, the token schemes, and ``document``, which
completes the generated schema (no 422, the failures every operation can give)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema

from agent_runtime.config import API_PREFIX
from agent_runtime.errors import ErrorCode


class ErrorEnvelope(BaseModel):
    """A failure answer (contract §2.2); ``retry_after`` (and ``Retry-After``) where the table
    has it."""

    ok: Literal[False]
    request_id: str | None
    error_code: ErrorCode
    error_message: str
    retry_after: Annotated[int, Field(ge=1)] | SkipJsonSchema[None] = None


class ValidationError400(ErrorEnvelope):
    error_code: Literal[ErrorCode.VALIDATION]


class Unauthorized401(ErrorEnvelope):
    error_code: Literal[ErrorCode.UNAUTHORIZED]


class NotFound404(ErrorEnvelope):
    error_code: Literal[ErrorCode.NOT_FOUND]


class Conflict409(ErrorEnvelope):
    error_code: Literal[ErrorCode.CONFIG_SYNC_BUSY, ErrorCode.CONFLICT, ErrorCode.REQUEST_ID_REUSED]


class Internal500(ErrorEnvelope):
    error_code: Literal[ErrorCode.INTERNAL]


class K8sError502(ErrorEnvelope):
    error_code: Literal[ErrorCode.K8S_ERROR]


class Unavailable503(ErrorEnvelope):
    error_code: Literal[
        ErrorCode.CONFIG_NOT_FOUND,
        ErrorCode.SCOPE_QUEUE_FULL,
        ErrorCode.NO_POD_AVAILABLE,
        ErrorCode.BACKEND_UNAVAILABLE,
        ErrorCode.OVERLOADED,
    ]


class Timeout504(ErrorEnvelope):
    error_code: Literal[ErrorCode.SCOPE_FULL_TIMEOUT]


# status → (model, description); the codes per status are the contract's table (errors.py)
ERROR_RESPONSES: dict[int, tuple[type[ErrorEnvelope], str]] = {
    400: (ValidationError400, "VALIDATION: malformed body, bad field, bad config item"),
    401: (Unauthorized401, "UNAUTHORIZED: missing or wrong bearer token"),
    404: (NotFound404, "NOT_FOUND: update or delete of an item that does not exist"),
    409: (
        Conflict409,
        "CONFIG_SYNC_BUSY or CONFLICT (config_sync); REQUEST_ID_REUSED (route, touch: the "
        "request_id answered another request within 60 s)",
    ),
    500: (Internal500, "INTERNAL: a bug (no stack trace)"),
    502: (K8sError502, "K8S_ERROR: Kubernetes refused the call"),
    503: (
        Unavailable503,
        "CONFIG_NOT_FOUND, SCOPE_QUEUE_FULL, NO_POD_AVAILABLE, BACKEND_UNAVAILABLE or "
        "OVERLOADED (also while the service starts or stops); Retry-After where retry_after "
        "is given",
    ),
    504: (Timeout504, "SCOPE_FULL_TIMEOUT: no slot within scope_full_timeout; Retry-After"),
}
_RETRY_AFTER = {"schema": {"type": "integer", "minimum": 1}, "description": "seconds"}


def documented_responses(
    success: type[BaseModel], *statuses: int
) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route decorator: the success envelope and the failures it can give."""
    out: dict[int | str, dict[str, Any]] = {200: {"model": success, "description": "ok: true"}}
    for status in statuses:
        model, description = ERROR_RESPONSES[status]
        entry: dict[str, Any] = {"model": model, "description": description}
        if status in (503, 504):
            entry["headers"] = {"Retry-After": _RETRY_AFTER}
        out[status] = entry
    return out


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema (validation side) with its ``$defs`` resolved in place, fit for
    an operation's ``requestBody`` (the app's components do not hold request models)."""
    schema = model.model_json_schema(mode="validation")
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, list):
            return [resolve(v) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            target = resolve(defs[ref.removeprefix("#/$defs/")])
            return {**target, **{k: resolve(v) for k, v in node.items() if k != "$ref"}}
        return {k: resolve(v) for k, v in node.items()}

    resolved: dict[str, Any] = resolve(schema)
    return resolved


def json_request_body(schema: dict[str, Any], *, security: str) -> dict[str, Any]:
    """``openapi_extra=`` for a route: its JSON body (any Content-Type is read as JSON) and the
    bearer token scheme that guards it."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "security": [{security: []}],
    }


class HealthOk(BaseModel):
    ok: Literal[True]
    instance_id: str


class HealthDown(BaseModel):
    ok: Literal[False]
    state: Literal["starting", "draining"]


HEALTHZ_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": HealthOk, "description": "Redis, the DB and the background jobs are up"},
    503: {"model": HealthDown, "description": "starting, or draining for shutdown"},
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


# contract §2.4; a token list left unset is open (local mode only: server mode needs admin tokens)
SECURITY_SCHEMES = {
    "GatewayToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "one of AGENT_RUNTIME_GATEWAY_TOKENS (route, touch)",
    },
    "AdminToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "one of AGENT_RUNTIME_ADMIN_TOKENS (config_sync, cleanup, admin views)",
    },
}


def _error_response(status: int, schemas: dict[str, Any]) -> dict[str, Any]:
    model, description = ERROR_RESPONSES[status]
    schemas.setdefault(model.__name__, model.model_json_schema())
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    entry: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": ref}},
    }
    if status in (503, 504):
        entry["headers"] = {"Retry-After": _RETRY_AFTER}
    return entry


def _complete(schema: dict[str, Any]) -> None:
    """What FastAPI cannot know: a 422 never leaves this app (a 400 envelope does, see
    ``error_handlers``), and every ``/api`` operation can answer 400, 401 (the admin token
    unless it says otherwise, contract §2.4), 500 and 503 (starting, stopping, backend down);
    one that names a thing in its path, 404."""
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schema["components"].setdefault("securitySchemes", {}).update(SECURITY_SCHEMES)
    for path, operations in schema.get("paths", {}).items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", _error_response(400, schemas))
            if not path.startswith(API_PREFIX + "/"):
                continue
            op.setdefault("security", [{"AdminToken": []}])
            for status in (400, 401, 500, 503, *((404,) if "{" in path else ())):
                responses.setdefault(str(status), _error_response(status, schemas))
    used = json.dumps(schema.get("paths", {}))
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 models
        if f"#/components/schemas/{name}" not in used:
            schemas.pop(name, None)


def document(app: FastAPI) -> None:
    """Complete the app's generated OpenAPI (built once, on first request): token schemes,
    no 422, the failures every operation can give (``_complete``)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _complete(generate())
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
