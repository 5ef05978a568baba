"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPubSub
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import WatchError
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from agent_runtime import redis_client
from agent_runtime.config import RM_KEY_PREFIX, SM_KEY_PREFIX, Mode, Settings
from agent_runtime.db.engine import Database, normalize_url
from agent_runtime.main import create_app
from agent_runtime.resource_manager.identity import PodIdentity
from agent_runtime.resource_manager.k8s_fake import FakeK8sPodClient
from agent_runtime.resource_manager.models import PodDeployInfo
from agent_runtime.session_manager.replies import PLACING, Placement, RoutePlacement
from agent_runtime.wiring import Backends

IN_CI = os.environ.get("CI", "").lower() == "true"
# A test's own Redis clients: a test that fires a hundred commands at once makes its client
# open a hundred connections at once, and on a loaded 2-core machine (the CI box, a busy loop
# on each core) the event loop gets to some of them seconds later. A refused connect fails at
# once whatever this says.
TEST_CONNECT_TIMEOUT = 10.0


def venv_tool(name: str) -> str:
    """A command the test extra installs into the venv (next to this Python), else on PATH;
    a missing one fails the test: it is a declared test dependency, never a reason to skip."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: install the test extra (requirements.lock)")
    return found


REDIS_URL = os.environ.get("AGENT_RUNTIME_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
MYSQL_URL = os.environ.get(
    "AGENT_RUNTIME_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
)
PG_URL = os.environ.get(
    "AGENT_RUNTIME_TEST_PG_URL", "postgresql+psycopg://root@127.0.0.1:5432/test"
)
CLAIM_KEY = "agent_runtime_test:claim"
# the pod identity of tests that build the resource manager by hand (an app makes its own)
IDENTITY = PodIdentity("tests-pod-identity-secret-0001")


def unavailable(what: str, exc: BaseException) -> None:
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    message = f"{what} unreachable: {type(exc).__name__}: {first_line}"
    if IN_CI:
        pytest.fail(f"CI=true and a configured backend is down: {message}", pytrace=False)
    pytest.skip(message)


# --- Redis ---


_claimed_url: str | None = None


def _owner_alive(owner: str) -> bool:
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine's run: assume alive
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def real_redis_url() -> str:
    """The real-Redis URL this test process claimed (see ``claim_real_redis``)."""
    return _claimed_url or REDIS_URL


async def claim_real_redis() -> Redis:
    """A client on a db index that this test process owns, flushed.

    The configured db (default 13) or, while another live test run holds it, the next lower
    ones down to 9. Ownership is a marker key naming host and pid: a db whose owner died is
    taken over; a db with keys and no marker belongs to someone else and is never flushed.
    """
    global _claimed_url
    base, _, index = REDIS_URL.rpartition("/")
    _claimed_url, client = await _claim_one_of(
        [_claimed_url] if _claimed_url else _db_urls(base, int(index or 0)),
        lambda url: Redis.from_url(
            url, decode_responses=True, socket_connect_timeout=TEST_CONNECT_TIMEOUT
        ),
        "redis",
        "no free real-Redis db for the tests: {}"
        " — point AGENT_RUNTIME_TEST_REDIS_URL at an empty db index",
    )
    return client


def _db_urls(base: str, index: int) -> list[str]:
    """The db ``index`` and the next lower ones, down to 4 below it (and never below 0)."""
    return [f"{base}/{db}" for db in range(index, max(index - 5, -1), -1)]


async def _claim_one_of(
    urls: list[str], connect: Callable[[str], Redis], what: str, failure: str
) -> tuple[str, Redis]:
    """The first of ``urls`` whose db this process claims (``_claim_db``), with its client
    (``connect``); unreachable: ``unavailable``; every one held: fails, ``failure`` naming
    why (``{}``)."""
    refused = []
    for url in urls:
        client = connect(url)
        try:
            await client.ping()
        except Exception as exc:
            await client.aclose()
            unavailable(f"{what} at {url}", exc)
        why = await _claim_db(client)
        if why is None:
            return url, client
        refused.append(f"{url} ({why})")
        await client.aclose()
    pytest.fail(failure.format("; ".join(refused)), pytrace=False)


async def _claim_db(client: Redis) -> str | None:
    """Claim the client's db for this process (flushed, marked); None when it is ours now,
    else why not. Check and claim are one transaction (WATCH): two runs that see the same
    free db at once must not both take it, and a db is never empty and unmarked in between."""
    me = f"{socket.gethostname()}:{os.getpid()}"
    async with client.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(CLAIM_KEY)
            owner = await pipe.get(CLAIM_KEY)
            size = await pipe.dbsize()
            free = (owner is None and size == 0) or owner == me
            if free or (owner and not _owner_alive(owner)):
                pipe.multi()
                pipe.flushdb()
                pipe.set(CLAIM_KEY, me)
                await pipe.execute()
                return None
        except WatchError:  # another run claimed it at this very moment
            owner = "another run, just now"
    return f"held by {owner}" if owner else f"{size} foreign keys"


async def redis_keys(client: Redis, pattern: str = "*") -> set[str]:
    return {k async for k in client.scan_iter(match=pattern) if k != CLAIM_KEY}


# --- Redis Cluster and Sentinel (scripts/redis_topologies.sh) ---

CLUSTER_URL = os.environ.get(
    "AGENT_RUNTIME_TEST_REDIS_CLUSTER_URL",
    "redis+cluster://127.0.0.1:17101,127.0.0.1:17102,127.0.0.1:17103",
)
SENTINEL_URL = os.environ.get(
    "AGENT_RUNTIME_TEST_REDIS_SENTINEL_URL",
    "redis+sentinel://127.0.0.1:17211,127.0.0.1:17212,127.0.0.1:17213/agent-runtime-test/13",
)
# the cluster is the tests' while it holds this key (set while it was empty): a cluster with
# keys and without it is someone else's and never touched
CLUSTER_CLAIM = "agent_runtime_test:cluster"
_claimed_sentinel_url: str | None = None


def topology_client(url: str, *, max_connections: int = 64) -> Redis:
    """The service's own client for a URL (redis_client.build), with the tests' timeouts."""
    return redis_client.build(
        redis_client.parse(url),
        redis_client.ClientOptions(max_connections=max_connections, timeout=TEST_CONNECT_TIMEOUT),
    )


async def claim_cluster(tag: str) -> Redis:
    """A client on the tests' Redis Cluster. The cluster has only db 0, and several test
    processes (xdist workers, two runs) may use it at once, so nothing is ever flushed: each
    test puts its ``tag`` in every key it writes (``{tag}`` as the hash tag, or a name of
    its own such as a job's), and ``release_cluster`` deletes exactly those. A cluster that
    holds keys but not the tests' marker is someone else's: refused."""
    client = topology_client(CLUSTER_URL)
    try:
        await client.ping()
        if not await client.exists(CLUSTER_CLAIM):
            sizes = await client.dbsize(target_nodes="primaries")  # type: ignore[call-arg]
            total = sum(sizes.values()) if isinstance(sizes, dict) else int(sizes)
            if total:
                await client.aclose()
                pytest.fail(
                    f"the Redis Cluster at {CLUSTER_URL} holds {total} keys and not the tests' "
                    f"marker {CLUSTER_CLAIM}: not ours, left alone — point "
                    "AGENT_RUNTIME_TEST_REDIS_CLUSTER_URL at an empty cluster",
                    pytrace=False,
                )
            await client.set(CLUSTER_CLAIM, socket.gethostname(), nx=True)
    except Exception as exc:
        await client.aclose()
        unavailable(f"redis cluster at {CLUSTER_URL}", exc)
    return client


async def release_cluster(client: Redis, tag: str) -> None:
    """Delete the keys this test wrote (every key with its tag), on each master (the cluster
    client's scan walks every master)."""
    keys = [k async for k in client.scan_iter(match=f"*{tag}*", count=500)]
    for key in keys:
        await client.unlink(key)


# A test run that runs a whole suite on the cluster (the ``redis`` fixture's "cluster" param:
# fixed scope ids, per-bucket keys shared by every scope) owns the cluster: this key names
# the run (host:pid) for CLUSTER_LEASE_MS after its last claim; between tests it flushes
# every master. Another run meanwhile waits up to CLUSTER_WAIT s for it, then fails clearly.
CLUSTER_OWNER = "agent_runtime_test:cluster_owner"
CLUSTER_LEASE_MS = 180_000
CLUSTER_WAIT = 60.0


def _run_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def hold_cluster(client: Redis) -> None:
    """Make this run the cluster's owner (or renew its lease), waiting for another run's."""
    me = _run_id()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CLUSTER_WAIT
    while True:
        if await client.set(CLUSTER_OWNER, me, nx=True, px=CLUSTER_LEASE_MS):
            return
        owner = await client.get(CLUSTER_OWNER)
        if owner == me:
            await client.pexpire(CLUSTER_OWNER, CLUSTER_LEASE_MS)
            return
        if loop.time() > deadline:
            pytest.fail(
                f"the tests' Redis Cluster is held by another test run ({owner}) for over "
                f"{CLUSTER_WAIT:.0f} s: run the topology tests one run at a time",
                pytrace=False,
            )
        await asyncio.sleep(0.5)


async def claim_cluster_whole() -> Redis:
    """The cluster for a test that does not tag its keys: owned by this run (``hold_cluster``)
    and empty but for the markers; ``release_cluster_whole`` empties it again."""
    client = await claim_cluster("")  # the marker checks: a cluster not ours is refused
    try:
        await hold_cluster(client)
        await _flush_cluster(client)
    except BaseException:
        await client.aclose()  # held by another run: its connections go with the refusal
        raise
    return client


async def release_cluster_whole(client: Redis) -> None:
    if await client.get(CLUSTER_OWNER) == _run_id():
        await _flush_cluster(client)


async def _flush_cluster(client: Redis) -> None:
    """Every key but the markers, on every master (the run owns the cluster)."""
    keep = {CLUSTER_CLAIM, CLUSTER_OWNER}
    keys = [k async for k in client.scan_iter(count=1000) if k not in keep]
    for i in range(0, len(keys), 500):
        await client.unlink(*keys[i : i + 500])  # the cluster client splits it by slot


async def drop_cluster_lease() -> None:
    """At the end of the run: the cluster is free for another run at once."""
    client = topology_client(CLUSTER_URL)
    try:
        if await client.get(CLUSTER_OWNER) == _run_id():
            await client.delete(CLUSTER_OWNER)
    finally:
        await client.aclose()


def sentinel_url() -> str:
    return _claimed_sentinel_url or SENTINEL_URL


async def claim_sentinel() -> Redis:
    """A master_for client on a db index of the Sentinel set's master that this test process
    owns, flushed: the configured db (13) or, while another live run holds it, the next lower
    ones down to 9 — the single server's claim (``_claim_db``)."""
    global _claimed_sentinel_url
    base, _, index = SENTINEL_URL.rstrip("/").rpartition("/")
    if not index.isdigit():
        base, index = SENTINEL_URL.rstrip("/"), "0"
    _claimed_sentinel_url, client = await _claim_one_of(
        [_claimed_sentinel_url] if _claimed_sentinel_url else _db_urls(base, int(index)),
        topology_client,
        "redis sentinel set",
        "no free db on the Sentinel set's master for the tests: {}",
    )
    return client


# --- SQL ---


@dataclass
class SqlBackend:
    name: str
    url: str
    cleanup: Any


def _sqlite(tmp_dir: Path) -> SqlBackend:
    path = tmp_dir / f"config-{uuid.uuid4().hex[:8]}.db"
    return SqlBackend("sqlite", f"sqlite:///{path}", lambda: path.unlink(missing_ok=True))


def _server_db(name: str, admin_url: str) -> SqlBackend:
    """A fresh database on a server, dropped again by ``cleanup``."""
    db_name = f"ar_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    url = make_url(normalize_url(admin_url))
    isolation = "AUTOCOMMIT"
    admin = create_engine(url, isolation_level=isolation, connect_args={"connect_timeout": 3})
    try:
        with admin.connect() as conn:
            if name == "mariadb":
                conn.execute(text(f"CREATE DATABASE `{db_name}` CHARACTER SET utf8mb4"))
            else:
                conn.execute(text(f'CREATE DATABASE "{db_name}"'))
    except Exception as exc:
        admin.dispose()
        unavailable(f"{name} at {admin_url}", exc)

    def cleanup() -> None:
        with admin.connect() as conn:
            if name == "mariadb":
                conn.execute(text(f"DROP DATABASE IF EXISTS `{db_name}`"))
            else:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)'))
        admin.dispose()

    return SqlBackend(
        name, url.set(database=db_name).render_as_string(hide_password=False), cleanup
    )


def make_sql_backend(name: str, tmp_dir: Path) -> SqlBackend:
    if name == "sqlite":
        return _sqlite(tmp_dir)
    return _server_db(name, MYSQL_URL if name == "mariadb" else PG_URL)


# --- the app ---


def make_settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "mode": Mode.LOCAL,
        "local_seed": False,
        "instance_id": "test-1",
        "jobs_enabled": False,  # tests tick jobs by hand unless they say otherwise
        # a fixed in-flight bound: in-process apps share one loop with the test and its client,
        # so the loop's lateness is the test's own (the governor has tests of its own)
        "admission_lag_target": 0,
    }
    base.update(overrides)
    return Settings(_env_file=None, **base)  # type: ignore[call-arg]


