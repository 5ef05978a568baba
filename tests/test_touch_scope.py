"""touch naming its scope (issue 17): ``bot_id`` and ``extra.group_id`` are optional on touch
and go together. With them, touch looks for the session in that scope only (on a Redis Cluster
that is one call on the scope's node); a session of another scope is unknown there and is
left as it was. Through HTTP, on every Redis and SQL backend.
"""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
from redis.asyncio import Redis

import contract_keys as K
from agent_runtime.db.engine import Database
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from helpers import envelope, running_app, sync_body

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"
SYNC = "/api/session/config_sync"


def scope_of(group_id: str, bot_id: str) -> str:
    return hashlib.md5(f"{group_id}\x00{bot_id}".encode()).hexdigest()


async def configure(client: httpx.AsyncClient) -> None:
    item = {"template_id": "tpl-a", "image": "agentserver:1", "ready_poll_interval": 0.02}
    resp = await client.post(SYNC, json=sync_body("template", "create", item))
    assert resp.status_code == 200, resp.text
    rule = {"group_id": "*", "bot_id": "*", "template_id": "tpl-a"}
    resp = await client.post(SYNC, json=sync_body("routing_rule", "create", rule))
    assert resp.status_code == 200, resp.text


def touch(session_id: str, eos: bool = False, **ids: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"session_id": session_id}
    if "bot_id" in ids:
        metadata["bot_id"] = ids["bot_id"]
    if "group_id" in ids:
        metadata["extra"] = {"group_id": ids["group_id"]}
    return envelope({"eos": True} if eos else {}, **metadata)


async def test_touch_with_its_scope_ids_finds_only_that_scopes_session(
    redis: Redis, db: Database
) -> None:
    async with running_app(redis, db, k8s=FakeK8sPodClient()) as client:
        await configure(client)
        route = envelope(session_id="s1", bot_id="bot-1", extra={"group_id": "g1"})
        resp = await client.post(ROUTE, json=route)
        assert resp.status_code == 200, resp.text
        session = await redis.hgetall(K.sm_session(scope_of("g1", "bot-1"), "s1"))
        assert session["scope_id"] == scope_of("g1", "bot-1")

        other = await client.post(TOUCH, json=touch("s1", bot_id="bot-2", group_id="g1"))
        assert other.status_code == 200, other.text
        assert other.json()["data"] == {"touched": False}
        ended = await client.post(TOUCH, json=touch("s1", True, bot_id="bot-2", group_id="g1"))
        assert ended.json()["data"] == {"touched": False, "released": False}
        assert (
            await redis.hget(K.sm_session(scope_of("g1", "bot-1"), "s1"), "expiry")
            == session["expiry"]
        )

        own = await client.post(TOUCH, json=touch("s1", bot_id="bot-1", group_id="g1"))
        assert own.json()["data"] == {"touched": True}
        plain = await client.post(TOUCH, json=touch("s1"))
        assert plain.json()["data"] == {"touched": True}, "without ids: as before"
        ended = await client.post(TOUCH, json=touch("s1", True, bot_id="bot-1", group_id="g1"))
        assert ended.json()["data"] == {"touched": True, "released": True}
        assert not await redis.exists(K.sm_session(scope_of("g1", "bot-1"), "s1"))


async def test_one_scope_id_without_the_other_is_refused(redis: Redis, db: Database) -> None:
    async with running_app(redis, db, k8s=FakeK8sPodClient()) as client:
        for ids, missing in (
            ({"bot_id": "bot-1"}, "extra.group_id"),
            ({"group_id": "g1"}, "bot_id"),
        ):
            resp = await client.post(TOUCH, json=touch("s1", **ids))
            assert resp.status_code == 400, resp.text
            body = resp.json()
            assert body["error_code"] == "VALIDATION"
            assert missing in body["error_message"], body
        wrong = touch("s1", bot_id=7, group_id="g1")
        resp = await client.post(TOUCH, json=wrong)
        assert resp.status_code == 400 and "bot_id" in resp.json()["error_message"]
