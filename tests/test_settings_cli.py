"""Settings from the environment (contract §6), the server-mode checks, and the command line
(contract §7) run as a user runs it: fail-fast exits and the schema migrations."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import fakeredis
import pytest
import redis as redis_sync
from pydantic import ValidationError
from sqlalchemy import create_engine, insert, inspect, select
from sqlalchemy.exc import IntegrityError

from agent_runtime import cli
from agent_runtime.config import ConfigError, Mode, Settings
from agent_runtime.db import schema
from agent_runtime.db.engine import Database
from agent_runtime.db.tables import routing_rule
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.wiring import Backends, check_backends
from helpers import REDIS_URL, make_sql_backend, unavailable

ENV_PREFIX = "AGENT_RUNTIME_"
# the real Redis, db index 14: only ever PINGed by these tests (never written, never flushed)
PING_REDIS_URL = REDIS_URL.rsplit("/", 1)[0] + "/14"
CLOSED = "127.0.0.1:1"  # nothing listens on port 1
CLOSED_DB_URL = f"postgresql+psycopg://root@{CLOSED}/nothing"
FAIL_FAST_SECONDS = 10.0  # python start + imports + a refused connection: about one second
CLI_TIMEOUT = 12.0  # per subprocess; a test runs at most four, within the 60 s test timeout

SERVER_DBS = [
    pytest.param("mariadb", marks=pytest.mark.real_backend),
    pytest.param("postgresql", marks=pytest.mark.real_backend),
]
ALL_DBS = [pytest.param("sqlite"), *SERVER_DBS]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No AGENT_RUNTIME_* setting leaks in from the environment running the tests."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    return monkeypatch


# --- Settings from the environment ---------------------------------------------------------------


def test_defaults_per_contract(clean_env: pytest.MonkeyPatch) -> None:
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.mode is Mode.LOCAL
    assert s.host == "127.0.0.1"
    assert s.port == 8091
    assert s.redis_url is None
    assert s.database_url is None
    assert s.kubeconfig is None
    assert s.default_namespace == "default"
    assert s.scope_full_timeout == 30
    assert s.default_session_ttl == 60
    assert s.sweep_interval == 1
    assert s.autoscale_interval == 1
    assert s.reclaim_interval == 1
    assert s.watch_interval == 10
    assert s.reconcile_interval == 30
    assert s.log_level == "INFO"
    assert s.gateway_tokens == []
    assert s.admin_tokens == []
    assert s.allow_unauthenticated is False
    assert s.instance_id
    # every process gets its own replica id
    assert Settings(_env_file=None).instance_id != s.instance_id  # type: ignore[call-arg]


def test_every_contract_setting_read_from_env(clean_env: pytest.MonkeyPatch) -> None:
    values = {
        "MODE": "server",
        "HOST": "0.0.0.0",
        "PORT": "9100",
        "REDIS_URL": "redis://redis.svc:6379/2",
        "DATABASE_URL": "mysql://u:p@db.svc/agents",
        "KUBECONFIG": "/etc/kube/config",
        "DEFAULT_NAMESPACE": "agents",
        "SCOPE_FULL_TIMEOUT": "2.5",
        "DEFAULT_SESSION_TTL": "90.5",
        "SWEEP_INTERVAL": "0.25",
        "AUTOSCALE_INTERVAL": "0.5",
        "RECLAIM_INTERVAL": "0.75",
        "WATCH_INTERVAL": "1.5",
        "RECONCILE_INTERVAL": "0.1",
        "INSTANCE_ID": "replica-7",
        "LOG_LEVEL": "debug",
        "GATEWAY_TOKENS": "gw1",
        "ADMIN_TOKENS": "adm1,adm2",
        "ALLOW_UNAUTHENTICATED": "true",
    }
    for name, value in values.items():
        clean_env.setenv(ENV_PREFIX + name, value)
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.mode is Mode.SERVER
    assert (s.host, s.port) == ("0.0.0.0", 9100)
    assert s.redis_url == "redis://redis.svc:6379/2"
    assert s.database_url == "mysql://u:p@db.svc/agents"
    assert s.kubeconfig == "/etc/kube/config"
    assert s.default_namespace == "agents"
    assert s.scope_full_timeout == 2.5
    assert s.default_session_ttl == 90.5
    assert (s.sweep_interval, s.autoscale_interval, s.reclaim_interval) == (0.25, 0.5, 0.75)
    assert (s.watch_interval, s.reconcile_interval) == (1.5, 0.1)
    assert s.instance_id == "replica-7"
    assert s.log_level == "DEBUG"
    assert s.gateway_tokens == ["gw1"]
    assert s.admin_tokens == ["adm1", "adm2"]
    assert s.allow_unauthenticated is True


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("a,b", ["a", "b"]),
        (" a , b ,c ", ["a", "b", "c"]),
        ("a,,b,", ["a", "b"]),
        ("single", ["single"]),
        ("", []),
        (" , ", []),
        ('["not","json"]', ['["not"', '"json"]']),  # a plain comma list, never decoded as JSON
    ],
)
def test_tokens_comma_split_and_stripped(
    clean_env: pytest.MonkeyPatch, raw: str, expected: list[str]
) -> None:
    clean_env.setenv("AGENT_RUNTIME_ADMIN_TOKENS", raw)
    clean_env.setenv("AGENT_RUNTIME_GATEWAY_TOKENS", raw)
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.admin_tokens == expected
    assert s.gateway_tokens == expected


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PORT", "abc"),
        ("PORT", "0"),
        ("PORT", "70000"),
        ("MODE", "cluster"),
        ("SWEEP_INTERVAL", "0"),
        ("WATCH_INTERVAL", "-1"),
        ("SCOPE_FULL_TIMEOUT", "soon"),
        ("LOG_LEVEL", "verbose"),
        ("ALLOW_UNAUTHENTICATED", "maybe"),
    ],
)
def test_bad_values_refused(clean_env: pytest.MonkeyPatch, name: str, value: str) -> None:
    clean_env.setenv(ENV_PREFIX + name, value)
    with pytest.raises(ValidationError):
        Settings(_env_file=None)  # type: ignore[call-arg]


def test_no_dotenv_read_unless_asked(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("AGENT_RUNTIME_PORT=1234\n")
    clean_env.chdir(tmp_path)
    assert Settings(_env_file=None).port == 8091  # type: ignore[call-arg]
    assert Settings().port == 8091


def test_env_file_loaded_and_real_env_wins(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env_file = tmp_path / "agent.env"
    env_file.write_text(
        "AGENT_RUNTIME_PORT=9001\n"
        "AGENT_RUNTIME_REDIS_URL=redis://from-file:6379/0\n"
        "AGENT_RUNTIME_ADMIN_TOKENS= f1 , f2 \n"
        "AGENT_RUNTIME_SWEEP_INTERVAL=0.2\n"
    )
    s = Settings(_env_file=env_file)  # type: ignore[call-arg]
    assert s.port == 9001
    assert s.redis_url == "redis://from-file:6379/0"
    assert s.admin_tokens == ["f1", "f2"]
    assert s.sweep_interval == 0.2

    clean_env.setenv("AGENT_RUNTIME_PORT", "9002")
    clean_env.setenv("AGENT_RUNTIME_ADMIN_TOKENS", "env1")
    s = Settings(_env_file=env_file)  # type: ignore[call-arg]
    assert s.port == 9002
    assert s.admin_tokens == ["env1"]
    assert s.redis_url == "redis://from-file:6379/0"  # not set in the env: the file's


def test_cli_settings_env_file_and_flags(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env_file = tmp_path / "agent.env"
    env_file.write_text("AGENT_RUNTIME_PORT=9001\nAGENT_RUNTIME_HOST=10.0.0.1\n")
    args = cli.build_parser().parse_args(["serve", "--env-file", str(env_file), "--port", "9500"])
    s = cli._settings(args, mode=args.mode, host=args.host, port=args.port)
    assert s.port == 9500  # the flag beats the file
    assert s.host == "10.0.0.1"  # no flag: the file's
    assert s.mode is Mode.LOCAL

    clean_env.setenv("AGENT_RUNTIME_HOST", "10.0.0.2")
    s = cli._settings(args, mode=args.mode, host=args.host, port=args.port)
    assert s.host == "10.0.0.2"  # the env beats the file


def test_cli_settings_missing_env_file(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(["serve", "--env-file", str(tmp_path / "missing.env")])
    with pytest.raises(ConfigError, match="does not exist"):
        cli._settings(args)


def test_cli_settings_bad_value_is_one_line_naming_the_variable(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("AGENT_RUNTIME_WATCH_INTERVAL", "often")
    args = cli.build_parser().parse_args(["serve"])
    with pytest.raises(ConfigError) as info:
        cli._settings(args)
    message = str(info.value)
    assert message.startswith("setting AGENT_RUNTIME_WATCH_INTERVAL:")
    assert "\n" not in message


# --- check_server --------------------------------------------------------------------------------

GOOD_SERVER = {
    "mode": Mode.SERVER,
    "redis_url": "redis://redis.svc:6379/0",
    "database_url": "postgresql://u@db.svc/agents",
    "admin_tokens": ["adm"],
    "gateway_tokens": ["gw"],
}


def server_settings(**overrides: object) -> Settings:
    return Settings(_env_file=None, **{**GOOD_SERVER, **overrides})  # type: ignore[arg-type]


def test_check_server_accepts_complete_config(clean_env: pytest.MonkeyPatch) -> None:
    server_settings().check_server()
    server_settings(admin_tokens=[], allow_unauthenticated=True).check_server()
    server_settings(database_url="mysql+pymysql://u@db/agents").check_server()


@pytest.mark.parametrize(
    ("overrides", "mentions"),
    [
        ({"redis_url": None}, "AGENT_RUNTIME_REDIS_URL"),
        ({"redis_url": ""}, "AGENT_RUNTIME_REDIS_URL"),
        ({"database_url": None}, "AGENT_RUNTIME_DATABASE_URL"),
        ({"database_url": "sqlite:///agents.db"}, "SQLite"),
        ({"database_url": "sqlite+pysqlite:////var/lib/agents.db"}, "SQLite"),
        ({"admin_tokens": []}, "AGENT_RUNTIME_ADMIN_TOKENS"),
        ({"admin_tokens": [], "allow_unauthenticated": False}, "ALLOW_UNAUTHENTICATED"),
        ({"gateway_tokens": []}, "AGENT_RUNTIME_GATEWAY_TOKENS"),
        ({"gateway_tokens": [], "allow_open_gateway": False}, "ALLOW_OPEN_GATEWAY"),
    ],
)
def test_check_server_refuses(
    clean_env: pytest.MonkeyPatch, overrides: dict[str, object], mentions: str
) -> None:
    with pytest.raises(ConfigError) as info:
        server_settings(**overrides).check_server()
    assert mentions in str(info.value)
    assert "\n" not in str(info.value)


def test_check_server_open_gateway_needs_an_explicit_opt_in(clean_env: pytest.MonkeyPatch) -> None:
    """Server mode without gateway tokens serves route and touch to anyone: only when told so,
    by ALLOW_OPEN_GATEWAY or by ALLOW_UNAUTHENTICATED (which already means "run open")."""
    server_settings(gateway_tokens=[], allow_open_gateway=True).check_server()
    server_settings(gateway_tokens=[], allow_unauthenticated=True).check_server()
    with pytest.raises(ConfigError):
        server_settings(gateway_tokens=[]).check_server()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "agents.example.com", "[::]"])
def test_local_mode_on_a_non_loopback_host_needs_tokens_or_the_opt_in(
    clean_env: pytest.MonkeyPatch, host: str
) -> None:
    local = {"mode": Mode.LOCAL, "host": host}
    with pytest.raises(ConfigError) as info:
        Settings(_env_file=None, **local).check_server()  # type: ignore[arg-type]
    assert "AGENT_RUNTIME_GATEWAY_TOKENS" in str(info.value) and host in str(info.value)
    assert "\n" not in str(info.value)
    Settings(_env_file=None, gateway_tokens=["gw"], **local).check_server()  # type: ignore[arg-type]
    Settings(_env_file=None, allow_open_gateway=True, **local).check_server()  # type: ignore[arg-type]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"])
def test_local_mode_on_loopback_stays_open(clean_env: pytest.MonkeyPatch, host: str) -> None:
    Settings(_env_file=None, mode=Mode.LOCAL, host=host).check_server()  # type: ignore[call-arg]


def test_check_server_ignores_local_mode(clean_env: pytest.MonkeyPatch) -> None:
    Settings(_env_file=None).check_server()  # type: ignore[call-arg]
    s = Settings(_env_file=None, mode=Mode.LOCAL)  # type: ignore[call-arg]
    s.check_server()
    assert s.sqlalchemy_url().startswith("sqlite:///")


# --- the command line as a subprocess ------------------------------------------------------------


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def error_line(self) -> str:
        """The single stderr line of a fail-fast exit (asserts there is exactly one)."""
        lines = self.stderr.splitlines()
        assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{self.stderr}"
        assert self.stderr.endswith("\n")
        assert lines[0].startswith("agent-runtime: error: "), lines[0]
        return lines[0]


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> CliRun:
    """``agent-runtime *args`` with a clean environment: PATH etc. kept, no AGENT_RUNTIME_*
    except ``env``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "agent_runtime.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        check=False,
    )
    return CliRun(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def assert_fail_fast(run: CliRun) -> str:
    assert run.returncode == 2, run.stderr
    assert run.seconds < FAIL_FAST_SECONDS
    assert run.stdout == ""
    return run.error_line


def ping_redis_14() -> int:
    """PING the real Redis on db 14 (writing nothing); its key count, to show none was written."""
    client = redis_sync.Redis.from_url(PING_REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
        return int(client.dbsize())
    except redis_sync.exceptions.RedisError as exc:
        unavailable(f"redis at {PING_REDIS_URL}", exc)
        raise
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_serve_server_without_urls(tmp_path: Path) -> None:
    line = assert_fail_fast(run_cli("serve", "--mode", "server", cwd=tmp_path))
    assert "AGENT_RUNTIME_REDIS_URL" in line


@pytest.mark.timeout(60)
def test_serve_server_mode_from_env_without_urls(tmp_path: Path) -> None:
    line = assert_fail_fast(run_cli("serve", cwd=tmp_path, env={"AGENT_RUNTIME_MODE": "server"}))
    assert "AGENT_RUNTIME_REDIS_URL" in line


@pytest.mark.timeout(60)
def test_serve_server_without_db_url(tmp_path: Path) -> None:
    env = {
        "AGENT_RUNTIME_REDIS_URL": f"redis://{CLOSED}/0",
        "AGENT_RUNTIME_ADMIN_TOKENS": "x",
        "AGENT_RUNTIME_GATEWAY_TOKENS": "gw",
    }
    line = assert_fail_fast(run_cli("serve", "--mode", "server", cwd=tmp_path, env=env))
    assert "AGENT_RUNTIME_DATABASE_URL" in line


@pytest.mark.timeout(60)
def test_serve_server_refuses_sqlite(tmp_path: Path) -> None:
    env = {
        "AGENT_RUNTIME_REDIS_URL": f"redis://{CLOSED}/0",
        "AGENT_RUNTIME_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
        "AGENT_RUNTIME_ADMIN_TOKENS": "x",
        "AGENT_RUNTIME_GATEWAY_TOKENS": "gw",
    }
    line = assert_fail_fast(run_cli("serve", "--mode", "server", cwd=tmp_path, env=env))
    assert "SQLite" in line
    assert not (tmp_path / "x.db").exists()


@pytest.mark.timeout(60)
def test_serve_server_refuses_no_admin_tokens(tmp_path: Path) -> None:
    env = {
        "AGENT_RUNTIME_REDIS_URL": f"redis://{CLOSED}/0",
        "AGENT_RUNTIME_DATABASE_URL": CLOSED_DB_URL,
    }
    line = assert_fail_fast(run_cli("serve", "--mode", "server", cwd=tmp_path, env=env))
    assert "AGENT_RUNTIME_ADMIN_TOKENS" in line
    # explicitly allowed: passes the token check and fails later, on the unreachable Redis
    env["AGENT_RUNTIME_ALLOW_UNAUTHENTICATED"] = "true"
    line = assert_fail_fast(run_cli("serve", "--mode", "server", cwd=tmp_path, env=env))
    assert "redis" in line.lower()


@pytest.mark.timeout(60)
def test_serve_refuses_an_open_gateway_without_the_opt_in(tmp_path: Path) -> None:
    env = {
        "AGENT_RUNTIME_REDIS_URL": f"redis://{CLOSED}/0",
        "AGENT_RUNTIME_DATABASE_URL": CLOSED_DB_URL,
        "AGENT_RUNTIME_ADMIN_TOKENS": "x",
    }
    line = assert_fail_fast(run_cli("serve", "--mode", "server", cwd=tmp_path, env=env))
    assert "AGENT_RUNTIME_GATEWAY_TOKENS" in line and "ALLOW_OPEN_GATEWAY" in line
    # opted in: past the token checks, refused later on the unreachable Redis
    line = assert_fail_fast(
        run_cli(
            "serve", "--mode", "server", cwd=tmp_path,
            env={**env, "AGENT_RUNTIME_ALLOW_OPEN_GATEWAY": "true"},
        )
    )  # fmt: skip
    assert "redis" in line.lower()
    # local mode on every interface, no tokens: refused before anything is started
    local = run_cli("serve", "--mode", "local", "--host", "0.0.0.0", cwd=tmp_path)
    line = assert_fail_fast(local)
    assert "0.0.0.0" in line and "AGENT_RUNTIME_GATEWAY_TOKENS" in line
    assert not (tmp_path / "agent_runtime_local.db").exists()


@pytest.mark.timeout(60)
def test_serve_server_unreachable_redis(tmp_path: Path) -> None:
    env = {
        "AGENT_RUNTIME_REDIS_URL": f"redis://{CLOSED}/0",
        "AGENT_RUNTIME_DATABASE_URL": CLOSED_DB_URL,
        "AGENT_RUNTIME_ADMIN_TOKENS": "x",
        "AGENT_RUNTIME_GATEWAY_TOKENS": "gw",
    }
    line = assert_fail_fast(run_cli("serve", "--mode", "server", cwd=tmp_path, env=env))
    assert "redis" in line.lower()
    assert "database" not in line.lower()


@pytest.mark.real_backend
@pytest.mark.timeout(60)
def test_serve_server_unreachable_database(tmp_path: Path) -> None:
    keys_before = ping_redis_14()
    env = {
        "AGENT_RUNTIME_REDIS_URL": PING_REDIS_URL,
        "AGENT_RUNTIME_DATABASE_URL": CLOSED_DB_URL,
        "AGENT_RUNTIME_ADMIN_TOKENS": "x",
        "AGENT_RUNTIME_GATEWAY_TOKENS": "gw",
    }
    line = assert_fail_fast(run_cli("serve", "--mode", "server", cwd=tmp_path, env=env))
    assert "database" in line.lower()
    assert ping_redis_14() == keys_before


@pytest.mark.timeout(60)
def test_serve_missing_env_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.env"
    line = assert_fail_fast(run_cli("serve", "--env-file", str(missing), cwd=tmp_path))
    assert str(missing) in line
    line = assert_fail_fast(run_cli("db", "status", "--env-file", str(missing), cwd=tmp_path))
    assert str(missing) in line


@pytest.mark.timeout(60)
def test_serve_bad_setting(tmp_path: Path) -> None:
    env = {"AGENT_RUNTIME_PORT": "not-a-port"}
    line = assert_fail_fast(run_cli("serve", "--mode", "server", cwd=tmp_path, env=env))
    assert "AGENT_RUNTIME_PORT" in line


@pytest.mark.timeout(60)
def test_serve_reads_env_file_and_env_wins(tmp_path: Path) -> None:
    env_file = tmp_path / "server.env"
    env_file.write_text(
        f"AGENT_RUNTIME_REDIS_URL=redis://{CLOSED}/0\n"
        f"AGENT_RUNTIME_DATABASE_URL={CLOSED_DB_URL}\n"
        "AGENT_RUNTIME_ADMIN_TOKENS=x\n"
        "AGENT_RUNTIME_GATEWAY_TOKENS=gw\n"
    )
    args = ("serve", "--mode", "server", "--env-file", str(env_file))
    # the file's URLs are used: the check gets as far as the (unreachable) Redis
    line = assert_fail_fast(run_cli(*args, cwd=tmp_path))
    assert "redis unreachable" in line
    assert "127.0.0.1:1" in line
    # a real environment variable beats the file
    env = {"AGENT_RUNTIME_REDIS_URL": "redis://127.0.0.1:2/0"}
    line = assert_fail_fast(run_cli(*args, cwd=tmp_path, env=env))
    assert "127.0.0.1:2" in line


@pytest.mark.timeout(60)
def test_ctrl_c_outside_the_server_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during the startup checks or a `db` command: one line, no traceback, 130 (the
    running server's own Ctrl-C is a drain and exit 0: tests/test_local_mode.py)."""

    def interrupted(args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_db", interrupted)
    with pytest.raises(SystemExit) as exited:
        cli.main(["db", "status"])
    assert exited.value.code == 130
    assert capsys.readouterr().err == "agent-runtime: interrupted\n"


def test_unknown_command_and_mode_are_usage_errors(tmp_path: Path) -> None:
    run = run_cli("serve", "--mode", "cluster", cwd=tmp_path)
    assert run.returncode == 2
    assert "invalid choice" in run.stderr
    assert run_cli("frobnicate", cwd=tmp_path).returncode == 2


@pytest.mark.timeout(60)
def test_db_status_unreachable_database(tmp_path: Path) -> None:
    env = {"AGENT_RUNTIME_DATABASE_URL": CLOSED_DB_URL}
    line = assert_fail_fast(run_cli("db", "status", cwd=tmp_path, env=env))
    assert "database" in line


# --- migrations ----------------------------------------------------------------------------------


def _schema_of(url: str) -> tuple[set[str], dict[str, set[str]], set[frozenset[str]]]:
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        tables = set(insp.get_table_names())
        columns = {t: {c["name"] for c in insp.get_columns(t)} for t in tables}
        uniques = {
            frozenset(u["column_names"]) for u in insp.get_unique_constraints("routing_rule")
        }
        uniques |= {
            frozenset(c for c in i["column_names"] if c)
            for i in insp.get_indexes("routing_rule")
            if i.get("unique")
        }
        return tables, columns, uniques
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend_name", ALL_DBS)
def test_db_upgrade_and_status(backend_name: str, tmp_path: Path) -> None:
    backend = make_sql_backend(backend_name, tmp_path)
    try:
        env = {"AGENT_RUNTIME_DATABASE_URL": backend.url}
        head = schema.head_revision()

        run = run_cli("db", "status", cwd=tmp_path, env=env)
        assert run.returncode == 1, run.stderr
        assert "schema at empty" in run.stdout
        assert f"code expects {head}" in run.stdout

        run = run_cli("db", "upgrade", cwd=tmp_path, env=env)
        assert run.returncode == 0, run.stderr
        assert f"schema at {head}, code expects {head}" in run.stdout

        run = run_cli("db", "status", cwd=tmp_path, env=env)
        assert run.returncode == 0, run.stderr
        assert f"schema at {head}, code expects {head}" in run.stdout

        run = run_cli("db", "upgrade", cwd=tmp_path, env=env)  # idempotent
        assert run.returncode == 0, run.stderr

        tables, columns, uniques = _schema_of(backend.url)
        assert {"service_config_template", "routing_rule", "alembic_version"} <= tables
        template_cols = columns["service_config_template"]
        legacy = {"min_idle_services", "service_concurrency", "service_ttl", "session_concurrency"}
        assert legacy <= template_cols
        assert not {"min_idle_pods", "pod_concurrency", "pod_ttl", "scope_concurrency"} & (
            template_cols
        )
        assert {"template_id", "image", "pod_name", "env", "kubeconfig", "session_ttl"} <= (
            template_cols
        )
        assert {"group_id", "bot_id", "template_id"} <= columns["routing_rule"]
        assert frozenset({"group_id", "bot_id"}) in uniques

        # the constraint is real, and ids are case-sensitive (MariaDB: binary collation)
        engine = create_engine(backend.url)
        try:
            with engine.begin() as conn:
                conn.execute(insert(routing_rule).values(group_id="g", bot_id="b", template_id="t"))
                conn.execute(insert(routing_rule).values(group_id="G", bot_id="b", template_id="t"))
            with pytest.raises(IntegrityError), engine.begin() as conn:
                conn.execute(
                    insert(routing_rule).values(group_id="g", bot_id="b", template_id="t2")
                )
            with engine.connect() as conn:
                rows = conn.execute(select(routing_rule.c.group_id, routing_rule.c.template_id))
                assert sorted(rows.all()) == [("G", "t"), ("g", "t")]
        finally:
            engine.dispose()
    finally:
        backend.cleanup()


@pytest.mark.parametrize("backend_name", ALL_DBS)
async def test_server_startup_refuses_outdated_schema(backend_name: str, tmp_path: Path) -> None:
    backend = make_sql_backend(backend_name, tmp_path)
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        mode=Mode.SERVER,
        redis_url="redis://unused:6379/0",
        database_url=backend.url,
        admin_tokens=["x"],
    )
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    db = Database.from_url(backend.url, pool_size=2)
    backends = Backends(redis=redis, db=db, k8s=FakeK8sPodClient())
    try:
        with pytest.raises(ConfigError) as info:
            await check_backends(settings, backends)
        message = str(info.value)
        assert "agent-runtime db upgrade" in message
        assert "schema at empty" in message
        assert "\n" not in message
        # server mode never migrates by itself
        status = await db.run(schema.status, db.engine)
        assert status.current is None

        await db.run(schema.upgrade, db.engine)
        await check_backends(settings, backends)  # up to date: accepted
    finally:
        await backends.close()
        backend.cleanup()


@pytest.mark.parametrize("backend_name", ALL_DBS)
async def test_local_startup_migrates_empty_database(backend_name: str, tmp_path: Path) -> None:
    backend = make_sql_backend(backend_name, tmp_path)
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, mode=Mode.LOCAL, database_url=backend.url
    )
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    db = Database.from_url(backend.url, pool_size=2)
    backends = Backends(redis=redis, db=db, k8s=FakeK8sPodClient())
    try:
        await check_backends(settings, backends)
        status = await db.run(schema.status, db.engine)
        assert status.up_to_date
        await check_backends(settings, backends)  # again: nothing to do, no error
    finally:
        await backends.close()
        backend.cleanup()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend_name", SERVER_DBS)
def test_serve_server_refuses_empty_database(backend_name: str, tmp_path: Path) -> None:
    keys_before = ping_redis_14()
    backend = make_sql_backend(backend_name, tmp_path)
    try:
        env = {
            "AGENT_RUNTIME_REDIS_URL": PING_REDIS_URL,
            "AGENT_RUNTIME_DATABASE_URL": backend.url,
            "AGENT_RUNTIME_ADMIN_TOKENS": "x",
            "AGENT_RUNTIME_GATEWAY_TOKENS": "gw",
            "AGENT_RUNTIME_LOG_LEVEL": "DEBUG",  # even at DEBUG the failure is one line
        }
        run = run_cli("serve", "--mode", "server", cwd=tmp_path, env=env)
        line = assert_fail_fast(run)
        assert "agent-runtime db upgrade" in line
        assert "schema at empty" in line
        assert ping_redis_14() == keys_before
    finally:
        backend.cleanup()