@asynccontextmanager
async def running_app(
    redis: Redis, db: Database, *, k8s: FakeK8sPodClient | None = None, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """The app over the given backends, lifespan started, as an httpx client. Pass one
    ``k8s`` to several apps to make them replicas of one (fake) cluster."""
    settings = make_settings(**overrides)
    backends = Backends(redis=redis, db=db, k8s=k8s or FakeK8sPodClient())
    app = create_app(settings, backends=backends, owns_backends=False)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def envelope(rawdata: dict[str, Any] | None = None, **metadata: Any) -> dict[str, Any]:
    metadata.setdefault("request_id", f"r-{uuid.uuid4().hex[:8]}")
    return {"metadata": metadata, "rawdata": rawdata or {}}


def sync_body(kind: str, op: str, item: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    return envelope({"kind": kind, "op": op, "item": item}, **metadata)


# --- a backend that can go down ---


class TcpProxy:
    """An asyncio TCP forwarder on 127.0.0.1 in front of a backend (Redis, a SQL server).

    ``stop()`` closes the listener and every forwarded connection, so clients see the backend
    go away (reset connections, then refused connects); ``start()`` listens again on the same
    port, so the same clients can reconnect. Use as ``async with TcpProxy(host, port) as p``.

    Faults short of going down, settable at any time (they apply to open connections too):

    - ``latency``: seconds every forwarded chunk waits, in either direction (a slow backend
      or network); 0 (the default) forwards at once. ``delayed``: chunks waiting right now
      (a request whose client gave up still reaches the backend when its wait ends).
    - ``intercept``: looks at each chunk a client sends (a request); returns ``"drop"``
      (forward it, then swallow the backend's reply and cut the client's connection: the
      request ran, its reply was lost), ``"hold"`` (forward it, keep the reply until
      ``release_held()``: a reply still in flight) or None (forward as usual). Meant for
      clients with one request in flight per connection (redis-py outside pipelines).
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, latency: float = 0.0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0  # chosen by the OS on the first start, kept for restarts
        self.latency = latency
        self.delayed = 0
        self.intercept: Callable[[bytes], str | None] | None = None
        self.replies_dropped = 0
        self.replies_held = 0
        self._release = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def release_held(self) -> None:
        """Let every held reply go (to a client still listening), and the next ones pass."""
        self._release.set()

    @property
    def running(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        assert self._server is None, "already running"
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in list(self._writers):
            writer.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> TcpProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._forward(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers = [writer]
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            writers.append(up_writer)
            self._writers.add(up_writer)
            link = _Link()
            await asyncio.gather(
                _pipe(reader, up_writer, proxy=self, link=link, request=True),
                _pipe(up_reader, writer, proxy=self, link=link, request=False),
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in writers:
                self._writers.discard(w)
                w.close()
            for w in writers:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await w.wait_closed()


@dataclass
class _Link:
    """One proxied connection: what to do with the reply to an intercepted request."""

    reply_action: str | None = None


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    proxy: TcpProxy | None = None,
    link: _Link | None = None,
    request: bool = False,
) -> None:
    try:
        while data := await reader.read(65536):
            if proxy is not None and link is not None:
                if proxy.latency > 0:
                    proxy.delayed += 1
                    try:
                        await asyncio.sleep(proxy.latency)
                    finally:
                        proxy.delayed -= 1
                if request and proxy.intercept is not None:
                    action = proxy.intercept(data)
                    if action is not None:
                        link.reply_action = action  # before the request can be answered
                elif not request and link.reply_action is not None:
                    action, link.reply_action = link.reply_action, None
                    if action == "drop":
                        proxy.replies_dropped += 1
                        writer.transport.abort()  # the client sees its connection cut
                        return
                    if action == "hold":
                        proxy.replies_held += 1
                        await proxy._release.wait()
                        if writer.is_closing():
                            return
            writer.write(data)
            await writer.drain()
    finally:
        if writer.can_write_eof() and not writer.is_closing():
            with contextlib.suppress(OSError):
                writer.write_eof()  # half-close: the other direction may still be talking


class GatedK8s(FakeK8sPodClient):
    """Deploys wait for ``gate`` before they start: a test sees a deploy in flight for as
    long as it needs to."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def deploy(self, **kwargs: Any) -> PodDeployInfo:
        await self.gate.wait()
        return await super().deploy(**kwargs)


def url_of(redis: Redis) -> str:
    """The URL of a real Redis fixture's server (the one server's claimed db, the Sentinel
    set's, or the cluster): what a replica built as the service builds it is given."""
    if redis_client.is_cluster(redis):
        return CLUSTER_URL
    if isinstance(redis.connection_pool, SentinelConnectionPool):
        return sentinel_url()
    return real_redis_url()


def other_client(redis: Redis) -> Redis:
    """A second connection to the same Redis (another replica): same fake server, the same
    real server and db, the same cluster, or the same Sentinel set's master and db."""
    if redis_client.is_cluster(redis):
        return topology_client(CLUSTER_URL)
    if isinstance(redis.connection_pool, SentinelConnectionPool):
        return topology_client(sentinel_url())
    kwargs = redis.connection_pool.connection_kwargs
    if "server" in kwargs:  # fakeredis
        import fakeredis

        return fakeredis.FakeAsyncRedis(server=kwargs["server"], decode_responses=True)
    return Redis.from_url(
        real_redis_url(), decode_responses=True, socket_connect_timeout=TEST_CONNECT_TIMEOUT
    )


def spelled(placement: RoutePlacement) -> list[Any]:
    """A ``route_place`` answer as route_place.lua's reply spells it (its header): how the
    script tests write what they expect, e.g. ``["scope_full", ""]``. A replay's stored answer
    comes back without its request binding (``SessionState`` takes it out)."""
    if placement.action is Placement.REPLAY:
        return ["replay", json.dumps(placement.replayed)]
    if placement.action in PLACING:
        return [
            placement.action.value,
            placement.pod_id,
            placement.pod_sse_url,
            placement.previous_pod_id,
        ]
    if placement.action is Placement.SCOPE_FULL:
        return ["scope_full", "1" if placement.reserved else ""]
    return [placement.action.value]


def run_redis_state_machine(
    backend: str,
    machine: Callable[[asyncio.AbstractEventLoop, Redis], Any],
    *,
    steps: int,
    examples: int = 100,
) -> None:
    """Run a Hypothesis ``RuleBasedStateMachine`` whose rules drive an async Redis client on a
    loop of their own: fakeredis, the real Redis db this process claimed (flushed after, still
    ours), the Sentinel set's master (a claimed db, likewise) or the cluster (owned by this
    run, emptied after)."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    async def connect() -> Redis:
        if backend == "fake":
            import fakeredis

            return fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
        if backend == "cluster":
            return await claim_cluster_whole()
        if backend == "sentinel":
            return await claim_sentinel()
        return await claim_real_redis()

    async def release(client: Redis) -> None:
        if backend == "cluster":
            await release_cluster_whole(client)
        if backend in ("real", "sentinel"):
            owner = await client.get(CLAIM_KEY)
            async with client.pipeline(transaction=True) as pipe:
                pipe.flushdb()
                pipe.set(CLAIM_KEY, owner)
                await pipe.execute()
        await client.aclose()

    loop = asyncio.new_event_loop()
    try:
        client = loop.run_until_complete(connect())
        try:
            run_state_machine_as_test(
                lambda: machine(loop, client),
                settings=settings(
                    max_examples=examples,
                    stateful_step_count=steps,
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow],
                ),
            )
        finally:
            loop.run_until_complete(release(client))
    finally:
        loop.close()


# --- which backends a test runs on (the redis and sql_backend fixtures, indirectly) ------------

both_redis_server_dbs = pytest.mark.parametrize(
    ("redis", "sql_backend"),
    [("real", "mariadb"), ("real", "postgresql"), ("fake", "sqlite")],
    indirect=True,
)
real_mariadb_and_fake = pytest.mark.parametrize(
    ("redis", "sql_backend"), [("real", "mariadb"), ("fake", "sqlite")], indirect=True
)
real_postgresql_and_fake = pytest.mark.parametrize(
    ("redis", "sql_backend"), [("real", "postgresql"), ("fake", "sqlite")], indirect=True
)
real_only = pytest.mark.parametrize(("redis", "sql_backend"), [("real", "mariadb")], indirect=True)
fake_only = pytest.mark.parametrize(("redis", "sql_backend"), [("fake", "sqlite")], indirect=True)


async def deploy_locks(client: Redis, scope_id: str) -> dict[str, str]:
    """The scope's cold deploys' locks held now: deploy id -> the leader's token."""
    prefix = f"resource_manager:lock:rm:deploy:{{{scope_id}}}:"
    keys = sorted(await redis_keys(client, f"{prefix}*"))
    values = await client.mget(keys) if keys else []
    return {k[len(prefix) :]: v for k, v in zip(keys, values, strict=True) if v is not None}


async def follower_seats(client: Redis, scope_id: str) -> list[str]:
    """Every seat in the scope's follower rooms (one room per cold deploy), live or not."""
    seats: list[str] = []
    pattern = f"resource_manager:resource:scope:{{{scope_id}}}:deploy_followers:*"
    for room in sorted(await redis_keys(client, pattern)):
        seats += await client.zrange(room, 0, -1)
    return sorted(seats)


async def redis_state(client: Redis) -> dict[str, Any]:
    """Every key of both modules with its type and value, to compare."""
    state: dict[str, Any] = {}
    async for key in client.scan_iter(match="*"):
        if not key.startswith((SM_KEY_PREFIX, RM_KEY_PREFIX)):
            continue
        kind = await client.type(key)
        if kind == "string":
            value: Any = await client.get(key)
        elif kind == "hash":
            value = await client.hgetall(key)
        elif kind == "set":
            value = sorted(await client.smembers(key))
        elif kind == "zset":
            value = await client.zrange(key, 0, -1, withscores=True)
        elif kind == "list":
            value = await client.lrange(key, 0, -1)
        else:
            value = kind
        state[key] = (kind, value)
    return state


async def session_hashes(redis: Redis, session_id: str = "*") -> list[str]:
    """The session's hash keys in any scope (``session:{<sid>}:<session_id>``, by SCAN): for a
    test that does not know, or checks, which scope holds a session."""
    pattern = f"session_manager:session:{{*}}:{session_id}"
    return sorted([str(k) async for k in redis.scan_iter(match=pattern, count=1000)])


def session_id_of(key: str) -> str:
    """The session id of a ``session:{<sid>}:<session_id>`` key."""
    return key.partition("}:")[2]


async def shard_message(pubsub: Any, within: float) -> dict[str, Any] | None:
    """The next message of a pub/sub SSUBSCRIBEd to shard channels (the scripts SPUBLISH):
    a cluster's pub/sub reads them per node (``get_sharded_message``), any other one as usual;
    subscribe confirmations included."""
    if isinstance(pubsub, ClusterPubSub):
        message: dict[str, Any] | None = await pubsub.get_sharded_message(timeout=within)
        return message
    return cast(dict[str, Any] | None, await pubsub.get_message(timeout=within))


# --- a private Redis server -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """A ``redis-server`` of one test on a free loopback port (the shared Redis is never
    reconfigured), stopped by PID: through the ``private_redis`` fixture, which stops it."""

    def __init__(self, tmp: Path, *args: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            message = "redis-server is not installed (scripts/services.sh installs it)"
            if IN_CI:
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
        self.port = free_port()
        cmd = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(tmp), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server on {self.port} did not start") from None
                time.sleep(0.05)

    def client(self) -> Redis:
        return Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
