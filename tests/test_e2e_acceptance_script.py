"""``scripts/e2e_acceptance.py``'s own behaviour (the scenarios it runs are
tests/test_server_e2e.py, run in CI against a stack of their own): the settings it needs,
its refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis

from helpers import real_redis_url

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "e2e_acceptance.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_it_prints_the_settings_the_scenarios_need() -> None:
    out = run("--print-settings")
    assert out.returncode == 0, out.stderr
    lines = dict(line.split("=", 1) for line in out.stdout.splitlines())
    assert lines["AGENT_RUNTIME_ADMIN_TOKENS"] and lines["AGENT_RUNTIME_GATEWAY_TOKENS"]
    assert float(lines["AGENT_RUNTIME_WATCH_INTERVAL"]) < 1


def test_it_needs_its_three_addresses() -> None:
    out = run("--base-url", "http://127.0.0.1:1")
    assert out.returncode == 2 and "--redis-url" in out.stderr


@pytest.mark.parametrize("redis", ["real"], indirect=True)
async def test_it_refuses_a_redis_db_with_foreign_keys(redis: Redis) -> None:
    await redis.set("someone-elses:key", "1")  # (the claim marker is foreign too)
    out = run(
        "--base-url", "http://127.0.0.1:1", "--redis-url", real_redis_url(),
        "--kubesim", "http://127.0.0.1:1",
    )  # fmt: skip
    assert out.returncode == 2
    assert "not this service's" in out.stderr and "--allow-foreign-keys" in out.stderr
    assert await redis.get("someone-elses:key") == "1", "left alone"
