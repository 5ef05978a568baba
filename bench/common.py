"""Shared parts of the benches: the Redis db they own, the bench server process, the load
generator (wrk, else a Python fallback), the admin calls that set a scenario up, and the
machine facts every result carries.

Redis: a dedicated db index (``AGENT_RUNTIME_BENCH_REDIS_URL``, default db 4). A db holding
any key that is not this service's (prefixes ``session_manager:``, ``resource_manager:``,
``agent_runtime:``) is refused; so is one claimed by another live bench run
(``agent_runtime:bench:claim`` = host:pid). Only the service's own keys are ever deleted.
A ``redis+cluster://`` URL names a Redis Cluster (db 0 only): the same claim over every
master, and the tests' cluster (scripts/redis_topologies.sh) only while the bench holds the
tests' lease on it (``BenchCluster``). ``bench_redis(url)`` picks the kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis as sync_redis

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
WRK_SCRIPT = BENCH / "wrk" / "bench.lua"
PY = sys.executable

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/4"
OWN_PREFIXES = ("session_manager:", "resource_manager:", "agent_runtime:")
CLAIM_KEY = "agent_runtime:bench:claim"
API = "/api/session"
CONNECTIONS = 50  # the wrk setting
HTTP_ENV = "AGENT_RUNTIME_BENCH_HTTP"  # bench/server.py's protocol: edge | httptools | h11
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchRefused(Exception):
    """The bench cannot run here (Redis db not ours, a server did not start, ...)."""


# --- machine --------------------------------------------------------------------------------


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("uvicorn", "uvloop", "httptools", "fastapi", "starlette", "pydantic", "redis"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


def git_state() -> dict[str, Any]:
    """The commit measured, and whether the tree had changes (read-only git calls)."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        )
        return done.stdout.strip()

    with contextlib.suppress(Exception):
        return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "-s"))}
    return {"commit": "unknown", "dirty": None}


def machine() -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "loadavg_start": loadavg(),
    }


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores (/proc/stat)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = ticks[3] + ticks[4]  # idle + iowait
        return (sum(ticks[:8]) - idle) / CLK_TCK, sum(ticks[:8]) / CLK_TCK
    return 0.0, 0.0


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ms(us: float) -> float:
    return round(us / 1000.0, 3)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


# --- Redis: the db the benches own ------------------------------------------------------------


def is_own(key: str) -> bool:
    return key.startswith(OWN_PREFIXES)


