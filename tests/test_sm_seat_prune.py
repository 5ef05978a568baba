"""seat_prune (the session side's prune of a dead replica's queue seats and reservations)
and the index it walks, on fakeredis and real Redis: a seat or reservation puts its scope in
``leased_scopes``; the prune drops only members past their lease, in slices, and an empty scope
leaves the index in the same step."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from agent_runtime.session_manager.state import SessionState
from helpers import spelled

pytestmark = pytest.mark.topologies

P = "session_manager:"
LEASED = f"{P}leased_scopes"


def waiters(sid: str) -> str:
    return f"{P}scope:{{{sid}}}:waiters"


def reserved(sid: str) -> str:
    return f"{P}scope:{{{sid}}}:reserved"


@pytest.fixture
def state(redis: Redis) -> SessionState:
    return SessionState(redis)


async def rnow(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return seconds + micros / 1e6


async def test_a_seat_and_a_reservation_put_their_scope_in_the_index(
    state: SessionState, redis: Redis
) -> None:
    assert await state.take_waiter_seat("sa", "r1", 3.0, 4)
    assert not await state.take_waiter_seat("sb", "r1", 3.0, 0), "refused: not indexed"
    await redis.hset(
        f"{P}scope:{{sc}}:config",
        mapping={"scope_concurrency": 4, "pod_concurrency": 2, "max_pods": 2, "session_ttl": 60},
    )
    reply = spelled(
        await state.route_place(request_id="r2", session_id="s2", scope_id="sc", token="t")
    )
    assert reply == ["need_acquire"]
    assert await redis.smembers(LEASED) == {"sa", "sc"}


async def test_prune_drops_only_what_outlived_its_lease(state: SessionState, redis: Redis) -> None:
    now = await rnow(redis)
    await redis.zadd(waiters("sa"), {"dead-seat": now - 1, "live-seat": now + 30})
    await redis.zadd(reserved("sa"), {"dead-res": now - 1})
    await redis.zadd(waiters("sb"), {"dead-seat": now - 1})
    await redis.zadd(reserved("sc"), {"live-res": now + 30})
    await redis.sadd(LEASED, "sa", "sb", "sc", "sd")  # sd: nothing left at all
    assert await state.prune_seats() == (2, 1)
    assert await redis.zrange(waiters("sa"), 0, -1) == ["live-seat"]
    assert not await redis.exists(reserved("sa"), waiters("sb"))
    assert await redis.zrange(reserved("sc"), 0, -1) == ["live-res"]
    assert await redis.smembers(LEASED) == {"sa", "sc"}
    assert await state.prune_seats() == (0, 0)


async def test_prune_works_through_more_scopes_than_one_slice(
    state: SessionState, redis: Redis
) -> None:
    now = await rnow(redis)
    n = 250  # more than two slices of PRUNE_BATCH
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.zadd(waiters(f"s{i}"), {"gone": now - 1})
            pipe.zadd(reserved(f"s{i}"), {"gone": now - 1})
            pipe.sadd(LEASED, f"s{i}")
        await pipe.execute()
    assert await state.prune_seats() == (n, n)
    assert await redis.scard(LEASED) == 0
