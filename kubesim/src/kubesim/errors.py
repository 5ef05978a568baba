"""``Status`` objects: how the Kubernetes API server answers a failure.

Every refusal of the simulator is one of these (``kind: Status``, ``apiVersion: v1``,
``status: Failure``, ``message``, ``reason``, ``details``, ``code``), with the real server's
wording, so clients parse them exactly as they parse a cluster's.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A failure to answer as a ``Status``; ``headers`` go on the HTTP response, ``metadata``
    (a ListMeta: a 410's ``continue``) in the Status."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}
        self.metadata = metadata or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": dict(self.metadata),
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{resource} "{name}" not found',
        details={"name": name, "kind": resource},
    )


def path_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", details={})


def already_exists(resource: str, name: str) -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{resource} "{name}" already exists',
        details={"name": name, "kind": resource},
    )


def conflict(resource: str, name: str) -> ApiError:
    """409 for a write with a stale ``resourceVersion`` (optimistic concurrency)."""
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        details={"name": name, "kind": resource},
    )


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{', '.join(PATCH_TYPES)} (kubesim; got {content_type or 'none'!r})",
        details={},
    )


# the patch formats kubesim applies (both as a merge of the patchable maps); a JSON patch or a
# server-side apply is refused with 415
PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


def forbidden(user: str, verb: str, resource: str, namespace: str, name: str = "") -> ApiError:
    subject = f'{resource} "{name}"' if name else resource
    scope = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
    message = (
        f'{subject} is forbidden: User "{user}" cannot {verb} resource "{resource}" '
        f'in API group ""{scope}'
    )
    details: dict[str, Any] = {"kind": resource}
    if name:
        details["name"] = name
    return ApiError(403, "Forbidden", message, details=details)


def invalid(kind: str, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """422: ``causes`` are ``(field, reason, message)`` (reason e.g. ``FieldValueInvalid``)."""
    text = "; ".join(message for _, _, message in causes)
    if len(causes) > 1:
        text = f"[{text}]"
    return ApiError(
        422,
        "Invalid",
        f'{kind} "{name}" is invalid: {text}',
        details={
            "name": name,
            "kind": kind,
            "causes": [
                {"reason": reason, "message": message, "field": field}
                for field, reason, message in causes
            ],
        },
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def method_not_allowed() -> ApiError:
    return ApiError(
        405,
        "MethodNotAllowed",
        "the server does not allow this method on the requested resource",
        details={},
    )


def too_many_requests(retry_after: int) -> ApiError:
    return ApiError(
        429,
        "TooManyRequests",
        "Too many requests, please try again later.",
        details={"retryAfterSeconds": retry_after},
        headers={"Retry-After": str(retry_after)},
    )


def server_error(code: int, message: str = "kubesim: injected failure") -> ApiError:
    reasons = {
        500: "InternalError",
        502: "InternalError",
        503: "ServiceUnavailable",
        504: "Timeout",
    }
    reason = reasons.get(code, "InternalError")
    text = f"Internal error occurred: {message}" if reason == "InternalError" else message
    return ApiError(code, reason, text, details={"causes": [{"message": message}]})


def injected(code: int, retry_after: int = 1) -> ApiError:
    """The Status a fault answers with: 429 with ``Retry-After``, a 5xx, or any other code."""
    if code == 429:
        return too_many_requests(retry_after)
    if code >= 500:
        return server_error(code)
    named = {
        400: "BadRequest",
        401: "Unauthorized",
        403: "Forbidden",
        404: "NotFound",
        409: "Conflict",
        410: "Expired",
        422: "Invalid",
    }
    return ApiError(code, named.get(code, "Unknown"), f"kubesim: injected {code}", details={})
