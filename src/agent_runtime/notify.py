"""One shared pub/sub connection per replica, fanned out to waiting tasks in process.

A waiter calls ``listen(channel)`` BEFORE it checks the state it waits for, then
``wait(timeout)``: a signal published between the check and the wait is not lost. Signals are
hints, never the truth: the waiter always re-checks the state (and polls it as a safety net),
so a lost message costs at most one poll interval. The reader task subscribes to patterns
given at start, so no per-request SUBSCRIBE ever runs on the shared connection.

The topologies (redis_client.py): on one server and on a Sentinel set's master the
connection comes from the client's pool (after a failover, the reconnect asks the sentinels
and subscribes on the new master; a demoted master's connection is killed by the sentinels or
fails its next read). On a Redis Cluster a PUBLISH reaches every node over the cluster bus, so
the patterns are subscribed on one node, taken at random at each (re)connect: a node that
died is left for another. That costs each publish a broadcast to every node; the sharded
SPUBLISH/SSUBSCRIBE form (one node per wake-up) is a later step of the cluster work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import cast

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from agent_runtime.redis_client import is_cluster

log = logging.getLogger(__name__)


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
            await asyncio.wait_for(self._event.wait(), within)
        except TimeoutError:
            return False
        self._event.clear()
        return True


class Notifier:
    def __init__(self, redis: Redis, *, patterns: list[str]) -> None:
        self._redis = redis
        self._patterns = patterns
        self._listeners: dict[str, set[Listener]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="notifier")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), 5.0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    @property
    def connected(self) -> bool:
        """Subscribed now: signals reach the listeners (else they wake by their poll)."""
        return self._ready.is_set()

    async def publish(self, channel: str, payload: str = "") -> None:
        await self._redis.publish(channel, payload)

    @contextlib.asynccontextmanager
    async def listen(self, channel: str) -> AsyncIterator[Listener]:
        listener = Listener()
        self._listeners[channel].add(listener)
        try:
            yield listener
        finally:
            listeners = self._listeners.get(channel)
            if listeners is not None:
                listeners.discard(listener)
                if not listeners:
                    del self._listeners[channel]

    async def _run(self) -> None:
        while True:  # reconnect after a Redis outage; waiters keep polling meanwhile
            pubsub = None
            try:
                pubsub = await self._pubsub()
                await pubsub.psubscribe(*self._patterns)
                self._ready.set()
                while not self._master_moved(pubsub):
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "pmessage":
                        self._dispatch(str(message["channel"]), str(message["data"]))
                log.info("notifier: the sentinels name another master; subscribing there")
                continue  # (finally closes the old connection)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._ready.clear()  # until resubscribed, waiters rely on their poll
                log.warning("notifier: pub/sub connection lost (%s); reconnecting", exc)
                await asyncio.sleep(0.5)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()

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

    async def _pubsub(self) -> PubSub:
        """A pub/sub of its own: the pool's (one server, Sentinel), or one cluster node's."""
        if is_cluster(self._redis):
            cluster = cast(RedisCluster, self._redis)
            await cluster.initialize()  # re-reads the slot map after a failure (else a no-op)
            return cluster.pubsub(node=cluster.get_random_node(), ignore_subscribe_messages=True)
        return self._redis.pubsub(ignore_subscribe_messages=True)

    def _dispatch(self, channel: str, payload: str) -> None:
        for listener in list(self._listeners.get(channel, ())):
            listener.deliver(payload)
