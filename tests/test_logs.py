"""Structured logs: one JSON object per line with the ids of what happened, no secrets —
the formatter alone, and a real ``agent-runtime serve`` process read from its stderr."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from agent_runtime import logs
from helpers import envelope, sync_body

BIN = Path(sys.executable).parent


def record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.getLogger("agent_runtime.test").makeRecord(
        "agent_runtime.test", logging.INFO, __file__, 1, msg, args, None, extra=extra
    )
    return rec


def test_a_record_carries_the_bound_ids_and_its_extra() -> None:
    with logs.bound(request_id="r-1", session_id="s-1", scope_id="sc-1"):
        line = logs.JsonFormatter().format(record("placed on %s", "p-1", pod_id="p-1"))
    event = json.loads(line)
    assert event["msg"] == "placed on p-1" and event["level"] == "INFO"
    assert (event["request_id"], event["session_id"], event["scope_id"]) == ("r-1", "s-1", "sc-1")
    assert event["pod_id"] == "p-1" and event["logger"] == "agent_runtime.test"
    assert event["ts"].endswith("Z") and "\n" not in line
    # outside the block the ids are gone: nothing leaks into the next request
    after = json.loads(logs.JsonFormatter().format(record("later")))
    assert "request_id" not in after


async def test_ids_bound_in_one_task_do_not_reach_another() -> None:
    seen: dict[str, str] = {}

    async def request(rid: str) -> None:
        with logs.bound(request_id=rid):
            await asyncio.sleep(0.01)
            seen[rid] = json.loads(logs.JsonFormatter().format(record("x")))["request_id"]

    await asyncio.gather(*(request(f"r{i}") for i in range(20)))
    assert seen == {f"r{i}": f"r{i}" for i in range(20)}


@pytest.mark.parametrize("formatter", [logs.JsonFormatter(), logs.TextFormatter()])
def test_secrets_never_reach_a_line(formatter: logging.Formatter) -> None:
    rec = record(
        "connecting to redis://:hunter2@10.0.0.1:6379/0 and mysql+pymysql://app:pw9@db/x "
        "with Authorization: Bearer tok-abc123",
        admin_token="tok-admin-1",
        password="pw-xyz",
    )
    line = formatter.format(rec)
    for secret in ("hunter2", "pw9", "tok-abc123", "tok-admin-1", "pw-xyz"):
        assert secret not in line, (secret, line)
    assert "redis://:***@10.0.0.1" in line and "app:***@db" in line


def test_an_exception_is_one_line_too() -> None:
    try:
        raise ValueError("boom redis://u:pw-in-exc@h/0")
    except ValueError:
        rec = logging.getLogger("t").makeRecord(
            "t", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = logs.JsonFormatter().format(rec)
    event = json.loads(line)
    assert "ValueError: boom" in event["exc"] and "pw-in-exc" not in line
    assert line.count("\n") == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
async def test_a_real_process_logs_json_with_ids_and_no_token(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "AGENT_RUNTIME_PORT": str(port),
        "AGENT_RUNTIME_SQLITE_PATH": str(tmp_path / "config.db"),
        "AGENT_RUNTIME_GATEWAY_TOKENS": "sekret-gateway",
        "AGENT_RUNTIME_ADMIN_TOKENS": "sekret-admin",
        "AGENT_RUNTIME_LOG_LEVEL": "INFO",
    }
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "agent-runtime"), "serve", "--mode", "local",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if (await client.get("/healthz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and proc.returncode is None, "not started"
                await asyncio.sleep(0.1)
            admin = {"Authorization": "Bearer sekret-admin"}
            gateway = {"Authorization": "Bearer sekret-gateway"}
            item = {"template_id": "tpl-l", "image": "agentserver:1", "scope_concurrency": 2}
            await client.post(
                "/api/session/config_sync",
                json=sync_body("template", "create", item),
                headers=admin,
            )
            rule = {"group_id": "g-l", "bot_id": "b-l", "template_id": "tpl-l"}
            await client.post(
                "/api/session/config_sync",
                json=sync_body("routing_rule", "create", rule),
                headers=admin,
            )
            body = envelope(request_id="r-log-1", session_id="s-log-1", bot_id="b-l",
                            extra={"group_id": "g-l"})  # fmt: skip
            resp = await client.post("/api/session/route", json=body, headers=gateway)
            assert resp.status_code == 200, resp.text
            bad = await client.post(
                "/api/session/route", json=body, headers={"Authorization": "Bearer wrong-tok"}
            )
            assert bad.status_code == 401
    finally:
        if proc.returncode is None:
            proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    lines = [line for line in err.decode().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    assert any(e["msg"].startswith("ready:") for e in events)
    registered = [e for e in events if "registered" in e["msg"]]
    assert registered, lines
    assert registered[0]["request_id"] == "r-log-1" and registered[0]["scope_id"]
    for secret in ("sekret-gateway", "sekret-admin", "wrong-tok"):
        assert secret not in err.decode()
