"""The gateway's client (``client/``) against the running service over real HTTP: two
``agent-runtime serve --mode server`` replicas (real uvicorn processes, the real Redis, a
PostgreSQL database of their own, the Kubernetes API simulator), started as
``test_server_e2e`` starts its stack.

- route, touch and end through the async and the sync client, every placement typed;
- a route whose answer is lost on the way (a proxy forwards the request, then cuts the
  connection): the client sends it again with the same request_id and the service replays
  the first answer: one session, placed once;
- a replica stopped mid-call: a route waits in a full scope's queue on a third replica
  behind a loopback proxy (a Service's address); the replica is SIGTERMed and the proxy sends
  new connections to another replica, as a Service drops a terminating pod's endpoint; the
  stopping replica answers 503 BACKEND_UNAVAILABLE + Retry-After, the client waits, sends the
  same request_id again, and the other replica answers. The caller sees success; the proxy
  saw the request_id go in twice; the scope's seats and queue are what they should be after.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_runtime_client import (
    AsyncGatewayClient,
    Ended,
    GatewayClient,
    Placement,
    RetryPolicy,
    Unauthorized,
)
from helpers import TcpProxy, free_port, sync_body
from test_server_e2e import (
    ADMIN,
    GATEWAY_TOKEN,
    SETTINGS,
    AttachServerLog,
    Backing,
    Child,
    backing,
    serve_on,
)

pytestmark = pytest.mark.timeout(180)

QUEUE_WAIT = 30.0  # the scope's queue wait: far longer than the test needs to stop a replica
REPLICA_SETTINGS = {**SETTINGS, "AGENT_RUNTIME_SCOPE_FULL_TIMEOUT": str(QUEUE_WAIT)}
DEADLINE = 30.0  # any poll
RID = re.compile(rb'"request_id":"([^"]+)"')


@dataclass
class Pair:
    workdir: Path
    shared: Backing
    urls: list[str]
    servers: list[Child]
    sse_port: int
    undo: contextlib.ExitStack


@pytest.fixture(scope="module")
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    workdir = tmp_path_factory.mktemp("client-e2e")
    with contextlib.ExitStack() as undo:
        plugin = AttachServerLog()
        request.config.pluginmanager.register(plugin, f"client-server-log-{workdir.name}")
        undo.callback(request.config.pluginmanager.unregister, plugin)
        shared = backing(workdir, "postgresql", undo)
        started = [serve_on(workdir, shared, REPLICA_SETTINGS, undo, name=f"r{i}") for i in (1, 2)]
        yield Pair(
            workdir, shared, [s[1] for s in started], [s[0] for s in started], free_port(), undo
        )
        stopped = [(s.stop(), s.killed) for s in (s[0] for s in started)]
    assert stopped == [(0, False), (0, False)], stopped


class Scope:
    """A scope of its own: a template and an exact rule, configured through one replica."""

    def __init__(self, pair: Pair, admin: httpx.AsyncClient, **fields: Any) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.group, self.bot = f"grp-client-{self.tag}", "bot-client"
        self.template_id = f"tpl-client-{self.tag}"
        self.scope_id = hashlib.md5(f"{self.group}\x00{self.bot}".encode()).hexdigest()
        self.admin = admin
        self.fields = {
            "template_id": self.template_id,
            "image": "agentserver:1",
            "pod_name": "client-e2e",
            "container_port": pair.sse_port,
            "sse_port": pair.sse_port,
            "sse_path": "/sse",
            "scope_concurrency": 4,
            "pod_concurrency": 2,
            "session_ttl": 60,
            "pod_ttl": 300,
            "min_idle_pods": 0,
            "ready_timeout": 10,
            "ready_poll_interval": 0.05,
            **fields,
        }

    async def configure(self) -> None:
        for kind, item in (
            ("template", self.fields),
            ("routing_rule", {"group_id": self.group, "bot_id": self.bot,
                              "template_id": self.template_id}),
        ):  # fmt: skip
            resp = await self.admin.post(
                "/api/session/config_sync", json=sync_body(kind, "sync", item), headers=ADMIN
            )
            assert resp.status_code == 200, resp.text

    async def view(self) -> dict[str, Any]:
        resp = await self.admin.get(f"/api/session/admin/scopes/{self.scope_id}", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        data: dict[str, Any] = resp.json()["data"]
        return data

    async def cleanup(self) -> None:
        """The scope's pods deleted in Kubernetes (the jobs notice)."""
        body = sync_body("x", "x", {})
        body["rawdata"] = {"label_selector": f"agent-runtime/scope={self.scope_id}"}
        resp = await self.admin.post("/api/session/cleanup", json=body, headers=ADMIN)
        assert resp.status_code == 200, resp.text


