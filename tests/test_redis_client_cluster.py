"""The service's cluster client (``redis_client.GatedCluster``) under bursts, on the tests'
Redis Cluster: fresh clients that get ~100 commands at once, and connections the server
closes while commands are in flight. Every command is answered; none fails with redis-py's
``'NoneType' object has no attribute 'writelines'``.

Two faults of redis-py 8.1's asyncio cluster client, each seen here without its remedy:
- a command picks its route before the client's first ``initialize()``: on a client without
  a slot map, EVALSHA goes to a random master, MOVED comes back, and every 5th MOVED the
  client closes all its connections, those of the commands in flight too (every round
  failed without ``GatedCluster``'s ``initialize()`` first);
- after a connection error a node disconnects its idle connections while they stay in its
  free list: a command that takes one meanwhile writes through a writer set to ``None``
  (about a third of the rounds failed without ``_WriteGuard``).

Bounded: each round has a deadline, the rounds a fixed count.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import uuid
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from agent_runtime import lua
from helpers import CLUSTER_URL, topology_client

pytestmark = pytest.mark.real_backend

ROUND = 15.0  # seconds a round may take: ~0.3 s here, far above it on a loaded 2-core box
LIMIT = 7


def named_client(name: str) -> Redis:
    """The service's client for the tests' cluster whose connections carry ``name`` (CLIENT
    LIST): RedisCluster makes its nodes' connections from ``connection_kwargs``."""
    client = topology_client(CLUSTER_URL)
    client.connection_kwargs["client_name"] = name  # type: ignore[attr-defined]
    return client


async def burst(
    clients: list[Redis], room: str, calls: int = 100, repeat: int = 1
) -> collections.Counter[str]:
    """``calls`` seat_gate calls at once and a ZCARD per four, spread over ``clients``, each
    caller ``repeat`` times in a row; the errors by kind (a round is clean when it is empty)."""
    gates = [lua.register(c, lua.SHARED, "seat_gate") for c in clients]
    errors: collections.Counter[str] = collections.Counter()

    async def call(i: int) -> None:
        for _ in range(repeat):
            try:
                if i % 5 == 4:
                    await clients[i % len(clients)].zcard(room)
                else:
                    await gates[i % len(gates)](keys=[room], args=[f"m{i % 80}", 30, LIMIT])
            except Exception as exc:
                errors[f"{type(exc).__name__}: {exc}"] += 1

    async with asyncio.timeout(ROUND):
        await asyncio.gather(*(call(i) for i in range(calls + calls // 4)))
    return errors


@pytest.mark.parametrize("clients", [1, 4])
async def test_fresh_cluster_clients_serve_a_burst_of_first_commands(
    redis_cluster: Redis, cluster_tag: str, clients: int
) -> None:
    """Ten rounds, each of new clients whose first commands are a burst of 125: every
    command is answered, the room holds exactly its limit."""
    failed: list[collections.Counter[str]] = []
    for round_ in range(10):
        room = f"agent_runtime_test:{{{cluster_tag}}}:room{round_}"
        fresh = [topology_client(CLUSTER_URL) for _ in range(clients)]
        try:
            errors = await burst(fresh, room)
        finally:
            for client in fresh:
                await client.aclose()
        if errors:
            failed.append(errors)
        else:
            assert await redis_cluster.zcard(room) == LIMIT
    assert not failed, f"{len(failed)} of 10 rounds failed: {failed[:3]}"


async def test_connections_closed_under_a_burst_are_reconnected_and_retried(
    redis_cluster: Redis, cluster_tag: str
) -> None:
    """Fifteen rounds: four warm clients under a burst (five calls in a row from each of 125
    callers) while the server closes their
    connections (CLIENT KILL of this test's connections only, every 10 ms). A command whose
    connection was closed is retried on a new one: none fails but as a connection lost over
    and over fails (a ConnectionError once its retries are spent), never with an error no
    retry catches."""
    name = f"agent-runtime-test-{uuid.uuid4().hex[:12]}"
    admin = redis_cluster if isinstance(redis_cluster, RedisCluster) else None
    assert admin is not None
    not_retried: list[collections.Counter[str]] = []
    kills = [0]

    async def killer(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(0.01)
            for node in admin.get_primaries():
                for entry in await admin.client_list(target_nodes=node):  # type: ignore[arg-type]
                    if entry.get("name") == name:
                        with contextlib.suppress(Exception):  # gone already
                            await admin.execute_command(
                                "CLIENT", "KILL", "ID", entry["id"], target_nodes=node
                            )
                            kills[0] += 1

    for round_ in range(15):
        room = f"agent_runtime_test:{{{cluster_tag}}}:kill{round_}"
        warm = [named_client(name) for _ in range(4)]
        stop = asyncio.Event()
        task: asyncio.Task[Any] | None = None
        try:
            for client in warm:
                await client.zcard(room)  # a slot map and a connection each
            task = asyncio.create_task(killer(stop))
            errors = await burst(warm, room, repeat=5)
        finally:
            stop.set()
            if task is not None:
                await task
            for client in warm:
                await client.aclose()
        unexpected = {k: n for k, n in errors.items() if not k.startswith("ConnectionError")}
        if unexpected:
            not_retried.append(collections.Counter(unexpected))
    assert kills[0] > 0, "the server never closed a connection of the test's"
    assert not not_retried, f"{len(not_retried)} of 15 rounds: {not_retried[:3]}"
