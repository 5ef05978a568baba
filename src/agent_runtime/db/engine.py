"""A synchronous SQLAlchemy engine whose calls run on a bounded thread pool.

Hazard: every DB call blocks its thread, so nothing here may be called on the event loop
directly; ``Database.run`` is the only way in. The pool has as many threads as connections,
so a slow DB queues callers instead of starving the loop. Config tables are tiny and read
only on a resolve-cache miss, so sync drivers (pymysql, psycopg, sqlite3) are enough.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import Connection, create_engine, event
from sqlalchemy.engine import Engine, make_url

T = TypeVar("T")

_DRIVER_OF = {
    "mysql": "mysql+pymysql",
    "mariadb": "mariadb+pymysql",
    "postgresql": "postgresql+psycopg",
}


def normalize_url(url: str) -> str:
    """Give bare ``mysql://`` / ``postgresql://`` URLs the drivers this package installs."""
    parsed = make_url(url)
    if parsed.drivername in _DRIVER_OF:
        parsed = parsed.set(drivername=_DRIVER_OF[parsed.drivername])
    return parsed.render_as_string(hide_password=False)


def build_engine(url: str, *, pool_size: int = 8, connect_timeout: int = 5) -> Engine:
    """An engine tuned for a long-running service: pre-ping, recycle, bounded connect time."""
    url = normalize_url(url)
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": connect_timeout}
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    connect_args: dict[str, Any] = {"connect_timeout": connect_timeout}
    if backend in ("mysql", "mariadb"):
        connect_args.update(read_timeout=30, write_timeout=30, charset="utf8mb4")
    return create_engine(
        url,
        pool_size=pool_size,
        max_overflow=0,
        pool_timeout=10,
        pool_pre_ping=True,
        pool_recycle=1800,
        connect_args=connect_args,
    )


class Database:
    """The engine plus the thread pool its calls run on."""

    def __init__(self, engine: Engine, *, threads: int = 8) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="db")
        # (op, seconds, ok) for every read/write, queueing for a thread included (metrics)
        self.observe: Callable[[str, float, bool], None] | None = None

    @classmethod
    def from_url(cls, url: str, *, pool_size: int = 8, connect_timeout: int = 5) -> Database:
        engine = build_engine(url, pool_size=pool_size, connect_timeout=connect_timeout)
        return cls(engine, threads=pool_size)

    @property
    def backend(self) -> str:
        return self.engine.dialect.name

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the DB thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    async def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` in a connection (no transaction commit needed)."""

        def _call() -> T:
            with self.engine.connect() as conn:
                return fn(conn)

        return await self._observed("read", _call)

    async def write(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` in one transaction, committed on success, rolled back on error."""

        def _call() -> T:
            with self.engine.begin() as conn:
                return fn(conn)

        return await self._observed("write", _call)

    def observed(self, observe: Callable[[str, float, bool], None]) -> Database:
        """The same engine and threads, each read/write reported to ``observe`` (one app's
        metrics; the original stays unobserved and is the one to close)."""
        clone = copy.copy(self)
        clone.observe = observe
        return clone

    async def _observed(self, op: str, call: Callable[[], T]) -> T:
        if self.observe is None:
            return await self.run(call)
        started = time.perf_counter()
        try:
            result = await self.run(call)
        except BaseException:
            self.observe(op, time.perf_counter() - started, False)
            raise
        self.observe(op, time.perf_counter() - started, True)
        return result

    async def ping(self) -> None:
        await self.read(lambda conn: conn.exec_driver_sql("SELECT 1").scalar())

    async def close(self) -> None:
        await self.run(self.engine.dispose)
        self._executor.shutdown(wait=False, cancel_futures=True)
