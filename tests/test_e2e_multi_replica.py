"""``scripts/e2e_multi_replica.py`` in CI: three real replicas (uvicorn processes in server
mode) over the real Redis (this run's claimed db), a MariaDB database of their own and the
Kubernetes API simulator — cold burst, 1,000 concurrent routes, replay, config propagation,
job leadership, failover (SIGKILL), a deploy leader killed between its pod's create and Ready
(SIGKILL), and drain (SIGTERM mid-load, every kind of waiting route)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis

from helpers import make_sql_backend, real_redis_url

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "e2e_multi_replica.py"


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports, below Linux's ephemeral range
    (32768–60999): a port there can be taken by any outgoing connection between this check
    and the replica's bind ("address already in use" on a busy machine)."""
    low, high = 20000, 32700
    start = low + os.getpid() % ((high - low) // 17) * 17
    for base in [*range(start, high, 17), *range(low, start, 17)]:
        sockets = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("redis", ["real"], indirect=True)
async def test_replicas_end_to_end(redis: Redis, tmp_path: Path) -> None:
    database = make_sql_backend("mariadb", tmp_path)
    env_file = tmp_path / "server.env"
    env_file.write_text(
        f"AGENT_RUNTIME_REDIS_URL={real_redis_url()}\n"
        f"AGENT_RUNTIME_DATABASE_URL={database.url}\n"
        "AGENT_RUNTIME_ADMIN_TOKENS=e2e-admin\n"
        "AGENT_RUNTIME_GATEWAY_TOKENS=e2e-gateway\n"
        "AGENT_RUNTIME_LOG_LEVEL=WARNING\n"
    )
    first = free_ports(4)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), "--env-file", str(env_file), "--replicas", "3",
            "--first-port", str(first), "--kubesim-port", str(first + 3),
            "--workdir", str(tmp_path / "run"),
            "--allow-foreign-keys",  # the test run's own claim marker
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 400)
    finally:
        database.cleanup()
    report = out.decode(errors="replace")
    logs = "".join(
        f"\n--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
        for p in sorted((tmp_path / "run").glob("*.log"))
    )
    assert proc.returncode == 0, report + logs
    assert "8 passed, 0 failed" in report, report
