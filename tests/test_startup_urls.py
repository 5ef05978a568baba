"""A malformed Redis or database URL is a startup refusal like every other (issue 13, §4):
one line on stderr, exit 2, no traceback and no password — run as a user runs it, through the
installed ``agent-runtime`` entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent_runtime.config import Settings

ENTRY_POINT = Path(sys.executable).parent / "agent-runtime"
CLI_TIMEOUT = 15.0  # python start + imports; a refusal comes before any connection
GOOD_REDIS = "redis://127.0.0.1:1/0"  # well-formed; never reached: the DB URL is refused first
GOOD_DB = "postgresql+psycopg://root@127.0.0.1:1/nothing"
BAD_REDIS = [
    "notaurl",
    "redis://host:notaport",
    "redis://h:99999/0",
    "redis://u:s3cret@h:x/0",
    "redis+cluster://u:s3cret@h",  # a node without its port
    "redis+sentinel://:s3cret@h:26379",  # no master name
]
BAD_DB = [
    "garbage",
    "mysql://x:s3cret@:bad",
    "nosuchdialect://u@h/db",
    "mssql://u:s3cret@h/db",  # a dialect whose driver is not installed
]


def run(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RUNTIME_")}
    return subprocess.run(
        [str(ENTRY_POINT), *args],
        env={**clean, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        check=False,
    )


def assert_one_line_refusal(proc: subprocess.CompletedProcess[str], variable: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("agent-runtime: error: "), lines[0]
    assert "Traceback" not in proc.stderr
    assert "s3cret" not in proc.stderr, "a password never reaches the terminal"
    assert variable in lines[0] or "backend URL not usable" in lines[0], lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("url", BAD_REDIS)
def test_serve_refuses_a_malformed_redis_url_in_one_line(url: str, tmp_path: Path) -> None:
    env = {
        "AGENT_RUNTIME_MODE": "server",
        "AGENT_RUNTIME_REDIS_URL": url,
        "AGENT_RUNTIME_DATABASE_URL": GOOD_DB,
        "AGENT_RUNTIME_ADMIN_TOKENS": "x",
        "AGENT_RUNTIME_GATEWAY_TOKENS": "g",
    }
    assert_one_line_refusal(run("serve", env=env, cwd=tmp_path), "AGENT_RUNTIME_REDIS_URL")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("url", BAD_DB)
def test_serve_and_db_commands_refuse_a_malformed_database_url_in_one_line(
    url: str, tmp_path: Path
) -> None:
    env = {
        "AGENT_RUNTIME_MODE": "server",
        "AGENT_RUNTIME_REDIS_URL": GOOD_REDIS,
        "AGENT_RUNTIME_DATABASE_URL": url,
        "AGENT_RUNTIME_ADMIN_TOKENS": "x",
        "AGENT_RUNTIME_GATEWAY_TOKENS": "g",
    }
    assert_one_line_refusal(run("serve", env=env, cwd=tmp_path), "AGENT_RUNTIME_DATABASE_URL")
    for action in ("upgrade", "status"):
        proc = run("db", action, env={"AGENT_RUNTIME_DATABASE_URL": url}, cwd=tmp_path)
        assert_one_line_refusal(proc, "AGENT_RUNTIME_DATABASE_URL")
    assert list(tmp_path.iterdir()) == [], "nothing created (no SQLite fallback)"


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://u:p@h:6380/2",
        "unix:///tmp/redis.sock",
        "redis+cluster://h1:7000,h2:7001",
        "redis+sentinel://s1:26379,s2:26379/mymaster/2",
    ],
)
def test_well_formed_redis_urls_are_accepted(url: str) -> None:
    assert Settings(_env_file=None, redis_url=url).redis_url == url  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "url",
    ["mysql://root@127.0.0.1:3306/x", "postgresql+psycopg://u:p@h/db", "sqlite:///x.db"],
)
def test_well_formed_database_urls_are_accepted(url: str) -> None:
    assert Settings(_env_file=None, database_url=url).database_url == url  # type: ignore[call-arg]


@pytest.mark.timeout(120)
def test_db_commands_in_server_mode_without_a_database_url_refuse_in_one_line(
    tmp_path: Path,
) -> None:
    """Server mode never falls back to SQLite: ``db upgrade|status`` without a URL is a
    one-line refusal (it was an AssertionError traceback, exit 1)."""
    for action in ("upgrade", "status"):
        proc = run("db", action, env={"AGENT_RUNTIME_MODE": "server"}, cwd=tmp_path)
        assert_one_line_refusal(proc, "AGENT_RUNTIME_DATABASE_URL")
    assert list(tmp_path.iterdir()) == [], "nothing created (no SQLite fallback)"
