"""Shared fixtures: every Redis test on fakeredis AND the real Redis, every DB test on SQLite,
MariaDB AND PostgreSQL.

Isolation: real Redis tests use their own db index (default 13), claimed with a marker key; a
db that holds keys without our marker is refused, never flushed. SQL tests create their own
database per run and drop it at the end. With ``CI=true`` an unreachable backend fails the
run; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import fakeredis
import pytest
from redis.asyncio import Redis
from sqlalchemy import create_engine

from agent_runtime.db import schema
from agent_runtime.db.engine import Database
from agent_runtime.db.tables import routing_rule, service_config_template
from helpers import SqlBackend, claim_real_redis, make_sql_backend


@pytest.fixture(params=["fake", "real"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[Redis]:
    """A clean Redis (decode_responses=True): in-process fakeredis, or the real server."""
    if request.param == "fake":
        client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
        yield client
        await client.aclose()
        return
    client = await claim_real_redis()
    try:
        yield client
    finally:
        await client.flushdb()
        await client.aclose()


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

        await database.write(wipe)
        await database.close()
