"""The HTTP envelope (contract §2.1–2.2): request models, responses, and error mapping.

Every answer, success or failure, is an envelope; no FastAPI 422, no HTML, no stack trace.
``install`` wires the exception handlers and the body-size guard into an app. Backend
connection errors (Redis, DB) become 503 ``BACKEND_UNAVAILABLE`` with ``retry_after``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from redis import exceptions as redis_errors
from sqlalchemy import exc as sa_errors
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_runtime.errors import AgentRuntimeError, BackendUnavailable, ErrorCode, ValidationFailed

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def no_control(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters")
    return value


Id = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(no_control)]


class Extra(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    group_id: Id | None = None


class Metadata(BaseModel):
    """Envelope metadata; which ids are required is each endpoint's business."""

    model_config = ConfigDict(extra="ignore", strict=True)
    request_id: Id | None = None
    session_id: Id | None = None
    bot_id: Id | None = None
    extra: Extra = Field(default_factory=Extra)


class AdminMetadata(Metadata):
    request_id: Id


class Envelope(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    metadata: Metadata
    rawdata: dict[str, Any] = Field(default_factory=dict)


class AdminEnvelope(Envelope):
    metadata: AdminMetadata


M = TypeVar("M", bound=BaseModel)


def _message(err: Any) -> str:
    if err.get("type") == "extra_forbidden":
        return "unknown field"
    return str(err.get("msg", "invalid")).removeprefix("Value error, ")


def describe_validation_error(exc: ValidationError, *, prefix: str | None) -> str:
    """One readable part per problem, naming the field: ``item.sse_port: Input should be ...``."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in (*([prefix] if prefix else []), *err["loc"])) or "body"
        parts.append(f"{loc}: {_message(err)}")
    return "; ".join(parts)


def validate_as(model: type[M], data: Any, *, prefix: str | None) -> M:
    """``model.model_validate(data)``, failing with 400 ``VALIDATION`` naming the fields."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ValidationFailed(describe_validation_error(exc, prefix=prefix)) from None


def parse_rawdata(model: type[M], rawdata: Any) -> M:
    return validate_as(model, rawdata, prefix="rawdata")


def echoable_request_id(body: Any) -> str | None:
    """``metadata.request_id`` of a parsed body if it is a valid id, else None: an invalid id
    (control characters, over 256 characters) is never echoed back."""
    metadata = body.get("metadata") if isinstance(body, dict) else None
    rid = metadata.get("request_id") if isinstance(metadata, dict) else None
    if isinstance(rid, str) and 1 <= len(rid) <= 256 and not _CONTROL.search(rid):
        return rid
    return None


async def read_envelope(request: Request, model: type[M]) -> M:
    """The request body as ``model``, whatever the Content-Type; anything else is 400
    ``VALIDATION``. Called after the token check (so a caller without a token learns nothing
    about the body rules); remembers the request_id as soon as it parses, so every later
    error echoes it."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, absurd nesting
        raise ValidationFailed("body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ValidationFailed("body must be a JSON object")
    remember_request_id(request, echoable_request_id(data))
    return validate_as(model, data, prefix=None)


# --- responses ---------------------------------------------------------------------------------


def ok(request_id: str | None, data: dict[str, Any]) -> JSONResponse:
    return JSONResponse({"ok": True, "request_id": request_id, "data": data})


def failure(
    status: int,
    code: ErrorCode,
    message: str,
    request_id: str | None,
    retry_after: float | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {
        "ok": False,
        "request_id": request_id,
        "error_code": code.value,
        "error_message": message,
    }
    headers = {}
    if retry_after is not None:
        seconds = max(1, math.ceil(retry_after))  # the header takes whole seconds
        body["retry_after"] = seconds
        headers["Retry-After"] = str(seconds)
    return JSONResponse(body, status_code=status, headers=headers)


def remember_request_id(request: Request, request_id: str | None) -> None:
    """Handlers call this first, so an error raised later still echoes the id."""
    request.state.request_id = request_id


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


# --- exception handlers ------------------------------------------------------------------------


def _describe(errors: list[Any]) -> str:
    parts = []
    for err in errors[:10]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            parts.append("body is not valid JSON")
            continue
        where = ".".join(loc) or "body"
        if where == "body" and err.get("type") in ("dict_type", "model_attributes_type"):
            parts.append("body must be a JSON object (Content-Type: application/json)")
            continue
        parts.append(f"{where}: {_message(err)}")
    return "; ".join(parts) or "invalid request"


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    request_id = echoable_request_id(getattr(exc, "body", None))
    return failure(400, ErrorCode.VALIDATION, _describe(list(exc.errors())), request_id)


async def _on_app_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AgentRuntimeError)
    return failure(exc.http_status, exc.code, exc.message, _request_id(request), exc.retry_after)


async def _on_backend_error(request: Request, exc: Exception) -> JSONResponse:
    log.warning("backend unavailable: %s: %s", type(exc).__name__, exc)
    which = "redis" if isinstance(exc, redis_errors.RedisError) else "database"
    err = BackendUnavailable(f"{which} is unavailable; retry shortly")
    return await _on_app_error(request, err)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {401: ErrorCode.UNAUTHORIZED, 404: ErrorCode.NOT_FOUND}.get(
        exc.status_code, ErrorCode.VALIDATION if exc.status_code < 500 else ErrorCode.INTERNAL
    )
    return failure(exc.status_code, code, str(exc.detail), _request_id(request))


BACKEND_ERRORS: tuple[type[Exception], ...] = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    sa_errors.OperationalError,
    sa_errors.InterfaceError,
    sa_errors.TimeoutError,
)


def install(app: FastAPI) -> None:
    """Envelope every failure; wrap the app in the body-size and last-resort guards."""
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(AgentRuntimeError, _on_app_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    for exc_type in BACKEND_ERRORS:
        app.add_exception_handler(exc_type, _on_backend_error)
    app.add_middleware(GuardMiddleware)


class _BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive``: an HTTPException, so that code reading the body (FastAPI's
    own body parsing re-raises HTTPExceptions) turns it into this 400, not a generic one."""

    def __init__(self) -> None:
        super().__init__(400, f"body exceeds {MAX_BODY_BYTES} bytes")


class GuardMiddleware:
    """Pure ASGI: refuses bodies over 64 KiB (declared or streamed) and turns any exception
    that escaped the handlers into a 500 ``INTERNAL`` envelope without a stack trace."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (not value.isdigit() or int(value) > MAX_BODY_BYTES):
                await _send(send, scope, _too_large())
                return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send(send, scope, _too_large())
        except Exception:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                request_id = scope.get("state", {}).get("request_id")
                response = failure(500, ErrorCode.INTERNAL, "internal error", request_id)
                await _send(send, scope, response)


def _too_large() -> JSONResponse:
    return failure(400, ErrorCode.VALIDATION, f"body exceeds {MAX_BODY_BYTES} bytes", None)


async def _send(send: Send, scope: Scope, response: JSONResponse) -> None:
    async def _no_receive() -> Message:
        return {"type": "http.disconnect"}

    await response(scope, _no_receive, send)
