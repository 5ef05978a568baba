"""The shared pub/sub notifier: fan-out to in-process listeners, and recovery after the
connection is dropped (on the real Redis: CLIENT KILL)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from agent_runtime.notify import Notifier
from helpers import other_client

PATTERN = "test:scope:*:signal"


@pytest.fixture
async def notifier(redis: Redis) -> AsyncIterator[Notifier]:
    n = Notifier(redis, patterns=[PATTERN])
    await n.start()
    yield n
    await n.stop()


async def test_a_signal_reaches_every_listener_of_its_channel_only(
    notifier: Notifier, redis: Redis
) -> None:
    async with (
        notifier.listen("test:scope:a:signal") as a1,
        notifier.listen("test:scope:a:signal") as a2,
        notifier.listen("test:scope:b:signal") as b,
    ):
        publisher = other_client(redis)
        await publisher.publish("test:scope:a:signal", "pod-1")
        assert await a1.wait(2) and await a2.wait(2)
        assert a1.payloads == ["pod-1"]
        assert not await b.wait(0.2)
        await publisher.aclose()


async def test_a_signal_between_check_and_wait_is_not_lost(
    notifier: Notifier, redis: Redis
) -> None:
    async with notifier.listen("test:scope:a:signal") as listener:
        await redis.publish("test:scope:a:signal", "early")  # before anybody waits
        await asyncio.sleep(0.1)
        started = time.monotonic()
        assert await listener.wait(2)
        assert time.monotonic() - started < 0.1


async def test_listeners_are_forgotten_when_they_leave(notifier: Notifier) -> None:
    async with notifier.listen("test:scope:a:signal"):
        pass
    assert notifier._listeners == {}


# real Redis only: fakeredis has no connections to kill
@pytest.mark.parametrize("redis", ["real"], indirect=True)
async def test_recovers_after_the_connection_is_killed(notifier: Notifier, redis: Redis) -> None:
    await redis.client_kill_filter(_type="pubsub")
    deadline = time.monotonic() + 5
    async with notifier.listen("test:scope:a:signal") as listener:
        while time.monotonic() < deadline:
            await redis.publish("test:scope:a:signal", "again")
            if await listener.wait(0.2):
                break
        else:
            pytest.fail("no signal within 5 s of the pub/sub connection being killed")
