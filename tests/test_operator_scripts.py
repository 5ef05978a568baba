"""scripts/deploy.sh and scripts/deploy_replicas.sh as an operator runs them: refusals, N
real replicas sharing one Redis and DB, every /healthz answered, all stopped on exit."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from helpers import make_sql_backend, real_redis_url
from test_e2e_multi_replica import free_ports

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
VENV = {"AGENT_RUNTIME_VENV": str(Path(sys.executable).parent.parent)}


def run(
    script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=60,
        env={**os.environ, **VENV, **(env or {})},
    )  # fmt: skip


def test_deploy_sh_refuses_without_a_mode_or_an_env_file() -> None:
    assert run("deploy.sh").returncode == 2
    out = run("deploy.sh", "server")
    assert out.returncode == 2 and "ENV_FILE" in out.stderr


def test_deploy_replicas_refuses_local_mode_and_bad_arguments(tmp_path: Path) -> None:
    local = tmp_path / "local.env"
    local.write_text("AGENT_RUNTIME_MODE=local\n")
    out = run("deploy_replicas.sh", "2", str(local))
    assert out.returncode == 2 and "local mode cannot run replicas" in out.stderr
    assert run("deploy_replicas.sh", "zero", str(local)).returncode == 2
    assert run("deploy_replicas.sh", "2", str(tmp_path / "missing.env")).returncode == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("redis", ["real"], indirect=True)
async def test_deploy_replicas_runs_n_healthy_replicas_and_stops_them_all(
    redis: Redis, tmp_path: Path
) -> None:
    database = make_sql_backend("mariadb", tmp_path)
    env_file = tmp_path / "server.env"
    env_file.write_text(
        f"AGENT_RUNTIME_REDIS_URL={real_redis_url()}\n"
        f"AGENT_RUNTIME_DATABASE_URL={database.url}\n"
        "AGENT_RUNTIME_ADMIN_TOKENS=ops-admin\n"
        "AGENT_RUNTIME_GATEWAY_TOKENS=ops-gateway\n"
        # no cluster: the pod jobs degrade, and routing is not what this test is about
        "AGENT_RUNTIME_KUBECONFIG=/nonexistent/kubeconfig\n"
    )
    first = free_ports(3)
    proc = await asyncio.create_subprocess_exec(
        str(SCRIPTS / "deploy_replicas.sh"), "3", str(env_file), str(first),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **VENV, "AGENT_RUNTIME_LOG_DIR": str(tmp_path)},
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not any("replicas healthy" in line for line in lines):
            line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
            if not line:
                break
            lines.append(line)
        assert any("3 replicas healthy" in line for line in lines), "".join(lines)
        ids = set()
        async with httpx.AsyncClient(trust_env=False) as client:
            for port in range(first, first + 3):
                health = await client.get(f"http://127.0.0.1:{port}/healthz")
                assert health.status_code == 200
                ids.add(health.json()["instance_id"])
        assert ids == {"replica-0", "replica-1", "replica-2"}
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 40)
        assert proc.returncode == 0
        async with httpx.AsyncClient(trust_env=False) as client:
            for port in range(first, first + 3):
                with pytest.raises(httpx.ConnectError):
                    await client.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        database.cleanup()
