"""Shared fixtures: every Redis test on fakeredis AND the real Redis, every DB test on SQLite,
MariaDB AND PostgreSQL.

Isolation: real Redis tests use their own db index (default 13), claimed with a marker key; a
db that holds keys without our marker is refused, never flushed. SQL tests create their own
database per run and drop it at the end. With ``CI=true`` an unreachable backend fails the
run; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy import create_engine

import helpers
from agent_runtime.db import schema
from agent_runtime.db.engine import Database
from agent_runtime.db.tables import installation_secret, routing_rule, service_config_template
from agent_runtime.resource_manager.deploy_state import DeployState
from agent_runtime.resource_manager.pool_jobs_state import PoolJobsState
from agent_runtime.resource_manager.state import ResourceState
from helpers import (
    CLAIM_KEY,
    REDIS_URL,
    SqlBackend,
    claim_cluster,
    claim_real_redis,
    claim_sentinel,
    make_sql_backend,
    real_redis_url,
    release_cluster,
    sentinel_url,
    topology_client,
)


@pytest.fixture(scope="session", autouse=True)
def _release_real_redis() -> Iterator[None]:
    """At the end of the run, leave the claimed db as we found it: empty."""
    yield
    url = real_redis_url()
    if url == REDIS_URL and not helpers._claimed_url:
        return  # never claimed
    client = SyncRedis.from_url(url, decode_responses=True, socket_connect_timeout=2)
    try:
        if client.get(CLAIM_KEY) == f"{socket.gethostname()}:{os.getpid()}":
            client.flushdb()
    finally:
        client.close()


@pytest.fixture(scope="session", autouse=True)
def _release_sentinel_db() -> Iterator[None]:
    """At the end of the run, the Sentinel set's db this process claimed: left empty."""
    yield
    if not helpers._claimed_sentinel_url:
        return

    async def release() -> None:
        client = topology_client(sentinel_url())
        try:
            if await client.get(CLAIM_KEY) == f"{socket.gethostname()}:{os.getpid()}":
                await client.flushdb()
        finally:
            await client.aclose()

    with contextlib.suppress(Exception):
        asyncio.run(release())


# The Redis each ``redis`` test runs on; a module marked ``topologies`` (the Lua suites, the
# scenarios, the concurrency tests) runs on the Sentinel set's master and the cluster too.
REDIS_KINDS = ["fake", "real"]
TOPOLOGY_KINDS = [*REDIS_KINDS, "sentinel", "cluster"]


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # a parametrize mark, before pytest's own hooks: it takes the fixture's params' place; a
    # test that names its own redis kinds (``both_redis_server_dbs``, …) keeps them
    definition = metafunc.definition
    named = any("redis" in str(mark.args[0]) for mark in definition.iter_markers("parametrize"))
    mark = definition.get_closest_marker("topologies")
    if "redis" in metafunc.fixturenames and mark is not None and not named:
        # ``topologies(cluster=False)``: a module whose scripts are not all of one slot yet (the
        # resource manager's pod budgets, issue 17) runs on the Sentinel set only
        kinds = [k for k in TOPOLOGY_KINDS if k != "cluster" or mark.kwargs.get("cluster", True)]
        definition.add_marker(pytest.mark.parametrize("redis", kinds, indirect=True))


@pytest.fixture(scope="session", autouse=True)
def _release_cluster_lease() -> Iterator[None]:
    """At the end of the run, the cluster is free for another run at once."""
    yield
    with contextlib.suppress(Exception):
        asyncio.run(helpers.drop_cluster_lease())


@pytest.fixture(params=REDIS_KINDS)
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[Redis]:
    """A clean Redis (decode_responses=True): in-process fakeredis, or the real server; in a
    ``topologies`` module also the Sentinel set's master (a claimed db) and the cluster
    (owned by this run, emptied after the test)."""
    if request.param == "sentinel":
        async with _claimed_db(await claim_sentinel()) as client:
            yield client
        return
    if request.param == "cluster":
        client = await helpers.claim_cluster_whole()
        try:
            yield client
        finally:
            await helpers.release_cluster_whole(client)
            with contextlib.suppress(RedisTimeoutError):
                await client.aclose()
        return
    if request.param == "fake":
        client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
        yield client
        await client.aclose()
        return
    async with _claimed_db(await claim_real_redis()) as client:
        yield client


