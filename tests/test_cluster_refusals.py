"""A script refused by a Redis Cluster (a slot migrating or uncovered, the cluster down, its
redirections or retries exhausted, keys of several slots) or by a Sentinel set without a master
is answered like an unreachable Redis: 503 ``BACKEND_UNAVAILABLE`` with ``Retry-After``, never
a 500. A script's own error (a Lua bug) stays 500 ``INTERNAL``. Through HTTP: a Redis client
whose EVALSHA raises each of redis-py's exceptions, and one real refusal on the tests' cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.sentinel import MasterNotFoundError

from agent_runtime.db.engine import Database
from agent_runtime.session_manager import state as sm_state
from helpers import envelope, running_app

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"

REFUSALS: dict[str, Callable[[], Exception]] = {
    "CROSSSLOT": lambda: rx.ClusterCrossSlotError("CROSSSLOT Keys don't hash to the same slot"),
    "TRYAGAIN": lambda: rx.TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
    "CLUSTERDOWN": lambda: rx.ClusterDownError("CLUSTERDOWN The cluster is down"),
    "MASTERDOWN": lambda: rx.MasterDownError("MASTERDOWN Link with MASTER is down"),
    "MOVED": lambda: rx.MovedError("3999 127.0.0.1:17102"),
    "ASK": lambda: rx.AskError("3999 127.0.0.1:17102"),
    "TTL exhausted": lambda: rx.ClusterError("TTL exhausted."),
    "slot not covered": lambda: rx.SlotNotCoveredError('Slot "3999" is not covered'),
    "client cross-slot": lambda: rx.RedisClusterException(
        "EVALSHA - all keys must map to the same key slot"
    ),
    "max connections": lambda: rx.MaxConnectionsError("Too many connections"),
    "no master": lambda: MasterNotFoundError("No master found for 'agent-runtime'"),
    "connection": lambda: rx.ConnectionError("Error 111 connecting to 127.0.0.1:6379."),
    "timeout": lambda: rx.TimeoutError("Timeout reading from socket"),
}  # fmt: skip


def refuse_scripts(
    redis: Redis, monkeypatch: pytest.MonkeyPatch, exc: Callable[[], Exception]
) -> None:
    """From now on every EVALSHA the client sends raises ``exc()`` (other commands pass)."""
    real = redis.execute_command

    async def execute_command(*args: Any, **options: Any) -> Any:
        if str(args[0]).upper() == "EVALSHA":
            raise exc()
        return await real(*args, **options)

    monkeypatch.setattr(redis, "execute_command", execute_command)


def route_body(session_id: str = "s1") -> dict[str, Any]:
    return envelope(session_id=session_id, bot_id="b1", extra={"group_id": "g1"})


def assert_unavailable(resp: httpx.Response) -> None:
    body = resp.json()
    assert resp.status_code == 503, resp.text
    assert body["ok"] is False and body["error_code"] == "BACKEND_UNAVAILABLE", body
    assert body["error_message"] == "redis is unavailable; retry shortly", body
    assert body["retry_after"] >= 1 and resp.headers["retry-after"] == str(body["retry_after"])


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("refusal", list(REFUSALS))
async def test_a_refused_script_answers_503_with_retry_after(
    redis: Redis, db: Database, refusal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_app(redis, db) as app:
        refuse_scripts(redis, monkeypatch, REFUSALS[refusal])
        assert_unavailable(await app.post(ROUTE, json=route_body()))
        named = envelope(session_id="s1", bot_id="b1", extra={"group_id": "g1"})
        assert_unavailable(await app.post(TOUCH, json=named))


@pytest.mark.parametrize("redis", ["fake"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_a_script_error_stays_500_internal(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    bug = "ERR user_script:12: Script attempted to access nonexistent global variable 'x'"
    async with running_app(redis, db) as app:
        refuse_scripts(redis, monkeypatch, lambda: rx.ResponseError(bug))
        resp = await app.post(ROUTE, json=route_body())
        assert resp.status_code == 500, resp.text
        assert resp.json()["error_code"] == "INTERNAL"
        assert "user_script" not in resp.text  # no internals in the answer


@pytest.mark.parametrize("redis", ["cluster"], indirect=True)
@pytest.mark.parametrize("sql_backend", ["sqlite"], indirect=True)
async def test_a_real_cross_slot_refusal_on_the_cluster_is_503(
    redis: Redis, db: Database, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The tests' cluster: a touch naming its scope is one EVALSHA on the scope's node; with
    one of its keys moved to another slot (the key builder broken on purpose) redis-py refuses
    it before sending (all keys must map to one slot): 503, and an ERROR in the log (a key
    layout bug)."""
    async with running_app(redis, db) as app:
        named = envelope(session_id="x1", bot_id="b1", extra={"group_id": "g1"})
        resp = await app.post(TOUCH, json=named)
        assert resp.status_code == 200 and resp.json()["data"] == {"touched": False}, resp.text
        monkeypatch.setattr(sm_state, "touch_key", lambda scope_id, request_id: "elsewhere")
        with caplog.at_level(logging.WARNING):
            assert_unavailable(await app.post(TOUCH, json=named))
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert any("same key slot" in r.getMessage() for r in errors), caplog.text
