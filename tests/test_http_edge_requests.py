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
from helpers import envelope, running_app

ROUTE = "/api/session/route"
TOUCH = "/api/session/touch"


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

    scope: dict[str, Any] = {
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
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8091),
        "state": {},
    }
    await asyncio.wait_for(app(scope, receive, send), 10)
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
        assert await redis.exists("session_manager:session:s-1") == 0


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