@pytest.fixture
def cluster_tag() -> str:
    """The mark of every key a cluster test writes: its hash tag (``{tag}``) or part of a
    name of its own; what ``redis_cluster`` deletes after the test."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def redis_cluster(cluster_tag: str) -> AsyncIterator[Redis]:
    """A RedisCluster client (typed as the Redis API) on the tests' cluster
    (AGENT_RUNTIME_TEST_REDIS_CLUSTER_URL; scripts/redis_topologies.sh starts it). Only db 0
    and maybe other test processes on it: never flushed; the keys with ``cluster_tag`` are
    deleted after the test."""
    client = await claim_cluster(cluster_tag)
    await helpers.hold_cluster(client)  # not while another run owns (and empties) it
    try:
        yield client
    finally:
        await release_cluster(client, cluster_tag)
        with contextlib.suppress(RedisTimeoutError):
            await client.aclose()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[type[helpers.PrivateRedis]]:
    """Start private ``redis-server``s with ``private_redis(*args)``; all stopped after."""
    started: list[helpers.PrivateRedis] = []

    class Tracked(helpers.PrivateRedis):
        def __init__(self, *args: str) -> None:
            super().__init__(tmp_path, *args)
            started.append(self)

    yield Tracked
    for server in started:
        server.stop()


@pytest.fixture
async def redis_sentinel() -> AsyncIterator[Redis]:
    """A master_for client (AGENT_RUNTIME_TEST_REDIS_SENTINEL_URL) on a db index of the
    Sentinel set's master that this process claimed (as the ``redis`` fixture's): flushed and
    marked again after the test."""
    async with _claimed_db(await claim_sentinel()) as client:
        yield client


@contextlib.asynccontextmanager
async def _claimed_db(client: Redis) -> AsyncIterator[Redis]:
    """A db this process claimed (the real server's, the Sentinel master's), kept ours for the
    next test: flushed and marked in one transaction, so that another run never finds it empty
    and unmarked for a moment and takes it too."""
    owner = await client.get(CLAIM_KEY)
    try:
        yield client
    finally:
        async with client.pipeline(transaction=True) as pipe:
            pipe.flushdb()
            pipe.set(CLAIM_KEY, owner)
            await pipe.execute()
        # closing waits up to the connect timeout (2 s) for every socket to be seen closed: on
        # a loaded machine, after a test that opened a hundred connections, that wait can run
        # out with nothing wrong (each socket was closed; the db is flushed and marked above)
        with contextlib.suppress(RedisTimeoutError):
            await client.aclose()


# the resource manager's state classes over the ``redis`` fixture (its script tests)
@pytest.fixture
def rs(redis: Redis) -> ResourceState:
    return ResourceState(redis)


@pytest.fixture
def ds(rs: ResourceState) -> DeployState:
    return DeployState(rs)


@pytest.fixture
def js(rs: ResourceState) -> PoolJobsState:
    return PoolJobsState(rs)


@pytest.fixture(scope="session", params=["sqlite", "mariadb", "postgresql"])
def sql_backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SqlBackend]:
    """An empty database (no schema) of each kind, for the whole session."""
    backend = make_sql_backend(request.param, tmp_path_factory.mktemp("sql"))
    yield backend
    backend.cleanup()


@pytest.fixture(scope="session")
def migrated_url(sql_backend: SqlBackend) -> str:
    engine = create_engine(sql_backend.url)
    schema.upgrade(engine)
    engine.dispose()
    return sql_backend.url


@pytest.fixture
async def db(migrated_url: str) -> AsyncIterator[Database]:
    """A migrated, empty config database (rows deleted after each test)."""
    database = Database.from_url(migrated_url, pool_size=4)
    try:
        yield database
    finally:

        def wipe(conn: Any) -> None:
            conn.execute(routing_rule.delete())
            conn.execute(service_config_template.delete())
            conn.execute(installation_secret.delete())

        await database.write(wipe)
        await database.close()


@pytest.fixture
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """kubernetes_asyncio honours proxy variables (trust_env) and the in-cluster host: the
    simulator is local, so a test that talks to it through the real client drops them."""
    for name in (
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
