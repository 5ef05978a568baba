"""seat_prune (the session side's prune of a dead replica's queue seats and reservations)
and the index it walks, on fakeredis and real Redis: a new seat or reservation marks its scope
in ``leased_scopes`` (a DueIndex, one ZSET per bucket ``{bNN}``) at its deadline; the prune
looks at the scopes due, drops only members past their lease and settles each scope with its
next deadline (an empty scope leaves the index). A mark lost with a crashed replica is made
again by the safety walk."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from agent_runtime.scope_buckets import BUCKETS, bucket_of
from agent_runtime.session_manager.state import SessionState
from helpers import spelled

# on the Sentinel set and the Redis Cluster too: every script is of one slot (issue 17)
pytestmark = pytest.mark.topologies

P = "session_manager:"


def leased(sid: str) -> str:
    """The bucket of the prune's index that holds ``sid``."""
    return f"{P}leased_scopes:{{b{bucket_of(sid):02d}}}"


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


async def prune_all(state: SessionState) -> tuple[int, int]:
    seats = reservations = 0
    for bucket in range(BUCKETS):
        pruned = await state.prune_seats(bucket, 100)
        seats, reservations = seats + pruned.seats, reservations + pruned.reservations
    return seats, reservations


async def test_a_seat_and_a_reservation_mark_their_scope_at_their_deadline(
    state: SessionState, redis: Redis
) -> None:
    before = await rnow(redis)
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
    for sid, key in (("sa", waiters("sa")), ("sc", reserved("sc"))):
        score = await redis.zscore(leased(sid), sid)
        assert score is not None and before + 3 - 0.01 <= score <= await rnow(redis) + 3
        assert score == pytest.approx((await redis.zrange(key, 0, 0, withscores=True))[0][1])
    assert await redis.zscore(leased("sb"), "sb") is None
    # a renewal keeps the mark where it was (the prune finds the later deadline then)
    held = await redis.zscore(leased("sa"), "sa")
    assert await state.take_waiter_seat("sa", "r1", 30.0, 4)
    assert await redis.zscore(leased("sa"), "sa") == held


async def test_prune_drops_only_what_outlived_its_lease(state: SessionState, redis: Redis) -> None:
    now = await rnow(redis)
    await redis.zadd(waiters("sa"), {"dead-seat": now - 1, "live-seat": now + 30})
    await redis.zadd(reserved("sa"), {"dead-res": now - 1})
    await redis.zadd(waiters("sb"), {"dead-seat": now - 1})
    await redis.zadd(reserved("sc"), {"live-res": now + 30})
    for sid in ("sa", "sb", "sc", "sd"):  # sd: nothing left at all
        await state.leased.mark(sid, now - 1)
    assert await prune_all(state) == (2, 1)
    assert await redis.zrange(waiters("sa"), 0, -1) == ["live-seat"]
    assert not await redis.exists(reserved("sa"), waiters("sb"))
    assert await redis.zrange(reserved("sc"), 0, -1) == ["live-res"]
    # settled: an empty scope left the index, the others wait for their next deadline
    assert await redis.zscore(leased("sb"), "sb") is None
    assert await redis.zscore(leased("sd"), "sd") is None
    for sid in ("sa", "sc"):
        assert await redis.zscore(leased(sid), sid) == pytest.approx(now + 30, abs=1e-3)
    assert await prune_all(state) == (0, 0), "nothing due before the live leases end"


async def test_prune_works_through_many_scopes(state: SessionState, redis: Redis) -> None:
    now = await rnow(redis)
    n = 250  # several scopes in most buckets
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.zadd(waiters(f"s{i}"), {"gone": now - 1})
            pipe.zadd(reserved(f"s{i}"), {"gone": now - 1})
        await pipe.execute()
    for i in range(n):
        await state.leased.mark(f"s{i}", now - 1)
    assert await prune_all(state) == (n, n)
    assert [k async for k in redis.scan_iter(match=f"{P}leased_scopes:*")] == []


async def test_a_seat_whose_mark_was_lost_is_found_by_the_safety_walk(
    state: SessionState, redis: Redis
) -> None:
    """A replica took a seat and died before marking the scope: the prune does not know of it
    until the safety walk (a page of scopes) marks it again."""
    now = await rnow(redis)
    await redis.zadd(waiters("lost"), {"dead-seat": now - 1})
    assert await prune_all(state) == (0, 0), "unmarked: the prune cannot see it"
    assert await state.safety_walk(["lost", "nothing-here"]) == 1
    assert await state.safety_walk(["lost"]) == 0, "marked as early already: no new mark"
    assert await prune_all(state) == (1, 0)
    assert not await redis.exists(waiters("lost"))
