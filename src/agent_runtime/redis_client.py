"""The Redis client for ``AGENT_RUNTIME_REDIS_URL``: one server, a Redis Cluster, or a master
named by a Sentinel set.

- ``redis://`` / ``rediss://`` / ``unix://``: one server (a blocking pool, as always);
- ``redis+cluster://[[user]:password@]host:port[,host:port…]`` (``rediss+cluster://`` with
  TLS): a ``RedisCluster`` over those startup nodes; it follows ``MOVED``/``ASK`` and, after a
  failover, re-reads the slot map;
- ``redis+sentinel://[[user]:password@]host:port[,host:port…]/<master_name>[/<db>]``
  (``rediss+sentinel://``: TLS to the data servers): the master the sentinels name, found
  again through them after a failover (a command on a demoted master fails, is retried once
  on the new one). The credentials are the data servers'; the sentinels are asked without.

``parse`` checks a URL without connecting (a bad one is a startup refusal naming the
setting); ``build`` makes the client. Everything else sees the ``redis.asyncio.Redis``
command API, which ``RedisCluster`` speaks too (scripts: EVALSHA, reloaded on NOSCRIPT on
whichever node or new master lacks them).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

SETTING = "AGENT_RUNTIME_REDIS_URL"
USAGE = (
    "redis://[[user]:password@]host[:port][/db], rediss://…, unix://path, "
    "redis+cluster://host:port[,host:port…] or "
    "redis+sentinel://host:port[,host:port…]/<master_name>[/<db>]"
)


class Topology(StrEnum):
    SINGLE = "single"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names. ``url`` is the URL itself (a single server's, for redis-py)."""

    topology: Topology
    url: str
    nodes: tuple[tuple[str, int], ...] = ()  # cluster startup nodes, or the sentinels
    master: str = ""  # sentinel: the master's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


_NODE = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>\d{1,5})$")
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


class RedisUrlError(ValueError):
    """A URL that names no usable Redis; the message never quotes the URL (its password)."""


def parse(url: str) -> RedisTarget:
    """The target a URL names; ``RedisUrlError`` (naming the setting and the forms) if none."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise RedisUrlError(f"{SETTING} is not a usable Redis URL: {USAGE}")
    if scheme in ("redis", "rediss", "unix"):
        from redis.asyncio.connection import parse_url

        try:
            parse_url(url)
        except (ValueError, TypeError):
            raise RedisUrlError(f"{SETTING} is not a usable Redis URL: {USAGE}") from None
        return RedisTarget(Topology.SINGLE, url)
    base, plus, kind = scheme.partition("+")
    if not plus or base not in ("redis", "rediss") or kind not in ("cluster", "sentinel"):
        raise RedisUrlError(f"{SETTING}: unknown scheme {scheme!r}: {USAGE}")
    topology = Topology(kind)
    if "?" in rest or "#" in rest:
        raise RedisUrlError(f"{SETTING}: {scheme}:// takes no query or fragment: {USAGE}")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = []
    for part in hosts.split(","):
        match = _NODE.match(part.strip())
        if match is None or not 0 < int(match["port"]) < 65536:
            raise RedisUrlError(
                f"{SETTING}: {scheme}:// needs host:port for each node (comma-separated): {USAGE}"
            )
        nodes.append((match["v6"] or match["host"], int(match["port"])))
    segments = [unquote(s) for s in path.split("/")] if path else []
    if topology is Topology.CLUSTER:
        if any(segments):
            raise RedisUrlError(
                f"{SETTING}: a Redis Cluster has only db 0: redis+cluster://host:port[,…] "
                "takes no path"
            )
        return RedisTarget(topology, url, tuple(nodes), "", 0, username, password, base == "rediss")
    if not segments or not segments[0] or len(segments) > 2 or not _NAME.match(segments[0]):
        raise RedisUrlError(
            f"{SETTING}: redis+sentinel:// needs the master's name: "
            "redis+sentinel://host:port[,host:port…]/<master_name>[/<db>]"
        )
    db = segments[1] if len(segments) == 2 else "0"
    if not db.isdigit():
        raise RedisUrlError(f"{SETTING}: the db of a redis+sentinel:// URL is a number")
    return RedisTarget(
        topology, url, tuple(nodes), segments[0], int(db), username, password, base == "rediss"
    )


@dataclass(frozen=True)
class ClientOptions:
    """How a client waits and retries: ``timeout`` bounds connect, each reply and the wait for
    a free connection; ``retries`` re-sends a command whose reply was lost (the scripts are
    replay-safe) — on a cluster, also the re-reads of the slot map after a failover."""

    max_connections: int
    timeout: float
    retries: int = 1


MASTER_CHECK = 0.5  # seconds between two questions to the sentinels while commands flow
WATCH_IDLE = 5.0  # seconds without a command after which the master watch stops (restarts on use)


class _WriteGuard:
    """A cluster connection's write that fails as a lost connection (``ConnectionError``,
    which the cluster client retries) when another task closed the connection under it.

    redis-py 8.1's cluster node disconnects its idle connections after a connection error
    (``ClusterNode.disconnect_free_connections``) while they stay in its free list, and closes
    every connection, busy ones too, when it drops its slot map (``RedisCluster.aclose`` after
    ``reinitialize_steps`` MOVED replies, or CLUSTERDOWN): a command that took such a
    connection meanwhile writes through ``self._writer`` after ``disconnect()`` set it to
    ``None``, an ``AttributeError`` that no retry catches. Here the writer is read once and
    checked (nothing was written when this raises), as upstream's fix does (redis-py #4288)."""

    _writer: asyncio.StreamWriter | None
    if TYPE_CHECKING:  # Connection's

        def _host_error(self) -> str: ...

    async def _send_packed_command(self, command: Iterable[bytes]) -> None:
        writer = self._writer
        if writer is None or writer.transport.is_closing():
            raise RedisConnectionError(
                f"the connection to {self._host_error()} was closed before the command was sent"
            )
        writer.writelines(command)
        await writer.drain()


