"""``AsyncGatewayClient``: the gateway's calls for asyncio code.

One ``httpx.AsyncClient`` per gateway client: its connections are pooled and kept alive
(idle ones dropped after 4 s, before the service's 5 s keep-alive closes them). Build one per
process and share it; close it with ``aclose()`` or ``async with``. Every retry rule is in
``core.Attempts``; this file only sends and reads.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any, Self

import httpx

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

# idle connections dropped after 4 s: before the service's 5 s keep-alive closes them under us
DEFAULT_LIMITS = httpx.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=4.0
)


class AsyncGatewayClient:
    """route, touch and end over one pooled HTTP client.

    ``base_url`` defaults to ``AGENT_RUNTIME_URL``, ``token`` to
    ``AGENT_RUNTIME_GATEWAY_TOKEN``. ``deadline`` bounds each call, retries and pauses
    included (a call's own ``deadline=`` overrides it); ``retry`` bounds its attempts
    (``RetryPolicy(max_attempts=1)``: retries off); answers over ``max_answer_bytes`` are
    refused before they are parsed. ``transport`` and ``trust_env`` go to httpx as they are.
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
        transport: httpx.AsyncBaseTransport | None = None,
        trust_env: bool = True,
    ) -> None:
        self.config: ClientConfig = resolve_config(
            base_url, token, deadline=deadline, retry=retry, max_answer_bytes=max_answer_bytes
        )
        self._http = httpx.AsyncClient(
            limits=limits, transport=transport, trust_env=trust_env, **self.config.http_options()
        )

    async def route(
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
        return decode_route(await self._run(call, deadline), call.request_id)

    async def touch(
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
        return decode_touch(await self._run(call, deadline), call.request_id)

    async def end(
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
        return decode_end(await self._run(call, deadline), call.request_id)

    async def _run(self, call: Call, deadline: float | None) -> dict[str, Any]:
        attempts = Attempts(call, self.config, deadline=deadline)
        while True:
            timeout = attempts.start()
            try:
                async with asyncio.timeout(timeout):
                    step = attempts.answered(await self._send(call, attempts, budget=timeout))
            except (httpx.TransportError, TimeoutError, UnexpectedAnswer) as exc:
                step = attempts.failed(exc)  # raises at once for an oversized answer
            if isinstance(step, Done):
                return step.data
            await asyncio.sleep(step.delay)

    async def _send(self, call: Call, attempts: Attempts, *, budget: float) -> Answer:
        """One attempt; ``budget`` (the time left) bounds each of its socket operations."""
        request = self._http.build_request("POST", call.path, content=call.content, timeout=budget)
        response = await self._http.send(request, stream=True)
        try:
            reader = attempts.reader(response.status_code, response.headers.get("content-length"))
            async for chunk in response.aiter_raw():
                reader.feed(chunk)
        finally:
            await response.aclose()
        return Answer(response.status_code, response.headers.get("retry-after"), reader.body())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
