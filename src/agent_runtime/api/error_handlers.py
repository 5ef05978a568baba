"""Every failure is an envelope: the exception handlers (``AgentRuntimeError`` → its code,
FastAPI's validation → 400, Starlette's HTTP errors → their code, backend connection errors and
a Redis Cluster's refusals → 503 ``BACKEND_UNAVAILABLE``, a caller gone mid-body → 499),
``GuardMiddleware`` (bodies over 64 KiB → 400, any escaped exception → 500 ``INTERNAL`` without
a stack trace) and ``install``, which wires them and the OpenAPI completion into an app."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis import exceptions as redis_errors
from sqlalchemy import exc as sa_errors
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_runtime.api.answers import failure
from agent_runtime.api.ids import printable
from agent_runtime.api.json_body import MAX_BODY_BYTES
from agent_runtime.api.openapi import document
from agent_runtime.api.request import echoable_request_id, error_text, request_id_of
from agent_runtime.errors import (
    AgentRuntimeError,
    BackendUnavailable,
    ClientDisconnected,
    ErrorCode,
    InternalError,
)

log = logging.getLogger(__name__)


def _describe(errors: list[Any]) -> str:
    parts = []
    for err in errors[:10]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            parts.append("body is not valid JSON")
            continue
        where = ".".join(printable(p) for p in loc) or "body"
        if where == "body" and err.get("type") in ("dict_type", "model_attributes_type"):
            parts.append("body must be a JSON object (Content-Type: application/json)")
            continue
        parts.append(f"{where}: {error_text(err)}")
    return "; ".join(parts) or "invalid request"


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    request_id = echoable_request_id(getattr(exc, "body", None))
    return failure(400, ErrorCode.VALIDATION, _describe(list(exc.errors())), request_id)


async def _on_app_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AgentRuntimeError)
    return failure(exc.http_status, exc.code, exc.message, request_id_of(request), exc.retry_after)


async def _on_backend_error(request: Request, exc: Exception) -> JSONResponse:
    # the library's text (hosts, ports, errno) is for the log; the caller gets which backend.
    # Keys of several slots are this code's fault, not the cluster's: an ERROR for whoever
    # watches the logs (the caller still gets the 503 and retries: nothing was done)
    crossslot = isinstance(exc, redis_errors.ClusterCrossSlotError) or (
        type(exc) is redis_errors.RedisClusterException and "same key slot" in str(exc)
    )
    log.log(
        logging.ERROR if crossslot else logging.WARNING,
        "request %s: backend unavailable: %s: %s", request_id_of(request), type(exc).__name__, exc,
    )  # fmt: skip
    redis = (redis_errors.RedisError, redis_errors.RedisClusterException)
    which = "redis" if isinstance(exc, redis) else "database"
    err = BackendUnavailable(f"{which} is unavailable; retry shortly")
    return await _on_app_error(request, err)


async def _on_client_disconnect(request: Request, exc: Exception) -> JSONResponse:
    """The caller went away while sending its body: not our failure, so 499 ``CLIENT_ABORTED``
    (the metrics count it so) and a debug line, never an ERROR with a traceback. Nobody reads
    the answer (uvicorn drops a reply to a closed connection)."""
    log.debug(
        "client disconnected before its body was read: %s %s", request.method, request.url.path
    )
    err = ClientDisconnected("the caller disconnected before sending its whole body")
    return await _on_app_error(request, err)


_HTTP_CODES = {
    401: ErrorCode.UNAUTHORIZED,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
}


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(
        exc.status_code, ErrorCode.VALIDATION if exc.status_code < 500 else ErrorCode.INTERNAL
    )
    # keep the exception's headers: a 405 says which methods the path has (Allow)
    return failure(
        exc.status_code, code, str(exc.detail), request_id_of(request), headers=exc.headers
    )


BACKEND_ERRORS: tuple[type[Exception], ...] = (
    # unreachable: refused, reset, timed out, the pool's connections all taken
    # (MaxConnectionsError), no master known to Sentinel (MasterNotFoundError)
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    # up, but refusing writes for now: out of memory (noeviction), a replica (READONLY: a
    # failover its clients have not followed yet), a primary without its replicas, a
    # cluster slot in migration or down. Retried shortly, never a 500.
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    redis_errors.MasterDownError,
    redis_errors.TryAgainError,
    redis_errors.ClusterDownError,
    # a Redis Cluster that refused the call: its redirections (MOVED, ASK) or TRYAGAINs
    # outlasted the client's retries (ClusterError "TTL exhausted", the base of
    # ClusterDownError), a redirection answered as such, keys of several slots (CROSSSLOT from
    # a node, or the client's own refusal before sending: RedisClusterException, the base of
    # SlotNotCoveredError — a slot no node is known to serve)
    redis_errors.ClusterError,
    redis_errors.AskError,
    redis_errors.ClusterCrossSlotError,
    redis_errors.RedisClusterException,
    sa_errors.OperationalError,
    sa_errors.InterfaceError,
    sa_errors.TimeoutError,
)


def install(app: FastAPI) -> None:
    """Envelope every failure; wrap the app in the body-size and last-resort guards; document
    the token schemes in the OpenAPI."""
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(AgentRuntimeError, _on_app_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ClientDisconnect, _on_client_disconnect)
    for exc_type in BACKEND_ERRORS:
        app.add_exception_handler(exc_type, _on_backend_error)
    app.add_middleware(GuardMiddleware)
    document(app)


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
                err = InternalError("internal error")  # the log line above has the trace
                request_id = scope.get("state", {}).get("request_id")
                response = failure(err.http_status, err.code, err.message, request_id)
                await _send(send, scope, response)


def _too_large() -> JSONResponse:
    return failure(400, ErrorCode.VALIDATION, f"body exceeds {MAX_BODY_BYTES} bytes", None)


async def _send(send: Send, scope: Scope, response: JSONResponse) -> None:
    async def _no_receive() -> Message:
        return {"type": "http.disconnect"}

    await response(scope, _no_receive, send)