class _ClusterConnection(_WriteGuard, Connection):
    pass


class _ClusterSSLConnection(_WriteGuard, SSLConnection):
    pass


class GatedCluster(RedisCluster):
    """A ``RedisCluster`` whose commands wait for a free connection, as the single server's
    blocking pool does. redis-py's cluster pool raises ``MaxConnectionsError`` at once when a
    node's ``max_connections`` are all busy: a burst of more concurrent routes than that would
    be answered 503 while Redis is fine. At most ``gate_size`` commands of this client are in
    flight (so no node's pool is ever short); a command waits ``gate_timeout`` s for a place,
    then fails as a Redis timeout does (503 + ``Retry-After``). A pipeline is one command to
    it (one connection per node it reaches).

    And a command reads the slot map first. redis-py 8.1's ``execute_command`` picks a
    command's route before its own ``initialize()``: with no map yet (a fresh client, or one
    whose map was dropped) EVALSHA, ZCARD and every keyed command without a fixed route go to
    a random master, which answers MOVED; every ``reinitialize_steps`` (5) MOVED replies the
    client drops its map and closes all its connections, those of the commands in flight
    too. A burst on a fresh client was a storm of MOVED and ``'NoneType' object has no
    attribute 'writelines'`` (tests/test_redis_client_cluster.py). Its connections are
    ``_WriteGuard``'s: a command whose connection another task closed is retried."""

    def __init__(self, *args: Any, gate_size: int, gate_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gate = asyncio.Semaphore(gate_size)
        self._gate_timeout = gate_timeout
        # RedisCluster takes no connection class: its nodes' connections are made from
        # connection_kwargs (the startup nodes' are already made, without connections yet)
        guarded = (
            _ClusterSSLConnection
            if self.connection_kwargs["connection_class"] is SSLConnection
            else _ClusterConnection
        )
        self.connection_kwargs["connection_class"] = guarded
        self.nodes_manager.connection_kwargs["connection_class"] = guarded
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = guarded

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self._gate_timeout):
                await self._gate.acquire()
        except TimeoutError:
            raise RedisTimeoutError(
                f"no free Redis connection within {self._gate_timeout} s"
            ) from None
        try:
            # the slot map first: redis-py picks a command's route before its own initialize()
            # (see the class), so a command on a client without a map goes to a random master
            await self.initialize()  # a no-op while the map is there; one reader at a time
            return await super().execute_command(*args, **kwargs)
        finally:
            self._gate.release()


