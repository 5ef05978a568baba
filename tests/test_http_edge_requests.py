"""The HTTP edge, request level (issue 13 §1): a client that goes away mid-body, every answer
on the API paths an envelope (405, no redirects, unknown paths), and the in-flight bound that
sheds overload before any Redis or DB work."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from starlette.types import Message

from agent_runtime.db.engine import Database
from helpers import envelope, running_app, session_hashes, session_id_of, sync_body

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"


def _post_scope(path: str, length: int) -> dict[str, Any]:
    """The ASGI scope of a JSON POST of ``length`` bytes, as uvicorn hands it to the app."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"application/json"),
            (b"content-length", str(length).encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8091),
        "state": {},
    }


async def requests_total(client: httpx.AsyncClient) -> dict[tuple[str, str, str], float]:
    """agent_runtime_http_requests_total by (endpoint, status, code)."""
    text = (await client.get("/metrics")).text
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "agent_runtime_http_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                labels = sample.labels
                out[(labels["endpoint"], labels["status"], labels["code"])] = sample.value
    return out


# --- a client that disconnects mid-body ----------------------------------------------------------


async def _send_half_a_body_then_disconnect(client: httpx.AsyncClient, path: str) -> list[Message]:
    """Drive the ASGI app as uvicorn does for a caller that sends its head and part of its
    body, then closes the connection."""
    app = client.app  # type: ignore[attr-defined]
    body = json.dumps(envelope(session_id="s-1", bot_id="b", extra={"group_id": "g"})).encode()
    half = body[: len(body) // 2]
    messages: list[Message] = [
        {"type": "http.request", "body": half, "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # nothing more ever comes
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await asyncio.wait_for(app(_post_scope(path, len(body)), receive, send), 10)
    return sent


@pytest.mark.parametrize("path", [ROUTE, TOUCH])
async def test_disconnect_mid_body_is_a_client_abort_not_an_internal_error(
    redis: Redis, db: Database, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="agent_runtime")
    async with running_app(redis, db) as client:
        before = await requests_total(client)
        caplog.clear()
        await _send_half_a_body_then_disconnect(client, path)
        after = await requests_total(client)
    grew = {
        k: v - before.get(k, 0)
        for k, v in after.items()
        if v != before.get(k, 0) and k[0] != "/metrics"
    }
    assert grew == {(path, "499", "CLIENT_ABORTED"): 1}, grew
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [(r.levelname, r.getMessage()) for r in loud]
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a client abort"
    assert any(
        r.levelno == logging.DEBUG and "disconnected" in r.getMessage() for r in caplog.records
    )


# --- every answer on the API paths is an envelope -------------------------------------------------


def _assert_envelope(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.headers, resp.text)
    body = resp.json()
    assert body["ok"] is False and body["error_code"] == code, body
    assert set(body) == {"ok", "request_id", "error_code", "error_message"}, body
    assert resp.headers["x-error-code"] == code
    return body


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", ROUTE, "POST"),
        ("PUT", TOUCH, "POST"),
        ("DELETE", "/api/session/config_sync", "POST"),
        ("POST", "/api/session/admin/scopes", "GET"),
    ],
)
async def test_wrong_method_is_405_method_not_allowed_with_allow(
    redis: Redis, db: Database, method: str, path: str, allow: str
) -> None:
    async with running_app(redis, db, gateway_tokens=["gw"], admin_tokens=["adm"]) as client:
        resp = await client.request(method, path, content=b"{}")
        _assert_envelope(resp, 405, "METHOD_NOT_ALLOWED")
        assert resp.headers["allow"] == allow


@pytest.mark.parametrize(
    "path", [ROUTE + "/", TOUCH + "/", "/api/session/config_sync/", "/api/session/nope"]
)
async def test_trailing_slash_and_unknown_paths_are_404_envelopes_never_redirects(
    redis: Redis, db: Database, path: str
) -> None:
    async with running_app(redis, db, gateway_tokens=["gw"], admin_tokens=["adm"]) as client:
        body = json.dumps(envelope(session_id="s-1", bot_id="b", extra={"group_id": "g"}))
        resp = await client.post(path, content=body, follow_redirects=False)
        _assert_envelope(resp, 404, "NOT_FOUND")
        assert "location" not in resp.headers
        # no route, so nothing was bound on the way
        assert not await session_hashes(redis, "s-1")


# --- an open gateway is said at startup ----------------------------------------------------------


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("settings", "warned"),
    [
        ({"host": "0.0.0.0", "allow_open_gateway": True}, True),
        ({"host": "0.0.0.0", "gateway_tokens": ["gw"]}, False),
        ({"host": "127.0.0.1"}, False),  # a developer's local run: open, and nobody else sees it
    ],
)
async def test_an_open_gateway_reachable_from_elsewhere_logs_a_warning_at_startup(
    redis: Redis,
    db: Database,
    caplog: pytest.LogCaptureFixture,
    settings: dict[str, Any],
    warned: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="agent_runtime")
    async with running_app(redis, db, **settings):
        pass
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "GATEWAY OPEN" in r.message
    ]
    assert bool(warnings) is warned, [r.getMessage() for r in caplog.records]


