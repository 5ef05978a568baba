"""The HTTP envelope (contract §2.1–2.2): request models, responses, and error mapping.

Every answer, success or failure, is an envelope; no FastAPI 422, no HTML, no stack trace.
``install`` wires the exception handlers and the body-size guard into an app. Backend
connection errors (Redis, DB) become 503 ``BACKEND_UNAVAILABLE`` with ``retry_after``.

Input limits at the edge (400 ``VALIDATION``): bodies of at most 64 KiB, UTF-8 JSON objects
nested at most ``MAX_DEPTH`` (checked before parsing), no NaN or Infinity; ids of 1–256
characters without control or format characters (``_FORBIDDEN``). The OpenAPI schema is
completed here too (token schemes, the error envelopes, no 422): see ``_complete``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import SkipJsonSchema
from redis import exceptions as redis_errors
from sqlalchemy import exc as sa_errors
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_runtime.config import API_PREFIX
from agent_runtime.errors import (
    AgentRuntimeError,
    BackendUnavailable,
    ClientDisconnected,
    ErrorCode,
    ValidationFailed,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
MAX_DEPTH = 32  # JSON nesting; the deepest real body (config_sync env) is 4
ID_MAX = 256  # contract §2.1; also the width of the id columns (db/tables.py ID_LEN)
MAX_MESSAGE = 4096  # characters of an error_message; a longer one is cut

# Characters no id or config text may hold: C0 and C1 controls and DEL, the Unicode format
# characters (category Cf: zero-width, bidi overrides, BOM, soft hyphen, tags), the line and
# paragraph separators, surrogates (a lone one cannot be encoded as UTF-8: Redis, the DB and the
# answer would fail on it) and the noncharacters U+FFFE/U+FFFF. They make log lines, Redis key
# names and error messages show something other than what they hold. Cf as of Unicode 15.1
# (Python 3.13); test_models checks this list against the running Python's unicodedata.
_FORBIDDEN_BMP = (
    "\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\ufffe\uffff"
)
_FORBIDDEN = re.compile(
    f"[{_FORBIDDEN_BMP}\ud800-\udfff\U000110bd\U000110cd\U00013430-\U0001343f"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]"
)
# The same rule for the OpenAPI schema (ECMA-262 syntax, BMP only: surrogates and astral format
# characters are left out of the documented pattern; the server refuses them all the same).
PRINTABLE_CLASS = (
    "[^" + "".join(c if c == "-" else f"\\u{ord(c):04x}" for c in _FORBIDDEN_BMP) + "]"
)
PRINTABLE_PATTERN = f"^{PRINTABLE_CLASS}*$"


# the same for ASCII text (the usual id: ``str.isascii`` is O(1)); a smaller class, 3x faster
_FORBIDDEN_ASCII = re.compile("[\x00-\x1f\x7f]")


def has_forbidden(value: str) -> bool:
    return (_FORBIDDEN_ASCII if value.isascii() else _FORBIDDEN).search(value) is not None


def no_control(value: str) -> str:
    """Refuse control and format characters (see ``_FORBIDDEN``)."""
    if has_forbidden(value):
        raise ValueError("must not contain control or format characters")
    return value


def is_id(value: object) -> bool:
    """Whether ``value`` is a valid id: a string of 1–256 characters, none of them forbidden."""
    return isinstance(value, str) and 0 < len(value) <= ID_MAX and not has_forbidden(value)


def printable(text: str, limit: int = 64) -> str:
    """``text`` fit for an error message or a log line: forbidden characters escaped
    (``\\u202e``), cut at ``limit`` characters."""
    if len(text) > limit:
        text = text[:limit] + "…"
    return _FORBIDDEN.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


Id = Annotated[
    str,
    Field(min_length=1, max_length=ID_MAX, json_schema_extra={"pattern": PRINTABLE_PATTERN}),
    AfterValidator(no_control),
]


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
    """One readable part per problem, naming the field: ``item.sse_port: Input should be ...``.
    A field name comes from the caller: it is shown escaped and cut (``printable``)."""
    parts = []
    for err in exc.errors(include_url=False):
        path = (*([prefix] if prefix else []), *err["loc"])
        loc = ".".join(printable(str(p)) for p in path) or "body"
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
    (control or format characters, a lone surrogate, over 256 characters) is never echoed."""
    metadata = body.get("metadata") if isinstance(body, dict) else None
    rid = metadata.get("request_id") if isinstance(metadata, dict) else None
    return rid if is_id(rid) else None


