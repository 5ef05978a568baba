"""The sharded pub/sub notifier: SSUBSCRIBE per channel with listeners (refcounted), fan-out
to in-process listeners, a script's SPUBLISH as the wake-up, and resubscribing after the
connection is dropped (CLIENT KILL), on fakeredis, one real server, the Sentinel set's master
and the real cluster (a channel per master; a slot migrated under a listener)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from agent_runtime.notify import SHARD_IDLE, Notifier
from helpers import other_client

WAIT = 5.0  # the longest a delivered signal may take here; a lost one fails after it
# the scripts' wake-up: SPUBLISH of a channel in the slot of the key the script writes
SPUBLISH = (
    "redis.call('SET', KEYS[1], '1', 'EX', 60); return redis.call('SPUBLISH', KEYS[2], ARGV[1])"
)


def channel_of(tag: str, what: str = "free") -> str:
    return f"agent_runtime_test:scope:{{{tag}}}:{what}"


async def script_publish(redis: Redis, tag: str, payload: str, what: str = "free") -> int:
    """As register_pod / evict do: a script that writes a key of the scope and SPUBLISHes the
    scope's channel (one slot on a cluster)."""
    key = f"agent_runtime_test:scope:{{{tag}}}:k"
    return int(await redis.eval(SPUBLISH, 2, key, channel_of(tag, what), payload))  # type: ignore[misc]


async def until(what: str, check: Callable[[], Awaitable[bool]], within: float = WAIT) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"not within {within} s: {what}")


async def shard_subscribers(redis: Redis, channel: str) -> int:
    reply = await redis.execute_command("PUBSUB", "SHARDNUMSUB", channel)
    if isinstance(reply, dict):  # a cluster answers per node: the one that owns the slot
        return sum(int(r[1]) for r in reply.values())
    return int(reply[1])


@pytest.fixture
async def notifier(redis: Redis) -> AsyncIterator[Notifier]:
    n = Notifier(redis)
    await n.start()
    yield n
    await n.stop()


@pytest.fixture
def tag() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


async def test_a_script_signal_reaches_every_listener_of_its_channel_only(
    notifier: Notifier, redis: Redis, tag: str
) -> None:
    other = f"{tag}-b"
    async with (
        notifier.listen(channel_of(tag)) as a1,
        notifier.listen(channel_of(tag)) as a2,
        notifier.listen(channel_of(other)) as b,
    ):
        publisher = other_client(redis)
        try:
            assert await script_publish(publisher, tag, "pod-1") == 1  # one replica subscribed
            assert await a1.wait(WAIT) and await a2.wait(WAIT)
            assert a1.payloads == a2.payloads == ["pod-1"]
            await notifier.publish(channel_of(other), "pod-2")  # the deployer's form
            assert await b.wait(WAIT)
            assert b.payloads == ["pod-2"] and not await a1.wait(0.1)
        finally:
            await publisher.aclose()


async def test_a_signal_right_after_listen_is_not_lost(
    notifier: Notifier, redis: Redis, tag: str
) -> None:
    """listen() returns once the server confirmed the SSUBSCRIBE: a signal sent at once
    (between the waiter's check and its wait) is heard."""
    for i in range(5):
        async with notifier.listen(channel_of(f"{tag}-{i}")) as listener:
            await script_publish(redis, f"{tag}-{i}", "early")
            assert await listener.wait(WAIT)


async def test_the_last_listener_that_leaves_unsubscribes(
    notifier: Notifier, redis: Redis, tag: str
) -> None:
    channel = channel_of(tag)
    async with notifier.listen(channel):
        async with notifier.listen(channel):
            assert await shard_subscribers(redis, channel) == 1  # one SSUBSCRIBE for both
        assert await shard_subscribers(redis, channel) == 1  # one listener left
        assert channel in notifier.subscriptions()[""]
    assert notifier._channels == {}

    async def gone() -> bool:
        return await shard_subscribers(redis, channel) == 0 and not notifier.subscriptions()

    await until("the channel unsubscribed", gone)
    assert await script_publish(redis, tag, "nobody") == 0
    # and a new listener subscribes it again
    async with notifier.listen(channel) as listener:
        assert await script_publish(redis, tag, "again") == 1
        assert await listener.wait(WAIT)