@contextlib.asynccontextmanager
async def admin_client(url: str) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as http:
        yield http


async def test_route_touch_end_through_the_async_client(pair: Pair) -> None:
    async with admin_client(pair.urls[0]) as admin:
        scope = Scope(pair, admin)
        await scope.configure()
        client = AsyncGatewayClient(pair.urls[1], token=GATEWAY_TOKEN, trust_env=False)
        async with client:
            first = await client.route("s-1", scope.bot, scope.group)
            assert first.placement is Placement.PLACED and first.previous_pod_id is None
            assert first.pod_sse_url.endswith(f":{pair.sse_port}/sse")
            again = await client.route("s-1", scope.bot, scope.group)
            assert (again.placement, again.pod_id) == (Placement.REFRESH, first.pod_id)
            assert again.request_id != first.request_id
            assert await client.touch("s-1", bot_id=scope.bot, group_id=scope.group) is True
            assert (
                await client.touch("never-routed", bot_id=scope.bot, group_id=scope.group) is False
            )
            ended = await client.end("s-1", bot_id=scope.bot, group_id=scope.group)
            assert ended == Ended(touched=True, released=True)
            assert await client.end("s-1", bot_id=scope.bot, group_id=scope.group) == Ended(
                False, False
            )
            # a stream that failed on a pod that is alive: the report is checked, nothing moves
            placed = await client.route("s-2", scope.bot, scope.group)
            reported = await client.route(
                "s-2", scope.bot, scope.group, failed_pod_id=placed.pod_id
            )
            assert reported.pod_id == placed.pod_id
            await client.end("s-2", bot_id=scope.bot, group_id=scope.group)
        wrong = AsyncGatewayClient(pair.urls[0], token="not-the-token", trust_env=False)
        async with wrong:
            with pytest.raises(Unauthorized) as caught:
                await wrong.route("s-3", scope.bot, scope.group)
        assert caught.value.http_status == 401
        assert (await scope.view())["live_sessions"] == 0
        await scope.cleanup()


async def test_route_touch_end_through_the_sync_client(pair: Pair) -> None:
    async with admin_client(pair.urls[0]) as admin:
        scope = Scope(pair, admin)
        await scope.configure()

        def gateway() -> tuple[Any, ...]:
            with GatewayClient(pair.urls[0], token=GATEWAY_TOKEN, trust_env=False) as client:
                placed = client.route("s-1", scope.bot, scope.group)
                refreshed = client.route("s-1", scope.bot, scope.group)
                touched = client.touch("s-1")  # without the ids: the index path
                ended = client.end("s-1", bot_id=scope.bot, group_id=scope.group)
            return placed, refreshed, touched, ended

        placed, refreshed, touched, ended = await asyncio.to_thread(gateway)
        assert placed.placement is Placement.PLACED
        assert (refreshed.placement, refreshed.pod_id) == (Placement.REFRESH, placed.pod_id)
        assert touched is True and ended == Ended(True, True)
        await scope.cleanup()


async def test_a_route_whose_answer_was_lost_is_replayed_not_placed_again(pair: Pair) -> None:
    """The proxy forwards the first route, swallows its answer and cuts the connection: the
    route ran. The client's retry (same request_id) gets the first answer again."""
    host, port = pair.urls[0].removeprefix("http://").split(":")
    seen: list[bytes] = []

    def drop_first_answer(chunk: bytes) -> str | None:
        found = RID.search(chunk)
        if found is None:
            return None
        seen.append(found[1])
        return "drop" if len(seen) == 1 else None

    async with admin_client(pair.urls[0]) as admin, TcpProxy(host, int(port)) as proxy:
        scope = Scope(pair, admin)
        await scope.configure()
        proxy.intercept = drop_first_answer
        client = AsyncGatewayClient(f"http://127.0.0.1:{proxy.port}", token=GATEWAY_TOKEN,
                                    trust_env=False)  # fmt: skip
        async with client:
            route = await client.route("s-lost", scope.bot, scope.group)
            proxy.intercept = None
            assert route.placement is Placement.PLACED  # the first answer, replayed
            assert proxy.replies_dropped == 1
            assert seen == [route.request_id.encode()] * 2
            view = await scope.view()
            assert view["live_sessions"] == 1  # placed once
            again = await client.route("s-lost", scope.bot, scope.group)
            assert (again.placement, again.pod_id) == (Placement.REFRESH, route.pod_id)
            assert (await client.end("s-lost", bot_id=scope.bot, group_id=scope.group)).released
        await scope.cleanup()