class _NotFinite(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        raise _NotFinite(text)
    return value


# one decoder: json.loads(..., **options) would build a new one per call
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)

# a JSON string (escapes skipped; an unterminated one runs to the end, so the scan stays linear)
# or one bracket; UTF-8 never puts these bytes inside a multi-byte character
_STRUCTURE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
_OPENERS = frozenset(b"[{")


def nesting_exceeds(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text nests deeper than ``limit``, found without parsing: a body with
    at most ``limit`` opening brackets cannot (two C-speed counts, the normal case); otherwise
    one pass over its strings and brackets that stops at the first level past the limit."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth = 0
    for match in _STRUCTURE.finditer(raw):
        first = raw[match.start()]
        if first in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        elif first != 0x22 and depth:  # a closing bracket (a stray one buys no depth)
            depth -= 1
    return False


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or 400 ``VALIDATION``: UTF-8 only (a leading BOM is
    skipped), nesting at most ``MAX_DEPTH`` (checked before parsing), no NaN or Infinity
    (literals, or numbers too large for a float). Duplicate keys: the last one wins, as in
    ``json.loads`` (rejecting them would cost a Python call per object on every route)."""
    if nesting_exceeds(raw):
        raise ValidationFailed(f"body nests deeper than {MAX_DEPTH} levels")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
        data = _DECODER.decode(text)
    except _NotFinite:
        raise ValidationFailed("body holds NaN or Infinity, which JSON does not allow") from None
    except UnicodeDecodeError:
        raise ValidationFailed("body is not UTF-8") from None
    except (ValueError, RecursionError):  # bad JSON; RecursionError cannot pass the scan
        raise ValidationFailed("body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ValidationFailed("body must be a JSON object")
    return data


async def read_envelope(request: Request, model: type[M]) -> M:
    """The request body as ``model``, whatever the Content-Type; anything else is 400
    ``VALIDATION``. Called after the token check (so a caller without a token learns nothing
    about the body rules); remembers the request_id as soon as it parses, so every later
    error echoes it."""
    data = parse_body(await request.body())
    remember_request_id(request, echoable_request_id(data))
    return validate_as(model, data, prefix=None)


# --- responses ---------------------------------------------------------------------------------


def ok(request_id: str | None, data: dict[str, Any]) -> JSONResponse:
    return JSONResponse({"ok": True, "request_id": request_id, "data": data})


ERROR_CODE_HEADER = "X-Error-Code"


def failure(
    status: int,
    code: ErrorCode,
    message: str,
    request_id: str | None,
    retry_after: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {
        "ok": False,
        "request_id": request_id if request_id is None or is_id(request_id) else None,
        "error_code": code.value,
        "error_message": printable(message, limit=MAX_MESSAGE),
    }
    # the code as a header too: metrics (and a gateway) read it without parsing the body
    out = {**(headers or {}), ERROR_CODE_HEADER: code.value}
    if retry_after is not None:
        seconds = max(1, math.ceil(retry_after))  # the header takes whole seconds
        body["retry_after"] = seconds
        out["Retry-After"] = str(seconds)
    return JSONResponse(body, status_code=status, headers=out)


def remember_request_id(request: Request, request_id: str | None) -> None:
    """Handlers call this first, so an error raised later still echoes the id."""
    request.state.request_id = request_id


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


# --- OpenAPI: documentation only (bodies are read by hand, answers built by ``ok``/``failure``) --


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
    ``_on_validation``), and every ``/api`` operation can answer 400, 401 (the admin token
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


def _document(app: FastAPI) -> None:
    """Complete the app's generated OpenAPI (built once, on first request): token schemes,
    no 422, the failures every operation can give (``_complete``)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _complete(generate())
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]


# --- exception handlers ------------------------------------------------------------------------


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
    # the library's text (hosts, ports, errno) is for the log; the caller gets which backend
    log.warning(
        "request %s: backend unavailable: %s: %s", _request_id(request), type(exc).__name__, exc
    )
    which = "redis" if isinstance(exc, redis_errors.RedisError) else "database"
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
        exc.status_code, code, str(exc.detail), _request_id(request), headers=exc.headers
    )


BACKEND_ERRORS: tuple[type[Exception], ...] = (
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
    _document(app)


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
