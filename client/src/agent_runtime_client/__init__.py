"""The gateway's client of agent-runtime: route, touch and end sessions over HTTP.

    from agent_runtime_client import GatewayClient

    with GatewayClient("http://agent-runtime:8091", token="…") as client:
        route = client.route("s-42", "bot-1", "grp-9")   # -> Route(pod_id, pod_sse_url, …)
        client.touch("s-42", bot_id="bot-1", group_id="grp-9")
        client.end("s-42", bot_id="bot-1", group_id="grp-9")

Reference: docs/reference/client.md of the agent-runtime repository.
"""

from agent_runtime_client.async_client import DEFAULT_LIMITS, AsyncGatewayClient
from agent_runtime_client.core import (
    DEFAULT_DEADLINE,
    DEFAULT_MAX_ANSWER_BYTES,
    DEFAULT_MAX_ATTEMPTS,
    TOKEN_ENV,
    URL_ENV,
    RetryPolicy,
)
from agent_runtime_client.errors import (
    ERROR_CLASSES,
    AgentRuntimeError,
    BackendUnavailable,
    ClientAborted,
    ConfigNotFound,
    ConfigSyncBusy,
    Conflict,
    DeadlineExceeded,
    GatewayClientError,
    HeadersTooLarge,
    Internal,
    K8sError,
    MethodNotAllowed,
    NoPodAvailable,
    NotFound,
    Overloaded,
    RequestIdReused,
    RequestTimeout,
    ScopeFullTimeout,
    ScopeQueueFull,
    TooManyConnections,
    Unauthorized,
    Unavailable,
    UnexpectedAnswer,
    ValidationFailed,
)
from agent_runtime_client.models import Ended, Placement, Route
from agent_runtime_client.sync_client import GatewayClient

__all__ = [
    "DEFAULT_DEADLINE",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_ANSWER_BYTES",
    "DEFAULT_MAX_ATTEMPTS",
    "ERROR_CLASSES",
    "TOKEN_ENV",
    "URL_ENV",
    "AgentRuntimeError",
    "AsyncGatewayClient",
    "BackendUnavailable",
    "ClientAborted",
    "ConfigNotFound",
    "ConfigSyncBusy",
    "Conflict",
    "DeadlineExceeded",
    "Ended",
    "GatewayClient",
    "GatewayClientError",
    "HeadersTooLarge",
    "Internal",
    "K8sError",
    "MethodNotAllowed",
    "NoPodAvailable",
    "NotFound",
    "Overloaded",
    "Placement",
    "RequestIdReused",
    "RequestTimeout",
    "RetryPolicy",
    "Route",
    "ScopeFullTimeout",
    "ScopeQueueFull",
    "TooManyConnections",
    "Unauthorized",
    "Unavailable",
    "UnexpectedAnswer",
    "ValidationFailed",
]
