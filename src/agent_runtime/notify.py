"""Sharded pub/sub wake-ups, fanned out to waiting tasks in process.

A waiter calls ``listen(channel)`` BEFORE it checks the state it waits for, then
``wait(timeout)``: a signal published between the check and the wait is not lost (the first
listener of a channel on this replica waits, at most ``SUBSCRIBE_WAIT``, for its
``SSUBSCRIBE`` to be confirmed before it goes on). Signals are hints, never the truth: the
waiter always re-checks the state (and polls it as a safety net: the routes' queue every
0.5 s, the deploy followers every 0.25 s), so a lost message costs at most one poll interval.

Every topology speaks one form, sharded pub/sub (Redis >= 7.0): the scripts and ``publish``
send ``SPUBLISH`` on the scope's channel, whose hash tag is the scope's, and this notifier
``SSUBSCRIBE``s each channel that has a listener here, refcounted (the last listener that
leaves unsubscribes it; a pattern cannot be sharded). On a Redis Cluster a channel lives on
the node that owns its slot: one connection per such node (a ``_Shard``), closed once it has
had no channel for ``SHARD_IDLE`` s; a wake-up costs that node only, where a ``PUBLISH`` went
to every node over the cluster bus. On one server and on a Sentinel set's master there is one
shard, on a connection of the client's pool.

The hazard is a deaf waiter. Each shard's reader resubscribes everything after its
connection failed (CLIENT KILL, a master killed: the slot map is read again and each channel
goes to the node that owns it now), moves a channel whose slot the client's map gives to
another node (a slot migration, a failover), takes an unasked ``SUNSUBSCRIBE`` (the server
dropped the channel: its slot left that node) as the sign to read the map again, and on a
Sentinel set follows the master the pool names. Meanwhile the waiters poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import SlotNotCoveredError

from agent_runtime import logs
from agent_runtime.redis_client import is_cluster

log = logging.getLogger(__name__)

# the first listener of a channel waits at most this long for its SSUBSCRIBE to be confirmed
# (a connected shard answers in a round trip); past it, it relies on its poll
SUBSCRIBE_WAIT = 1.0
READ_TIMEOUT = 1.0  # a shard's reader looks at its slot map, master and idleness this often
RECONNECT_PAUSE = 0.5
SHARD_IDLE = 10.0  # a shard without a channel keeps its connection this long
SINGLE = ""  # the one shard's name on one server or a Sentinel set


class Listener:
    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.payloads: list[str] = []

    def deliver(self, payload: str) -> None:
        self.payloads.append(payload)
        self._event.set()

    async def wait(self, within: float) -> bool:
        """True if a signal arrived (since the last wait), False on timeout."""
        try:
            async with asyncio.timeout(within):  # (3.11's wait_for can swallow a cancel)
                await self._event.wait()
        except TimeoutError:
            return False
        self._event.clear()
        return True


async def _first_of(*events: asyncio.Event, within: float) -> None:
    """Until one of the events is set, at most ``within`` seconds."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


class _Channel:
    """A channel with listeners here; ``subscribed`` once its shard's server confirmed it."""

    def __init__(self) -> None:
        self.listeners: set[Listener] = set()
        self.subscribed = asyncio.Event()
        self.routed = False  # given to a shard (once; a slot that moves takes it elsewhere)
        self.shard = SINGLE


class _Shard:
    """One connection, SSUBSCRIBEd to the wanted channels of one node (or of the server).

    ``wanted``: the channels with listeners routed here; ``confirmed``: those the server
    confirmed; ``sent``: (S)SUBSCRIBE/SUNSUBSCRIBE commands per channel not yet answered (the
    replies come in order, so a channel is in step once its count is back to 0)."""

    def __init__(self, name: str, node: ClusterNode | None) -> None:
        self.name = name
        self.node = node
        self.wanted: set[str] = set()
        self.confirmed: set[str] = set()
        self.sent: dict[str, int] = {}
        self.pubsub: PubSub | None = None
        self.lock = asyncio.Lock()  # one writer at a time on the connection
        self.refresh = False  # read the cluster's slot map again (an unasked SUNSUBSCRIBE)
        self.failing = False  # its last connection failed: until one works, nobody waits on it
        self.failed = asyncio.Event()  # set with ``failing``: wakes the listeners waiting on it
        self.idle_since = 0.0
        self.task: asyncio.Task[None] | None = None
        self.syncer: asyncio.Task[None] | None = None  # a listener's (un)subscribe, sent
        self.again = False  # wanted changed while the syncer ran: once more

    @property
    def ready(self) -> bool:
        return self.pubsub is not None