# --- overload: the in-flight bound sheds at the edge ----------------------------------------------

GROUP, BOT = "g-edge", "b-edge"


async def _configure(client: httpx.AsyncClient, *, scope_concurrency: int) -> None:
    item = {
        "template_id": "tpl-edge",
        "image": "agentserver:1",
        "scope_concurrency": scope_concurrency,
        "pod_concurrency": scope_concurrency,
        "min_idle_pods": 0,
        "ready_poll_interval": 0.02,
    }
    for kind, body in (
        ("template", item),
        ("routing_rule", {"group_id": GROUP, "bot_id": BOT, "template_id": "tpl-edge"}),
    ):
        resp = await client.post("/api/session/config_sync", json=sync_body(kind, "create", body))
        assert resp.status_code == 200, resp.text


def _route_body(session_id: str) -> dict[str, Any]:
    return envelope(session_id=session_id, bot_id=BOT, extra={"group_id": GROUP})


_NOT_REQUESTS = frozenset({"route_lease", "pod_fields", "read_many", "pod_usage"})


async def _redis_script_calls(client: httpx.AsyncClient) -> float:
    """Script calls on /metrics, but the held requests' lease renewals (``route_lease``: a
    request held while its answer is written keeps renewing; a shed request has no lease) and
    the read-only scripts /metrics itself runs for its pod gauges at every scrape."""
    text = (await client.get("/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "agent_runtime_redis_script_seconds"
        for sample in family.samples
        if sample.name.endswith("_count") and sample.labels.get("script") not in _NOT_REQUESTS
    )


async def _settled_script_calls(client: httpx.AsyncClient) -> float:
    """The script call count once the held requests' own follow-ups (done after their answer
    was computed) have landed: two reads 0.3 s apart agree."""
    last = await _redis_script_calls(client)
    for _ in range(100):
        await asyncio.sleep(0.3)
        now = await _redis_script_calls(client)
        if now == last:
            return now
        last = now
    raise AssertionError("script calls never settled")


async def _gauge(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return family.samples[0].value
    raise AssertionError(f"{name} not on /metrics")


async def _eventually(check: Any, within: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


class _SlowReader:
    """A request whose answer is held back until ``release`` (a client that reads its answer
    slowly): it is in flight (admitted) the whole time. Its body arrives at once: a slow
    *body* holds no place (it is read before the place is taken)."""

    def __init__(self, app: Any, body: bytes) -> None:
        self.app, self.body = app, body
        self.gate = asyncio.Event()
        self.answering = asyncio.Event()  # its handler is done: only the answer is held back
        self.sent: list[Message] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        first = True

        async def receive() -> Message:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": self.body, "more_body": False}
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            self.answering.set()
            await self.gate.wait()
            self.sent.append(message)

        await self.app(_post_scope(ROUTE, len(self.body)), receive, send)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])


async def test_past_the_in_flight_bound_requests_are_shed_at_once_without_redis_work(
    redis: Redis, db: Database
) -> None:
    limit = 3
    async with running_app(redis, db, max_in_flight=limit, admission_queue=0) as client:
        await _configure(client, scope_concurrency=50)
        app = client.app  # type: ignore[attr-defined]
        # `limit` slow clients hold every place
        slow = [_SlowReader(app, json.dumps(_route_body(f"s-{i}")).encode()) for i in range(limit)]
        await _eventually(lambda: _gauge_is(client, "agent_runtime_http_in_flight", limit))
        await asyncio.wait_for(asyncio.gather(*(r.answering.wait() for r in slow)), 20)
        calls_before = await _settled_script_calls(client)
        shed = await asyncio.gather(
            *(client.post(ROUTE, json=_route_body(f"shed-{i}")) for i in range(20))
        )
        for resp in shed:
            body = _assert_retry(resp)
            assert body["request_id"] is None  # the prebuilt answer: nothing was parsed
        # healthz, metrics and openapi are never shed
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/openapi.json")).status_code == 200
        # no Redis (nor DB) work was done for them, and they left nothing behind
        assert await _redis_script_calls(client) == calls_before
        for i in range(20):
            assert not await session_hashes(redis, f"shed-{i}")
        # a touch has a reserve on top (it frees what a route took): admitted even now
        touched = await client.post(TOUCH, json=envelope(session_id="nobody"))
        assert touched.status_code == 200, touched.text
        # the slow ones go on and are served; then the replica serves everyone again
        for request in slow:
            request.gate.set()
        await asyncio.wait_for(asyncio.gather(*(r.task for r in slow)), 20)
        assert [r.status for r in slow] == [200] * limit
        assert await _gauge(client, "agent_runtime_http_in_flight") == 0
        after = await client.post(ROUTE, json=_route_body("after"))
        assert after.status_code == 200, after.text
        counts = await requests_total(client)
        assert counts[(ROUTE, "503", "OVERLOADED")] == 20
    sid_sessions = [session_id_of(k) for k in await session_hashes(redis)]
    assert sorted(sid_sessions) == sorted([f"s-{i}" for i in range(limit)] + ["after"])


async def _gauge_is(client: httpx.AsyncClient, name: str, value: float) -> bool:
    return await _gauge(client, name) == value


def _assert_retry(resp: httpx.Response) -> dict[str, Any]:
    body = _assert_envelope_with_retry(resp, 503, "OVERLOADED")
    assert body["retry_after"] >= 1 and resp.headers["retry-after"] == str(body["retry_after"])
    return body


def _assert_envelope_with_retry(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert body["ok"] is False and body["error_code"] == code, body
    assert set(body) == {"ok", "request_id", "error_code", "error_message", "retry_after"}, body
    assert resp.headers["x-error-code"] == code
    return body


@pytest.mark.parametrize("queue", [0, 512], ids=["no-queue", "queue"])
async def test_a_burst_over_a_small_bound_is_served_or_shed_and_leaks_nothing(
    redis: Redis, db: Database, queue: int
) -> None:
    """Without a waiting room the excess of a burst is shed; with one (the default) a burst
    that clears within the burst wait is absorbed: every route is served (a long burst wait
    here: 60 routes through 4 places may take a loaded machine past the default 0.1 s, and
    then the excess is overload, shed; the admission tests cover that). Either way nothing
    is left behind."""
    async with running_app(
        redis, db, max_in_flight=4, admission_queue=queue, admission_burst_wait=30
    ) as client:
        await _configure(client, scope_concurrency=200)
        answers = await asyncio.gather(
            *(client.post(ROUTE, json=_route_body(f"burst-{i}")) for i in range(60))
        )
        served = set()
        for i, resp in enumerate(answers):
            if resp.status_code == 200:
                served.add(f"burst-{i}")
            else:
                _assert_retry(resp)
        assert served, "the bound must let some through"
        if queue:
            assert len(served) == 60
        assert await _gauge(client, "agent_runtime_http_in_flight") == 0
        live = {session_id_of(k) for k in await session_hashes(redis)}
        assert live == served  # a shed route bound nothing
        scopes = [k async for k in redis.scan_iter("session_manager:scope:*:sessions")]
        assert len(scopes) == 1 and await redis.scard(scopes[0]) == len(served)
        # every served session ends; the scope is empty again (nothing held by a shed one)
        ended = await asyncio.gather(
            *(client.post(TOUCH, json=envelope({"eos": True}, session_id=s)) for s in served)
        )
        assert all(r.status_code == 200 for r in ended)
        assert await redis.scard(scopes[0]) == 0


async def test_routes_waiting_in_a_full_scope_do_not_hold_in_flight_places(
    redis: Redis, db: Database
) -> None:
    """Queued waiters give their place back while they wait: the fast path keeps being
    admitted, and a woken waiter is served (not shed)."""
    limit = 2
    async with running_app(redis, db, max_in_flight=limit, scope_full_timeout=30) as client:
        await _configure(client, scope_concurrency=1)
        first = await client.post(ROUTE, json=_route_body("holder"))
        assert first.status_code == 200, first.text
        waiters = [
            asyncio.create_task(client.post(ROUTE, json=_route_body(f"wait-{i}")))
            for i in range(2)  # the scope's queue holds 2 x scope_concurrency
        ]
        await _eventually(lambda: _gauge_is(client, "agent_runtime_http_parked", 2))
        assert await _gauge(client, "agent_runtime_http_in_flight") == 0
        for _ in range(3):  # the fast path (a refresh) is admitted while they wait
            again = await client.post(ROUTE, json=_route_body("holder"))
            assert again.status_code == 200 and again.json()["data"]["placement"] == "refresh"
        ended = await client.post(TOUCH, json=envelope({"eos": True}, session_id="holder"))
        assert ended.status_code == 200, ended.text
        done, _ = await asyncio.wait(waiters, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        assert done and all(t.result().status_code == 200 for t in done)
        winner = next(iter(done)).result().json()
        assert winner["ok"] is True
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


async def test_a_request_waiting_for_a_place_is_shed_after_its_wait_and_leaves_nothing(
    redis: Redis, db: Database
) -> None:
    """The waiting room is bounded in count (admission_queue) and in time (burst_wait)."""
    async with running_app(
        redis, db, max_in_flight=1, admission_queue=2, admission_burst_wait=0.3
    ) as client:
        await _configure(client, scope_concurrency=50)
        app = client.app  # type: ignore[attr-defined]
        holder = _SlowReader(app, json.dumps(_route_body("holder")).encode())
        await _eventually(lambda: _gauge_is(client, "agent_runtime_http_in_flight", 1))
        await asyncio.wait_for(holder.answering.wait(), 20)
        calls_before = await _settled_script_calls(client)
        answers = await asyncio.gather(
            *(client.post(ROUTE, json=_route_body(f"late-{i}")) for i in range(5))
        )
        for resp in answers:  # 3 shed at once (room for 2), 2 after their 0.3 s
            _assert_retry(resp)
        assert await _redis_script_calls(client) == calls_before
        assert await _gauge(client, "agent_runtime_http_admission_waiting") == 0
        holder.gate.set()
        await asyncio.wait_for(holder.task, 20)
        assert holder.status == 200


async def test_a_waiter_is_handed_the_place_the_moment_it_frees(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, max_in_flight=1, admission_burst_wait=30) as client:
        await _configure(client, scope_concurrency=50)
        app = client.app  # type: ignore[attr-defined]
        second = _SlowReader(app, json.dumps(_route_body("second")).encode())
        # its handler done, only its answer held back: it holds the place (while its deploy
        # ran it was parked, as a route waiting on Kubernetes is)
        await asyncio.wait_for(second.answering.wait(), 20)
        await _eventually(lambda: _gauge_is(client, "agent_runtime_http_in_flight", 1))
        waiter = asyncio.create_task(client.post(ROUTE, json=_route_body("waiter")))
        await _eventually(lambda: _gauge_is(client, "agent_runtime_http_admission_waiting", 1))
        second.gate.set()
        resp = await asyncio.wait_for(waiter, 20)
        assert resp.status_code == 200, resp.text
        await asyncio.wait_for(second.task, 20)
        assert await _gauge(client, "agent_runtime_http_in_flight") == 0


async def test_clients_that_drip_their_bodies_hold_no_place(redis: Redis, db: Database) -> None:
    """A body that arrives slowly is read before the place is taken: `limit` clients stuck
    mid-body leave every place to the others (a drip of 50 bodies took a replica's 32 places
    and made every route wait ~1 s behind them)."""
    limit = 2
    async with running_app(redis, db, max_in_flight=limit, admission_queue=0) as client:
        await _configure(client, scope_concurrency=50)
        app = client.app  # type: ignore[attr-defined]
        stuck = asyncio.Event()

        async def drip_forever() -> None:
            body = json.dumps(_route_body("drip")).encode()
            parts = [{"type": "http.request", "body": body[:10], "more_body": True}]

            async def receive() -> Message:
                if parts:
                    return parts.pop()
                stuck.set()
                await asyncio.sleep(3600)
                raise AssertionError("unreachable")

            async def send(message: Message) -> None:
                raise AssertionError(f"a stuck body got an answer: {message}")

            await app(_post_scope(ROUTE, len(body)), receive, send)

        drips = [asyncio.create_task(drip_forever()) for _ in range(3 * limit)]
        try:
            await asyncio.wait_for(stuck.wait(), 20)
            assert await _gauge(client, "agent_runtime_http_in_flight") == 0
            answers = await asyncio.gather(
                *(client.post(ROUTE, json=_route_body(f"fast-{i}")) for i in range(limit))
            )
            assert [r.status_code for r in answers] == [200] * limit, [r.text for r in answers]
        finally:
            for task in drips:
                task.cancel()
            await asyncio.gather(*drips, return_exceptions=True)
