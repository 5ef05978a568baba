"""The error table of contract §2.2 as exceptions.

Raise one of these anywhere below the handlers; ``api.error_handlers.install`` turns it
into the failure envelope with the right HTTP status and ``Retry-After``. Facades raise the
same classes across modules (the resource manager's own failures are mapped by the caller).
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class ErrorCode(StrEnum):
    VALIDATION = "VALIDATION"
    UNAUTHORIZED = "UNAUTHORIZED"
    NOT_FOUND = "NOT_FOUND"
    CONFIG_SYNC_BUSY = "CONFIG_SYNC_BUSY"
    CONFLICT = "CONFLICT"
    K8S_ERROR = "K8S_ERROR"
    CONFIG_NOT_FOUND = "CONFIG_NOT_FOUND"
    SCOPE_QUEUE_FULL = "SCOPE_QUEUE_FULL"
    NO_POD_AVAILABLE = "NO_POD_AVAILABLE"
    BACKEND_UNAVAILABLE = "BACKEND_UNAVAILABLE"
    SCOPE_FULL_TIMEOUT = "SCOPE_FULL_TIMEOUT"
    INTERNAL = "INTERNAL"
    # -- http edge --
    HEADERS_TOO_LARGE = "HEADERS_TOO_LARGE"
    REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
    TOO_MANY_CONNECTIONS = "TOO_MANY_CONNECTIONS"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"  # 405, with Allow
    CLIENT_ABORTED = "CLIENT_ABORTED"  # 499: the caller went away; nobody reads the answer
    OVERLOADED = "OVERLOADED"  # 503 + Retry-After: the replica's in-flight bound is reached

    # -- bounded growth --

    # -- answers --
    REQUEST_ID_REUSED = "REQUEST_ID_REUSED"


class AgentRuntimeError(Exception):
    """Base of every error with a contract code. ``retry_after`` only where the table says so."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL
    http_status: ClassVar[int] = 500
    default_retry_after: ClassVar[float | None] = None

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after if retry_after is not None else self.default_retry_after


class ValidationFailed(AgentRuntimeError):
    code = ErrorCode.VALIDATION
    http_status = 400


class Unauthorized(AgentRuntimeError):
    code = ErrorCode.UNAUTHORIZED
    http_status = 401


class NotFound(AgentRuntimeError):
    code = ErrorCode.NOT_FOUND
    http_status = 404


class ConfigSyncBusy(AgentRuntimeError):
    code = ErrorCode.CONFIG_SYNC_BUSY
    http_status = 409


class Conflict(AgentRuntimeError):
    code = ErrorCode.CONFLICT
    http_status = 409


class K8sError(AgentRuntimeError):
    code = ErrorCode.K8S_ERROR
    http_status = 502


class ConfigNotFound(AgentRuntimeError):
    code = ErrorCode.CONFIG_NOT_FOUND
    http_status = 503


class ScopeQueueFull(AgentRuntimeError):
    code = ErrorCode.SCOPE_QUEUE_FULL
    http_status = 503
    default_retry_after = 1


class NoPodAvailable(AgentRuntimeError):
    code = ErrorCode.NO_POD_AVAILABLE
    http_status = 503
    default_retry_after = 1


class BackendUnavailable(AgentRuntimeError):
    code = ErrorCode.BACKEND_UNAVAILABLE
    http_status = 503
    default_retry_after = 1


class ScopeFullTimeout(AgentRuntimeError):
    code = ErrorCode.SCOPE_FULL_TIMEOUT
    http_status = 504
    default_retry_after = 1


class ClientDisconnected(AgentRuntimeError):
    """The caller went away while waiting or while sending its body (nobody reads this answer;
    499 as nginx logs it)."""

    code = ErrorCode.CLIENT_ABORTED
    http_status = 499


class MethodNotAllowed(AgentRuntimeError):
    code = ErrorCode.METHOD_NOT_ALLOWED
    http_status = 405


class Overloaded(AgentRuntimeError):
    """Shed before any Redis or DB work: this replica has ``max_in_flight`` requests at work."""

    code = ErrorCode.OVERLOADED
    http_status = 503
    default_retry_after = 1


class InternalError(AgentRuntimeError):
    """A bug: the last-resort answer of ``api.error_handlers.GuardMiddleware`` to an exception
    no handler took (the trace goes to the log, never to the caller)."""

    code = ErrorCode.INTERNAL
    http_status = 500


class RequestIdReused(AgentRuntimeError):
    """A request_id answered (or being answered) within 60 s for another request: another
    session or scope (route), another session (touch eos), another scope (acquire). The
    first answer is never handed to a different request."""

    code = ErrorCode.REQUEST_ID_REUSED
    http_status = 409


# -- http edge: connections (answered by http_server's protocol, before the app sees a request)


class HeadersTooLarge(AgentRuntimeError):
    code = ErrorCode.HEADERS_TOO_LARGE
    http_status = 431


class RequestTimeout(AgentRuntimeError):
    code = ErrorCode.REQUEST_TIMEOUT
    http_status = 408


class TooManyConnections(AgentRuntimeError):
    code = ErrorCode.TOO_MANY_CONNECTIONS
    http_status = 503
    default_retry_after = 1