async def test_a_listener_that_is_cancelled_while_it_subscribes_leaves_nothing(
    notifier: Notifier, redis: Redis, tag: str
) -> None:
    channel = channel_of(tag)

    async def listen_forever() -> None:
        async with notifier.listen(channel) as listener:
            await listener.wait(60)

    for _ in range(3):
        task = asyncio.create_task(listen_forever())
        await asyncio.sleep(0)  # cancelled inside listen(), before or during its SSUBSCRIBE
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def gone() -> bool:
        return await shard_subscribers(redis, channel) == 0 and not notifier.subscriptions()

    await until("nothing subscribed", gone)
    assert notifier._channels == {}


async def test_an_idle_shard_closes_its_connection(
    redis: Redis, tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent_runtime.notify.SHARD_IDLE", 0.2)
    monkeypatch.setattr("agent_runtime.notify.READ_TIMEOUT", 0.1)
    notifier = Notifier(redis)
    try:
        async with notifier.listen(channel_of(tag)):
            assert notifier.connected and len(notifier._shards) == 1
        await until("the shard closed", lambda: _true(not notifier._shards))
        async with notifier.listen(channel_of(tag)) as listener:  # a new one opens
            await script_publish(redis, tag, "x")
            assert await listener.wait(WAIT)
    finally:
        await notifier.stop()
    assert SHARD_IDLE >= 1.0  # the module's own value: the patch above was for this test


async def _true(value: bool) -> bool:
    return value


async def hears_again(notifier: Notifier, redis: Redis, tag: str) -> None:
    """A publish reaches a listener again (the reader resubscribed): published until heard."""
    async with notifier.listen(channel_of(tag)) as listener:

        async def heard() -> bool:
            await script_publish(redis, tag, "again")
            return await listener.wait(0.2)

        await until("a signal after the pub/sub connection was killed", heard)


async def kill_pubsub_connections(server: Redis) -> int:
    return int(await server.client_kill_filter(_type="pubsub"))


# real Redis only: fakeredis has no connections to kill
@pytest.mark.parametrize("redis", ["real"], indirect=True)
async def test_resubscribes_after_the_connection_is_killed(
    notifier: Notifier, redis: Redis, tag: str
) -> None:
    held = f"{tag}-held"
    async with notifier.listen(channel_of(held)) as waiting:  # subscribed before the kill
        assert await kill_pubsub_connections(redis) >= 1
        await hears_again(notifier, redis, tag)  # a new channel
        await script_publish(redis, held, "old")  # and the one held across the kill
        assert await waiting.wait(WAIT)
        assert waiting.payloads == ["old"]


@pytest.mark.real_backend
async def test_sentinel_master_wake_up_and_resubscribe(redis_sentinel: Redis, tag: str) -> None:
    notifier = Notifier(redis_sentinel)
    try:
        async with notifier.listen(channel_of(tag)) as listener:
            await script_publish(redis_sentinel, tag, "pod-1")
            assert await listener.wait(WAIT)
            assert await kill_pubsub_connections(redis_sentinel) >= 1
            await hears_again(notifier, redis_sentinel, tag)
    finally:
        await notifier.stop()


# --- the real cluster -------------------------------------------------------------------------


def tags_on_every_master(cluster: RedisCluster, tag: str) -> dict[str, str]:
    """node name → a tag of the test's whose channels live on that master."""
    by_node: dict[str, str] = {}
    for i in range(300):
        candidate = f"{tag}-{i}"
        by_node.setdefault(cluster.get_node_from_key(channel_of(candidate)).name, candidate)
        if len(by_node) == len(cluster.get_primaries()):
            return by_node
    pytest.fail(f"no tag for every master: {by_node}")


def direct(node: object) -> Redis:
    return Redis(host=node.host, port=node.port, decode_responses=True)  # type: ignore[attr-defined]


@pytest.mark.real_backend
async def test_cluster_one_connection_per_master_each_channel_on_its_node(
    redis_cluster: Redis, cluster_tag: str
) -> None:
    cluster = redis_cluster
    assert isinstance(cluster, RedisCluster)
    tags = tags_on_every_master(cluster, cluster_tag)
    notifier = Notifier(redis_cluster)
    try:
        async with contextlib.AsyncExitStack() as stack:
            heard = [
                await stack.enter_async_context(notifier.listen(channel_of(t)))
                for t in tags.values()
            ]
            assert set(notifier.subscriptions()) == set(tags)  # a shard per master
            for node, t in tags.items():
                assert notifier.subscriptions()[node] == {channel_of(t)}
                assert await script_publish(redis_cluster, t, f"to {node}") == 1
            for t, listener in zip(tags.values(), heard, strict=True):
                assert await listener.wait(WAIT), t
        # and SPUBLISH reaches the owner only: another master has no subscriber for it
        node, t = next(iter(tags.items()))
        other = next(n for n in cluster.get_primaries() if n.name != node)
        server = direct(other)
        try:
            assert await server.execute_command("PUBSUB", "SHARDNUMSUB", channel_of(t)) == [
                channel_of(t),
                0,
            ]
        finally:
            await server.aclose()
    finally:
        await notifier.stop()


@pytest.mark.real_backend
async def test_cluster_resubscribes_after_the_connection_is_killed(
    redis_cluster: Redis, cluster_tag: str
) -> None:
    cluster = redis_cluster
    assert isinstance(cluster, RedisCluster)
    notifier = Notifier(redis_cluster)
    try:
        async with notifier.listen(channel_of(cluster_tag)):
            owner = direct(cluster.get_node_from_key(channel_of(cluster_tag)))
            try:
                assert await kill_pubsub_connections(owner) >= 1
            finally:
                await owner.aclose()
            await hears_again(notifier, redis_cluster, cluster_tag)
    finally:
        await notifier.stop()


@pytest.mark.real_backend
async def test_cluster_a_slot_migrated_under_a_listener_is_followed(
    redis_cluster: Redis, cluster_tag: str
) -> None:
    """CLUSTER SETSLOT moves the (empty) slot of the test's channel to another master: the
    old owner drops the subscription (an unasked SUNSUBSCRIBE), the notifier reads the slot
    map again and subscribes on the new owner; the slot goes back after."""
    cluster = redis_cluster
    assert isinstance(cluster, RedisCluster)
    channel = channel_of(cluster_tag)
    slot = cluster.keyslot(channel)
    source = cluster.get_node_from_key(channel)
    target = next(n for n in cluster.get_primaries() if n.name != source.name)
    src, dst = direct(source), direct(target)
    ids = {
        source.name: await src.execute_command("CLUSTER", "MYID"),
        target.name: await dst.execute_command("CLUSTER", "MYID"),
    }
    assert await src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0

    async def move(a: Redis, b: Redis, a_name: str, b_name: str) -> None:
        await b.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[a_name])
        await a.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[b_name])
        await b.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[b_name])
        await a.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[b_name])

    notifier = Notifier(redis_cluster)
    moved = False
    try:
        async with notifier.listen(channel) as listener:
            assert notifier.subscriptions() == {source.name: {channel}}
            await move(src, dst, source.name, target.name)
            moved = True

            async def resubscribed() -> bool:
                return notifier.subscriptions() == {target.name: {channel}}

            await until("the channel subscribed on the slot's new owner", resubscribed)
            assert await script_publish(redis_cluster, cluster_tag, "after the move") == 1
            assert await listener.wait(WAIT)
    finally:
        await notifier.stop()
        if moved:
            # the publish wrote its key on the new owner: a node refuses to give away a slot
            # it holds keys of (unless the old owner's bumped epoch reached it first by gossip
            # and it dropped them: a race, which made this test fail now and then)
            await dst.delete(f"agent_runtime_test:scope:{{{cluster_tag}}}:k")
            try:
                await move(dst, src, target.name, source.name)
            finally:  # never a slot left half moved for the tests after (or the next run)
                for node in (src, dst):
                    await node.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
            await cluster.nodes_manager.initialize()
        await src.aclose()
        await dst.aclose()
