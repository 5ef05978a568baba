"""The watch stream's leader dies (SIGKILL): another replica takes the streams over and a pod
killed afterwards is still cleaned by a stream, not by the pass.

Two ``agent-runtime serve --mode server`` processes over one real Redis db, one MariaDB
database and one simulator (``test_server_e2e``'s pieces), the watch pass and reconcile an
hour apart. The replica holding ``agent_runtime:job:rm_pod_watch`` is killed without a
chance to give the lock back; its lease (3 s) lapses and the other takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
from redis.asyncio import Redis

from contract_keys import rm_pod_known, sm_pods_registered
from helpers import envelope, sync_body
from test_local_mode import free_port
from test_pod_watch_e2e import STREAM_ONLY
from test_server_e2e import ADMIN, DEADLINE, GATEWAY, ROUTE, SYNC, Child, backing, serve_on

pytestmark = pytest.mark.timeout(180)

LOCK = "agent_runtime:job:rm_pod_watch"


@dataclass
class Replicas:
    servers: list[Child]
    urls: list[str]
    sim_url: str
    redis_url: str
    sse_port: int


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    workdir = tmp_path_factory.mktemp("e2e-failover")
    with contextlib.ExitStack() as undo:
        shared = backing(workdir, "mariadb", undo)
        started = [serve_on(workdir, shared, STREAM_ONLY, undo, name=n) for n in ("a", "b")]
        yield Replicas(
            [server for server, _, _ in started],
            [url for _, url, _ in started],
            shared.sim_url,
            shared.redis_url,
            free_port(),
        )


async def streams_of(http: httpx.AsyncClient) -> float:
    with contextlib.suppress(httpx.HTTPError):
        for line in (await http.get("/metrics")).text.splitlines():
            if line.startswith("agent_runtime_pod_watch_streams "):
                return float(line.rpartition(" ")[2])
    return -1.0


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {DEADLINE:g} s: {what}")
        await asyncio.sleep(0.05)


async def test_a_killed_stream_leader_is_replaced_and_deaths_are_still_seen(
    replicas: Replicas,
) -> None:
    tag = uuid.uuid4().hex[:6]
    group, template_id = f"grp-f-{tag}", f"tpl-f-{tag}"
    port = replicas.sse_port
    async with contextlib.AsyncExitStack() as stack:
        https = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=DEADLINE, trust_env=False)
            )
            for url in replicas.urls
        ]
        sim = await stack.enter_async_context(
            httpx.AsyncClient(base_url=replicas.sim_url, timeout=DEADLINE, trust_env=False)
        )
        redis = Redis.from_url(replicas.redis_url, decode_responses=True)
        stack.push_async_callback(redis.aclose)
        template = {
            "template_id": template_id, "image": "agentserver:1", "pod_name": "e2e-f",
            "container_port": port, "sse_port": port, "sse_path": "/sse",
            "scope_concurrency": 4, "pod_concurrency": 2, "session_ttl": 60, "pod_ttl": 300,
            "min_idle_pods": 0, "ready_timeout": 10, "ready_poll_interval": 0.05,
        }  # fmt: skip
        rule = {"group_id": group, "bot_id": "bot-1", "template_id": template_id}
        for kind, item in (("template", template), ("routing_rule", rule)):
            resp = await https[0].post(SYNC, json=sync_body(kind, "sync", item), headers=ADMIN)
            assert resp.status_code == 200, resp.text

        async def route(http: httpx.AsyncClient, session: str) -> dict[str, str]:
            body = envelope(
                session_id=f"{session}-{tag}", bot_id="bot-1", extra={"group_id": group}
            )
            resp = await http.post(ROUTE, json=body, headers=GATEWAY)
            assert resp.status_code == 200, resp.text
            data: dict[str, str] = resp.json()["data"]
            return data

        async def one_leader() -> bool:
            counts = [await streams_of(http) for http in https]
            return sorted(c > 0 for c in counts) == [False, True]

        await eventually(one_leader, "exactly one replica streams")
        leader = 0 if await streams_of(https[0]) > 0 else 1
        survivor = 1 - leader
        pod = (await route(https[survivor], "s1"))["pod_id"]

        replicas.servers[leader].proc.send_signal(signal.SIGKILL)  # no chance to give back
        replicas.servers[leader].proc.wait(timeout=10)
        assert await redis.exists(LOCK), "the dead leader's lock is still there: a lease"

        async def taken_over() -> bool:
            return await streams_of(https[survivor]) > 0

        await eventually(taken_over, "the survivor takes the streams over")
        killed = await sim.post(f"/_sim/pods/default/{pod}/kill", json={"mode": "fail"})
        assert killed.status_code == 200, killed.text

        async def cleaned() -> bool:
            registered = [
                member
                async for key in redis.scan_iter(match=sm_pods_registered("*"))
                for member in await redis.smembers(key)
            ]
            return not await rm_pod_known(redis, pod) and pod not in registered

        await eventually(cleaned, "the survivor's stream cleans the killed pod")
        again = await route(https[survivor], "s1")
        assert again["placement"] == "rebound" and again["previous_pod_id"] == pod, again
        text = (await https[survivor].get("/metrics")).text
        assert 'agent_runtime_dead_pods_cleaned_total{by="stream"} 1.0' in text, text[-2000:]