class BenchRedis:
    """A sync client on the bench db: claim, wipe (own keys only), INFO readings."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = sync_redis.Redis.from_url(url, decode_responses=True, socket_timeout=30)
        self.me = f"{socket.gethostname()}:{os.getpid()}"

    def claim(self) -> None:
        try:
            self.client.ping()
        except sync_redis.RedisError as exc:
            raise BenchRefused(f"redis at {self.url} unreachable: {exc}") from None
        for key in self.client.scan_iter(count=1000):
            if self.is_foreign(key):
                raise BenchRefused(
                    f"redis {self.url} holds keys that are not agent-runtime's (e.g. {key!r}): "
                    "point AGENT_RUNTIME_BENCH_REDIS_URL at a db index of its own"
                )
        owner = self.client.get(CLAIM_KEY)
        if owner and owner != self.me and _owner_alive(owner):
            raise BenchRefused(f"redis {self.url} is in use by another bench run ({owner})")
        self.wipe()
        self.client.set(CLAIM_KEY, self.me)

    def is_foreign(self, key: str) -> bool:
        """A key the claim refuses to share the db with."""
        return not is_own(key)

    def wipe(self) -> int:
        """Delete this service's keys (never another's), except the claim."""
        deleted, batch = 0, []
        for key in self.client.scan_iter(count=2000):
            if is_own(key) and key != CLAIM_KEY:
                batch.append(key)
                if len(batch) >= 2000:
                    deleted += int(self.client.unlink(*batch))
                    batch.clear()
        if batch:
            deleted += int(self.client.unlink(*batch))
        return deleted

    def release(self) -> None:
        self.wipe()
        if self.client.get(CLAIM_KEY) == self.me:
            self.client.delete(CLAIM_KEY)
        self.client.close()

    def info(self, section: str) -> dict[str, Any]:
        return dict(self.client.info(section))

    def used_memory(self) -> int:
        return int(self.info("memory")["used_memory"])

    def cpu_seconds(self) -> float:
        cpu = self.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    def commandstats(self) -> dict[str, int]:
        """Calls per command, server-wide (every db and client; commands run inside scripts
        are counted too)."""
        return {
            name.removeprefix("cmdstat_"): int(v["calls"])
            for name, v in self.info("commandstats").items()
        }

    def total_commands(self) -> int:
        return int(self.info("stats")["total_commands_processed"])

    def keep(self) -> None:
        """Renew what the claim holds for a while (a single server's claim holds for good)."""

    def masters(self) -> dict[str, sync_redis.Redis]:
        """A client per master, by ``host:port``: a single server is its one master."""
        kwargs = self.client.connection_pool.connection_kwargs
        return {f"{kwargs.get('host', 'unix')}:{kwargs.get('port', 0)}": self.client}

    def readings(
        self, masters: dict[str, sync_redis.Redis] | None = None
    ) -> dict[str, NodeReading]:
        """CPU and command counters of every master (``masters``: found before, so that
        finding them is not among the counted commands), by ``host:port``."""
        return {name: NodeReading.of(node) for name, node in (masters or self.masters()).items()}


@dataclass(frozen=True)
class NodeReading:
    """One master's counters at one moment: ``INFO cpu`` (``used_cpu_sys`` +
    ``used_cpu_user``), ``INFO commandstats`` (calls per command, those a script runs inside
    Redis included), ``total_commands_processed`` (the commands clients sent)."""

    cpu_s: float
    calls: dict[str, int]
    total_commands: int

    @classmethod
    def of(cls, node: sync_redis.Redis) -> NodeReading:
        info = node.info("all")
        calls = {
            name.removeprefix("cmdstat_"): int(v["calls"])
            for name, v in info.items()
            if name.startswith("cmdstat_")
        }
        cpu = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return cls(cpu, calls, int(info["total_commands_processed"]))


class BenchCluster(BenchRedis):
    """The bench's claim on a Redis Cluster (``redis+cluster://``; db 0 only): the single
    server's claim (only the service's keys, ``CLAIM_KEY``, a wipe of the service's keys) over
    every master. The tests' cluster (it holds ``tests/helpers.py``'s ``CLUSTER_CLAIM``) is
    shared with test runs that own it by a lease (``CLUSTER_OWNER``) and flush it: the bench
    takes that lease first (waiting as a test run does), renews it (``keep``) and gives it back
    on release; a test run meanwhile waits for it. The hazard: a wipe without the lease would
    delete a running test's keys (they carry the service's prefixes)."""

    def __init__(self, url: str) -> None:
        from redis.cluster import ClusterNode, RedisCluster

        from agent_runtime import redis_client

        self.url = url
        self.target = redis_client.parse(url)
        self.client = RedisCluster(  # type: ignore[assignment]
            startup_nodes=[ClusterNode(host, port) for host, port in self.target.nodes],
            username=self.target.username,
            password=self.target.password,
            ssl=self.target.tls,
            decode_responses=True,
            socket_timeout=30,
        )
        self.me = f"{socket.gethostname()}:{os.getpid()}"
        self._nodes: dict[str, sync_redis.Redis] = {}
        self._lease: tuple[str, int] | None = None  # the tests' owner key, its lease (ms)

    def masters(self) -> dict[str, sync_redis.Redis]:
        """The masters serving slots now (``CLUSTER NODES``), a plain client on each."""
        nodes = self.client.cluster_nodes()  # type: ignore[attr-defined]
        names = sorted(
            name
            for name, node in nodes.items()
            if "master" in node["flags"] and "fail" not in node["flags"] and node["slots"]
        )
        for name in names:
            if name not in self._nodes:
                host, _, port = name.rpartition(":")
                self._nodes[name] = sync_redis.Redis(
                    host=host,
                    port=int(port),
                    username=self.target.username,
                    password=self.target.password,
                    ssl=self.target.tls,
                    decode_responses=True,
                    socket_timeout=30,
                )
        return {name: self._nodes[name] for name in names}

    def claim(self) -> None:
        try:
            self.client.ping()
            self._take_tests_lease()
        except sync_redis.RedisError as exc:
            raise BenchRefused(f"redis cluster at {self.url} unusable: {exc}") from None
        super().claim()

    def _take_tests_lease(self) -> None:
        tests = _tests_cluster_protocol()
        if not self.client.exists(tests.CLUSTER_CLAIM):
            return  # not the tests' cluster: the claim alone decides
        deadline = time.monotonic() + tests.CLUSTER_WAIT
        while not self.client.set(tests.CLUSTER_OWNER, self.me, nx=True, px=tests.CLUSTER_LEASE_MS):
            owner = self.client.get(tests.CLUSTER_OWNER)
            if owner == self.me:
                break
            if owner and not _owner_alive(owner):
                self.client.set(tests.CLUSTER_OWNER, self.me, px=tests.CLUSTER_LEASE_MS)
                break
            if time.monotonic() > deadline:
                raise BenchRefused(
                    f"the tests' Redis Cluster at {self.url} is held by a test run ({owner}) "
                    f"for over {tests.CLUSTER_WAIT:.0f} s"
                )
            time.sleep(0.5)
        self._lease = (tests.CLUSTER_OWNER, tests.CLUSTER_LEASE_MS)

    def is_foreign(self, key: str) -> bool:
        return not is_own(key) and not key.startswith(_tests_cluster_protocol().PREFIX)

    def keep(self) -> None:
        if self._lease is not None and self.client.get(self._lease[0]) == self.me:
            self.client.pexpire(self._lease[0], self._lease[1])

    def release(self) -> None:
        try:
            self.wipe()
            if self.client.get(CLAIM_KEY) == self.me:
                self.client.delete(CLAIM_KEY)
            if self._lease is not None and self.client.get(self._lease[0]) == self.me:
                self.client.delete(self._lease[0])
        finally:
            for node in self._nodes.values():
                node.close()
            self.client.close()

    def info(self, section: str) -> dict[str, Any]:
        """The first master's (``redis_version``, …): the cluster's sums are ``readings``."""
        return dict(next(iter(self.masters().values())).info(section))

    def used_memory(self) -> int:
        return sum(int(n.info("memory")["used_memory"]) for n in self.masters().values())

    def cpu_seconds(self) -> float:
        return sum(r.cpu_s for r in self.readings().values())

    def commandstats(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for reading in self.readings().values():
            total.update(reading.calls)
        return dict(total)

    def total_commands(self) -> int:
        return sum(r.total_commands for r in self.readings().values())


@dataclass(frozen=True)
class _TestsCluster:
    CLUSTER_CLAIM: str
    CLUSTER_OWNER: str
    CLUSTER_LEASE_MS: int
    CLUSTER_WAIT: float
    PREFIX: str


def _tests_cluster_protocol() -> _TestsCluster:
    """The tests' names for their cluster's marker and lease (tests/helpers.py)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import helpers

    return _TestsCluster(
        helpers.CLUSTER_CLAIM,
        helpers.CLUSTER_OWNER,
        helpers.CLUSTER_LEASE_MS,
        helpers.CLUSTER_WAIT,
        helpers.CLUSTER_CLAIM.split(":", 1)[0] + ":",
    )


def bench_redis(url: str) -> BenchRedis:
    """The bench's claim on the Redis a URL names: one server, or a Redis Cluster."""
    if url.split("://", 1)[0].lower().endswith("+cluster"):
        return BenchCluster(url)
    return BenchRedis(url)


def _owner_alive(owner: str) -> bool:
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- the bench server process -----------------------------------------------------------------


# The hot path's benches (no-op, refresh, placed, touch, redis_cost, cluster) measure what a
# request costs, not the admission: 50 connections against the default in-flight bound (32)
# and its loop-lag governor would have most routes shed as OVERLOADED on a saturated 2-core
# machine (wrk does not honour Retry-After), and the ratios would compare shedding. The
# environment given wins over these.
HOT_PATH_ENV = {"AGENT_RUNTIME_MAX_IN_FLIGHT": "128", "AGENT_RUNTIME_ADMISSION_LAG_TARGET": "0"}


class Server:
    """``python -m bench.server`` on a free port: the service's app, one uvicorn worker."""

    def __init__(
        self,
        ctx: Context,
        name: str,
        *,
        ready_delay: float = 0.0,
        jobs: bool = False,
        seed_k8s: bool = False,
        count_redis: bool = False,
        asyncio_debug: float = 0.0,
        callback_audit: float = 0.0,
        profile: Path | None = None,
        cpus: set[int] | None = None,
        extra_args: list[str] | None = None,
        hot_path: bool = False,
    ) -> None:
        """``cpus``: pin the server process to these CPUs (``sched_setaffinity``), so that a
        load generator pinned elsewhere does not take its cycles; ``extra_args``: more of
        ``bench.server``'s options; ``hot_path``: a run of the hot path's cost, where the
        in-flight bound must not shed (HOT_PATH_ENV: what an operator's setting would
        override); the overload bench measures the shedding."""
        self.ctx = ctx
        self.cpus = cpus
        self.env = HOT_PATH_ENV if hot_path else {}
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = ctx.tmp / f"server-{name}-{self.port}.log"
        self.args = [
            PY,
            "-m",
            "bench.server",
            "--port",
            str(self.port),
            "--redis-url",
            ctx.redis.url,
            "--database-url",
            ctx.database_url,
            "--ready-delay",
            str(ready_delay),
            "--instance-id",
            f"bench-{name}",
        ]
        if jobs:
            self.args.append("--jobs")
        if seed_k8s:
            self.args.append("--seed-k8s")
        if count_redis:
            self.args.append("--count-redis")
        if asyncio_debug:
            self.args += ["--asyncio-debug", str(asyncio_debug)]
        if callback_audit:
            self.args += ["--callback-audit", str(callback_audit)]
        if profile is not None:
            self.args += ["--profile", str(profile)]
        self.args += extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _spawn(self) -> None:
        env = {
            **self.env,
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        if self.cpus:
            os.sched_setaffinity(self.proc.pid, self.cpus)
        self.ctx.servers.append(self)

    async def start(self, within: float = 60.0) -> Server:
        """Spawn the process and wait (at most ``within`` seconds) until /healthz is 200."""
        self._spawn()
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise BenchRefused(f"bench server {self.name} exited: {self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/healthz")).status_code == 200:
                        return self
                await asyncio.sleep(0.1)
        self.stop()
        raise BenchRefused(f"bench server {self.name} not healthy in {within:g} s")

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    async def stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
            return dict((await client.get(f"{self.url}/_bench/stats")).json())

    async def metrics(self) -> dict[str, float]:
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
            return parse_metrics((await client.get(f"{self.url}/metrics")).text)

    def cpu_seconds(self) -> float | None:
        return proc_cpu_seconds(self.pid)


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def metric_delta(
    before: dict[str, float], after: dict[str, float], prefix: str
) -> dict[str, float]:
    """Changed series whose name starts with ``prefix`` (counters: after - before)."""
    return {
        k: after[k] - before.get(k, 0.0)
        for k in after
        if k.startswith(prefix) and after[k] != before.get(k, 0.0)
    }


# --- load generation (a separate process) -----------------------------------------------------


@dataclass
class LoadSpec:
    """One load run: where, what (``BENCH_*`` environment of wrk/bench.lua), how hard."""

    url: str
    mode: str  # route_existing | route_new | touch | touch_ids | noop
    group: str
    sessions: int = 1
    scopes: int = 1
    prefix: str = "s-"
    connections: int = CONNECTIONS
    seconds: float = 3.0
    threads: int | None = None

    def env(self) -> dict[str, str]:
        return {
            "BENCH_MODE": self.mode,
            "BENCH_SESSIONS": str(self.sessions),
            "BENCH_SCOPES": str(self.scopes),
            "BENCH_GROUP": self.group,
            "BENCH_PREFIX": self.prefix,
            "BENCH_RUN": uuid.uuid4().hex[:10],
        }


class LoadGen:
    """wrk with bench/wrk/bench.lua when installed, else bench/httpgen.py (say which)."""

    def __init__(self, prefer: str = "auto") -> None:
        wrk = shutil.which("wrk")
        self.kind = "wrk" if wrk and prefer != "python" else "python-httpx"
        self.version = ""
        if self.kind == "wrk":
            done = subprocess.run(["wrk", "--version"], capture_output=True, text=True, check=False)
            self.version = (done.stdout or done.stderr).splitlines()[0] if done else ""

    def describe(self) -> str:
        if self.kind == "wrk":
            return f"wrk ({self.version.strip()}) + bench/wrk/bench.lua"
        why = "chosen" if shutil.which("wrk") else "wrk not installed"
        return f"python-httpx (bench/httpgen.py, {why}: a weak client, numbers are a floor)"

    def command(self, spec: LoadSpec) -> list[str]:
        seconds = max(1, round(spec.seconds))
        if self.kind == "wrk":
            threads = spec.threads or min(2, spec.connections)
            return [
                "wrk",
                f"-t{threads}",
                f"-c{spec.connections}",
                f"-d{seconds}s",
                "--timeout",
                "10s",
                "-s",
                str(WRK_SCRIPT),
                spec.url,
            ]
        return [PY, str(BENCH / "httpgen.py"), spec.url, str(spec.connections), str(seconds)]

    async def run(self, spec: LoadSpec, *, servers: Iterable[Server] = ()) -> dict[str, Any]:
        return (await self.run_many([spec], servers=servers))[0]

    async def run_many(
        self, specs: list[LoadSpec], *, servers: Iterable[Server] = ()
    ) -> list[dict[str, Any]]:
        """Run the specs at once (one process each); CPU of servers, Redis and load generator
        over the window, load average at the end."""
        servers = list(servers)
        redis = servers[0].ctx.redis if servers else None
        cpu0 = [s.cpu_seconds() for s in servers]
        redis0 = redis.cpu_seconds() if redis else None
        gen0 = children_cpu_seconds()
        busy0, _ = machine_cpu()
        started = time.perf_counter()
        procs = [
            await asyncio.create_subprocess_exec(
                *self.command(spec),
                env={**os.environ, **spec.env()},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            for spec in specs
        ]
        outputs = await asyncio.gather(*(p.communicate() for p in procs))
        wall = time.perf_counter() - started
        busy = machine_cpu()[0] - busy0
        gen_cpu = children_cpu_seconds() - gen0
        results = []
        for spec, proc, (out, err) in zip(specs, procs, outputs, strict=True):
            raw = _bench_json(out.decode(errors="replace"))
            if raw is None:
                raise BenchRefused(
                    f"load generator gave no result (exit {proc.returncode}): "
                    f"{err.decode(errors='replace')[-500:]}"
                )
            results.append(summarize(raw, spec))
        cpu = {"loadgen_cpu_pct": round(100 * gen_cpu / wall, 1)}
        for i, server in enumerate(servers):
            now = server.cpu_seconds()
            if now is not None and cpu0[i] is not None:
                cpu[f"server_{server.name}_cpu_pct"] = round(100 * (now - cpu0[i]) / wall, 1)
        if redis is not None and redis0 is not None:
            cpu["redis_cpu_pct"] = round(100 * (redis.cpu_seconds() - redis0) / wall, 1)
        # every core's busy time (2 cores: up to 200 %); what is not ours is other jobs' load
        cpu["machine_busy_pct"] = round(100 * busy / wall, 1)
        cpu["others_cpu_pct"] = round(
            cpu["machine_busy_pct"] - sum(v for k, v in cpu.items() if k != "machine_busy_pct"),
            1,
        )
        for result in results:
            result["cpu"] = cpu
            result["loadavg"] = loadavg()
        return results


def _bench_json(text: str) -> dict[str, Any] | None:
    for line in text.splitlines():
        if line.startswith("BENCH_JSON "):
            return dict(json.loads(line.removeprefix("BENCH_JSON ")))
    return None


def summarize(raw: dict[str, Any], spec: LoadSpec) -> dict[str, Any]:
    errors = dict(raw["errors"])
    requests = int(raw["requests"])
    return {
        "connections": spec.connections,
        "seconds": round(float(raw["duration_s"]), 2),
        "requests": requests,
        "rps": round(requests / float(raw["duration_s"]), 1) if raw["duration_s"] else 0.0,
        "ok_rps": (
            round((requests - sum(errors.values())) / float(raw["duration_s"]), 1)
            if raw["duration_s"]
            else 0.0
        ),
        "p50_ms": ms(raw["p50_us"]),
        "p90_ms": ms(raw["p90_us"]),
        "p99_ms": ms(raw["p99_us"]),
        "p999_ms": ms(raw["p999_us"]),
        "max_ms": ms(raw["max_us"]),
        "mean_ms": ms(raw["mean_us"]),
        "errors": errors,
        "error_total": sum(errors.values()),
        "valid": sum(errors.values()) <= 0.01 * max(requests, 1),  # else: not the service's speed
    }


# --- the service's admin calls, a route, a touch ----------------------------------------------


def client(base_url: str, connections: int = 64) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=30.0, limits=limits)


def rid() -> str:
    return f"b-{uuid.uuid4().hex}"


async def configure(
    http: httpx.AsyncClient,
    name: str,
    group: str,
    *,
    scope_concurrency: int,
    pod_concurrency: int,
    session_ttl: int = 3600,
    bot: str = "*",
) -> None:
    """A template ``bench-<name>`` and the rule ``(group, bot)`` → it, through config_sync."""
    template = {
        "template_id": f"bench-{name}",
        "image": "bench:1",
        "scope_concurrency": scope_concurrency,
        "pod_concurrency": pod_concurrency,
        "session_ttl": session_ttl,
        "min_idle_pods": 0,
    }
    rule = {"group_id": group, "bot_id": bot, "template_id": f"bench-{name}"}
    for kind, item in (("template", template), ("routing_rule", rule)):
        body = {
            "metadata": {"request_id": rid()},
            "rawdata": {"kind": kind, "op": "sync", "item": item},
        }
        response = await http.post(f"{API}/config_sync", json=body)
        if response.status_code != 200:
            raise BenchRefused(f"config_sync {kind} refused: {response.text[:300]}")


def route_body(request_id: str, session: str, group: str, bot: str) -> dict[str, Any]:
    meta = {"request_id": request_id, "session_id": session, "bot_id": bot}
    return {"metadata": {**meta, "extra": {"group_id": group}}, "rawdata": {}}


async def route(http: httpx.AsyncClient, session: str, group: str, bot: str) -> dict[str, Any]:
    response = await http.post(f"{API}/route", json=route_body(rid(), session, group, bot))
    return dict(response.json())


async def touch(http: httpx.AsyncClient, session: str, *, eos: bool = False) -> dict[str, Any]:
    body = {"metadata": {"request_id": rid(), "session_id": session}, "rawdata": {"eos": eos}}
    return dict((await http.post(f"{API}/touch", json=body)).json())


SHED_RETRY_S = 30.0


async def place_sessions(
    http: httpx.AsyncClient,
    group: str,
    count: int,
    scopes: int,
    *,
    prefix: str = "s-",
    concurrency: int = 16,
    first_concurrency: int = 1,
) -> Counter[str]:
    """Route sessions ``prefix + k`` (k < count) in bot ``b-<k % scopes>``: the first route of
    each scope goes through the slow path (resolve, acquire, deploy on the fake Kubernetes),
    ``first_concurrency`` scopes at a time (1: one deploy after the other), before the rest.
    A route shed by the in-flight bound (``OVERLOADED``, on a loaded machine) is sent again,
    as a gateway does, for up to ``SHED_RETRY_S``."""
    outcomes: Counter[str] = Counter()

    async def one(k: int, gate: asyncio.Semaphore) -> None:
        deadline = time.monotonic() + SHED_RETRY_S
        async with gate:
            answer = await route(http, f"{prefix}{k}", group, f"b-{k % scopes}")
            while answer.get("error_code") == "OVERLOADED" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                answer = await route(http, f"{prefix}{k}", group, f"b-{k % scopes}")
        outcomes[answer.get("data", {}).get("placement") or answer.get("error_code", "?")] += 1

    first = asyncio.Semaphore(first_concurrency)  # one per scope first: one deploy each
    await asyncio.gather(*(one(k, first) for k in range(min(scopes, count))))
    rest = asyncio.Semaphore(concurrency)
    await asyncio.gather(*(one(k, rest) for k in range(min(scopes, count), count)))
    return outcomes


class RawConnection:
    """One keep-alive HTTP/1.1 connection with requests prepared as bytes: a client that adds
    next to no time of its own (httpx spends ~1 ms of Python per request, which skews bursts
    and short waits)."""

    def __init__(self, base_url: str) -> None:
        host_port = base_url.removeprefix("http://")
        self.host, _, port = host_port.partition(":")
        self.port = int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_used = time.monotonic()  # when its last answer came (or it opened)

    async def open(self) -> RawConnection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    def prepare(self, path: str, body: dict[str, Any]) -> bytes:
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        return head.encode() + payload

    async def send(self, request: bytes) -> dict[str, Any]:
        """Write a prepared request, read its answer (JSON body)."""
        assert self.reader is not None and self.writer is not None
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        answer = dict(json.loads(await self.reader.readexactly(length)))
        self.last_used = time.monotonic()
        return answer

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.send(self.prepare(path, body))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()


# --- the run's context --------------------------------------------------------------------------


@dataclass
class Context:
    quick: bool
    redis: BenchRedis
    loadgen: LoadGen
    tmp: Path
    database_url: str
    profile: bool = False
    results: dict[str, Any] = field(default_factory=dict)
    servers: list[Server] = field(default_factory=list)
    _main: Server | None = None

    @property
    def loaded_seconds(self) -> float:
        return 3.0 if self.quick else 10.0

    @property
    def unloaded_seconds(self) -> float:
        return 2.0 if self.quick else 5.0

    @property
    def warmup_seconds(self) -> float:
        return 1.0 if self.quick else 2.0

    async def main_server(self) -> Server:
        """The server shared by baseline, refresh, placed, touch and queue_wake."""
        if self._main is None or self._main.proc is None or self._main.proc.poll() is not None:
            self._main = await Server(self, "main", hot_path=True).start()
        return self._main

    def stop_main_server(self) -> None:
        if self._main is not None:
            self._main.stop()
            self._main = None

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()
        self._main = None

    async def throughput(
        self, spec: LoadSpec, servers: list[Server], *, path: str
    ) -> dict[str, Any]:
        """Warm-up (discarded), loaded run (50 connections), unloaded run (1 connection)."""
        base = servers[0].url + path
        warm = LoadSpec(**{**spec.__dict__, "url": base, "seconds": self.warmup_seconds})
        await self.loadgen.run(warm, servers=servers)
        loaded_spec = LoadSpec(**{**spec.__dict__, "url": base, "seconds": self.loaded_seconds})
        loaded = await self.loadgen.run(loaded_spec, servers=servers)
        single = {"url": base, "seconds": self.unloaded_seconds, "connections": 1, "threads": 1}
        unloaded = await self.loadgen.run(LoadSpec(**{**spec.__dict__, **single}), servers=servers)
        return {"loaded": loaded, "unloaded": unloaded}


@contextlib.asynccontextmanager
async def bench_context(
    *,
    quick: bool,
    redis_url: str,
    loadgen: str = "auto",
    profile: bool = False,
    database_url: str | None = None,
) -> AsyncIterator[Context]:
    """The run's context; ``database_url``: another context's SQL database (its
    configuration), else a SQLite file of its own."""
    redis = bench_redis(redis_url)
    redis.claim()
    tmp = Path(tempfile.mkdtemp(prefix="agent-runtime-bench-"))
    ctx = Context(
        quick=quick,
        redis=redis,
        loadgen=LoadGen(loadgen),
        tmp=tmp,
        database_url=database_url or f"sqlite:///{tmp / 'config.db'}",
        profile=profile,
    )
    try:
        yield ctx
    finally:
        ctx.stop_all()
        redis.release()
        if not os.environ.get("AGENT_RUNTIME_BENCH_KEEP_TMP"):
            shutil.rmtree(tmp, ignore_errors=True)