async def test_a_replica_stopped_mid_call_the_retry_lands_on_another(pair: Pair) -> None:
    """A route waits in a full scope's queue on the victim replica; SIGTERM: 503 + Retry-After,
    the client retries with the same request_id through the proxy, another replica answers."""
    with contextlib.ExitStack() as undo:
        victim, victim_url, _ = serve_on(
            pair.workdir, pair.shared, REPLICA_SETTINGS, undo, name="victim"
        )
        v_host, v_port = victim_url.removeprefix("http://").split(":")
        o_host, o_port = pair.urls[1].removeprefix("http://").split(":")
        sent: list[tuple[tuple[str, int], bytes]] = []

        async with admin_client(pair.urls[1]) as admin, TcpProxy(v_host, int(v_port)) as proxy:

            def record(chunk: bytes) -> None:
                found = RID.search(chunk)
                if found is not None:
                    sent.append((proxy.upstream, found[1]))
                return None

            proxy.intercept = record
            scope = Scope(pair, admin, scope_concurrency=1, pod_concurrency=1)
            await scope.configure()
            holder = AsyncGatewayClient(pair.urls[1], token=GATEWAY_TOKEN, trust_env=False)
            recording = Recording()
            service = AsyncGatewayClient(
                f"http://127.0.0.1:{proxy.port}",
                token=GATEWAY_TOKEN,
                trust_env=False,
                deadline=60.0,
                retry=RetryPolicy(max_attempts=6),
                transport=recording,
            )
            async with holder, service:
                held = await holder.route("s-held", scope.bot, scope.group)  # the scope is full
                waiting = asyncio.create_task(service.route("s-waiting", scope.bot, scope.group))
                await eventually(lambda: _waiters(scope), "the route waits in the queue")
                assert not waiting.done()
                # the Service drops the terminating pod: new connections go to the other one
                proxy.upstream = (o_host, int(o_port))
                stopped_at = time.monotonic()
                victim.proc.send_signal(15)
                await eventually(lambda: _victim_gone(victim), "the victim exits")
                assert victim.proc.returncode == 0, victim.log()[-5000:]
                # the slot frees: the waiting route (now on the other replica) gets it
                assert (await holder.end("s-held", bot_id=scope.bot, group_id=scope.group)).released
                route = await asyncio.wait_for(waiting, DEADLINE)
                assert time.monotonic() - stopped_at >= 1.0  # it waited Retry-After
                assert route.placement is Placement.PLACED and route.pod_id == held.pod_id
                rid = route.request_id.encode()
                upstreams = [up for up, r in sent if r == rid]
                assert len(upstreams) >= 2, sent  # the same request_id went in twice (or more)
                assert upstreams[0] == (v_host, int(v_port))
                assert upstreams[-1] == (o_host, int(o_port))
                # the victim's answer to the waiting route, then the other replica's success
                assert recording.answers[0] == (503, "BACKEND_UNAVAILABLE", "1"), recording.answers
                assert recording.answers[-1] == (200, None, None), recording.answers
                view = await scope.view()
                seats = (view["live_sessions"], count(view["waiters"]), count(view["reserved"]))
                assert seats == (1, 0, 0), view
                assert (
                    await service.end("s-waiting", bot_id=scope.bot, group_id=scope.group)
                ).released
                view = await scope.view()
                assert view["live_sessions"] == 0, view
            await scope.cleanup()


async def _waiters(scope: Scope) -> bool:
    return count((await scope.view())["waiters"]) > 0


async def _victim_gone(victim: Child) -> bool:
    return victim.proc.poll() is not None


async def eventually(check: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {DEADLINE:g} s: {what}")
        await asyncio.sleep(0.05)


def count(value: Any) -> int:
    """A view's count: a number (the summary) or a list (the first 100, in detail)."""
    return value if isinstance(value, int) else len(value)


class Recording(httpx.AsyncBaseTransport):
    """The client's own transport, recording each answer's status and error code."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.answers: list[tuple[int, str | None, str | None]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        headers = response.headers
        self.answers.append(
            (response.status_code, headers.get("x-error-code"), headers.get("retry-after"))
        )
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()