class Notifier:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._channels: dict[str, _Channel] = {}
        self._shards: dict[str, _Shard] = {}
        self._stopped = False

    async def start(self) -> None:
        """Nothing to connect yet: a shard connects when a channel is first listened to."""
        self._stopped = False

    async def stop(self) -> None:
        self._stopped = True
        shards = list(self._shards.values())
        self._shards.clear()
        for shard in shards:
            for task in (shard.syncer, shard.task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task

    @property
    def connected(self) -> bool:
        """Every shard that has channels is subscribed now: signals reach the listeners (else
        they wake by their poll). True with no channel listened to."""
        return all(shard.ready for shard in self._shards.values() if shard.wanted)

    def subscriptions(self) -> dict[str, frozenset[str]]:
        """Shard (node ``host:port``, ``""`` off a cluster) → the channels its server
        confirmed."""
        return {name: frozenset(s.confirmed) for name, s in self._shards.items() if s.confirmed}

    async def publish(self, channel: str, payload: str = "") -> None:
        await self._redis.spublish(channel, payload)

    @contextlib.asynccontextmanager
    async def listen(self, channel: str) -> AsyncIterator[Listener]:
        listener = Listener()
        entry = self._channels.get(channel)
        if entry is None:
            entry = self._channels[channel] = _Channel()
        entry.listeners.add(listener)
        try:
            if not entry.routed:
                await self._want(channel, entry)
            shard = self._shards.get(entry.shard)
            if shard is not None and not shard.failing and not entry.subscribed.is_set():
                await _first_of(entry.subscribed, shard.failed, within=SUBSCRIBE_WAIT)
            yield listener
        finally:
            entry.listeners.discard(listener)
            if not entry.listeners and self._channels.get(channel) is entry:
                del self._channels[channel]
                shard = self._shards.get(entry.shard)
                if shard is not None:
                    shard.wanted.discard(channel)
                    if not shard.wanted:
                        shard.idle_since = asyncio.get_running_loop().time()
                    self._kick(shard)

    # --- routing -------------------------------------------------------------------------

    async def _want(self, channel: str, entry: _Channel) -> None:
        if is_cluster(self._redis):
            await cast(RedisCluster, self._redis).initialize()  # a no-op once it has a map
        if entry.routed:  # another listener routed it meanwhile
            return
        try:
            shard = self._shard_for(channel)
        except SlotNotCoveredError:  # a moment of a failover: the next listener tries again
            return
        entry.routed, entry.shard = True, shard.name
        shard.wanted.add(channel)
        self._kick(shard)

    def _kick(self, shard: _Shard) -> None:
        """Sync the shard's subscriptions soon, in a task of the notifier's: the listener's
        task never writes on the connection (redis-py swallows a cancellation that lands in
        a pub/sub send: the waiter would not stop)."""
        if shard.syncer is None or shard.syncer.done():
            shard.syncer = logs.detached_task(self._sync_soon(shard), name="notifier-sync")
        else:
            shard.again = True

    async def _sync_soon(self, shard: _Shard) -> None:
        while True:
            shard.again = False
            with contextlib.suppress(Exception):  # the reader resubscribes after a failure
                await self._sync(shard)
            if not shard.again:
                return

    def _shard_for(self, channel: str) -> _Shard:
        name, node = SINGLE, None
        if is_cluster(self._redis):
            node = cast(RedisCluster, self._redis).get_node_from_key(channel)
            if node is None:
                raise SlotNotCoveredError(f"no node owns the slot of {channel}")
            name = node.name
        shard = self._shards.get(name)
        if shard is None or shard.task is None or shard.task.done():
            old, shard = shard, _Shard(name, node)
            self._shards[name] = shard
            shard.wanted = set(old.wanted) if old is not None else set()
            shard.idle_since = asyncio.get_running_loop().time()
            if not self._stopped:
                # the reader outlives the route whose listen started it
                shard.task = logs.detached_task(self._run(shard), name=f"notifier:{name}")
        return shard

    def _reroute(self, shard: _Shard) -> None:
        """Cluster: the channels whose slot the client's map gives to another node now go
        there (a slot migrated, a replica promoted); this shard unsubscribes them."""
        if shard.node is None:
            return
        cluster = cast(RedisCluster, self._redis)
        for channel in list(shard.wanted):
            try:
                owner = cluster.get_node_from_key(channel)
            except Exception:  # the slot uncovered for a moment: look again later
                continue
            if owner is None or owner.name == shard.name:
                continue
            shard.wanted.discard(channel)
            entry = self._channels.get(channel)
            if entry is None:
                continue
            entry.subscribed.clear()
            target = self._shard_for(channel)
            entry.shard = target.name
            target.wanted.add(channel)
            log.info("notifier: %s moved from %s to %s", channel, shard.name, target.name)
        if not shard.wanted:
            shard.idle_since = asyncio.get_running_loop().time()

    # --- one shard's connection ----------------------------------------------------------

    async def _sync(self, shard: _Shard) -> None:
        """Bring the server's subscriptions in step with ``wanted``: subscribe what is missing,
        unsubscribe what is left; a channel with a command in flight waits for its reply.
        One channel per command: on a cluster two channels of different slots are CROSSSLOT."""
        async with shard.lock:
            connection = shard.pubsub.connection if shard.pubsub is not None else None
            # written on the connection as it is, never reconnected from here (PubSub's own
            # commands reconnect on a failed send, racing the reader that closes it)
            if connection is None or not connection.is_connected:
                return
            for command, channels in (
                ("SSUBSCRIBE", shard.wanted - shard.confirmed),
                ("SUNSUBSCRIBE", shard.confirmed - shard.wanted),
            ):
                for channel in sorted(channels):
                    if not shard.sent.get(channel):
                        shard.sent[channel] = 1
                        await connection.send_command(command, channel, check_health=False)

    def _handle(self, shard: _Shard, message: dict[str, Any]) -> None:
        kind, channel = message.get("type"), str(message.get("channel"))
        if kind == "smessage":
            entry = self._channels.get(channel)
            if entry is not None:
                for listener in list(entry.listeners):
                    listener.deliver(str(message["data"]))
            return
        if kind not in ("ssubscribe", "sunsubscribe"):
            return
        asked = shard.sent.get(channel, 0)
        if asked > 1:
            shard.sent[channel] = asked - 1
        else:
            shard.sent.pop(channel, None)
        if kind == "ssubscribe":
            shard.confirmed.add(channel)
            entry = self._channels.get(channel)
            if not shard.sent.get(channel) and channel in shard.wanted and entry is not None:
                entry.subscribed.set()
            return
        shard.confirmed.discard(channel)
        if not asked and channel in shard.wanted:
            # not ours: the server dropped the channel (its slot left this node)
            entry = self._channels.get(channel)
            if entry is not None:
                entry.subscribed.clear()
            shard.refresh = True

    async def _run(self, shard: _Shard) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopped:
            pubsub: PubSub | None = None
            pool: ConnectionPool | None = None  # (the connection's own)
            try:
                pubsub, pool = await self._connect(shard)
                async with shard.lock:
                    shard.confirmed.clear()
                    shard.sent.clear()
                    shard.pubsub = pubsub
                    shard.failing = False
                    shard.failed.clear()
                await self._sync(shard)
                # (the flag too: fakeredis absorbs a cancellation that lands in a read)
                while not self._stopped and not self._master_moved(pubsub):
                    if shard.refresh:
                        shard.refresh = False
                        await self._read_slot_map()
                    self._reroute(shard)
                    if not shard.wanted and loop.time() - shard.idle_since >= SHARD_IDLE:
                        if self._shards.get(shard.name) is shard:
                            del self._shards[shard.name]  # (no await since the check)
                        return
                    await self._sync(shard)
                    message = await pubsub.get_message(timeout=READ_TIMEOUT)
                    if message is not None:
                        self._handle(shard, message)
                if self._stopped:
                    return
                log.info("notifier: the sentinels name another master; subscribing there")
                self._drop_connection(shard)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._drop_connection(shard)
                shard.failing = True
                shard.failed.set()  # its first listeners stop waiting: Redis is away, they poll
                log.warning(
                    "notifier: pub/sub connection %s lost (%s); resubscribing",
                    shard.name or "to the server",
                    exc,
                )
                await asyncio.sleep(RECONNECT_PAUSE)
                with contextlib.suppress(Exception):
                    await self._read_slot_map()
                self._reroute(shard)
                if not shard.wanted and shard.node is not None:  # (a dead node's shard)
                    if self._shards.get(shard.name) is shard:
                        del self._shards[shard.name]
                    return
            finally:
                self._drop_connection(shard)
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
                if pool is not None:
                    with contextlib.suppress(Exception):
                        await pool.aclose()

    def _drop_connection(self, shard: _Shard) -> None:
        shard.pubsub = None
        shard.confirmed.clear()
        shard.sent.clear()
        for channel in shard.wanted:  # until resubscribed, their waiters rely on their poll
            entry = self._channels.get(channel)
            if entry is not None:
                entry.subscribed.clear()

    async def _connect(self, shard: _Shard) -> tuple[PubSub, ConnectionPool]:
        """A connection of the shard's own, outside the client's pool: to the shard's node, to
        the server, or to the master the sentinels name now; with no retry of its own (a
        failure is this reader's to handle: it resubscribes per channel, where redis-py's
        reconnect would send them all in one SSUBSCRIBE, CROSSSLOT on a cluster)."""
        cls: type[Any]
        if shard.node is not None:
            cls, kwargs = shard.node.connection_class, dict(shard.node.connection_kwargs)
        else:
            client_pool = self._redis.connection_pool
            cls, kwargs = client_pool.connection_class, dict(client_pool.connection_kwargs)
            if isinstance(client_pool, SentinelConnectionPool):
                host, port = await client_pool.get_master_address()
                kwargs.pop("connection_pool", None)  # a plain connection to that master
                cls = SSLConnection if issubclass(cls, SSLConnection) else Connection
                kwargs.update(host=host, port=port)
        kwargs["retry"] = Retry(NoBackoff(), 0)
        pool = ConnectionPool(connection_class=cls, max_connections=1, **kwargs)
        pubsub = PubSub(connection_pool=pool)
        try:
            await pubsub.connect()
        except BaseException:
            await pool.aclose()
            raise
        return pubsub, pool

    async def _read_slot_map(self) -> None:
        if is_cluster(self._redis):
            await cast(RedisCluster, self._redis).nodes_manager.initialize()

    def _master_moved(self, pubsub: PubSub) -> bool:
        """Sentinel: the pool (which asks the sentinels while commands flow) names a master
        other than the one this connection is subscribed on. A demoted master goes on
        serving its subscribers, but the publishes now reach the new master, and the old
        one replicates them only once the sentinels have turned it into a replica (seconds
        later): subscribe on the new one at once."""
        pool = getattr(self._redis, "connection_pool", None)  # a RedisCluster has none
        connection = pubsub.connection
        if not isinstance(pool, SentinelConnectionPool) or connection is None:
            return False
        master = pool.master_address
        return master is not None and (connection.host, connection.port) != tuple(master)