class SentinelBlockingPool(SentinelConnectionPool, BlockingConnectionPool):
    """The sentinel's master pool, blocking: a burst waits (at most ``timeout``) for a free
    connection instead of failing at once (as the single server's pool).

    And it follows a failover on its own: redis-py's async pool keeps a connection to the
    old master until a write on it fails (READONLY), and a forced failover leaves the old
    master a master for seconds, taking writes that are then lost, and a read-only script
    served by it reads old data. So while commands flow a task of the pool's asks the
    sentinels every ``MASTER_CHECK`` seconds — off the request path: a slow or unreachable
    sentinel never holds a command up — and when they name another master, idle connections
    are dropped and a connection handed out to the old one is reconnected first."""

    _watch: asyncio.Task[None] | None = None
    _last_use = 0.0

    async def get_connection(self, *args: Any, **options: Any) -> Any:
        self._last_use = time.monotonic()
        if self._watch is None or self._watch.done():
            # often (re)started by a request's command: an empty context, not that request's
            # log ids and trace (logs.detached_task, which this bottom floor cannot import)
            self._watch = asyncio.create_task(
                self._watch_master(), name="sentinel-master-watch", context=contextvars.Context()
            )
        connection = await super().get_connection(*args, **options)
        master = self.master_address
        if master is not None and (connection.host, connection.port) != tuple(master):
            try:  # a connection of the old master's: to the new one before it is used
                await connection.disconnect()
                await self.ensure_connection(connection)
            except BaseException:
                await self.release(connection)
                raise
        return connection

    async def _watch_master(self) -> None:
        """While commands flow (one within ``WATCH_IDLE`` s), ask the sentinels which master
        they name (a change drops the idle connections: ``get_master_address``); sentinels
        out of reach: go on as we are, and ask again."""
        while time.monotonic() - self._last_use < WATCH_IDLE:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.get_master_address(), timeout=4 * MASTER_CHECK)
            await asyncio.sleep(MASTER_CHECK)

    def stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None


class SentinelMaster(Redis):
    """The master's client; closing it closes the connections to the sentinels too."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        pool = self.connection_pool
        if isinstance(pool, SentinelBlockingPool):
            pool.stop_watch()
        await super().aclose(close_connection_pool)
        if isinstance(pool, SentinelConnectionPool):
            for sentinel in pool.sentinel_manager.sentinels:
                await sentinel.aclose()


def _retry(retries: int) -> Retry:
    return Retry(ExponentialBackoff(cap=0.1, base=0.02), retries=retries)


def build(target: RedisTarget, options: ClientOptions) -> Redis:
    """The client. A ``RedisCluster`` comes back typed as ``Redis``: it speaks the same
    command API, and the state classes are written against that API."""
    common: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": options.timeout,
        "socket_connect_timeout": options.timeout,
        "health_check_interval": 0,
    }
    retry_on: list[type[Exception]] = [RedisConnectionError, RedisTimeoutError]
    if target.topology is Topology.SINGLE:
        # A blocking pool: a burst of more concurrent commands than connections waits for a
        # free one (redis-py's default pool raises at once: 503s while Redis was fine). One
        # Retry serves command, connect() and health check, so the attempts multiply: one
        # retry and no health check keep a command within 2 x 2 x timeout plus the backoff.
        pool = BlockingConnectionPool.from_url(
            target.url,
            max_connections=options.max_connections,
            timeout=options.timeout,  # the wait for a free connection
            retry=_retry(options.retries),
            retry_on_error=retry_on,
            **common,
        )
        return Redis.from_pool(pool)  # the client owns the pool: aclose() closes it
    if target.topology is Topology.CLUSTER:
        # MOVED / ASK are followed inside one call (up to 16 redirections); a connection error
        # or timeout marks the node, re-reads the slot map and retries: a master that died
        # answers again through its promoted replica once the cluster has failed it over
        # (cluster-node-timeout), within the retries' backoff or at the next call.
        cluster = GatedCluster(
            gate_size=options.max_connections,
            gate_timeout=options.timeout,
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            username=target.username,
            password=target.password,
            ssl=target.tls,
            max_connections=options.max_connections,  # per node
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=max(3, options.retries)),
            retry_on_error=retry_on,
            **common,
        )
        return cast(Redis, cluster)
    sentinel = Sentinel(
        target.nodes,
        sentinel_kwargs={
            "socket_timeout": options.timeout,
            "socket_connect_timeout": options.timeout,
            "decode_responses": True,
        },
    )
    # A demoted master answers READONLY: the connection turns it into a ConnectionError and
    # drops itself; the retry asks the sentinels again and lands on the new master.
    return sentinel.master_for(
        target.master,
        redis_class=SentinelMaster,
        connection_pool_class=SentinelBlockingPool,
        db=target.db,
        username=target.username,
        password=target.password,
        ssl=target.tls,
        max_connections=options.max_connections,
        timeout=options.timeout,
        retry=_retry(options.retries),
        retry_on_error=retry_on,
        **common,
    )


def is_cluster(redis: object) -> bool:
    return isinstance(redis, RedisCluster)


async def primaries(redis: Redis) -> list[Any]:
    """The cluster's masters (``ClusterNode``), each a ``target_nodes=`` for a command sent
    per master; empty for any other client."""
    if not isinstance(redis, RedisCluster):
        return []
    await redis.initialize()
    return list(redis.get_primaries())
