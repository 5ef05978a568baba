"""The gateway's client (``client/``) against scripted answers (httpx.MockTransport): the retry
rules, the deadline, the size bound, the envelopes it sends and the errors it raises. The
same client against the running service over real HTTP: tests/test_client_service.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest

from agent_runtime_client import (
    AgentRuntimeError,
    AsyncGatewayClient,
    ConfigNotFound,
    DeadlineExceeded,
    GatewayClient,
    Internal,
    K8sError,
    Overloaded,
    Placement,
    RequestIdReused,
    RetryPolicy,
    Route,
    ScopeFullTimeout,
    Unauthorized,
    Unavailable,
    UnexpectedAnswer,
    ValidationFailed,
)
from agent_runtime_client.core import parse_retry_after

URL = "http://gateway.test"
ROUTE_DATA = {"pod_id": "agent-a", "pod_sse_url": "http://10.0.0.1:8080/sse", "placement": "placed"}
FAST = RetryPolicy(backoff_base=0.01, backoff_cap=0.02, min_attempt_time=0.1)


def ok(data: dict[str, Any], request_id: str | None = None) -> httpx.Response:
    return httpx.Response(200, json={"ok": True, "request_id": request_id, "data": data})


def failure(status: int, code: str, retry_after: int | None = None) -> httpx.Response:
    body: dict[str, Any] = {"ok": False, "request_id": None, "error_code": code,
                            "error_message": f"{code} said"}  # fmt: skip
    headers = {"x-error-code": code}
    if retry_after is not None:
        body["retry_after"] = retry_after
        headers["retry-after"] = str(retry_after)
    return httpx.Response(status, json=body, headers=headers)


class Script:
    """Answers in order (a response, or an exception to raise); records every request."""

    def __init__(self, *steps: httpx.Response | Exception) -> None:
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.requests.append(request)
            step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        if isinstance(step, Exception):
            raise step
        # a response of its own per request, as a transport gives (one is read only once)
        return httpx.Response(step.status_code, headers=step.headers, stream=step.stream)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]

    def request_ids(self) -> list[str]:
        return [b["metadata"]["request_id"] for b in self.bodies()]


def sync_client(script: Callable[[httpx.Request], httpx.Response], **kw: Any) -> GatewayClient:
    kw.setdefault("retry", FAST)
    return GatewayClient(URL, transport=httpx.MockTransport(script), **kw)


def async_client(
    script: Callable[[httpx.Request], httpx.Response], **kw: Any
) -> AsyncGatewayClient:
    kw.setdefault("retry", FAST)
    return AsyncGatewayClient(URL, transport=httpx.MockTransport(script), **kw)


# --- what is sent ------------------------------------------------------------------------------


def test_route_sends_the_envelope_and_returns_a_typed_route() -> None:
    script = Script(ok({**ROUTE_DATA, "placement": "rebound", "previous_pod_id": "agent-old"}))
    with sync_client(script, token="tok-1") as client:
        route = client.route("s-1", "bot-1", "grp-1", failed_pod_id="agent-old")
    (request,) = script.requests
    assert request.url == f"{URL}/api/session/route" and request.method == "POST"
    assert request.headers["authorization"] == "Bearer tok-1"
    assert request.headers["content-type"] == "application/json"
    body = script.bodies()[0]
    assert body == {
        "metadata": {"request_id": route.request_id, "session_id": "s-1", "bot_id": "bot-1",
                     "extra": {"group_id": "grp-1"}},
        "rawdata": {"failed_pod_id": "agent-old"},
    }  # fmt: skip
    assert len(route.request_id) == 32
    assert route == Route("agent-a", ROUTE_DATA["pod_sse_url"], Placement.REBOUND, "agent-old",
                          route.request_id)  # fmt: skip


def test_touch_and_end_send_the_ids_and_eos() -> None:
    script = Script(ok({"touched": True}), ok({"touched": True, "released": True}))
    with sync_client(script) as client:
        assert client.touch("s-1", bot_id="b", group_id="g", request_id="t-1") is True
        ended = client.end("s-1")
    assert (ended.touched, ended.released) == (True, True)
    touch, end = script.bodies()
    assert touch == {"metadata": {"request_id": "t-1", "session_id": "s-1", "bot_id": "b",
                                  "extra": {"group_id": "g"}}, "rawdata": {}}  # fmt: skip
    assert end["rawdata"] == {"eos": True} and "bot_id" not in end["metadata"]
    assert end["metadata"]["request_id"]  # one id even on touch: a retried eos replays
    assert "authorization" not in script.requests[0].headers
    with pytest.raises(ValueError, match="go together"):
        client.touch("s-1", bot_id="b")


def test_url_and_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENT_RUNTIME_URL", raising=False)
    monkeypatch.delenv("AGENT_RUNTIME_GATEWAY_TOKEN", raising=False)
    with pytest.raises(ValueError, match="AGENT_RUNTIME_URL"):
        GatewayClient()
    monkeypatch.setenv("AGENT_RUNTIME_URL", "http://from-env:8091/")
    monkeypatch.setenv("AGENT_RUNTIME_GATEWAY_TOKEN", "env-token")
    script = Script(ok({"touched": False}))
    with GatewayClient(transport=httpx.MockTransport(script)) as client:
        assert client.touch("s") is False
        assert client.config.base_url == "http://from-env:8091"
    assert script.requests[0].headers["authorization"] == "Bearer env-token"
    with GatewayClient(token="mine", transport=httpx.MockTransport(script)) as client:
        client.touch("s")
    assert script.requests[1].headers["authorization"] == "Bearer mine"
    with GatewayClient(token="", transport=httpx.MockTransport(script)) as client:
        client.touch("s")
    assert "authorization" not in script.requests[2].headers  # "": none, the variable unread


# --- retries -----------------------------------------------------------------------------------


async def test_a_retry_after_answer_is_retried_with_the_same_request_id_after_the_pause() -> None:
    script = Script(failure(503, "BACKEND_UNAVAILABLE", retry_after=1), ok(ROUTE_DATA))
    async with async_client(script) as client:
        started = time.monotonic()
        route = await client.route("s-1", "b", "g")
        waited = time.monotonic() - started
    assert script.request_ids() == [route.request_id, route.request_id]
    assert script.requests[0].content == script.requests[1].content  # the same bytes
    assert waited >= 1.0  # Retry-After honoured, never cut short


@pytest.mark.parametrize(
    ("answer", "raised"),
    [
        (failure(400, "VALIDATION"), ValidationFailed),
        (failure(401, "UNAUTHORIZED"), Unauthorized),
        (failure(409, "REQUEST_ID_REUSED"), RequestIdReused),
        (failure(500, "INTERNAL"), Internal),
        (failure(502, "K8S_ERROR"), K8sError),
        (failure(503, "CONFIG_NOT_FOUND"), ConfigNotFound),  # no retry_after: not retried
    ],
)
def test_answers_without_retry_after_are_not_retried(
    answer: httpx.Response, raised: type[AgentRuntimeError]
) -> None:
    script = Script(answer, ok(ROUTE_DATA))
    with sync_client(script) as client, pytest.raises(raised) as caught:
        client.route("s-1", "b", "g", request_id="r-1")
    assert len(script.requests) == 1
    assert type(caught.value) is raised
    assert caught.value.http_status == answer.status_code and caught.value.retry_after is None


def test_an_unknown_code_is_the_base_class_with_its_code() -> None:
    script = Script(failure(418, "TEAPOT"))
    with sync_client(script) as client, pytest.raises(AgentRuntimeError) as caught:
        client.touch("s")
    assert type(caught.value) is AgentRuntimeError
    assert (caught.value.code, caught.value.http_status) == ("TEAPOT", 418)


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused"),
        httpx.ReadError("reset"),
        httpx.RemoteProtocolError("server closed the kept-alive connection"),
    ],
)
def test_transport_errors_are_retried_then_unavailable_with_the_cause(error: Exception) -> None:
    script = Script(error)
    retry = RetryPolicy(max_attempts=3, backoff_base=0.01, backoff_cap=0.02, min_attempt_time=0)
    with sync_client(script, retry=retry) as client, pytest.raises(Unavailable) as caught:
        client.route("s-1", "b", "g")
    assert type(caught.value) is Unavailable and caught.value.cause is error
    assert caught.value.attempts == 3 and len(script.requests) == 3
    assert (
        len(set(script.request_ids())) == 1 == len({caught.value.request_id, *script.request_ids()})
    )


async def test_a_transport_error_then_success() -> None:
    script = Script(httpx.ConnectError("refused"), ok({"touched": True}))
    async with async_client(script) as client:
        assert await client.touch("s", request_id="t-7") is True
    assert script.request_ids() == ["t-7", "t-7"]


def test_retries_off_means_one_attempt() -> None:
    script = Script(failure(503, "OVERLOADED", retry_after=1), ok(ROUTE_DATA))
    client = sync_client(script, retry=RetryPolicy(max_attempts=1))
    with client, pytest.raises(Overloaded) as caught:
        client.route("s", "b", "g")
    assert caught.value.code == "OVERLOADED" and caught.value.retry_after == 1
    assert len(script.requests) == 1


def test_a_retry_after_longer_than_the_deadline_ends_with_the_answer() -> None:
    script = Script(failure(504, "SCOPE_FULL_TIMEOUT", retry_after=5), ok(ROUTE_DATA))
    with sync_client(script, deadline=2.0) as client, pytest.raises(ScopeFullTimeout) as caught:
        client.route("s", "b", "g")
    assert len(script.requests) == 1 and caught.value.retry_after == 5


def test_a_proxy_503_with_retry_after_is_retried_and_other_pages_are_not() -> None:
    page = httpx.Response(503, text="<html>no backend</html>", headers={"retry-after": "0"})
    script = Script(page, ok({"touched": True}))
    with sync_client(script) as client:
        assert client.touch("s") is True
    assert len(script.requests) == 2
    script = Script(httpx.Response(502, text="<html>bad gateway</html>"))
    with sync_client(script) as client, pytest.raises(UnexpectedAnswer) as caught:
        client.touch("s")
    assert caught.value.code == "HTTP_502" and "bad gateway" in caught.value.excerpt
    assert len(script.requests) == 1


# --- the deadline ------------------------------------------------------------------------------


async def test_the_deadline_bounds_an_attempt_that_never_answers() -> None:
    release = asyncio.Event()
    seen: list[httpx.Request] = []

    async def hang(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        await release.wait()
        return ok(ROUTE_DATA)

    client = AsyncGatewayClient(URL, transport=httpx.MockTransport(hang), deadline=1.0)
    started = time.monotonic()
    async with client:
        with pytest.raises(DeadlineExceeded) as caught:
            await client.route("s", "b", "g")
    elapsed = time.monotonic() - started
    release.set()
    assert isinstance(caught.value.cause, TimeoutError) and caught.value.attempts == 1
    assert 1.0 <= elapsed < 10.0  # ended at the deadline, not at the answer (which never came)


async def test_retries_off_an_attempt_cut_by_the_deadline_is_deadline_exceeded() -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(60)
        return ok(ROUTE_DATA)

    client = AsyncGatewayClient(
        URL, transport=httpx.MockTransport(hang), deadline=0.5, retry=RetryPolicy(max_attempts=1)
    )
    async with client:
        with pytest.raises(DeadlineExceeded) as caught:
            await client.touch("s")
    assert caught.value.attempts == 1


def test_the_sync_deadline_bounds_an_answer_that_trickles() -> None:
    def trickle() -> Iterator[bytes]:
        yield b'{"ok": true, '
        for _ in range(100):
            time.sleep(0.1)
            yield b" "
        yield b'"data": {"touched": true}}'

    script = Script(httpx.Response(200, content=trickle()))
    with sync_client(script, deadline=1.0) as client, pytest.raises(DeadlineExceeded):
        client.touch("s")


def test_a_per_call_deadline_overrides_the_clients() -> None:
    script = Script(httpx.ConnectError("refused"))
    retry = RetryPolicy(max_attempts=1000, backoff_base=0.05, backoff_cap=0.05, min_attempt_time=0)
    with sync_client(script, retry=retry, deadline=60.0) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as caught:
            client.touch("s", deadline=0.5)
    assert time.monotonic() - started < 10.0
    assert isinstance(caught.value.cause, httpx.ConnectError) and caught.value.attempts > 1


# --- the answer's bound ------------------------------------------------------------------------


def test_an_answer_over_the_bound_is_refused_before_it_is_parsed() -> None:
    big = json.dumps({"ok": True, "data": {"touched": True, "pad": "x" * 5000}}).encode()
    script = Script(httpx.Response(200, content=big))  # with a Content-Length
    with (
        sync_client(script, max_answer_bytes=1024) as client,
        pytest.raises(UnexpectedAnswer) as caught,
    ):
        client.touch("s", request_id="t-big")
    assert caught.value.request_id == "t-big" and caught.value.http_status == 200
    streamed = Script(httpx.Response(200, content=iter([big[:800], big[800:]])))  # without one
    with sync_client(streamed, max_answer_bytes=1024) as client, pytest.raises(UnexpectedAnswer):
        client.touch("s")
    assert len(script.requests) == len(streamed.requests) == 1  # not retried


async def test_an_answer_over_the_bound_async() -> None:
    big = b'{"ok": true, "data": {"touched": true, "pad": "' + b"x" * 4096 + b'"}}'
    script = Script(httpx.Response(200, content=big))
    async with async_client(script, max_answer_bytes=1024) as client:
        with pytest.raises(UnexpectedAnswer, match="over the client's bound"):
            await client.touch("s")


def test_answers_are_asked_uncompressed_and_bounded_as_sent() -> None:
    """A compressed answer is not inflated to be measured: the client asks for identity, and
    reads what a server sends anyway as it was sent (a bomb is a few KB of nonsense to it)."""
    bomb = gzip.compress(b'{"ok": true, "data": {"touched": true, "pad": "' + b"x" * 10_000_000)
    assert len(bomb) < 64 * 1024
    script = Script(httpx.Response(200, content=bomb, headers={"content-encoding": "gzip"}))
    with (
        sync_client(script, max_answer_bytes=64 * 1024) as client,
        pytest.raises(UnexpectedAnswer),
    ):
        client.touch("s")
    assert script.requests[0].headers["accept-encoding"] == "identity"


async def test_a_compressed_answer_is_unexpected_async() -> None:
    body = gzip.compress(json.dumps({"ok": True, "data": {"touched": True}}).encode())
    script = Script(httpx.Response(200, content=body, headers={"content-encoding": "gzip"}))
    async with async_client(script) as client:
        with pytest.raises(UnexpectedAnswer):
            await client.touch("s")
    assert script.requests[0].headers["accept-encoding"] == "identity"


@pytest.mark.parametrize("token", ["a b", "line\nbreak", "caf\u00e9", "x" * 4097])
def test_a_token_that_cannot_be_sent_is_refused_at_construction(token: str) -> None:
    with pytest.raises(ValueError, match="visible ASCII"):
        GatewayClient(URL, token=token)
    with pytest.raises(ValueError, match="visible ASCII"):
        AsyncGatewayClient(URL, token=token)


def test_a_success_without_the_referenced_data_is_unexpected() -> None:
    script = Script(ok({"pod_id": "p", "pod_sse_url": "u", "placement": "teleported"}))
    with sync_client(script) as client, pytest.raises(UnexpectedAnswer, match="teleported"):
        client.route("s", "b", "g")


# --- Retry-After -------------------------------------------------------------------------------


def test_retry_after_parsing() -> None:
    now = time.time()
    later = format_datetime(datetime.fromtimestamp(now, UTC) + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-1") is None
    seconds = parse_retry_after(later, now=now)
    assert seconds is not None and 28.0 <= seconds <= 30.0
    past = format_datetime(datetime.fromtimestamp(now, UTC) - timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(past, now=now) == 0.0


def test_the_header_wins_over_the_body() -> None:
    answer = failure(503, "SCOPE_QUEUE_FULL", retry_after=30)  # the body's 30 s: past the deadline
    answer.headers["retry-after"] = "0"
    script = Script(answer, ok(ROUTE_DATA))
    with sync_client(script, deadline=10.0) as client:
        client.route("s", "b", "g")
    assert len(script.requests) == 2
