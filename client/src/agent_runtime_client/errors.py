"""What a call can raise: the service's error codes as exceptions, and the failures where no
usable answer came.

``GatewayClientError`` is the root. Below it:

- ``AgentRuntimeError``: the service answered with a failure envelope. One subclass per error
  code of the API reference's table (``ERROR_CLASSES``); a code this client does not know
  raises the base class itself, with the code as sent. Branch on the class or on ``code``,
  never on ``message`` (its wording may change in any release).
- ``Unavailable``: no answer came (connect, read or write failed) and the retries ran out;
  ``DeadlineExceeded``, its subclass, when the call's deadline ran out first. Both carry the
  last cause.
- ``UnexpectedAnswer``: an answer that is not the contract's envelope (a proxy's page, a wrong
  base URL, an answer over the size bound).

The table is held equal to the service's codes by tests/test_client_errors.py.
"""

from __future__ import annotations

from typing import ClassVar


class GatewayClientError(Exception):
    """The root of everything a call of this client raises."""


class AgentRuntimeError(GatewayClientError):
    """The service answered with a failure envelope.

    ``retry_after`` (seconds) is set for the codes the reference marks so: try again shortly,
    preferably on another replica. ``request_id`` is the id the service echoed (``None`` for an
    answer given before the body was read).
    """

    CODE: ClassVar[str | None] = None  # the code a subclass stands for; None for the base
    HTTP_STATUS: ClassVar[int | None] = None

    def __init__(
        self,
        message: str,
        *,
        code: str,
        http_status: int,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{code} ({http_status}): {message}")
        self.code = code
        self.http_status = http_status
        self.message = message
        self.request_id = request_id
        self.retry_after = retry_after


class ValidationFailed(AgentRuntimeError):
    CODE, HTTP_STATUS = "VALIDATION", 400


class Unauthorized(AgentRuntimeError):
    CODE, HTTP_STATUS = "UNAUTHORIZED", 401


class NotFound(AgentRuntimeError):
    CODE, HTTP_STATUS = "NOT_FOUND", 404


class MethodNotAllowed(AgentRuntimeError):
    CODE, HTTP_STATUS = "METHOD_NOT_ALLOWED", 405


class RequestTimeout(AgentRuntimeError):
    CODE, HTTP_STATUS = "REQUEST_TIMEOUT", 408


class ConfigSyncBusy(AgentRuntimeError):
    CODE, HTTP_STATUS = "CONFIG_SYNC_BUSY", 409


class Conflict(AgentRuntimeError):
    CODE, HTTP_STATUS = "CONFLICT", 409


class RequestIdReused(AgentRuntimeError):
    CODE, HTTP_STATUS = "REQUEST_ID_REUSED", 409


class HeadersTooLarge(AgentRuntimeError):
    CODE, HTTP_STATUS = "HEADERS_TOO_LARGE", 431


class ClientAborted(AgentRuntimeError):
    CODE, HTTP_STATUS = "CLIENT_ABORTED", 499


class Internal(AgentRuntimeError):
    CODE, HTTP_STATUS = "INTERNAL", 500


class K8sError(AgentRuntimeError):
    CODE, HTTP_STATUS = "K8S_ERROR", 502


class ConfigNotFound(AgentRuntimeError):
    CODE, HTTP_STATUS = "CONFIG_NOT_FOUND", 503


class ScopeQueueFull(AgentRuntimeError):
    CODE, HTTP_STATUS = "SCOPE_QUEUE_FULL", 503


class NoPodAvailable(AgentRuntimeError):
    CODE, HTTP_STATUS = "NO_POD_AVAILABLE", 503


class BackendUnavailable(AgentRuntimeError):
    CODE, HTTP_STATUS = "BACKEND_UNAVAILABLE", 503


class Overloaded(AgentRuntimeError):
    CODE, HTTP_STATUS = "OVERLOADED", 503


class TooManyConnections(AgentRuntimeError):
    CODE, HTTP_STATUS = "TOO_MANY_CONNECTIONS", 503


class ScopeFullTimeout(AgentRuntimeError):
    CODE, HTTP_STATUS = "SCOPE_FULL_TIMEOUT", 504


ERROR_CLASSES: dict[str, type[AgentRuntimeError]] = {
    cls.CODE: cls
    for cls in (
        ValidationFailed,
        Unauthorized,
        NotFound,
        MethodNotAllowed,
        RequestTimeout,
        ConfigSyncBusy,
        Conflict,
        RequestIdReused,
        HeadersTooLarge,
        ClientAborted,
        Internal,
        K8sError,
        ConfigNotFound,
        ScopeQueueFull,
        NoPodAvailable,
        BackendUnavailable,
        Overloaded,
        TooManyConnections,
        ScopeFullTimeout,
    )
    if cls.CODE is not None
}


def error_for(
    code: str,
    http_status: int,
    message: str,
    *,
    request_id: str | None,
    retry_after: float | None,
) -> AgentRuntimeError:
    """The exception of an error code: its class, or the base class for a code not known here."""
    cls = ERROR_CLASSES.get(code, AgentRuntimeError)
    return cls(
        message, code=code, http_status=http_status, request_id=request_id, retry_after=retry_after
    )


class Unavailable(GatewayClientError):
    """No usable answer came and no attempt is left (``attempts`` were made).

    ``cause`` is the last attempt's transport error (``httpx.ConnectError``, a read error or
    timeout, a connection the server closed). When the last attempt got a retryable answer
    instead, that answer's ``AgentRuntimeError`` is raised itself, not this.
    """

    def __init__(
        self, message: str, *, cause: BaseException | None, attempts: int, request_id: str
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.attempts = attempts
        self.request_id = request_id  # the call's: send it again to replay, not redo, the call


class DeadlineExceeded(Unavailable):
    """The call's overall deadline ran out before an answer that ends it came."""


class UnexpectedAnswer(GatewayClientError):
    """An answer that is not the contract's envelope, or is over the client's size bound.

    ``code`` is ``HTTP_<status>`` (``HTTP_200`` for a success envelope whose data is not what
    the reference says), ``excerpt`` the answer's first 200 characters, ``request_id`` the
    call's.
    """

    def __init__(self, message: str, *, http_status: int, excerpt: str = "") -> None:
        super().__init__(message)
        self.http_status = http_status
        self.code = f"HTTP_{http_status}"
        self.excerpt = excerpt
        self.request_id: str | None = None
