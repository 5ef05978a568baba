"""``GatewayClient``: the gateway's calls for threaded (blocking) code.

The same calls and rules as ``AsyncGatewayClient`` (all of them in ``core.Attempts``) over one
pooled ``httpx.Client``; safe to share between threads. Hazard: httpx's sync timeouts bound
each socket operation, not the whole attempt, so the deadline is also checked after each
chunk of an answer; a server that sends nothing for the attempt's whole timeout is cut at
the deadline, one that trickles bytes at the first chunk after it.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, Self

import httpx

from agent_runtime_client.async_client import DEFAULT_LIMITS
from agent_runtime_client.core import (
    DEFAULT_DEADLINE,
    DEFAULT_MAX_ANSWER_BYTES,
    Answer,
    Attempts,
    Call,
    ClientConfig,
    Done,
    RetryPolicy,
    decode_end,
    decode_route,
    decode_touch,
    resolve_config,
    route_call,
    touch_call,
)
from agent_runtime_client.errors import UnexpectedAnswer
from agent_runtime_client.models import Ended, Route


class GatewayClient:
    """route, touch and end over one pooled HTTP client (blocking).

    The constructor's arguments are those of ``AsyncGatewayClient``.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        deadline: float = DEFAULT_DEADLINE,
        retry: RetryPolicy | None = None,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        limits: httpx.Limits = DEFAULT_LIMITS,
        transport: httpx.BaseTransport | None = None,
        trust_env: bool = True,
    ) -> None:
        self.config: ClientConfig = resolve_config(
            base_url, token, deadline=deadline, retry=retry, max_answer_bytes=max_answer_bytes
        )
        self._http = httpx.Client(
            limits=limits, transport=transport, trust_env=trust_env, **self.config.http_options()
        )

    def route(
        self,
        session_id: str,
        bot_id: str,
        group_id: str,
        *,
        failed_pod_id: str | None = None,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> Route:
        """Which pod serves the session. ``failed_pod_id``: the pod whose stream just failed."""
        call = route_call(
            session_id, bot_id, group_id, failed_pod_id=failed_pod_id, request_id=request_id
        )
        return decode_route(self._run(call, deadline), call.request_id)

    def touch(
        self,
        session_id: str,
        *,
        bot_id: str | None = None,
        group_id: str | None = None,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> bool:
        """Keep the session alive; False: it is unknown or expired (route it again)."""
        call = touch_call(
            session_id, bot_id=bot_id, group_id=group_id, eos=False, request_id=request_id
        )
        return decode_touch(self._run(call, deadline), call.request_id)

    def end(
        self,
        session_id: str,
        *,
        bot_id: str | None = None,
        group_id: str | None = None,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> Ended:
        """End the session now (touch with ``eos``): its slot is freed."""
        call = touch_call(
            session_id, bot_id=bot_id, group_id=group_id, eos=True, request_id=request_id
        )
        return decode_end(self._run(call, deadline), call.request_id)

    def _run(self, call: Call, deadline: float | None) -> dict[str, Any]:
        attempts = Attempts(call, self.config, deadline=deadline)
        while True:
            timeout = attempts.start()
            try:
                step = attempts.answered(self._send(call, attempts, timeout))
            except (httpx.TransportError, TimeoutError, UnexpectedAnswer) as exc:
                step = attempts.failed(exc)  # raises at once for an oversized answer
            if isinstance(step, Done):
                return step.data
            time.sleep(step.delay)

    def _send(self, call: Call, attempts: Attempts, timeout: float) -> Answer:
        request = self._http.build_request("POST", call.path, content=call.content, timeout=timeout)
        response = self._http.send(request, stream=True)
        try:
            reader = attempts.reader(response.status_code, response.headers.get("content-length"))
            for chunk in response.iter_raw():
                reader.feed(chunk)
        finally:
            response.close()
        return Answer(response.status_code, response.headers.get("retry-after"), reader.body())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
