"""Admin read views through HTTP: scopes (paged), one scope, one pod, one session — with the
admin token, read only, on fakeredis and the real Redis."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.wiring import Services
from helpers import envelope, running_app, sync_body

ADMIN = {"Authorization": "Bearer adm-tok"}
GATEWAY = {"Authorization": "Bearer gw-tok"}
BASE = "/api/session/admin"

pytestmark = pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)


def sid_of(group: str, bot: str) -> str:
    return hashlib.md5(f"{group}\x00{bot}".encode()).hexdigest()


async def configure(client: httpx.AsyncClient, tpl: str, group: str, bot: str, **lim: Any) -> None:
    item = {"template_id": tpl, "image": "agentserver:1", "ready_poll_interval": 0.02, **lim}
    for kind, body in (
        ("template", item),
        ("routing_rule", {"group_id": group, "bot_id": bot, "template_id": tpl}),
    ):
        resp = await client.post(
            "/api/session/config_sync", json=sync_body(kind, "create", body), headers=ADMIN
        )
        assert resp.status_code == 200, resp.text


async def route(client: httpx.AsyncClient, session: str, group: str, bot: str) -> dict[str, Any]:
    body = envelope(session_id=session, bot_id=bot, extra={"group_id": group})
    resp = await client.post("/api/session/route", json=body, headers=GATEWAY)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()["data"]
    return data


def app(redis: Redis, db: Database, **kw: Any) -> Any:
    return running_app(redis, db, admin_tokens="adm-tok", gateway_tokens="gw-tok", **kw)


async def test_scope_pod_and_session_views(redis: Redis, db: Database) -> None:
    async with app(redis, db, k8s=FakeK8sPodClient(), scope_full_timeout=5) as client:
        await configure(client, "tpl-a", "g-a", "b-a", scope_concurrency=2, pod_concurrency=2)
        first = await route(client, "s-1", "g-a", "b-a")
        await route(client, "s-2", "g-a", "b-a")
        waiting = asyncio.create_task(
            client.post(
                "/api/session/route",
                json=envelope(request_id="r-wait", session_id="s-3", bot_id="b-a",
                              extra={"group_id": "g-a"}),
                headers=GATEWAY,
            )
        )  # fmt: skip
        sid = sid_of("g-a", "b-a")
        for _ in range(100):
            detail = (await client.get(f"{BASE}/scopes/{sid}", headers=ADMIN)).json()["data"]
            if detail["waiters"]:
                break
            await asyncio.sleep(0.02)

        listed = (await client.get(f"{BASE}/scopes", headers=ADMIN)).json()
        assert listed["ok"] is True and listed["data"]["next_cursor"] == 0
        (scope,) = listed["data"]["scopes"]
        assert scope["scope_id"] == sid and (scope["group_id"], scope["bot_id"]) == ("g-a", "b-a")
        assert scope["live_sessions"] == 2 and scope["waiters"] == 1
        assert scope["pods"] == {"in_use": 1, "idle": 0, "deploying": 0, "retiring": 0}
        assert scope["config"]["scope_concurrency"] == "2"

        assert detail["live_sessions"] == 2
        assert detail["pods"] == [{"pod_id": first["pod_id"], "candidate": True, "sessions": 2}]
        assert [w["request_id"] for w in detail["waiters"]] == ["r-wait"]
        assert detail["pool"]["pods"][0]["phase"] == "in_use"
        assert detail["pool"]["pool_config"]["max_pods"] == "1"

        pod = (await client.get(f"{BASE}/pods/{first['pod_id']}", headers=ADMIN)).json()["data"]
        assert pod["info"]["scope_id"] == sid and pod["info"]["phase"] == "in_use"
        assert pod["scopes"] == [
            {"scope_id": sid, "sessions": 2, "candidate": True, "info": pod["scopes"][0]["info"]}
        ]
        session = (await client.get(f"{BASE}/sessions/s-1", headers=ADMIN)).json()["data"]
        assert session["binding"]["pod_id"] == first["pod_id"]
        assert session["previous_pod_id"] is None

        await client.post(
            "/api/session/touch", json=envelope({"eos": True}, session_id="s-1"), headers=GATEWAY
        )
        assert (await waiting).status_code == 200


async def test_a_session_whose_pod_died_shows_its_tombstone_in_the_scope_asked(
    redis: Redis, db: Database
) -> None:
    """Tombstones are kept per scope (previous_pod:{sid}:{session_id}) and the dead pod took
    the binding with it: the view finds the tombstone in the scope ``scope_id`` names, or
    without one in the scope the session-scope index names (it outlives the binding)."""
    async with app(redis, db, k8s=FakeK8sPodClient()) as client:
        await configure(client, "tpl-a", "g-a", "b-a", scope_concurrency=2, pod_concurrency=2)
        first = await route(client, "s-1", "g-a", "b-a")
        services: Services = client.app.state.services  # type: ignore[attr-defined]
        sid = sid_of("g-a", "b-a")
        assert await services.sessions.notify_pod_dead(sid, first["pod_id"]) == 1
        resp = await client.get(f"{BASE}/sessions/s-1", params={"scope_id": sid}, headers=ADMIN)
        assert resp.json()["data"] == {
            "session_id": "s-1",
            "binding": None,
            "previous_pod_id": first["pod_id"],
        }
        resp = await client.get(f"{BASE}/sessions/s-1", headers=ADMIN)
        assert resp.json()["data"]["previous_pod_id"] == first["pod_id"], "through the index"
        other = sid_of("g-b", "b-a")
        resp = await client.get(f"{BASE}/sessions/s-1", params={"scope_id": other}, headers=ADMIN)
        assert resp.status_code == 404
        for query in (f"scope_id={sid}&scope_id={sid}", "scope_id=%0A", "scope_id=", "x=1"):
            resp = await client.get(f"{BASE}/sessions/s-1?{query}", headers=ADMIN)
            assert resp.status_code == 400 and resp.json()["error_code"] == "VALIDATION", query


async def test_tokens_ids_and_unknowns(redis: Redis, db: Database) -> None:
    async with app(redis, db) as client:
        for path in ("/scopes", "/scopes/x", "/pods/p", "/sessions/s"):
            for headers in ({}, GATEWAY, {"Authorization": "Bearer nope"}):
                resp = await client.get(BASE + path, headers=headers)
                assert resp.status_code == 401, (path, headers)
                assert resp.json()["error_code"] == "UNAUTHORIZED"
        for path in ("/scopes/nope", "/pods/nope", "/sessions/nope"):
            resp = await client.get(BASE + path, headers=ADMIN)
            assert resp.status_code == 404 and resp.json()["error_code"] == "NOT_FOUND"
        bad = await client.get(BASE + "/sessions/" + "x" * 300, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error_code"] == "VALIDATION"
        # out of range, not a number, or a number the OpenAPI's integer does not admit (pydantic's
        # lax parsing alone takes the last five), and a repeated parameter
        odd = (
            "cursor=0.0",
            "limit=1.0",
            "limit=%201",
            "limit=1_0",
            "limit=%2B1",
            "cursor=0&cursor=1",
        )
        for query in ("limit=0", "limit=201", "cursor=-1", "limit=abc", *odd):
            resp = await client.get(f"{BASE}/scopes?{query}", headers=ADMIN)
            assert resp.status_code == 400, query
            assert resp.json()["error_code"] == "VALIDATION"


async def test_the_scope_list_pages_through_a_large_registry(redis: Redis, db: Database) -> None:
    """Past the compact encoding (Redis: hash-max-listpack-entries, 128 by default, 512 on
    some servers) HSCAN really pages: every scope exactly once, bounded pages."""
    async with app(redis, db) as client:
        state = client.app.state.services.scope_state  # type: ignore[attr-defined]
        for i in range(700):
            await state.write_scope_config(f"sc-{i:03d}", f"g{i}", "b", {"scope_concurrency": "1"})
        seen: list[str] = []
        cursor, pages = 0, 0
        while True:
            resp = await client.get(f"{BASE}/scopes?cursor={cursor}&limit=50", headers=ADMIN)
            data = resp.json()["data"]
            seen += [s["scope_id"] for s in data["scopes"]]
            assert len(data["scopes"]) <= 120, "a page is bounded (COUNT is a hint)"
            pages += 1
            cursor = data["next_cursor"]
            if cursor == 0:
                break
        assert pages > 2
        assert sorted(set(seen)) == [f"sc-{i:03d}" for i in range(700)]
