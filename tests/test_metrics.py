"""/metrics as an operator reads it: requests, placements, the slow path, the pool, the
backends and the state gauges, after real traffic through the app (fakeredis and real Redis,
fake Kubernetes). Values are read from the Prometheus text page, not from the objects."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from helpers import envelope, running_app, sync_body

ROUTE = "/api/session/route"
SYNC = "/api/session/config_sync"
GROUP, BOT = "grp-m", "bot-m"
SID = hashlib.md5(f"{GROUP}\x00{BOT}".encode()).hexdigest()

pytestmark = pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)


async def configure(client: httpx.AsyncClient, **limits: Any) -> None:
    item = {"template_id": "tpl-m", "image": "agentserver:1", "ready_poll_interval": 0.02}
    resp = await client.post(SYNC, json=sync_body("template", "create", {**item, **limits}))
    assert resp.status_code == 200, resp.text
    rule = {"group_id": GROUP, "bot_id": BOT, "template_id": "tpl-m"}
    resp = await client.post(SYNC, json=sync_body("routing_rule", "create", rule))
    assert resp.status_code == 200, resp.text


async def route(client: httpx.AsyncClient, session_id: str) -> httpx.Response:
    body = envelope(session_id=session_id, bot_id=BOT, extra={"group_id": GROUP})
    return await client.post(ROUTE, json=body)


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """``name{label="v",...}`` → value, for every sample."""
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


async def test_traffic_shows_up_in_every_family(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    async with running_app(redis, db, k8s=k8s, scope_full_timeout=0.3) as client:
        await configure(client, scope_concurrency=1, pod_concurrency=1)
        assert (await route(client, "m-1")).status_code == 200  # need_config, acquire, placed
        assert (await route(client, "m-1")).status_code == 200  # refresh (hot path)
        waiting = [asyncio.create_task(route(client, f"m-w{i}")) for i in range(3)]
        codes = sorted(r.json()["error_code"] for r in await asyncio.gather(*waiting))
        assert codes == ["SCOPE_FULL_TIMEOUT", "SCOPE_FULL_TIMEOUT", "SCOPE_QUEUE_FULL"]
        m = await scrape(client)

    assert m['agent_runtime_route_placements_total{placement="placed"}'] == 1
    assert m['agent_runtime_route_placements_total{placement="refresh"}'] == 1
    assert m['agent_runtime_queue_outcomes_total{outcome="placed"}'] == 1
    assert m['agent_runtime_queue_outcomes_total{outcome="timeout"}'] == 2
    assert m['agent_runtime_queue_outcomes_total{outcome="queue_full"}'] == 1
    assert m["agent_runtime_queue_wait_seconds_count"] == 4
    assert m['agent_runtime_pool_acquires_total{source="deploy"}'] == 1
    assert m['agent_runtime_pool_deploys_total{kind="cold",outcome="ok"}'] == 1
    assert m['agent_runtime_pool_deploy_seconds_count{kind="cold"}'] == 1
    assert m['agent_runtime_k8s_calls_total{status="ok",verb="deploy"}'] == 1
    # the hot path is one route_place; the cold route ran it three times, the waiters more
    assert m['agent_runtime_redis_script_seconds_count{script="route_place"}'] >= 5
    assert m['agent_runtime_redis_script_seconds_count{script="waiter_gate"}'] == 3
    assert m.get('agent_runtime_redis_errors_total{script="route_place"}', 0) == 0
    assert m['agent_runtime_db_seconds_count{op="read"}'] >= 1  # the resolve
    assert m['agent_runtime_db_seconds_count{op="write"}'] >= 2  # template + rule
    # the state at scrape time: one pod in use, one live session, nothing deploying
    assert m['agent_runtime_pods{state="in_use"}'] == 1
    assert m['agent_runtime_pods{state="idle"}'] == 0
    assert m['agent_runtime_pods{state="deploying"}'] == 0
    assert m['agent_runtime_pods{state="retiring"}'] == 0
    assert m["agent_runtime_live_sessions"] == 1
    assert not any(k.startswith("agent_runtime_scope_live_sessions") for k in m), "opt-in"
    route_ok = (
        'agent_runtime_http_requests_total{code="OK",endpoint="/api/session/route",status="200"}'
    )
    assert m[route_ok] == 2
    timeouts = (
        "agent_runtime_http_requests_total"
        '{code="SCOPE_FULL_TIMEOUT",endpoint="/api/session/route",status="504"}'
    )
    assert m[timeouts] == 2


async def test_per_scope_series_only_when_enabled(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, scope_metrics=True) as client:
        await configure(client, scope_concurrency=4, pod_concurrency=2)
        for i in range(3):
            assert (await route(client, f"m-s{i}")).status_code == 200
        m = await scrape(client)
    assert m[f'agent_runtime_scope_live_sessions{{scope="{SID}"}}'] == 3
    assert m["agent_runtime_live_sessions"] == 3


async def test_kubernetes_refusals_are_counted_by_status(redis: Redis, db: Database) -> None:
    k8s = FakeK8sPodClient()
    k8s.forbidden_namespaces.add("locked")
    async with running_app(redis, db, k8s=k8s, namespaces=["locked"]) as client:
        item = {"template_id": "tpl-locked", "image": "agentserver:1", "namespace": "locked"}
        synced = await client.post(SYNC, json=sync_body("template", "create", item))
        assert synced.status_code == 200, synced.text  # an allowed namespace
        body = envelope({"namespace": "locked"})
        resp = await client.post("/api/session/cleanup", json=body)
        assert resp.json()["error_code"] == "K8S_ERROR"
        m = await scrape(client)
    assert m['agent_runtime_k8s_calls_total{status="403",verb="list"}'] == 1


async def test_a_scrape_without_redis_still_serves_the_counters(redis: Redis, db: Database) -> None:
    async with running_app(redis, db) as client:
        svc = client.app.state.services  # type: ignore[attr-defined]

        async def broken(metrics: Any) -> None:
            raise ConnectionError("redis is gone")

        svc.update_gauges = broken
        resp = await client.get("/metrics")
        assert resp.status_code == 200
        assert "agent_runtime_http_requests_total" in resp.text
