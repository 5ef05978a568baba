"""Redis that is up but refuses writes — out of memory (``maxmemory`` with ``noeviction``) or
a read-only replica (what a client sees for a moment after a failover) — is a backend that
cannot serve now: 503 ``BACKEND_UNAVAILABLE`` with ``Retry-After``, never a 500 ``INTERNAL``.

Real servers: two private ``redis-server`` processes on free loopback ports, started here and
stopped by PID (the shared Redis is never reconfigured)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import OutOfMemoryError

from agent_runtime.db.engine import Database
from helpers import PrivateRedis, running_app
from test_faults import assert_error, configure, route


async def test_a_redis_out_of_memory_answers_503_backend_unavailable(
    private_redis: type[PrivateRedis], db: Database
) -> None:
    server = private_redis("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    redis = server.client()
    try:
        async with running_app(redis, db) as app:
            await configure(app, scope_concurrency=50, pod_concurrency=50)
            assert (await route(app, "before")).status_code == 200
            # well past maxmemory (filled to it, then the bound halved): every write, in a
            # script or not, is refused with OOM from now on
            ballast = "x" * 65536
            with pytest.raises(OutOfMemoryError):
                for i in range(200):
                    await redis.set(f"ballast:{i}", ballast)
            await redis.config_set("maxmemory", "2mb")
            resp = await route(app, "after")
            assert_error(resp, "BACKEND_UNAVAILABLE")
            assert "OOM" not in resp.text  # the library's text is for the log only
    finally:
        await redis.aclose()


async def test_a_read_only_replica_answers_503_backend_unavailable(
    private_redis: type[PrivateRedis], db: Database
) -> None:
    """What a replica sees right after a failover that its clients have not followed yet."""
    primary = private_redis()
    replica = private_redis("--replicaof", "127.0.0.1", str(primary.port))
    writer, reader = primary.client(), replica.client()
    try:
        async with running_app(writer, db) as app:  # configured through the primary
            await configure(app, scope_concurrency=50, pod_concurrency=50)
        deadline = time.monotonic() + 20
        while (await reader.info("replication"))["master_link_status"] != "up":
            assert time.monotonic() < deadline, "the replica never caught up"
            await asyncio.sleep(0.05)
        async with running_app(reader, db) as app:
            resp = await route(app, "s-1")
            assert_error(resp, "BACKEND_UNAVAILABLE")
            assert "READONLY" not in resp.text
    finally:
        await writer.aclose()
        await reader.aclose()
